// Grouped expert GEMMs on tensor cores (mma.sync bf16, fp32 accumulation) for many rows per
// expert (prefill, large decode batches). One launch covers every local expert: the rows come
// sorted by expert from moe_permute, and each block finds its expert and row tile from `offsets`
// on the device (no host sync; ragged groups, empty groups and tails of any length).
//
// grid (tile slots, N tiles): slot i is the i-th (expert, 64-row tile) pair in expert order; an
// expert with c rows has ceil(c / 64) tiles, so at most (P + El * 63) / 64 slots are used and the
// rest return at once. A block computes a 64 x 128 output tile with 4 warps (2 x 2, 32 x 64 each),
// K in steps of 32 through a 3-stage cp.async pipeline in shared memory, fragments by ldmatrix.
//   moe_tc_gate_up: h[p, u] = silu(x[tok_p] . w[e, u]) * (x[tok_p] . w[e, I + u]), tok_p =
//     sorted_slot[p] / k; a tile holds 64 units, their gate and up rows side by side in each warp.
//   moe_tc_down: y[p, n] = h[p] . w_down[e, n] (fp32 out).
//   moe_tc_gate_up_swiglu / moe_tc_down_bias: gpt-oss's bf16 experts, the same tiles with the
//     expert's fp32 biases added and the clamped SwiGLU, (clip(up, -limit, limit) + 1) * g *
//     sigmoid(alpha * g) with g = min(gate, limit), in place of silu(gate) * up (gptoss.cu's formula).
// __launch_bounds__(TC_THREADS, 1): without the minimum, ptxas held the fp8 kernels to 128
// registers on sm_80 and spilled.
// *_fp8: weights float8_e4m3fn with [block_n, block_k] scales; the bytes go to shared memory as
// they are and become bf16 (w * scale, one rounding) in the B fragments, converted by the
// hardware (cvt.rn.f16x2.e4m3x2 on sm_89+; CUDA's emulation before). The scale is looked up
// once per row and 32-column step (host-checked: block_k a multiple of 32, K of 16).
// D and I are multiples of 8 (bf16) and the arrays 16-byte aligned (host-checked).
#include <cuda_fp8.h>

#include "tensor_core.cuh"

#define TC_THREADS 128
#define TC_BM 64
#define TC_BN 128  // weight rows per tile
#define TC_BK 32
#define TC_STAGES 3
#define TC_LDA (TC_BK + 8)    // bf16 per shared row: 80 bytes, ldmatrix rows in distinct banks
#define TC_LDB8 (TC_BK + 16)  // fp8 bytes per shared row: 48

// The expert and row tile of tile slot `slot` (expert -1: past the last tile). Each warp scans
// the experts 32 at a time: tiles per expert, an inclusive warp scan, the first lane past slot.
__device__ __forceinline__ void find_tile(const int* __restrict__ offsets, int El, int slot, int& expert, int& tile) {
    const int lane = threadIdx.x % WARP_SIZE;
    int base = 0;
    expert = -1;
    tile = 0;
    for (int e0 = 0; e0 < El; e0 += WARP_SIZE) {
        const int e = e0 + lane;
        const int tiles = e < El ? (offsets[e + 1] - offsets[e] + TC_BM - 1) / TC_BM : 0;
        int incl = tiles;
#pragma unroll
        for (int o = 1; o < WARP_SIZE; o <<= 1) {
            const int v = __shfl_up_sync(FULL_MASK, incl, o);
            if (lane >= o) incl += v;
        }
        const int total = __shfl_sync(FULL_MASK, incl, WARP_SIZE - 1);
        if (slot < base + total) {
            const int first = __ffs(__ballot_sync(FULL_MASK, slot < base + incl)) - 1;
            expert = e0 + first;
            tile = slot - base - __shfl_sync(FULL_MASK, incl - tiles, first);
            return;
        }
        base += total;
    }
}

// Where the tile's operands come from and where its result goes.
struct TileJob {
    int expert, row0, rows;  // sorted rows [row0, row0 + rows) of the expert, rows <= TC_BM
    int K;                   // reduction length (D for gate_up, I for down)
};

