// Grouped expert GEMMs for small token counts per expert (decode): one launch covers every
// local expert, reads the sorted rows of moe_permute on the device (no host sync), and skips
// experts no token chose, so only the chosen experts' weights are streamed from memory.
//
// grid (ceil(units / (GG_WARPS * units_per_warp)), El); expert e = blockIdx.y owns sorted rows
// [offsets[e], offsets[e+1]). A warp computes units_per_warp consecutive output units; a unit
// is a pair of weight rows dotted with up to GG_MT input rows at a time: lanes split the
// reduction dim K into 16-byte chunks (coalesced weight reads), then a warp reduction.
// fp32 accumulation; K (D or I) must be a multiple of 8 and the arrays 16-byte aligned.
// Weights are bf16, or FP8 with block scales (the *_fp8 entry points), read through weight_rows.cuh.
#include "weight_rows.cuh"

#define GG_THREADS 128
#define GG_WARPS (GG_THREADS / WARP_SIZE)
// __launch_bounds__(GG_THREADS, 1): without the minimum, ptxas spilled moe_down (sm_90) and moe_down_fp8 (sm_80)

// h[p, u] = silu(x[tok_p] . w_gate_up[e, u]) * (x[tok_p] . w_gate_up[e, I + u]) for the rows p
// of expert e, tok_p = sorted_slot[p] / k. x [T, D]; w_gate_up [El, 2I, D]; h [P, I]. Units: I.
template <typename W>
__device__ void gate_up_silu(const bf16* __restrict__ x, const int* __restrict__ sorted_slot,
                             const int* __restrict__ offsets, const W& w, bf16* __restrict__ h, int D, int I, int k,
                             int units_per_warp) {
    const int e = blockIdx.y;
    const int start = offsets[e], count = offsets[e + 1] - start;
    if (count == 0) return;
    const int lane = threadIdx.x % WARP_SIZE, warp = threadIdx.x / WARP_SIZE;
    const int first = (blockIdx.x * GG_WARPS + warp) * units_per_warp;
    const int last = min(first + units_per_warp, I);
    for (int u = first; u < last; ++u) {
        for (int m0 = 0; m0 < count; m0 += GG_MT) {
            const int mt = min(GG_MT, count - m0);
            const bf16* xr[GG_MT];
#pragma unroll
            for (int m = 0; m < GG_MT; ++m)
                xr[m] = x + (long long)(sorted_slot[start + m0 + min(m, mt - 1)] / k) * D;
            float g[GG_MT], up[GG_MT];
            dot_two_rows(w, u, I + u, xr, mt, D, g, up);
#pragma unroll
            for (int m = 0; m < GG_MT; ++m)
                if (m < mt && lane == m)
                    h[(long long)(start + m0 + m) * I + u] = __float2bfloat16(silu(g[m]) * up[m]);
        }
    }
}

// y[p, n] = h[p] . w_down[e, n] for the rows p of expert e. h [P, I]; w_down [El, D, I];
// y [P, D] fp32. Units: output column pairs (2u, 2u + 1), ceil(D / 2) of them.
template <typename W>
__device__ void down(const bf16* __restrict__ h, const int* __restrict__ offsets, const W& w, float* __restrict__ y,
                     int D, int I, int units_per_warp) {
    const int e = blockIdx.y;
    const int start = offsets[e], count = offsets[e + 1] - start;
    if (count == 0) return;
    const int lane = threadIdx.x % WARP_SIZE, warp = threadIdx.x / WARP_SIZE;
    const int first = (blockIdx.x * GG_WARPS + warp) * units_per_warp;
    const int last = min(first + units_per_warp, (D + 1) / 2);
    for (int u = first; u < last; ++u) {
        const int n0 = 2 * u, n1 = min(2 * u + 1, D - 1);  // odd D: the last unit repeats n0
        for (int m0 = 0; m0 < count; m0 += GG_MT) {
            const int mt = min(GG_MT, count - m0);
            const bf16* xr[GG_MT];
#pragma unroll
            for (int m = 0; m < GG_MT; ++m) xr[m] = h + (long long)(start + m0 + min(m, mt - 1)) * I;
            float a0[GG_MT], a1[GG_MT];
            dot_two_rows(w, n0, n1, xr, mt, I, a0, a1);
#pragma unroll
            for (int m = 0; m < GG_MT; ++m) {
                if (m < mt && lane == m) {  // one 8-byte store (n0 even, D a multiple of 8): no spill
                    float* yr = y + (long long)(start + m0 + m) * D;
                    if (n1 != n0) {
                        float2 pair;
                        pair.x = a0[m];
                        pair.y = a1[m];
                        *reinterpret_cast<float2*>(yr + n0) = pair;
                    } else
                        yr[n0] = a0[m];
                }
            }
        }
    }
}

