// Flash-style prefill attention on tensor cores over the paged KV cache: GQA (flash_attention_d*)
// and MLA in the latent space (flash_mla), one sequence's chunk of T query rows per launch
// (chunked prefill: the rows sit at positions start_pos .. start_pos + T - 1, the cache holds
// everything before them and themselves).
//
// The M dimension packs (token, query head of the group) pairs: row r of the chunk is token
// r / G, head kvh * G + r % G, so the G heads that share a KV head read each K/V tile once (MLA:
// G = H, one latent row per token for every head). grid (ceil(T * G / 64), Hk); a block owns 64
// rows, 4 row groups of 16 (one warp each, or WN warps that split the V columns between them).
// Key tiles of BN positions stream through shared memory (cp.async, double-buffered when it
// fits), and each warp keeps its rows' scores in registers:
//   S = Q K^T (mma.sync m16n8k16 bf16, fp32) -> causal / sliding-window mask -> online softmax
//   (running max and sum per row, exp2 with the scale folded in) -> P as bf16 A fragments ->
//   O += P V (V fragments by ldmatrix.trans) -> O / sum, bf16.
// A row attends to positions [max(0, qpos - window + 1), qpos] (window 0: no limit); the keys a
// block's tiles round in before its first row's window are zeros, never read (a windowed table holds
// block 0 where the window has left). sinks[H] (gpt-oss; -inf: none) adds exp(sink_h) to row's softmax
// denominator and nothing to its numerator. Blocks run in reverse so the longest rows start first.
// Layouts: q [T, H, DQK]; out [T, H, DV]; cache row of position p: k_cache + slot * kv_stride +
// kvh * head_stride with slot = block_table[p / BS] * BS + p % BS (GQA: [NB, BS, Hk, Dh], MLA:
// latent [NB, BS, L] with head_stride 0 and v_cache == k_cache: V is its first DV columns). DQK, DV
// multiples of 8 (zero-padded to 16 in shared memory), at most the entry point's caps.
#include "tensor_core.cuh"

#define FA_ROWS 64  // query rows per block
#define FA_LOG2E 1.4426950408889634f

struct FaParams {
    const bf16* q;
    const bf16* k_cache;
    const bf16* v_cache;  // null (passed as k_cache): V is the first DV columns of the K rows (MLA)
    const int* block_table;
    const float* sinks;  // [H] logits in the denominator only (-inf: no sink)
    bf16* out;
    int T, H, G, DQK, DV, BS, kv_stride, head_stride, start_pos, window, stages;
    float scale_log2;  // softmax scale * log2(e)
};

// Shared memory: Q [64][ldq] | stages x (K [BN][ldq] | V [BN][ldv]) (V absent when it is K's).
struct FaSmem {
    int ldq, ldv, stage_elems;
    bf16 *q, *kv;
    __device__ __forceinline__ bf16* k(int s) const { return kv + s * stage_elems; }
};

__device__ __forceinline__ int pad16(int n) { return (n + 15) / 16 * 16; }

// cp.async of `rows` rows of `cols` (a multiple of 8) bf16 from src(r) (null: zeros) into dst
// [rows][ld], zero-filled to pad16(cols); every thread of the block takes a share.
template <typename Src>
__device__ __forceinline__ void copy_rows(bf16* dst, int ld, int rows, int cols, const Src& src, const void* any) {
    const int chunks = pad16(cols) / 8;
    for (int i = threadIdx.x; i < rows * chunks; i += blockDim.x) {
        const int r = i / chunks, c = 8 * (i % chunks);
        const bf16* s = c < cols ? src(r) : nullptr;
        cp_async16(dst + r * ld + c, s ? (const void*)(s + c) : any, s != nullptr);
    }
}

// The cache row of position pos (which must be below the chunk's end).
__device__ __forceinline__ const bf16* cache_row(const FaParams& p, const bf16* cache, int kvh, int pos) {
    const long long slot = (long long)p.block_table[pos / p.BS] * p.BS + pos % p.BS;
    return cache + slot * p.kv_stride + (long long)kvh * p.head_stride;
}

