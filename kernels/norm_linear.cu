// rms_norm_linear: an RMSNorm fused into the product that reads it, for decode's few rows (MLA's
// q LoRA: rms_norm(q_a) then q_b in one launch instead of rms_norm + a cuBLAS GEMM).
//
// y[t, n] = rms_norm(x[t], norm) . w[n] for t < T <= GG_MT. Every block first normalizes the T rows
// into shared memory as bf16, with rms_norm's bits (the host launches rms_norm's block size for
// width K, so block_sum adds in rms_norm's order, and the normed value is rounded to bf16 as
// rms_norm's output is), then each warp dots them with its pairs of weight rows (dot_two_rows:
// every weight row read once per launch, coalesced 16-byte loads), rounded to bf16 as cuBLAS's bf16
// output is. x [T, ldx] (rows spaced ldx: a column slice of a larger product); norm [K]; w [N, K];
// y [T, N]. K a multiple of 8 (host-checked). Grid ceil(ceil(N / 2) / (warps * units_per_warp)).
// Dynamic shared memory: block_sum's WARP_SIZE floats, then the T * K bf16 normed rows.
#include "rms_row.cuh"
#include "weight_rows.cuh"

extern "C" __global__ void __launch_bounds__(512) rms_norm_linear(const bf16* __restrict__ x, int ldx,
                                                                    const bf16* __restrict__ norm,
                                                                    const bf16* __restrict__ w, bf16* __restrict__ y,
                                                                    int T, int K, int N, float eps,
                                                                    int units_per_warp) {
    extern __shared__ uint4 smem_raw[];
    float* scratch = reinterpret_cast<float*>(smem_raw);         // [WARP_SIZE]: block_sum's
    bf16* xn = reinterpret_cast<bf16*>(scratch + WARP_SIZE);  // [T, K]
    for (int t = 0; t < T; ++t) rms_norm_row(x + (long long)t * ldx, norm, xn + t * K, K, eps, scratch);
    __syncthreads();
    const int warps = blockDim.x / WARP_SIZE;
    const int first = (blockIdx.x * warps + threadIdx.x / WARP_SIZE) * units_per_warp;
    dense_down_units(xn, Bf16Rows{w, K}, y, T, N, K, first, min(first + units_per_warp, (N + 1) / 2));
}