extern "C" __global__ void __launch_bounds__(GG_THREADS, 1) moe_gate_up_silu(
    const bf16* __restrict__ x, const int* __restrict__ sorted_slot, const int* __restrict__ offsets,
    const bf16* __restrict__ w_gate_up, bf16* __restrict__ h, int D, int I, int k, int units_per_warp) {
    const Bf16Rows w{w_gate_up + (long long)blockIdx.y * 2 * I * D, D};
    gate_up_silu(x, sorted_slot, offsets, w, h, D, I, k, units_per_warp);
}

extern "C" __global__ void __launch_bounds__(GG_THREADS, 1) moe_down(
    const bf16* __restrict__ h, const int* __restrict__ offsets, const bf16* __restrict__ w_down,
    float* __restrict__ y, int D, int I, int units_per_warp) {
    const Bf16Rows w{w_down + (long long)blockIdx.y * D * I, I};
    down(h, offsets, w, y, D, I, units_per_warp);
}

// A dense MLP's (or shared expert's) gate_up product with silu_and_mul as its epilogue, for decode's
// few rows (one launch instead of cuBLAS + silu_and_mul): h[t, u] = silu(g) * up with g and up the
// row's two dot products rounded to bf16 first, as the product's bf16 output that silu_and_mul reads.
// x [T, D]; w_gate_up [2I, D]; h [T, I]. Grid ceil(I / (GG_WARPS * units_per_warp)); units: I.
extern "C" __global__ void __launch_bounds__(GG_THREADS, 1)
    dense_gate_up_silu(const bf16* __restrict__ x, const bf16* __restrict__ w_gate_up, bf16* __restrict__ h, int T,
                       int D, int I, int units_per_warp) {
    const Bf16Rows w{w_gate_up, D};
    const int lane = threadIdx.x % WARP_SIZE, warp = threadIdx.x / WARP_SIZE;
    const int first = (blockIdx.x * GG_WARPS + warp) * units_per_warp;
    const int last = min(first + units_per_warp, I);
    for (int u = first; u < last; ++u) {
        for (int m0 = 0; m0 < T; m0 += GG_MT) {
            const int mt = min(GG_MT, T - m0);
            const bf16* xr[GG_MT];
#pragma unroll
            for (int m = 0; m < GG_MT; ++m) xr[m] = x + (long long)(m0 + min(m, mt - 1)) * D;
            float g[GG_MT], up[GG_MT];
            dot_two_rows(w, u, I + u, xr, mt, D, g, up);
#pragma unroll
            for (int m = 0; m < GG_MT; ++m)
                if (m < mt && lane == m) {
                    const float gb = to_f32(__float2bfloat16(g[m])), ub = to_f32(__float2bfloat16(up[m]));
                    h[(long long)(m0 + m) * I + u] = __float2bfloat16(silu(gb) * ub);
                }
        }
    }
}

// FP8 experts: w_gate_up [El, 2I, D] bytes with scale [El, 2 * ceil(I / bn), ceil(D / bk)] (gate and up
// blocked separately); w_down [El, D, I] bytes with scale [El, ceil(D / bn), ceil(I / bk)].
extern "C" __global__ void __launch_bounds__(GG_THREADS, 1) moe_gate_up_silu_fp8(
    const bf16* __restrict__ x, const int* __restrict__ sorted_slot, const int* __restrict__ offsets,
    const unsigned char* __restrict__ w_gate_up, const float* __restrict__ scale, bf16* __restrict__ h, int D, int I,
    int k, int units_per_warp, int block_n, int block_k) {
    const long long scales = 2LL * ((I + block_n - 1) / block_n) * ((D + block_k - 1) / block_k);
    const Fp8Rows w{w_gate_up + (long long)blockIdx.y * 2 * I * D, scale + blockIdx.y * scales, D, block_n, block_k, I};
    gate_up_silu(x, sorted_slot, offsets, w, h, D, I, k, units_per_warp);
}

extern "C" __global__ void __launch_bounds__(GG_THREADS, 1) moe_down_fp8(
    const bf16* __restrict__ h, const int* __restrict__ offsets, const unsigned char* __restrict__ w_down,
    const float* __restrict__ scale, float* __restrict__ y, int D, int I, int units_per_warp, int block_n,
    int block_k) {
    const long long scales = (long long)((D + block_n - 1) / block_n) * ((I + block_k - 1) / block_k);
    const Fp8Rows w{w_down + (long long)blockIdx.y * D * I, scale + blockIdx.y * scales, I, block_n, block_k, D};
    down(h, offsets, w, y, D, I, units_per_warp);
}