// The weight row of B-tile row j (0 .. TC_BN - 1) of N tile `nt`, or -1 past the end.
template <bool GATE_UP>
__device__ __forceinline__ int weight_row(int j, int nt, int D, int I) {
    if (GATE_UP) {  // warp column wn = j / 64 takes units nt * 64 + wn * 32 + [0, 32): gate rows, then up rows
        const int jj = j % 64, unit = nt * 64 + (j / 64) * 32 + jj % 32;
        return unit < I ? (jj < 32 ? unit : I + unit) : -1;
    }
    const int n = nt * TC_BN + j;
    return n < D ? n : -1;
}

// Shared memory of one stage: A [TC_BM][TC_LDA] bf16 | B [TC_BN][TC_LDA] bf16 or [TC_BN][TC_LDB8] bytes.
template <bool FP8>
struct Stage {
    static constexpr int a_bytes = TC_BM * TC_LDA * 2;
    static constexpr int b_bytes = FP8 ? TC_BN * TC_LDB8 : TC_BN * TC_LDA * 2;
    static constexpr int bytes = a_bytes + b_bytes;
};

// Issue the cp.async copies of k step k0 into stage `s`: A rows a_src[i] (nullptr: zeros), B rows b_src[i].
template <bool FP8>
__device__ __forceinline__ void load_stage(unsigned char* s, const bf16* const a_src[2], const unsigned char* const b_src[4],
                                           int k0, int K, const void* any) {
    const int tid = threadIdx.x;
    bf16* As = reinterpret_cast<bf16*>(s);
#pragma unroll
    for (int i = 0; i < 2; ++i) {  // 64 rows x 4 chunks of 8: row (tid + 128 i) / 4, chunk tid % 4
        const int row = tid / 4 + 32 * i, k = k0 + 8 * (tid % 4);
        const bool ok = a_src[i] && k < K;
        cp_async16(As + row * TC_LDA + 8 * (tid % 4), ok ? (const void*)(a_src[i] + k) : any, ok);
    }
    unsigned char* Bs = s + Stage<FP8>::a_bytes;
    if (FP8) {
#pragma unroll
        for (int i = 0; i < 2; ++i) {  // 128 rows x 2 chunks of 16 bytes: row (tid + 128 i) / 2
            const int row = tid / 2 + 64 * i, k = k0 + 16 * (tid % 2);
            const bool ok = b_src[i] && k < K;
            cp_async16(Bs + row * TC_LDB8 + 16 * (tid % 2), ok ? (const void*)(b_src[i] + k) : any, ok);
        }
    } else {
#pragma unroll
        for (int i = 0; i < 4; ++i) {  // 128 rows x 4 chunks of 8 bf16: row tid / 4 + 32 i
            const int row = tid / 4 + 32 * i, k = k0 + 8 * (tid % 4);
            const bool ok = b_src[i] && k < K;
            cp_async16(reinterpret_cast<bf16*>(Bs) + row * TC_LDA + 8 * (tid % 4),
                       ok ? (const void*)(b_src[i] + 2 * k) : any, ok);
        }
    }
}

// B fragment of fp8 rows: 2 bytes at k and k + 8 of row `row` (lane's g), times `scale`, as bf16.
__device__ __forceinline__ void fp8_b_frag(u32 b[2], const unsigned char* Bs, int row, int k, float scale) {
    const int t = threadIdx.x % 4;
#pragma unroll
    for (int i = 0; i < 2; ++i) {
        const unsigned short v = *reinterpret_cast<const unsigned short*>(Bs + row * TC_LDB8 + k + 8 * i + 2 * t);
        const __half2_raw raw = __nv_cvt_fp8x2_to_halfraw2(v, __NV_E4M3);
        const float2 f = __half22float2(__half2(raw));
        b[i] = pack_bf16(f.x * scale, f.y * scale);
    }
}

