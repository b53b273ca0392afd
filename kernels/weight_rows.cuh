// Weight-row readers for the CUDA-core GEMMs (moe_grouped_gemm.cu, fp8_linear.cu): bf16 rows, or
// float8_e4m3fn rows dequantized on the fly with their [block_n, block_k] scales (FP8 checkpoints
// stay FP8 in device memory). `row(r)` resolves a row once (its address and, for FP8, its scale
// row); load8(row, d, kb, out) gives w[r, d .. d+8) in fp32, kb = d / block_k its scale column
// (computed once per 8 columns for both rows of a unit). d is a multiple of 8, so the 8 values
// share one scale when block_k is a multiple of 8 (host-checked). FP8 bytes become fp32 through
// the hardware conversion (cvt.rn.f16x2.e4m3x2 on sm_89+; CUDA's emulation before), two at a time.
#pragma once

#include <cuda_fp8.h>

#include "common.cuh"

#define GG_MT 8  // input rows dotted at a time

// float8_e4m3fn byte -> fp32, exact (0x7f / 0xff: NaN).
__device__ __forceinline__ float fp8_e4m3_to_f32(unsigned int b) {
    return __half2float(__half(__nv_cvt_fp8_to_halfraw((__nv_fp8_storage_t)b, __NV_E4M3)));
}

struct Bf16Rows {
    const bf16* w;  // [rows, K]
    int K;
    typedef const bf16* Row;
    __device__ __forceinline__ Row row(int r) const { return w + (long long)r * K; }
    __device__ __forceinline__ int kblock(int) const { return 0; }
    __device__ __forceinline__ void load8(Row r, int d, int, float out[8]) const { ::load8(r + d, out); }
};

// FP8 rows with block scales. Rows [i * part_rows, (i + 1) * part_rows) form part i (gate | up
// stacked), each blocked on its own: scale row of `row` = (row / part_rows) * ceil(part_rows /
// block_n) + (row % part_rows) / block_n; scale [scale rows, ceil(K / block_k)] fp32.
struct Fp8Rows {
    const unsigned char* w;  // [rows, K] float8_e4m3fn bytes
    const float* scale;
    int K, block_n, block_k, part_rows;
    struct Row {
        const unsigned char* w;  // the row's bytes
        const float* scale;      // its scale row
    };
    __device__ __forceinline__ Row row(int r) const {
        const int row_blocks = (part_rows + block_n - 1) / block_n, k_blocks = (K + block_k - 1) / block_k;
        const int srow = (r / part_rows) * row_blocks + (r % part_rows) / block_n;
        return Row{w + (long long)r * K, scale + (long long)srow * k_blocks};
    }
    __device__ __forceinline__ int kblock(int d) const { return d / block_k; }
    __device__ __forceinline__ float scale_of(int r, int d) const { return row(r).scale[d / block_k]; }
    __device__ __forceinline__ void load8(const Row& r, int d, int kb, float out[8]) const {
        const uint2 raw = *reinterpret_cast<const uint2*>(r.w + d);
        const float s = r.scale[kb];
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            const unsigned int word = i < 2 ? raw.x : raw.y;
            const __half2_raw h = __nv_cvt_fp8x2_to_halfraw2((__nv_fp8x2_storage_t)(word >> (16 * (i % 2))), __NV_E4M3);
            const float2 f = __half22float2(__half2(h));
            out[2 * i] = f.x * s;
            out[2 * i + 1] = f.y * s;
        }
    }
};

// a0[m] = w[r0] . x_m and a1[m] = w[r1] . x_m for m < mt (rows of length K); every lane gets the
// sums. Lanes split K into chunks of 8 (coalesced weight reads), then a warp reduction.
template <typename W>
__device__ __forceinline__ void dot_two_rows(const W& w, int r0, int r1, const bf16* const xr[GG_MT], int mt, int K,
                                             float a0[GG_MT], float a1[GG_MT]) {
    const int lane = threadIdx.x % WARP_SIZE;
    const typename W::Row row0 = w.row(r0), row1 = w.row(r1);
#pragma unroll
    for (int m = 0; m < GG_MT; ++m) a0[m] = a1[m] = 0.0f;
#pragma unroll 2
    for (int d = lane * 8; d < K; d += WARP_SIZE * 8) {
        float wa[8], wb[8];
        const int kb = w.kblock(d);
        w.load8(row0, d, kb, wa);
        w.load8(row1, d, kb, wb);
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

// s[t, n] = h[t] . w[n] rounded to bf16 (a linear's output) for the rows t < T and this warp's
// column pairs u in [first, last) (n = 2u, 2u + 1). h [T, K]; w [D, K] rows, bf16 or FP8 (then the
// bits of fp8_linear's product: the same dot_two_rows); s [T, D]. The shared expert's down product
// (moe_grouped_gemm.cu) and rms_norm_linear's product (norm_linear.cu).
template <typename W>
__device__ void dense_down_units(const bf16* __restrict__ h, const W& w, bf16* __restrict__ s, int T, int D, int K,
                                 int first, int last) {
    const int lane = threadIdx.x % WARP_SIZE;
    for (int u = first; u < last; ++u) {
        const int n0 = 2 * u, n1 = min(2 * u + 1, D - 1);
        for (int m0 = 0; m0 < T; m0 += GG_MT) {
            const int mt = min(GG_MT, T - m0);
            const bf16* xr[GG_MT];
#pragma unroll
            for (int m = 0; m < GG_MT; ++m) xr[m] = h + (long long)(m0 + min(m, mt - 1)) * K;
            float a0[GG_MT], a1[GG_MT];
            dot_two_rows(w, n0, n1, xr, mt, K, a0, a1);
#pragma unroll
            for (int m = 0; m < GG_MT; ++m)
                if (m < mt && lane == m) {
                    bf16* sr = s + (long long)(m0 + m) * D;
                    sr[n0] = __float2bfloat16(a0[m]);
                    if (n1 != n0) sr[n1] = __float2bfloat16(a1[m]);
                }
        }
    }
}
