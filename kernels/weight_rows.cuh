// Weight-row readers for the CUDA-core GEMMs (moe_grouped_gemm.cu, fp8_linear.cu): bf16 rows, or
// float8_e4m3fn rows dequantized on the fly with their [block_n, block_k] scales (FP8 checkpoints
// stay FP8 in device memory). load8(row, d) gives w[row, d .. d+8) in fp32; d is a multiple of 8,
// so the 8 values share one scale block when block_k is a multiple of 8 (host-checked).
#pragma once

#include "common.cuh"

#define GG_MT 8  // input rows dotted at a time

// float8_e4m3fn byte -> fp32, exact: 1 sign, 4 exponent (bias 7), 3 mantissa bits; 0x7f is NaN.
__device__ __forceinline__ float fp8_e4m3_to_f32(unsigned int b) {
    const unsigned int sign = (b & 0x80u) << 24, em = b & 0x7fu;
    if (em == 0x7fu) return __int_as_float(0x7fc00000);
    if (em < 8u) {  // subnormal: m * 2^-9
        const float v = (float)em * (1.0f / 512.0f);
        return sign ? -v : v;
    }
    return __int_as_float(sign | ((em + (120u << 3)) << 20));  // exponent e - 7 + 127
}

struct Bf16Rows {
    const bf16* w;  // [rows, K]
    int K;
    __device__ __forceinline__ void load8(int row, int d, float out[8]) const {
        ::load8(w + (long long)row * K + d, out);
    }
};

// FP8 rows with block scales. Rows [i * part_rows, (i + 1) * part_rows) form part i (gate | up
// stacked), each blocked on its own: scale row of `row` = (row / part_rows) * ceil(part_rows /
// block_n) + (row % part_rows) / block_n; scale [scale rows, ceil(K / block_k)] fp32.
struct Fp8Rows {
    const unsigned char* w;  // [rows, K] float8_e4m3fn bytes
    const float* scale;
    int K, block_n, block_k, part_rows;
    __device__ __forceinline__ float scale_of(int row, int d) const {
        const int row_blocks = (part_rows + block_n - 1) / block_n, k_blocks = (K + block_k - 1) / block_k;
        const int srow = (row / part_rows) * row_blocks + (row % part_rows) / block_n;
        return scale[(long long)srow * k_blocks + d / block_k];
    }
    __device__ __forceinline__ void load8(int row, int d, float out[8]) const {
        const uint2 raw = *reinterpret_cast<const uint2*>(w + (long long)row * K + d);
        const float s = scale_of(row, d);
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            out[i] = fp8_e4m3_to_f32((raw.x >> (8 * i)) & 0xffu) * s;
            out[4 + i] = fp8_e4m3_to_f32((raw.y >> (8 * i)) & 0xffu) * s;
        }
    }
};

// a0[m] = w[r0] . x_m and a1[m] = w[r1] . x_m for m < mt (rows of length K); every lane gets the
// sums. Lanes split K into chunks of 8 (coalesced weight reads), then a warp reduction.
template <typename W>
__device__ __forceinline__ void dot_two_rows(const W& w, int r0, int r1, const bf16* const xr[GG_MT], int mt, int K,
                                             float a0[GG_MT], float a1[GG_MT]) {
    const int lane = threadIdx.x % WARP_SIZE;
#pragma unroll
    for (int m = 0; m < GG_MT; ++m) a0[m] = a1[m] = 0.0f;
#pragma unroll 2
    for (int d = lane * 8; d < K; d += WARP_SIZE * 8) {
        float wa[8], wb[8];
        w.load8(r0, d, wa);
        w.load8(r1, d, wb);
#pragma unroll
        for (int m = 0; m < GG_MT; ++m) {
            if (m < mt) {
                float xv[8];
                load8(xr[m] + d, xv);
#pragma unroll
                for (int i = 0; i < 8; ++i) {
                    a0[m] += wa[i] * xv[i];
                    a1[m] += wb[i] * xv[i];
                }
            }
        }
    }
#pragma unroll
    for (int m = 0; m < GG_MT; ++m) {
        if (m < mt) {
            a0[m] = warp_sum(a0[m]);
            a1[m] = warp_sum(a1[m]);
        }
    }
}