// acc[mi][ni] += the warp's 32 x 64 piece of one stage (two k16 steps).
template <bool FP8>
__device__ __forceinline__ void compute_stage(const unsigned char* s, float acc[2][8][4], const float scales[8]) {
    const int warp = threadIdx.x / WARP_SIZE, wm = warp / 2, wn = warp % 2, g = (threadIdx.x % WARP_SIZE) / 4;
    const bf16* As = reinterpret_cast<const bf16*>(s);
    const unsigned char* Bs = s + Stage<FP8>::a_bytes;
#pragma unroll
    for (int ks = 0; ks < TC_BK; ks += 16) {
        u32 a[2][4];
#pragma unroll
        for (int mi = 0; mi < 2; ++mi) load_a(a[mi], As + (wm * 32 + mi * 16) * TC_LDA + ks, TC_LDA);
#pragma unroll
        for (int nj = 0; nj < 4; ++nj) {
            u32 b0[2], b1[2];
            const int row = wn * 64 + nj * 16;
            if (FP8) {
                fp8_b_frag(b0, Bs, row + g, ks, scales[2 * nj]);
                fp8_b_frag(b1, Bs, row + 8 + g, ks, scales[2 * nj + 1]);
            } else {
                load_b_nk(b0, b1, reinterpret_cast<const bf16*>(Bs) + row * TC_LDA + ks, TC_LDA);
            }
#pragma unroll
            for (int mi = 0; mi < 2; ++mi) {
                mma_bf16(acc[mi][2 * nj], a[mi], b0);
                mma_bf16(acc[mi][2 * nj + 1], a[mi], b1);
            }
        }
    }
}

// FP8 scales of the lane's 8 B rows (row g of each n8 tile of its warp) for k step k0.
struct Fp8Scales {
    const float* scale;  // this expert's [scale rows, ceil(K / block_k)]
    int k_blocks, block_k;
    int srow[8];  // scale row of each of the lane's rows (0 for rows past the end)
    __device__ __forceinline__ void at(int k0, float out[8]) const {
        const int kb = k0 / block_k;
#pragma unroll
        for (int i = 0; i < 8; ++i) out[i] = scale[(long long)srow[i] * k_blocks + kb];
    }
};

// The pipelined main loop of one tile: acc = A rows x B rows over K.
template <bool FP8>
__device__ __forceinline__ void tile_mainloop(unsigned char* smem, const bf16* const a_src[2],
                                              const unsigned char* const b_src[4], int K, const void* any,
                                              const Fp8Scales& sc, float acc[2][8][4]) {
#pragma unroll
    for (int mi = 0; mi < 2; ++mi)
#pragma unroll
        for (int ni = 0; ni < 8; ++ni)
#pragma unroll
            for (int c = 0; c < 4; ++c) acc[mi][ni][c] = 0.0f;
    const int steps = (K + TC_BK - 1) / TC_BK;
#pragma unroll
    for (int s = 0; s < TC_STAGES - 1; ++s) {
        if (s < steps) load_stage<FP8>(smem + s * Stage<FP8>::bytes, a_src, b_src, s * TC_BK, K, any);
        cp_async_commit();  // empty groups keep the count uniform
    }
    for (int kt = 0; kt < steps; ++kt) {
        cp_async_wait<TC_STAGES - 2>();  // step kt has landed (this thread's copies) ...
        __syncthreads();                 // ... everyone's, and step kt - 1's stage is free again
        const int next = kt + TC_STAGES - 1;
        if (next < steps) load_stage<FP8>(smem + (next % TC_STAGES) * Stage<FP8>::bytes, a_src, b_src, next * TC_BK, K, any);
        cp_async_commit();
        float scales[8] = {};
        if (FP8) sc.at(kt * TC_BK, scales);
        compute_stage<FP8>(smem + (kt % TC_STAGES) * Stage<FP8>::bytes, acc, scales);
    }
    cp_async_wait<0>();
}

// The block's tile (expert -1: its slot has none).
__device__ __forceinline__ bool begin_tile(const int* __restrict__ offsets, int El, int K, TileJob& job) {
    int tile;
    find_tile(offsets, El, blockIdx.x, job.expert, tile);
    if (job.expert < 0) return false;
    job.row0 = offsets[job.expert] + tile * TC_BM;
    job.rows = min(TC_BM, offsets[job.expert + 1] - job.row0);
    job.K = K;
    return true;
}

// The sorted row r of the tile's A operand: a token's row of x (gate_up) or the row of h (down).
template <bool GATE_UP>
__device__ __forceinline__ long long a_row(const TileJob& job, const int* __restrict__ sorted_slot, int k, int r) {
    return GATE_UP ? (long long)(sorted_slot[job.row0 + min(r, job.rows - 1)] / k) : job.row0 + r;
}