// K (and V) of positions [k0, k0 + BN) into stage s; positions outside [lo, end) are zeros.
template <int BN>
__device__ __forceinline__ void load_kv(const FaParams& p, const FaSmem& sm, int s, int kvh, int k0, int lo, int end) {
    const auto row = [&](const bf16* cache, int r) {
        return k0 + r >= lo && k0 + r < end ? cache_row(p, cache, kvh, k0 + r) : (const bf16*)nullptr;
    };
    copy_rows(sm.k(s), sm.ldq, BN, p.DQK, [&](int r) { return row(p.k_cache, r); }, p.q);
    if (p.v_cache) copy_rows(sm.k(s) + BN * sm.ldq, sm.ldv, BN, p.DV, [&](int r) { return row(p.v_cache, r); }, p.q);
}

// s[j] = the warp's 16 rows x keys [8j, 8j + 8) of the tile, times scale * log2(e), masked to -inf.
template <int BN>
__device__ __forceinline__ void tile_scores(const FaParams& p, const FaSmem& sm, int stage, int wr, int k0,
                                            const int qpos[2], float s[BN / 8][4]) {
    const int t = threadIdx.x % 4;
#pragma unroll
    for (int j = 0; j < BN / 8; ++j)
#pragma unroll
        for (int c = 0; c < 4; ++c) s[j][c] = 0.0f;
    const bf16* K = sm.k(stage);
    for (int kk = 0; kk < pad16(p.DQK); kk += 16) {
        u32 a[4];
        load_a(a, sm.q + wr * 16 * sm.ldq + kk, sm.ldq);
#pragma unroll
        for (int j = 0; j < BN / 16; ++j) {
            u32 b0[2], b1[2];
            load_b_nk(b0, b1, K + j * 16 * sm.ldq + kk, sm.ldq);
            mma_bf16(s[2 * j], a, b0);
            mma_bf16(s[2 * j + 1], a, b1);
        }
    }
#pragma unroll
    for (int j = 0; j < BN / 8; ++j)
#pragma unroll
        for (int c = 0; c < 4; ++c) {
            const int pos = k0 + 8 * j + 2 * t + c % 2, q = qpos[c / 2];
            const bool ok = pos <= q && (p.window == 0 || pos > q - p.window);
            s[j][c] = ok ? s[j][c] * p.scale_log2 : neg_inf();
        }
}

// Online softmax over one tile for the lane's rows g (h = 0) and g + 8 (h = 1): updates the
// running max m and (lane-partial) sum l, rescales o, and turns s into probabilities.
template <int BN, int NV>
__device__ __forceinline__ void softmax_update(float s[BN / 8][4], float m[2], float l[2], float o[NV][4]) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        float mx = neg_inf();
#pragma unroll
        for (int j = 0; j < BN / 8; ++j) mx = fmaxf(mx, fmaxf(s[j][2 * h], s[j][2 * h + 1]));
        mx = fmaxf(mx, __shfl_xor_sync(FULL_MASK, mx, 1));
        mx = fmaxf(mx, __shfl_xor_sync(FULL_MASK, mx, 2));
        const float m_new = fmaxf(m[h], mx);
        const float base = m_new == neg_inf() ? 0.0f : m_new;  // a row with nothing visible yet
        const float alpha = exp2f(m[h] - base);                 // 0 while m was -inf
        float sum = 0.0f;
#pragma unroll
        for (int j = 0; j < BN / 8; ++j)
#pragma unroll
            for (int c = 2 * h; c < 2 * h + 2; ++c) {
                s[j][c] = exp2f(s[j][c] - base);
                sum += s[j][c];
            }
        l[h] = l[h] * alpha + sum;
        m[h] = m_new;
#pragma unroll
        for (int n = 0; n < NV; ++n) o[n][2 * h] *= alpha, o[n][2 * h + 1] *= alpha;
    }
}

