// rms_norm's and add_rms_norm's row arithmetic (rms_norm.cu), shared with the kernels that normalise
// a row themselves (moe_grouped_gemm.cu's dense_add_norm_gate_up_silu, norm_linear.cu's
// rms_norm_linear), so they round and sum alike.
#pragma once

#include "common.cuh"

__device__ __forceinline__ float as_x_dtype(float v, const float*) { return v; }
__device__ __forceinline__ float as_x_dtype(float v, const bf16*) { return to_f32(__float2bfloat16(v)); }

// One thread's share of a row of add_rms_norm, the thread v of a block of B: s[d] = x[d] (+ extra[d],
// stored as x's dtype) + residual[d] rounded to bf16 and stored to s_out[d], for d = v, v + B, ...
// < D; returns the sum of the squares of the stored values in that order.
template <typename TX>
__device__ __forceinline__ float add_row_squares(const TX* __restrict__ x, const bf16* __restrict__ residual,
                                                 bf16* __restrict__ s_out, int D, int v, int B,
                                                 const bf16* __restrict__ extra, int has_extra) {
    float ss = 0.0f;
    for (int d = v; d < D; d += B) {
        const float xv = has_extra ? as_x_dtype(to_f32(x[d]) + to_f32(extra[d]), x) : to_f32(x[d]);
        bf16 s = __float2bfloat16(xv + to_f32(residual[d]));
        s_out[d] = s;
        float f = to_f32(s);
        ss += f * f;
    }
    return ss;
}

// 1 / rms of a row from the block's sum of squares.
__device__ __forceinline__ float rms_inv(float total, int D, float eps) { return rsqrtf(total / D + eps); }

// One normalised element: s * inv * w, rounded to bf16.
__device__ __forceinline__ bf16 rms_scaled(bf16 s, float inv, bf16 w) {
    return __float2bfloat16(to_f32(s) * inv * to_f32(w));
}

// out[d] = x[d] * rsqrt(mean(x^2) + eps) * w[d] for one row of D by the whole block (rms_norm's
// arithmetic: fp32 sum of squares in the block's order, bf16 out). scratch: block_sum's [WARP_SIZE].
__device__ __forceinline__ void rms_norm_row(const bf16* __restrict__ x, const bf16* __restrict__ w,
                                             bf16* __restrict__ out, int D, float eps, float* scratch) {
    float ss = 0.0f;
    for (int d = threadIdx.x; d < D; d += blockDim.x) {
        float v = to_f32(x[d]);
        ss += v * v;
    }
    const float inv = rsqrtf(block_sum(ss, scratch) / D + eps);
    for (int d = threadIdx.x; d < D; d += blockDim.x)
        out[d] = __float2bfloat16(to_f32(x[d]) * inv * to_f32(w[d]));
}