// The scale row (of [scale rows, ceil(K / block_k)]) of weight row `row` (-1: 0) when rows
// [i * part, (i + 1) * part) are blocked on their own.
__device__ __forceinline__ int scale_row(int row, int part, int block_n) {
    return row < 0 ? 0 : (row / part) * ((part + block_n - 1) / block_n) + (row % part) / block_n;
}

// One tile of either GEMM (expert -1: the slot has none). Sets the lane's source rows.
template <bool FP8, bool GATE_UP>
__device__ void tc_tile(const bf16* __restrict__ a, const int* __restrict__ sorted_slot, const int* __restrict__ offsets,
                        const unsigned char* __restrict__ w, const float* __restrict__ scale, int D, int I, int k, int El,
                        int block_n, int block_k, float acc[2][8][4], TileJob& job) {
    extern __shared__ __align__(16) unsigned char smem[];
    if (!begin_tile(offsets, El, GATE_UP ? D : I, job)) return;
    const int tid = threadIdx.x, N = GATE_UP ? 2 * I : D, part = GATE_UP ? I : D;
    const int elem = FP8 ? 1 : 2;
    const unsigned char* we = w + (long long)job.expert * N * job.K * elem;
    const bf16* a_src[2];
#pragma unroll
    for (int i = 0; i < 2; ++i) {
        const int r = tid / 4 + 32 * i;
        a_src[i] = r < job.rows ? a + a_row<GATE_UP>(job, sorted_slot, k, r) * job.K : nullptr;
    }
    const unsigned char* b_src[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const int row = weight_row<GATE_UP>(FP8 ? tid / 2 + 64 * i : tid / 4 + 32 * i, blockIdx.y, D, I);
        b_src[i] = row >= 0 && (!FP8 || i < 2) ? we + (long long)row * job.K * elem : nullptr;
    }
    Fp8Scales sc{};
    if (FP8) {
        const int row_blocks = (part + block_n - 1) / block_n;
        sc.k_blocks = (job.K + block_k - 1) / block_k;
        sc.block_k = block_k;
        sc.scale = scale + (long long)job.expert * (N / part) * row_blocks * sc.k_blocks;
        const int warp = tid / WARP_SIZE, g = (tid % WARP_SIZE) / 4;
#pragma unroll
        for (int i = 0; i < 8; ++i)
            sc.srow[i] = scale_row(weight_row<GATE_UP>((warp % 2) * 64 + i * 8 + g, blockIdx.y, D, I), part, block_n);
    }
    tile_mainloop<FP8>(smem, a_src, b_src, job.K, a, sc, acc);
}

// gpt-oss's epilogue: b the expert's biases (gate_up: [2I], down: [D]; null: none), the clamp and alpha.
struct Bias {
    const float* b;
    float alpha, limit;
};

// The activation of unit u: silu(gate) * up, or with biases gpt-oss's clamped SwiGLU.
template <bool BIAS>
__device__ __forceinline__ float gate_act(float gate, float up, const Bias& e, int u, int I) {
    if (!BIAS) return silu(gate) * up;
    const float g = fminf(gate + e.b[u], e.limit);
    up = fminf(fmaxf(up + e.b[I + u], -e.limit), e.limit);
    return (up + 1.0f) * (g / (1.0f + __expf(-e.alpha * g)));
}

// h rows of the tile: the activation of each unit, bf16 (units of N tile blockIdx.y).
template <bool BIAS = false>
__device__ __forceinline__ void store_gate_up(const TileJob& job, const float acc[2][8][4], bf16* __restrict__ h, int I,
                                              const Bias& e = Bias{}) {
    const int lane = threadIdx.x % WARP_SIZE, warp = threadIdx.x / WARP_SIZE, g = lane / 4, t = lane % 4;
#pragma unroll
    for (int mi = 0; mi < 2; ++mi)
#pragma unroll
        for (int half = 0; half < 2; ++half) {
            const int r = (warp / 2) * 32 + mi * 16 + g + 8 * half;
            if (r >= job.rows) continue;
            bf16* hr = h + (long long)(job.row0 + r) * I;
#pragma unroll
            for (int ni = 0; ni < 4; ++ni) {
                const int u = blockIdx.y * 64 + (warp % 2) * 32 + ni * 8 + 2 * t;
                if (u >= I) continue;
                const float* gt = acc[mi][ni] + 2 * half;
                const float* up = acc[mi][ni + 4] + 2 * half;
                *reinterpret_cast<u32*>(hr + u) =
                    pack_bf16(gate_act<BIAS>(gt[0], up[0], e, u, I), gate_act<BIAS>(gt[1], up[1], e, u + 1, I));
            }
        }
}