// o += P V for the warp's V columns [col0, col0 + 8 * nv) (nv even, columns past pad16(DV) skipped).
template <int BN, int NV>
__device__ __forceinline__ void tile_pv(const FaParams& p, const FaSmem& sm, int stage, const float s[BN / 8][4],
                                        int col0, int nv, float o[NV][4]) {
    const bf16* V = p.v_cache ? sm.k(stage) + BN * sm.ldq : sm.k(stage);
    const int ldv = p.v_cache ? sm.ldv : sm.ldq;
#pragma unroll
    for (int kb = 0; kb < BN / 16; ++kb) {
        const u32 a[4] = {pack_bf16(s[2 * kb][0], s[2 * kb][1]), pack_bf16(s[2 * kb][2], s[2 * kb][3]),
                          pack_bf16(s[2 * kb + 1][0], s[2 * kb + 1][1]), pack_bf16(s[2 * kb + 1][2], s[2 * kb + 1][3])};
#pragma unroll
        for (int n = 0; n < NV; n += 2) {
            if (n >= nv || col0 + 8 * n >= pad16(p.DV)) break;
            u32 b0[2], b1[2];
            load_b_kn(b0, b1, V + kb * 16 * ldv + col0 + 8 * n, ldv);
            mma_bf16(o[n], a, b0);
            mma_bf16(o[n + 1], a, b1);
        }
    }
}

// out rows of the lane (row0 + g, row0 + g + 8 of the chunk), columns col0 + 8n + 2t, divided by the
// sum (with the head's sink: o and the sum rescaled to max(m, sink), exp(sink) added to the sum).
template <int NV>
__device__ __forceinline__ void store_out(const FaParams& p, int kvh, int row0, int col0, int nv, const float m[2],
                                          const float l[2], const float o[NV][4]) {
    const int lane = threadIdx.x % WARP_SIZE, g = lane / 4, t = lane % 4;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        const float sum = l[h] + __shfl_xor_sync(FULL_MASK, l[h], 1);
        float total = sum + __shfl_xor_sync(FULL_MASK, sum, 2);
        const int r = row0 + g + 8 * h;
        if (r >= p.T * p.G) continue;
        const float sink = p.sinks[kvh * p.G + r % p.G] * FA_LOG2E, m_new = fmaxf(m[h], sink);
        const float alpha = m_new == neg_inf() ? 1.0f : exp2f(m[h] - m_new);
        total = total * alpha + (sink == neg_inf() ? 0.0f : exp2f(sink - m_new));
        const float inv = total > 0.0f ? alpha / total : 0.0f;
        bf16* dst = p.out + ((long long)(r / p.G) * p.H + kvh * p.G + r % p.G) * p.DV;
#pragma unroll
        for (int n = 0; n < NV; ++n) {
            const int c = col0 + 8 * n + 2 * t;
            if (n < nv && c < p.DV) *reinterpret_cast<u32*>(dst + c) = pack_bf16(o[n][2 * h] * inv, o[n][2 * h + 1] * inv);
        }
    }
}

