// Write this step's keys and values into the paged KV cache.
// k, v [T, Hk, Dh]; k_cache, v_cache [NB, BS, Hk, Dh] viewed as [NB*BS, Hk*Dh]; slot_mapping [T].
// Token t goes to flat slot slot_mapping[t]; a negative slot is padding and is skipped.
// One block per token, 16-byte copies: row = Hk*Dh must be a multiple of 8 (host-checked).
#include "common.cuh"

extern "C" __global__ void kv_write(bf16* __restrict__ k_cache, bf16* __restrict__ v_cache,
                                    const bf16* __restrict__ k, const bf16* __restrict__ v,
                                    const int* __restrict__ slot_mapping, int row) {
    const int slot = slot_mapping[blockIdx.x];
    if (slot < 0) return;
    const int nvec = row / 8;
    const uint4* ks = reinterpret_cast<const uint4*>(k + (long long)blockIdx.x * row);
    const uint4* vs = reinterpret_cast<const uint4*>(v + (long long)blockIdx.x * row);
    uint4* kd = reinterpret_cast<uint4*>(k_cache + (long long)slot * row);
    uint4* vd = reinterpret_cast<uint4*>(v_cache + (long long)slot * row);
    for (int i = threadIdx.x; i < nvec; i += blockDim.x) {
        kd[i] = ks[i];
        vd[i] = vs[i];
    }
}