// y rows of the tile, fp32 (columns of N tile blockIdx.y), plus the bias with BIAS.
template <bool BIAS = false>
__device__ __forceinline__ void store_down(const TileJob& job, const float acc[2][8][4], float* __restrict__ y, int D,
                                           const Bias& e = Bias{}) {
    const int lane = threadIdx.x % WARP_SIZE, warp = threadIdx.x / WARP_SIZE, g = lane / 4, t = lane % 4;
#pragma unroll
    for (int mi = 0; mi < 2; ++mi)
#pragma unroll
        for (int half = 0; half < 2; ++half) {
            const int r = (warp / 2) * 32 + mi * 16 + g + 8 * half;
            if (r >= job.rows) continue;
            float* yr = y + (long long)(job.row0 + r) * D;
#pragma unroll
            for (int ni = 0; ni < 8; ++ni) {
                const int n = blockIdx.y * TC_BN + (warp % 2) * 64 + ni * 8 + 2 * t;
                if (n >= D) continue;
                const float b0 = BIAS ? e.b[n] : 0.0f, b1 = BIAS ? e.b[n + 1] : 0.0f;
                *reinterpret_cast<float2*>(yr + n) = make_float2(acc[mi][ni][2 * half] + b0, acc[mi][ni][2 * half + 1] + b1);
            }
        }
}

template <bool FP8>
__device__ void gate_up_tile(const bf16* x, const int* sorted_slot, const int* offsets, const unsigned char* w,
                             const float* scale, bf16* __restrict__ h, int D, int I, int k, int El, int block_n, int block_k) {
    float acc[2][8][4];
    TileJob job;
    tc_tile<FP8, true>(x, sorted_slot, offsets, w, scale, D, I, k, El, block_n, block_k, acc, job);
    if (job.expert >= 0) store_gate_up(job, acc, h, I);
}

template <bool FP8>
__device__ void down_tile(const bf16* h, const int* offsets, const unsigned char* w, const float* scale,
                          float* __restrict__ y, int D, int I, int El, int block_n, int block_k) {
    float acc[2][8][4];
    TileJob job;
    tc_tile<FP8, false>(h, nullptr, offsets, w, scale, D, I, 1, El, block_n, block_k, acc, job);
    if (job.expert >= 0) store_down(job, acc, y, D);
}

// ---- W8A8: FP8 activations x FP8 weights on the FP8 tensor cores (sm_89+) ----------------------
// The activations come quantized by fp8_quantize_rows, per row and group of block_k columns (the
// weights' K block): q = e4m3(x / s), s = max |x| / 448 over the group. A tile step of 32 columns
// lies in one K block (block_k a multiple of 32), so the step's mma sums over one scale pair: each
// K block sums into its own accumulator, then adds into the tile's with both scales, s_row(A) x
// s_block(W) (an n8 tile shares one weight scale row: block_n a multiple of 8, host-checked).
#define Q8_LD (TC_BK + 16)  // fp8 bytes per shared row (48)
#define Q8_STAGE ((TC_BM + TC_BN) * Q8_LD)

// x [R, K] bf16 -> q [R, K] e4m3 bytes, scale [R, ceil(K / group)]; one warp per (row, group).
extern "C" __global__ void __launch_bounds__(TC_THREADS) fp8_quantize_rows(const bf16* __restrict__ x,
                                                                         unsigned char* __restrict__ q,
                                                                         float* __restrict__ scale, int R, int K,
                                                                         int group) {
    const int groups = (K + group - 1) / group, lane = threadIdx.x % WARP_SIZE;
    const long long item = (long long)blockIdx.x * (TC_THREADS / WARP_SIZE) + threadIdx.x / WARP_SIZE;
    if (item >= (long long)R * groups) return;  // whole warps
    const long long r = item / groups;
    const int c0 = (int)(item % groups) * group, n = min(group, K - c0);
    const bf16* xr = x + r * K + c0;
    float amax = 0.0f;
    for (int i = lane; i < n; i += WARP_SIZE) amax = fmaxf(amax, fabsf(to_f32(xr[i])));
    amax = warp_max(amax);
    const float s = amax > 0.0f ? amax / 448.0f : 1.0f;
    for (int i = lane; i < n; i += WARP_SIZE)
        q[r * K + c0 + i] = __nv_cvt_float_to_fp8(to_f32(xr[i]) / s, __NV_SATFINITE, __NV_E4M3);
    if (lane == 0) scale[item] = s;
}

