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
// moe_gate_up_silu / moe_down (and their _fp8 pair) also run an ungated shared expert (DeepSeek's,
// GLM's) on every row t < T in blocks of their own (blockIdx.y >= El; its weights passed apart, of
// the routed weights' format; T = 0: none), so its two products cost no launch of their own (issue
// 39); its output stays a bf16 [T, D] of its own. dense_add_norm_gate_up_silu: a dense MLP's
// post-attention add_rms_norm and gate_up product with silu_and_mul, one launch (below).
#include "rms_row.cuh"
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

// The first unit of this warp in the shared expert's blocks (blockIdx.y >= El), numbered on from
// the routed blocks' x.
__device__ __forceinline__ int shared_first_unit(int El, int units_per_warp) {
    const int block = (blockIdx.y - El) * gridDim.x + blockIdx.x;
    return (block * GG_WARPS + threadIdx.x / WARP_SIZE) * units_per_warp;
}

// h[t, u] = silu(g) * up for the rows t < T of x (row stride D) and this warp's units u in
// [first, last), g and up the row's two dot products rounded to bf16 first, as the product's bf16
// output that silu_and_mul reads: a dense MLP's (or shared expert's) gate_up product with silu_and_mul
// as its epilogue. w: [2I, D] rows (gate | up), bf16 or FP8; h [T, I]. x may be in shared memory.
template <typename W>
__device__ void dense_gate_up_silu_units(const bf16* x, const W& w, bf16* __restrict__ h, int T, int D, int I,
                                         int first, int last) {
    const int lane = threadIdx.x % WARP_SIZE;
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

// The shared expert's blocks of the grouped launches (blockIdx.y >= El): its gate_up with silu_and_mul
// over every row t < T (w: [2Is, D] rows) into h_shared [T, Is], or its down product (w: [D, Is] rows)
// of h_shared into y_shared [T, D] bf16.
template <typename W>
__device__ void shared_gate_up_blocks(const bf16* x, const W& w, bf16* h_shared, int T, int D, int Is, int El,
                                      int units_per_warp) {
    const int first = shared_first_unit(El, units_per_warp);
    dense_gate_up_silu_units(x, w, h_shared, T, D, Is, first, min(first + units_per_warp, Is));
}

template <typename W>
__device__ void shared_down_blocks(const bf16* h_shared, const W& w, bf16* y_shared, int T, int D, int Is, int El,
                                   int units_per_warp) {
    const int first = shared_first_unit(El, units_per_warp);
    dense_down_units(h_shared, w, y_shared, T, D, Is, first, min(first + units_per_warp, (D + 1) / 2));
}

// Routed experts: grid (ceil(I / (GG_WARPS * units_per_warp)), El + shared blocks). The shared
// expert (shared_gate_up [2Is, D], T > 0): h_shared[t] = its silu_and_mul of x[t], t < T.
extern "C" __global__ void __launch_bounds__(GG_THREADS, 1) moe_gate_up_silu(
    const bf16* __restrict__ x, const int* __restrict__ sorted_slot, const int* __restrict__ offsets,
    const bf16* __restrict__ w_gate_up, bf16* __restrict__ h, int D, int I, int k, int units_per_warp, int El,
    const bf16* __restrict__ shared_gate_up, bf16* __restrict__ h_shared, int T, int Is) {
    if ((int)blockIdx.y >= El) {
        shared_gate_up_blocks(x, Bf16Rows{shared_gate_up, D}, h_shared, T, D, Is, El, units_per_warp);
        return;
    }
    const Bf16Rows w{w_gate_up + (long long)blockIdx.y * 2 * I * D, D};
    gate_up_silu(x, sorted_slot, offsets, w, h, D, I, k, units_per_warp);
}

// Routed experts: grid (ceil(ceil(D / 2) / (GG_WARPS * units_per_warp)), El + shared blocks). The
// shared expert (shared_down [D, Is]): y_shared[t] = h_shared[t] . shared_down, bf16 [T, D].
extern "C" __global__ void __launch_bounds__(GG_THREADS, 1) moe_down(
    const bf16* __restrict__ h, const int* __restrict__ offsets, const bf16* __restrict__ w_down,
    float* __restrict__ y, int D, int I, int units_per_warp, int El, const bf16* __restrict__ h_shared,
    const bf16* __restrict__ shared_down, bf16* __restrict__ y_shared, int T, int Is) {
    if ((int)blockIdx.y >= El) {
        shared_down_blocks(h_shared, Bf16Rows{shared_down, Is}, y_shared, T, D, Is, El, units_per_warp);
        return;
    }
    const Bf16Rows w{w_down + (long long)blockIdx.y * D * I, I};
    down(h, offsets, w, y, D, I, units_per_warp);
}

// A dense MLP's (or shared expert's) gate_up product with silu_and_mul as its epilogue, for decode's
// few rows (one launch instead of cuBLAS + silu_and_mul). x [T, D]; w_gate_up [2I, D]; h [T, I].
// Grid ceil(I / (GG_WARPS * units_per_warp)); units: I.
extern "C" __global__ void __launch_bounds__(GG_THREADS, 1)
    dense_gate_up_silu(const bf16* __restrict__ x, const bf16* __restrict__ w_gate_up, bf16* __restrict__ h, int T,
                       int D, int I, int units_per_warp) {
    const int first = (blockIdx.x * GG_WARPS + threadIdx.x / WARP_SIZE) * units_per_warp;
    dense_gate_up_silu_units(x, Bf16Rows{w_gate_up, D}, h, T, D, I, first, min(first + units_per_warp, I));
}

// Rows t < T of add_rms_norm(x, residual, norm) into xn [T, D] (this block's shared memory) with
// add_rms_norm's bits: its block of norm_threads (a multiple of 32, at most 32 warps) is stood in for
// by this one, warp w doing the warps w, w + GG_WARPS, .. of it (the same lanes), and the warps' sums
// added as block_sum adds them. Block 0 alone writes the sums s to sum_out (which no block reads).
// scratch: WARP_SIZE floats of shared memory.
__device__ void add_norm_rows(const bf16* __restrict__ x, const bf16* __restrict__ residual,
                              const bf16* __restrict__ norm, bf16* __restrict__ sum_out, bf16* xn, float* scratch,
                              int T, int D, float eps, int norm_threads) {
    const int lane = threadIdx.x % WARP_SIZE, warp = threadIdx.x / WARP_SIZE, warps = norm_threads / WARP_SIZE;
    for (int t = 0; t < T; ++t) {
        const long long off = (long long)t * D;
        for (int vw = warp; vw < warps; vw += GG_WARPS) {
            const float ss = add_row_squares(x + off, residual + off, xn + off, D, vw * WARP_SIZE + lane,
                                             norm_threads, x, 0);
            const float sum = warp_sum(ss);
            if (lane == 0) scratch[vw] = sum;
        }
        __syncthreads();
        const float inv = rms_inv(warp_sum(lane < warps ? scratch[lane] : 0.0f), D, eps);
        __syncthreads();  // scratch is the next row's
        for (int vw = warp; vw < warps; vw += GG_WARPS)  // each thread rescales the elements it stored
            for (int d = vw * WARP_SIZE + lane; d < D; d += norm_threads) {
                const bf16 s = xn[off + d];
                if (blockIdx.x == 0) sum_out[off + d] = s;
                xn[off + d] = rms_scaled(s, inv, norm[d]);
            }
    }
    __syncthreads();
}

// The post-attention add_rms_norm fused into dense_gate_up_silu (a dense MLP at decode): every block
// normalises the T rows itself into shared memory (WARP_SIZE floats of scratch, then T * D bf16), then
// runs dense_gate_up_silu's units on them. x, residual [T, D]; norm [D]; sum_out [T, D] (x + residual,
// the residual stream); h [T, I]. w: [2I, D] rows, bf16, or FP8 (the _fp8 entry point: fp8_linear's
// products, so the bits of fp8_linear then silu_and_mul).
template <typename W>
__device__ void add_norm_gate_up_silu(const bf16* __restrict__ x, const bf16* __restrict__ residual,
                                      const bf16* __restrict__ norm, bf16* __restrict__ sum_out, const W& w,
                                      bf16* __restrict__ h, int T, int D, int I, float eps, int norm_threads,
                                      int units_per_warp) {
    extern __shared__ __align__(16) unsigned char dn_smem[];
    float* scratch = reinterpret_cast<float*>(dn_smem);                   // [WARP_SIZE]
    bf16* xn = reinterpret_cast<bf16*>(dn_smem + WARP_SIZE * sizeof(float));  // [T, D]
    add_norm_rows(x, residual, norm, sum_out, xn, scratch, T, D, eps, norm_threads);
    const int first = (blockIdx.x * GG_WARPS + threadIdx.x / WARP_SIZE) * units_per_warp;
    dense_gate_up_silu_units(xn, w, h, T, D, I, first, min(first + units_per_warp, I));
}

extern "C" __global__ void __launch_bounds__(GG_THREADS, 1) dense_add_norm_gate_up_silu(
    const bf16* __restrict__ x, const bf16* __restrict__ residual, const bf16* __restrict__ norm,
    bf16* __restrict__ sum_out, const bf16* __restrict__ w_gate_up, bf16* __restrict__ h, int T, int D, int I,
    float eps, int norm_threads, int units_per_warp) {
    add_norm_gate_up_silu(x, residual, norm, sum_out, Bf16Rows{w_gate_up, D}, h, T, D, I, eps, norm_threads,
                          units_per_warp);
}

// w_gate_up [2I, D] float8_e4m3fn bytes, scale [2I / part_rows * ceil(part_rows / bn), ceil(D / bk)].
extern "C" __global__ void __launch_bounds__(GG_THREADS, 1) dense_add_norm_gate_up_silu_fp8(
    const bf16* __restrict__ x, const bf16* __restrict__ residual, const bf16* __restrict__ norm,
    bf16* __restrict__ sum_out, const unsigned char* __restrict__ w_gate_up, const float* __restrict__ scale,
    bf16* __restrict__ h, int T, int D, int I, float eps, int norm_threads, int units_per_warp, int block_n,
    int block_k, int part_rows) {
    const Fp8Rows w{w_gate_up, scale, D, block_n, block_k, part_rows};
    add_norm_gate_up_silu(x, residual, norm, sum_out, w, h, T, D, I, eps, norm_threads, units_per_warp);
}

// FP8 experts: w_gate_up [El, 2I, D] bytes with scale [El, 2 * ceil(I / bn), ceil(D / bk)] (gate and up
// blocked separately); w_down [El, D, I] bytes with scale [El, ceil(D / bn), ceil(I / bk)]. An FP8 shared
// expert has the routed weights' blocks (its rows in parts of shared_part_rows, as fp8_linear reads them).
extern "C" __global__ void __launch_bounds__(GG_THREADS, 1) moe_gate_up_silu_fp8(
    const bf16* __restrict__ x, const int* __restrict__ sorted_slot, const int* __restrict__ offsets,
    const unsigned char* __restrict__ w_gate_up, const float* __restrict__ scale, bf16* __restrict__ h, int D, int I,
    int k, int units_per_warp, int block_n, int block_k, int El, const unsigned char* __restrict__ shared_gate_up,
    const float* __restrict__ shared_scale, int shared_part_rows, bf16* __restrict__ h_shared, int T, int Is) {
    if ((int)blockIdx.y >= El) {
        const Fp8Rows w{shared_gate_up, shared_scale, D, block_n, block_k, shared_part_rows};
        shared_gate_up_blocks(x, w, h_shared, T, D, Is, El, units_per_warp);
        return;
    }
    const long long scales = 2LL * ((I + block_n - 1) / block_n) * ((D + block_k - 1) / block_k);
    const Fp8Rows w{w_gate_up + (long long)blockIdx.y * 2 * I * D, scale + blockIdx.y * scales, D, block_n, block_k, I};
    gate_up_silu(x, sorted_slot, offsets, w, h, D, I, k, units_per_warp);
}

extern "C" __global__ void __launch_bounds__(GG_THREADS, 1) moe_down_fp8(
    const bf16* __restrict__ h, const int* __restrict__ offsets, const unsigned char* __restrict__ w_down,
    const float* __restrict__ scale, float* __restrict__ y, int D, int I, int units_per_warp, int block_n,
    int block_k, int El, const bf16* __restrict__ h_shared, const unsigned char* __restrict__ shared_down,
    const float* __restrict__ shared_scale, int shared_part_rows, bf16* __restrict__ y_shared, int T, int Is) {
    if ((int)blockIdx.y >= El) {
        const Fp8Rows w{shared_down, shared_scale, Is, block_n, block_k, shared_part_rows};
        shared_down_blocks(h_shared, w, y_shared, T, D, Is, El, units_per_warp);
        return;
    }
    const long long scales = (long long)((D + block_n - 1) / block_n) * ((I + block_k - 1) / block_k);
    const Fp8Rows w{w_down + (long long)blockIdx.y * D * I, scale + blockIdx.y * scales, I, block_n, block_k, D};
    down(h, offsets, w, y, D, I, units_per_warp);
}
