// RMSNorm, plain and with the residual add fused in front of it.
// One block per row; rows are D contiguous elements. fp32 statistics, bf16 in and out.
#include "rms_row.cuh"

// out[row] = x[row] * rsqrt(mean(x[row]^2) + eps) * w          x, out [R, D]; w [D]
extern "C" __global__ void rms_norm(const bf16* __restrict__ x, const bf16* __restrict__ w,
                                    bf16* __restrict__ out, int D, float eps) {
    __shared__ float scratch[WARP_SIZE];
    const long long row = blockIdx.x;
    rms_norm_row(x + row * D, w, out + row * D, D, eps, scratch);
}

// s = x + residual (stored as bf16 in sum_out); out = rms_norm(s) computed from the stored s,
// so the residual stream and the normed input agree. x is bf16, or fp32 (a MoE layer's output).
// has_extra: x + extra[D] first (bf16: a shared expert's output), fp32 and stored as x's dtype as
// elementwise.cu's add would: the add kernel folded in, the same bits. The row arithmetic is
// rms_row.cuh's, which dense_add_norm_gate_up_silu repeats at this kernel's block size (same bits).
template <typename TX>
__device__ void add_rms_norm_row(const TX* __restrict__ x, const bf16* __restrict__ residual,
                                 const bf16* __restrict__ w, bf16* __restrict__ out,
                                 bf16* __restrict__ sum_out, int D, float eps, const bf16* __restrict__ extra,
                                 int has_extra) {
    __shared__ float scratch[WARP_SIZE];
    const long long off = (long long)blockIdx.x * D;
    x += off;
    extra += has_extra ? off : 0;
    residual += off;
    out += off;
    sum_out += off;
    const float ss = add_row_squares(x, residual, sum_out, D, threadIdx.x, blockDim.x, extra, has_extra);
    const float inv = rms_inv(block_sum(ss, scratch), D, eps);
    // Each thread re-reads only the elements it wrote itself: no barrier needed for them.
    for (int d = threadIdx.x; d < D; d += blockDim.x) out[d] = rms_scaled(sum_out[d], inv, w[d]);
}

extern "C" __global__ void add_rms_norm_bf16(const bf16* x, const bf16* residual, const bf16* w,
                                             bf16* out, bf16* sum_out, int D, float eps, const bf16* extra,
                                             int has_extra) {
    add_rms_norm_row<bf16>(x, residual, w, out, sum_out, D, eps, extra, has_extra);
}

extern "C" __global__ void add_rms_norm_f32(const float* x, const bf16* residual, const bf16* w,
                                            bf16* out, bf16* sum_out, int D, float eps, const bf16* extra,
                                            int has_extra) {
    add_rms_norm_row<float>(x, residual, w, out, sum_out, D, eps, extra, has_extra);
}