// Copies of one 32-column step: A rows a_src (64 x 2 chunks of 16 bytes: one per thread), B rows b_src.
__device__ __forceinline__ void q8_load_stage(unsigned char* s, const unsigned char* a_src,
                                              const unsigned char* const b_src[2], int k0, int K, const void* any) {
    const int tid = threadIdx.x, k = k0 + 16 * (tid % 2);
    cp_async16(s + (tid / 2) * Q8_LD + 16 * (tid % 2), a_src && k < K ? (const void*)(a_src + k) : any, a_src && k < K);
#pragma unroll
    for (int i = 0; i < 2; ++i)
        cp_async16(s + (TC_BM + tid / 2 + 64 * i) * Q8_LD + 16 * (tid % 2), b_src[i] && k < K ? (const void*)(b_src[i] + k) : any,
                   b_src[i] && k < K);
}

// blk[mi][ni] += the warp's 32 x 64 piece of one 32-column step, e4m3 x e4m3.
__device__ __forceinline__ void q8_compute_stage(const unsigned char* s, float blk[2][8][4]) {
    const int warp = threadIdx.x / WARP_SIZE, wm = warp / 2, wn = warp % 2, lane = threadIdx.x % WARP_SIZE;
    const int g = lane / 4, t = lane % 4;
    u32 a[2][4];
#pragma unroll
    for (int mi = 0; mi < 2; ++mi) {
        const unsigned char* r0 = s + (wm * 32 + mi * 16 + g) * Q8_LD + 4 * t;
        a[mi][0] = *reinterpret_cast<const u32*>(r0);
        a[mi][1] = *reinterpret_cast<const u32*>(r0 + 8 * Q8_LD);
        a[mi][2] = *reinterpret_cast<const u32*>(r0 + 16);
        a[mi][3] = *reinterpret_cast<const u32*>(r0 + 8 * Q8_LD + 16);
    }
#pragma unroll
    for (int ni = 0; ni < 8; ++ni) {
        const unsigned char* rb = s + (TC_BM + wn * 64 + ni * 8 + g) * Q8_LD + 4 * t;
        const u32 b[2] = {*reinterpret_cast<const u32*>(rb), *reinterpret_cast<const u32*>(rb + 16)};
#pragma unroll
        for (int mi = 0; mi < 2; ++mi) mma_e4m3(blk[mi][ni], a[mi], b);
    }
}

// Scales of the lane's accumulator rows (mi, half) and n8 tiles for one K block.
struct Q8Scales {
    const float* as;  // activation scales [rows, ceil(K / block_k)]
    const float* ws;  // this expert's weight scales [scale rows, ceil(K / block_k)]
    int a[2][2];      // offsets of the lane's rows' scales in as
    int w[8];         // offsets of its n8 tiles' scale rows in ws
};

// acc += blk * s_a * s_w, blk = 0.
__device__ __forceinline__ void q8_flush(float acc[2][8][4], float blk[2][8][4], const Q8Scales& sc, int kb) {
#pragma unroll
    for (int mi = 0; mi < 2; ++mi)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            const float sa = sc.as[sc.a[mi][h] + kb];
#pragma unroll
            for (int ni = 0; ni < 8; ++ni)
#pragma unroll
                for (int c = 2 * h; c < 2 * h + 2; ++c) {
                    acc[mi][ni][c] += blk[mi][ni][c] * (sa * sc.ws[sc.w[ni] + kb]);
                    blk[mi][ni][c] = 0.0f;
                }
        }
}