// The whole block: rows [row0, row0 + 64) of the chunk against their keys, tile by tile.
template <int NV, int BN, int WN>
__device__ void flash_block(const FaParams& p) {
    extern __shared__ __align__(16) unsigned char fa_smem[];
    const int kvh = blockIdx.y, row0 = (gridDim.x - 1 - blockIdx.x) * FA_ROWS, rows = p.T * p.G;
    const int warp = threadIdx.x / WARP_SIZE, wr = warp / WN, g = threadIdx.x % WARP_SIZE / 4;
    FaSmem sm;
    sm.ldq = pad16(p.DQK) + 8;
    sm.ldv = pad16(p.DV) + 8;
    sm.stage_elems = BN * sm.ldq + (p.v_cache ? BN * sm.ldv : 0);
    sm.q = reinterpret_cast<bf16*>(fa_smem);
    sm.kv = sm.q + FA_ROWS * sm.ldq;
    const int last = min(row0 + FA_ROWS, rows) - 1;
    const int end = p.start_pos + last / p.G + 1;  // keys the block needs: [begin, end)
    const int lo = p.window ? max(0, p.start_pos + row0 / p.G - p.window + 1) : 0;  // the first row's first key
    const int begin = lo / BN * BN;
    int qpos[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        const int r = row0 + wr * 16 + g + 8 * h;
        qpos[h] = r < rows ? p.start_pos + r / p.G : -1;  // -1: a padding row sees nothing
    }
    copy_rows(sm.q, sm.ldq, FA_ROWS, p.DQK, [&](int r) {
        const int R = row0 + r;
        return R < rows ? p.q + ((long long)(R / p.G) * p.H + kvh * p.G + R % p.G) * p.DQK : (const bf16*)nullptr;
    }, p.q);
    load_kv<BN>(p, sm, 0, kvh, begin, lo, end);
    cp_async_commit();
    const int nv = (pad16(p.DV) / 16 + WN - 1) / WN * 2, col0 = (warp % WN) * nv * 8;
    float o[NV][4], m[2] = {neg_inf(), neg_inf()}, l[2] = {0.0f, 0.0f};
#pragma unroll
    for (int n = 0; n < NV; ++n) o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.0f;
    for (int k0 = begin, it = 0; k0 < end; k0 += BN, ++it) {
        const int stage = it % p.stages;
        if (p.stages == 2 && k0 + BN < end) {
            load_kv<BN>(p, sm, 1 - stage, kvh, k0 + BN, lo, end);
            cp_async_commit();
            cp_async_wait<1>();
        } else {
            cp_async_wait<0>();
        }
        __syncthreads();  // the tile is everyone's
        float s[BN / 8][4];
        tile_scores<BN>(p, sm, stage, wr, k0, qpos, s);
        softmax_update<BN, NV>(s, m, l, o);
        tile_pv<BN, NV>(p, sm, stage, s, col0, nv, o);
        __syncthreads();  // done with the stage before it is refilled
        if (p.stages == 1 && k0 + BN < end) {
            load_kv<BN>(p, sm, 0, kvh, k0 + BN, lo, end);
            cp_async_commit();
        }
    }
    store_out<NV>(p, kvh, row0 + wr * 16, col0, nv, m, l, o);
}

#define FA_ARGS                                                                                                \
    const bf16 *__restrict__ q, const bf16 *__restrict__ k_cache, const bf16 *__restrict__ v_cache,            \
        const int *__restrict__ block_table, const float *__restrict__ sinks, bf16 *__restrict__ out, int T,    \
        int H, int G, int DQK, int DV, int BS, int kv_stride, int head_stride, int start_pos, int window,      \
        int stages, float scale
#define FA_PARAMS \
    FaParams { q, k_cache, v_cache == k_cache ? nullptr : v_cache, block_table, sinks, out, T, H, G, DQK, DV, BS, kv_stride, head_stride, start_pos, window, stages, scale * FA_LOG2E }

// GQA, head dims up to 64 / 128 / 256 (NV n8 tiles of V per warp).
extern "C" __global__ void __launch_bounds__(128, 1) flash_attention_d64(FA_ARGS) { flash_block<8, 64, 1>(FA_PARAMS); }
extern "C" __global__ void __launch_bounds__(128, 1) flash_attention_d128(FA_ARGS) { flash_block<16, 64, 1>(FA_PARAMS); }
extern "C" __global__ void __launch_bounds__(128, 1) flash_attention_d256(FA_ARGS) { flash_block<32, 32, 1>(FA_PARAMS); }
// MLA: latent rows up to the shared memory's width, values (C) up to 512 split over 2 warps per row group.
extern "C" __global__ void __launch_bounds__(256, 1) flash_mla(FA_ARGS) { flash_block<32, 32, 2>(FA_PARAMS); }
