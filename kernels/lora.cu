// Batched multi-LoRA (the BGMV form of Punica / S-LoRA): every row t carries its own adapter
// slot slots[t] (-1: none) and gets y[t] += (x[t] @ a[s].T) @ b[s], in two launches.
// a [S, R, K] and b [S, R, N] are fp32 stacks read through slot strides (the rank prefix R of a
// zero-padded stack); x [T, K] and y [T, N] are bf16; xa [T, R] is the fp32 shrink result.
#include "common.cuh"

// lora_shrink: one block per row, one warp per rank index r (strided): xa[t, r] = x[t] . a[s, r].
extern "C" __global__ void lora_shrink(const bf16* __restrict__ x, const float* __restrict__ a,
                                       const int* __restrict__ slots, float* __restrict__ xa,
                                       int K, int R, long long a_slot_stride) {
    const int t = blockIdx.x;
    const int s = slots[t];
    const int warp = threadIdx.x / WARP_SIZE, lane = threadIdx.x % WARP_SIZE;
    const int warps = blockDim.x / WARP_SIZE;
    for (int r = warp; r < R; r += warps) {
        float acc = 0.f;
        if (s >= 0) {
            const float* row = a + (long long)s * a_slot_stride + (long long)r * K;
            for (int k = lane; k < K; k += WARP_SIZE) acc += to_f32(x[(long long)t * K + k]) * row[k];
        }
        acc = warp_sum(acc);
        if (lane == 0) xa[(long long)t * R + r] = acc;
    }
}

// lora_expand: grid-stride over the T*N outputs: y[t, n] += sum_r xa[t, r] * b[s, r, n] (rows of
// slot -1 untouched), summed in fp32 and rounded to bf16 once.
extern "C" __global__ void lora_expand(const float* __restrict__ xa, const float* __restrict__ b,
                                       const int* __restrict__ slots, bf16* __restrict__ y,
                                       long long total, int N, int R, long long b_slot_stride) {
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < total;
         i += (long long)gridDim.x * blockDim.x) {
        const long long t = i / N, n = i % N;
        const int s = slots[t];
        if (s < 0) continue;
        const float* col = b + (long long)s * b_slot_stride + n;
        float acc = to_f32(y[i]);
        for (int r = 0; r < R; ++r) acc += xa[t * R + r] * col[(long long)r * N];
        y[i] = __float2bfloat16(acc);
    }
}