template <bool GATE_UP>
__device__ void q8_tile(const unsigned char* __restrict__ aq, const float* __restrict__ as,
                        const int* __restrict__ sorted_slot, const int* __restrict__ offsets,
                        const unsigned char* __restrict__ w, const float* __restrict__ ws, int D, int I, int k, int El,
                        int block_n, int block_k, float acc[2][8][4], TileJob& job) {
    extern __shared__ __align__(16) unsigned char smem[];
    if (!begin_tile(offsets, El, GATE_UP ? D : I, job)) return;
    const int tid = threadIdx.x, warp = tid / WARP_SIZE, g = (tid % WARP_SIZE) / 4, N = GATE_UP ? 2 * I : D;
    const int part = GATE_UP ? I : D, kbs = (job.K + block_k - 1) / block_k;
    const unsigned char* we = w + (long long)job.expert * N * job.K;
    const int ar = tid / 2;
    const unsigned char* a_src = ar < job.rows ? aq + a_row<GATE_UP>(job, sorted_slot, k, ar) * job.K : nullptr;
    const unsigned char* b_src[2];
    Q8Scales sc;
#pragma unroll
    for (int i = 0; i < 2; ++i) {
        const int row = weight_row<GATE_UP>(tid / 2 + 64 * i, blockIdx.y, D, I);
        b_src[i] = row >= 0 ? we + (long long)row * job.K : nullptr;
    }
    sc.as = as;
    sc.ws = ws + (long long)job.expert * (N / part) * ((part + block_n - 1) / block_n) * kbs;
#pragma unroll
    for (int ni = 0; ni < 8; ++ni)
        sc.w[ni] = scale_row(weight_row<GATE_UP>((warp % 2) * 64 + ni * 8, blockIdx.y, D, I), part, block_n) * kbs;
#pragma unroll
    for (int mi = 0; mi < 2; ++mi)
#pragma unroll
        for (int h = 0; h < 2; ++h)
            sc.a[mi][h] = (int)a_row<GATE_UP>(job, sorted_slot, k, min((warp / 2) * 32 + mi * 16 + g + 8 * h, job.rows - 1)) * kbs;
    float blk[2][8][4];
#pragma unroll
    for (int mi = 0; mi < 2; ++mi)
#pragma unroll
        for (int ni = 0; ni < 8; ++ni)
#pragma unroll
            for (int c = 0; c < 4; ++c) acc[mi][ni][c] = blk[mi][ni][c] = 0.0f;
    const int steps = (job.K + TC_BK - 1) / TC_BK;
#pragma unroll
    for (int st = 0; st < TC_STAGES - 1; ++st) {
        if (st < steps) q8_load_stage(smem + st * Q8_STAGE, a_src, b_src, st * TC_BK, job.K, aq);
        cp_async_commit();
    }
    for (int kt = 0; kt < steps; ++kt) {
        cp_async_wait<TC_STAGES - 2>();
        __syncthreads();
        const int next = kt + TC_STAGES - 1;
        if (next < steps) q8_load_stage(smem + (next % TC_STAGES) * Q8_STAGE, a_src, b_src, next * TC_BK, job.K, aq);
        cp_async_commit();
        q8_compute_stage(smem + (kt % TC_STAGES) * Q8_STAGE, blk);
        const int k_end = (kt + 1) * TC_BK;
        if (k_end % block_k == 0 || kt == steps - 1) q8_flush(acc, blk, sc, kt * TC_BK / block_k);
    }
    cp_async_wait<0>();
}

extern "C" __global__ void __launch_bounds__(TC_THREADS, 1) moe_tc_gate_up(
    const bf16* __restrict__ x, const int* __restrict__ sorted_slot, const int* __restrict__ offsets,
    const bf16* __restrict__ w_gate_up, bf16* __restrict__ h, int D, int I, int k, int El) {
    gate_up_tile<false>(x, sorted_slot, offsets, reinterpret_cast<const unsigned char*>(w_gate_up), nullptr, h, D, I, k,
                        El, 1, 1);
}

extern "C" __global__ void __launch_bounds__(TC_THREADS, 1) moe_tc_down(
    const bf16* __restrict__ h, const int* __restrict__ offsets, const bf16* __restrict__ w_down, float* __restrict__ y,
    int D, int I, int El) {
    down_tile<false>(h, offsets, reinterpret_cast<const unsigned char*>(w_down), nullptr, y, D, I, El, 1, 1);
}

