// Dense linear layers with FP8 block-scaled weights kept FP8 in device memory (weight_rows.cuh).
//
// fp8_linear: out[t, n] = x[t] . (w[n] * scale) (+ bias[n]) on CUDA cores, for few rows T (decode):
//   the weight bytes are the traffic, so they are read once per 8 rows of x. grid (ceil(units /
//   (FL_WARPS * units_per_warp))); a unit is the output pair (2u, 2u + 1). x [T, K] bf16, w [N, K]
//   bytes, out [T, N] bf16; K and block_k multiples of 8 (host-checked).
// fp8_dequant: out [rows, K] bf16 = w[row0 + r] * scale, for cuBLAS on many rows (prefill) and the
//   gathered expert path; grid-stride over the elements, any block shape.
#include "weight_rows.cuh"

#define FL_THREADS 128
#define FL_WARPS (FL_THREADS / WARP_SIZE)

extern "C" __global__ void __launch_bounds__(FL_THREADS) fp8_linear(
    const bf16* __restrict__ x, const unsigned char* __restrict__ w, const float* __restrict__ scale,
    const bf16* __restrict__ bias, bf16* __restrict__ out, int T, int N, int K, int block_n, int block_k,
    int part_rows, int has_bias, int units_per_warp) {
    const int lane = threadIdx.x % WARP_SIZE, warp = threadIdx.x / WARP_SIZE;
    const Fp8Rows rows{w, scale, K, block_n, block_k, part_rows};
    const int first = (blockIdx.x * FL_WARPS + warp) * units_per_warp;
    const int last = min(first + units_per_warp, (N + 1) / 2);
    for (int u = first; u < last; ++u) {
        const int n0 = 2 * u, n1 = min(2 * u + 1, N - 1);  // odd N: the last unit repeats n0
        const float b0 = has_bias ? to_f32(bias[n0]) : 0.0f, b1 = has_bias ? to_f32(bias[n1]) : 0.0f;
        for (int m0 = 0; m0 < T; m0 += GG_MT) {
            const int mt = min(GG_MT, T - m0);
            const bf16* xr[GG_MT];
#pragma unroll
            for (int m = 0; m < GG_MT; ++m) xr[m] = x + (long long)(m0 + min(m, mt - 1)) * K;
            float a0[GG_MT], a1[GG_MT];
            dot_two_rows(rows, n0, n1, xr, mt, K, a0, a1);
#pragma unroll
            for (int m = 0; m < GG_MT; ++m) {
                if (m < mt && lane == m) {
                    bf16* o = out + (long long)(m0 + m) * N;
                    o[n0] = __float2bfloat16(a0[m] + b0);
                    if (n1 != n0) o[n1] = __float2bfloat16(a1[m] + b1);
                }
            }
        }
    }
}

extern "C" __global__ void fp8_dequant(const unsigned char* __restrict__ w, const float* __restrict__ scale,
                                       bf16* __restrict__ out, int row0, int rows, int K, int block_n, int block_k,
                                       int part_rows) {
    const Fp8Rows src{w, scale, K, block_n, block_k, part_rows};
    const long long n = (long long)rows * K;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += (long long)gridDim.x * blockDim.x) {
        const int r = row0 + (int)(i / K), k = (int)(i % K);
        out[i] = __float2bfloat16(fp8_e4m3_to_f32(w[(long long)r * K + k]) * src.scale_of(r, k));
    }
}
