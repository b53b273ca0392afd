// Grouped expert GEMMs for small token counts per expert (decode): one launch covers every
// local expert, reads the sorted rows of moe_permute on the device (no host sync), and skips
// experts no token chose, so only the chosen experts' weights are streamed from memory.
//
// grid (ceil(units / (GG_WARPS * units_per_warp)), El); expert e = blockIdx.y owns sorted rows
// [offsets[e], offsets[e+1]). A warp computes units_per_warp consecutive output units; a unit
// is a pair of weight rows dotted with up to GG_MT input rows at a time: lanes split the
// reduction dim K into 16-byte chunks (coalesced weight reads), then a warp reduction.
// fp32 accumulation; K (D or I) must be a multiple of 8 and the arrays 16-byte aligned.
#include "common.cuh"

#define GG_THREADS 128
#define GG_WARPS (GG_THREADS / WARP_SIZE)
#define GG_MT 8

// a0[m] = w0 . x_m and a1[m] = w1 . x_m for m < mt (rows of length K); every lane gets the sums.
__device__ __forceinline__ void dot_two_rows(const bf16* __restrict__ w0, const bf16* __restrict__ w1,
                                             const bf16* const xr[GG_MT], int mt, int K,
                                             float a0[GG_MT], float a1[GG_MT]) {
    const int lane = threadIdx.x % WARP_SIZE;
#pragma unroll
    for (int m = 0; m < GG_MT; ++m) a0[m] = a1[m] = 0.0f;
#pragma unroll 2
    for (int d = lane * 8; d < K; d += WARP_SIZE * 8) {
        float wa[8], wb[8];
        load8(w0 + d, wa);
        load8(w1 + d, wb);
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

// h[p, u] = silu(x[tok_p] . w_gate_up[e, u]) * (x[tok_p] . w_gate_up[e, I + u]) for the rows p
// of expert e, tok_p = sorted_slot[p] / k. x [T, D]; w_gate_up [El, 2I, D]; h [P, I]. Units: I.
extern "C" __global__ void __launch_bounds__(GG_THREADS) moe_gate_up_silu(
    const bf16* __restrict__ x, const int* __restrict__ sorted_slot, const int* __restrict__ offsets,
    const bf16* __restrict__ w_gate_up, bf16* __restrict__ h, int D, int I, int k,
    int units_per_warp) {
    const int e = blockIdx.y;
    const int start = offsets[e], count = offsets[e + 1] - start;
    if (count == 0) return;
    const int lane = threadIdx.x % WARP_SIZE, warp = threadIdx.x / WARP_SIZE;
    const bf16* w = w_gate_up + (long long)e * 2 * I * D;
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
            dot_two_rows(w + (long long)u * D, w + (long long)(I + u) * D, xr, mt, D, g, up);
#pragma unroll
            for (int m = 0; m < GG_MT; ++m)
                if (m < mt && lane == m)
                    h[(long long)(start + m0 + m) * I + u] = __float2bfloat16(silu(g[m]) * up[m]);
        }
    }
}

// y[p, n] = h[p] . w_down[e, n] for the rows p of expert e. h [P, I]; w_down [El, D, I];
// y [P, D] fp32. Units: output column pairs (2u, 2u + 1), ceil(D / 2) of them.
extern "C" __global__ void __launch_bounds__(GG_THREADS) moe_down(
    const bf16* __restrict__ h, const int* __restrict__ offsets, const bf16* __restrict__ w_down,
    float* __restrict__ y, int D, int I, int units_per_warp) {
    const int e = blockIdx.y;
    const int start = offsets[e], count = offsets[e + 1] - start;
    if (count == 0) return;
    const int lane = threadIdx.x % WARP_SIZE, warp = threadIdx.x / WARP_SIZE;
    const bf16* w = w_down + (long long)e * D * I;
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
            dot_two_rows(w + (long long)n0 * I, w + (long long)n1 * I, xr, mt, I, a0, a1);
#pragma unroll
            for (int m = 0; m < GG_MT; ++m) {
                if (m < mt && lane == m) {
                    float* yr = y + (long long)(start + m0 + m) * D;
                    yr[n0] = a0[m];
                    if (n1 != n0) yr[n1] = a1[m];
                }
            }
        }
    }
}