// gpt-oss, bf16 experts: b_gate_up [El, 2I], b_down [El, D] fp32.
extern "C" __global__ void __launch_bounds__(TC_THREADS, 1) moe_tc_gate_up_swiglu(
    const bf16* __restrict__ x, const int* __restrict__ sorted_slot, const int* __restrict__ offsets,
    const bf16* __restrict__ w_gate_up, const float* __restrict__ b_gate_up, bf16* __restrict__ h, int D, int I, int k,
    int El, float alpha, float limit) {
    float acc[2][8][4];
    TileJob job;
    tc_tile<false, true>(x, sorted_slot, offsets, reinterpret_cast<const unsigned char*>(w_gate_up), nullptr, D, I, k,
                         El, 1, 1, acc, job);
    if (job.expert >= 0) store_gate_up<true>(job, acc, h, I, Bias{b_gate_up + (long long)job.expert * 2 * I, alpha, limit});
}

extern "C" __global__ void __launch_bounds__(TC_THREADS, 1) moe_tc_down_bias(
    const bf16* __restrict__ h, const int* __restrict__ offsets, const bf16* __restrict__ w_down,
    const float* __restrict__ b_down, float* __restrict__ y, int D, int I, int El) {
    float acc[2][8][4];
    TileJob job;
    tc_tile<false, false>(h, nullptr, offsets, reinterpret_cast<const unsigned char*>(w_down), nullptr, D, I, 1, El, 1, 1,
                          acc, job);
    if (job.expert >= 0) store_down<true>(job, acc, y, D, Bias{b_down + (long long)job.expert * D, 0.0f, 0.0f});
}

extern "C" __global__ void __launch_bounds__(TC_THREADS, 1) moe_tc_gate_up_fp8(
    const bf16* __restrict__ x, const int* __restrict__ sorted_slot, const int* __restrict__ offsets,
    const unsigned char* __restrict__ w_gate_up, const float* __restrict__ scale, bf16* __restrict__ h, int D, int I,
    int k, int El, int block_n, int block_k) {
    gate_up_tile<true>(x, sorted_slot, offsets, w_gate_up, scale, h, D, I, k, El, block_n, block_k);
}

extern "C" __global__ void __launch_bounds__(TC_THREADS, 1) moe_tc_down_fp8(
    const bf16* __restrict__ h, const int* __restrict__ offsets, const unsigned char* __restrict__ w_down,
    const float* __restrict__ scale, float* __restrict__ y, int D, int I, int El, int block_n, int block_k) {
    down_tile<true>(h, offsets, w_down, scale, y, D, I, El, block_n, block_k);
}

// W8A8 (sm_89+): xq / hq e4m3 activations with their scales from fp8_quantize_rows (group block_k).
extern "C" __global__ void __launch_bounds__(TC_THREADS, 1) moe_tc_gate_up_w8a8(
    const unsigned char* __restrict__ xq, const float* __restrict__ xs, const int* __restrict__ sorted_slot,
    const int* __restrict__ offsets, const unsigned char* __restrict__ w_gate_up, const float* __restrict__ scale,
    bf16* __restrict__ h, int D, int I, int k, int El, int block_n, int block_k) {
    float acc[2][8][4];
    TileJob job;
    q8_tile<true>(xq, xs, sorted_slot, offsets, w_gate_up, scale, D, I, k, El, block_n, block_k, acc, job);
    if (job.expert >= 0) store_gate_up(job, acc, h, I);
}

extern "C" __global__ void __launch_bounds__(TC_THREADS, 1) moe_tc_down_w8a8(
    const unsigned char* __restrict__ hq, const float* __restrict__ hs, const int* __restrict__ offsets,
    const unsigned char* __restrict__ w_down, const float* __restrict__ scale, float* __restrict__ y, int D, int I,
    int El, int block_n, int block_k) {
    float acc[2][8][4];
    TileJob job;
    q8_tile<false>(hq, hs, nullptr, offsets, w_down, scale, D, I, 1, El, block_n, block_k, acc, job);
    if (job.expert >= 0) store_down(job, acc, y, D);
}
