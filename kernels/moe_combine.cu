// Weighted combine of the expert outputs back into token order, without atomics:
// out[t] = sum over j = 0..k-1 (in slot order) of weights[t, j] * y[slot_pos[t*k + j]],
// skipping slots whose expert is not on this rank (slot_pos -1); a token with no local
// expert gets a zero row. The fixed summation order makes the result reproducible.
// y [P, D] fp32; weights [T, k] fp32; slot_pos [T*k]; out [T, D] fp32. One block per token.
#include "common.cuh"

extern "C" __global__ void moe_combine(const float* __restrict__ y, const float* __restrict__ weights,
                                       const int* __restrict__ slot_pos, float* __restrict__ out,
                                       int D, int k) {
    const long long t = blockIdx.x;
    const int* pos = slot_pos + t * k;
    const float* w = weights + t * k;
    for (int d = threadIdx.x; d < D; d += blockDim.x) {
        float acc = 0.0f;
        for (int j = 0; j < k; ++j) {
            const int p = pos[j];
            if (p >= 0) acc += w[j] * y[(long long)p * D + d];
        }
        out[t * D + d] = acc;
    }
}
