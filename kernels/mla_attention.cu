// Multi-head latent attention (MLA) over the paged latent cache, in the latent space.
//
// latent_cache [NB, BS, L]: one row per token, [normed latent (C) | roped key (R)], L = C + R;
// position p of a sequence with block table bt is latent_cache[bt[p / BS], p % BS]. Every
// query head reads the same rows (MQA-like): keys are whole rows [L], values their first C
// columns. Queries q [B, H, L] are [absorbed latent query (C) | roped query (R)].
//
// mla_latent_write: x [T, L] to flat slots slot_mapping[T] (negative: padding, skipped); one
// block per token, 16-byte copies (L a multiple of 8, host-checked).
//
// mla_attention{,_split}: grid (B, ceil(H / heads_per_block), P), MLA_THREADS threads. A block
// serves heads_per_block query heads of one query row, so each latent row is read once for the
// whole head group. Keys come in chunks of MLA_CHUNK rows copied to shared memory, with an
// online softmax (running max and sum per head) and fp32 accumulation:
//   1. scores: thread i scores (head i / CHUNK, key i % CHUNK) against the pre-scaled query;
//   2. softmax update: one warp per head (CHUNK = 32: one key per lane);
//   3. P.V: thread i owns output element (head, column) of the accumulator in shared memory.
// Query row b attends to keys [0, context_lens[b]) of table block_tables + b * table_stride
// (table_stride 0: every row shares one table, the causal prefill of one sequence). Split
// (flash-decoding): partition z covers keys [z * split_keys, (z + 1) * split_keys) and writes its
// unnormalized output to part_acc [B, P, H, C] and (max, sum) to part_ml [B, P, H, 2], combined
// by attention_split_combine of paged_attention.cu (an empty partition writes 0, -inf, 0).
//
// The value up-projection folded in (decode's few rows; host-checked C a multiple of 8, Dv even):
// mla_attention_uv rounds a block's outputs o [G, C] to bf16 into shared memory (as the output
// is) and each warp dots them with pairs of w_uv rows (w_uv [H, Dv, C]: every weight row read once
// per block), writing out [B, H, Dv] = o_h @ w_uv[h].T rounded to bf16; mla_split_combine_uv merges a
// split decode's partitions for one (row, head) per block (split_combine.cuh: attention_split_combine's
// bits) and up-projects the same way. The host spreads a small batch over more blocks (fewer heads per
// block: a head's arithmetic does not depend on its block-mates) so the weights are read by many SMs.
#include "common.cuh"
#include "split_combine.cuh"
#include "weight_rows.cuh"

#define MLA_THREADS 128
#define MLA_WARPS (MLA_THREADS / WARP_SIZE)
#define MLA_CHUNK WARP_SIZE

// mla_prologue: MLA's attention prologue in one launch (rms_norm, two ropes, the concatenations and
// mla_latent_write): the cache row [rms_norm(compressed[t, :C]) | rope(compressed[t, C:])] to
// slot_mapping[t] (negative: padding, not written), and the roped query columns q[t, h, Dn:] to
// q_all[t, h, C:]. The norm is rms_norm's bit for bit: the host launches rms_norm's block size for
// width C, and block_sum adds in the same order; the rotations share rope.cu's rope_rotate.
// compressed [T, ldc] (rows spaced ldc: a column slice of the q_a | kv_a product, C + R wide);
// norm [C]; q [T, H, Dn + R]; cos_sin [P, R]; q_all [T, H, C + R]; latent_cache [NB*BS, C + R].
// The absorbed query q_all[t, h, :C] = w_uk[h] @ q[t, h, :Dn] (w_uk [H, C, Dn]): with absorb_blocks
// = 0 the host computed it (cuBLAS, larger batches); otherwise (decode's few rows, T <= GG_MT, C
// even, Dn a multiple of 8) blocks [0, absorb_blocks) compute it on CUDA cores, each warp a pair of
// w_uk rows of one head for every row t (every weight row read once per launch, coalesced), and
// blocks absorb_blocks + t do token t's prologue. Grid absorb_blocks + T.
__device__ void mla_absorb_query(const bf16* __restrict__ q, const bf16* __restrict__ w_uk, bf16* __restrict__ q_all,
                                 int T, int C, int R, int H, int Dn, int units_per_warp) {
    const Bf16Rows rows{w_uk, Dn};  // [H * C, Dn]
    const int lane = threadIdx.x % WARP_SIZE, warps = blockDim.x / WARP_SIZE;
    const int first = (blockIdx.x * warps + threadIdx.x / WARP_SIZE) * units_per_warp;
    const int last = min(first + units_per_warp, H * C / 2);
    for (int u = first; u < last; ++u) {
        const int h = 2 * u / C, c = 2 * u % C;
        const bf16* xr[GG_MT];
#pragma unroll
        for (int m = 0; m < GG_MT; ++m) xr[m] = q + ((long long)min(m, T - 1) * H + h) * (Dn + R);
        float a0[GG_MT], a1[GG_MT];
        dot_two_rows(rows, 2 * u, 2 * u + 1, xr, T, Dn, a0, a1);
#pragma unroll
        for (int m = 0; m < GG_MT; ++m)
            if (m < T && lane == m) {
                bf16* out = q_all + ((long long)m * H + h) * (C + R) + c;
                out[0] = __float2bfloat16(a0[m]);
                out[1] = __float2bfloat16(a1[m]);
            }
    }
}

template <typename TCS>
__device__ void mla_prologue_token(long long t, const bf16* __restrict__ compressed, int ldc,
                                   const bf16* __restrict__ norm, const bf16* __restrict__ q,
                                   const int* __restrict__ positions, const TCS* __restrict__ cos_sin,
                                   bf16* __restrict__ q_all, bf16* __restrict__ latent_cache,
                                   const int* __restrict__ slot_mapping, int C, int R, int H, int Dn, float eps) {
    __shared__ float scratch[WARP_SIZE];
    const int slot = slot_mapping[t], L = C + R, half = R / 2;
    const bf16* x = compressed + t * ldc;
    float ss = 0.0f;
    for (int d = threadIdx.x; d < C; d += blockDim.x) {
        const float v = to_f32(x[d]);
        ss += v * v;
    }
    const float inv = rsqrtf(block_sum(ss, scratch) / C + eps);
    const TCS* cs = cos_sin + (long long)positions[t] * R;
    if (slot >= 0) {
        bf16* row = latent_cache + (long long)slot * L;
        for (int d = threadIdx.x; d < C; d += blockDim.x)
            row[d] = __float2bfloat16(to_f32(x[d]) * inv * to_f32(norm[d]));
        for (int j = threadIdx.x; j < half; j += blockDim.x)
            rope_rotate(to_f32(x[C + j]), to_f32(x[C + j + half]), to_f32(cs[j]), to_f32(cs[half + j]), row + C + j,
                        row + C + j + half);
    }
    for (int i = threadIdx.x; i < H * half; i += blockDim.x) {
        const int h = i / half, j = i % half;
        const bf16* qh = q + (t * H + h) * (Dn + R) + Dn;
        bf16* oh = q_all + (t * H + h) * L + C;
        rope_rotate(to_f32(qh[j]), to_f32(qh[j + half]), to_f32(cs[j]), to_f32(cs[half + j]), oh + j, oh + j + half);
    }
}

template <typename TCS>
__device__ void mla_prologue(const bf16* compressed, int ldc, const bf16* norm, const bf16* q, const int* positions,
                             const TCS* cos_sin, bf16* q_all, bf16* latent_cache, const int* slot_mapping,
                             const bf16* w_uk, int C, int R, int H, int Dn, float eps, int T, int absorb_blocks,
                             int units_per_warp) {
    if ((int)blockIdx.x < absorb_blocks)
        mla_absorb_query(q, w_uk, q_all, T, C, R, H, Dn, units_per_warp);
    else
        mla_prologue_token<TCS>(blockIdx.x - absorb_blocks, compressed, ldc, norm, q, positions, cos_sin, q_all,
                                latent_cache, slot_mapping, C, R, H, Dn, eps);
}

extern "C" __global__ void __launch_bounds__(512)
    mla_prologue_bf16(const bf16* compressed, int ldc, const bf16* norm, const bf16* q, const int* positions,
                      const bf16* cos_sin, bf16* q_all, bf16* latent_cache, const int* slot_mapping, const bf16* w_uk,
                      int C, int R, int H, int Dn, float eps, int T, int absorb_blocks, int units_per_warp) {
    mla_prologue<bf16>(compressed, ldc, norm, q, positions, cos_sin, q_all, latent_cache, slot_mapping, w_uk, C, R, H,
                       Dn, eps, T, absorb_blocks, units_per_warp);
}

extern "C" __global__ void __launch_bounds__(512)
    mla_prologue_f32(const bf16* compressed, int ldc, const bf16* norm, const bf16* q, const int* positions,
                     const float* cos_sin, bf16* q_all, bf16* latent_cache, const int* slot_mapping, const bf16* w_uk,
                     int C, int R, int H, int Dn, float eps, int T, int absorb_blocks, int units_per_warp) {
    mla_prologue<float>(compressed, ldc, norm, q, positions, cos_sin, q_all, latent_cache, slot_mapping, w_uk, C, R, H,
                        Dn, eps, T, absorb_blocks, units_per_warp);
}

extern "C" __global__ void mla_latent_write(bf16* __restrict__ latent_cache, const bf16* __restrict__ x,
                                            const int* __restrict__ slot_mapping, int L) {
    const int slot = slot_mapping[blockIdx.x];
    if (slot < 0) return;
    const uint4* src = reinterpret_cast<const uint4*>(x + (long long)blockIdx.x * L);
    uint4* dst = reinterpret_cast<uint4*>(latent_cache + (long long)slot * L);
    for (int i = threadIdx.x; i < L / 8; i += blockDim.x) dst[i] = src[i];
}

// out [G, Dv] = o_s [G, C] (bf16, shared) up-projected by w [G * Dv, C] (the block's heads of w_uv),
// each warp a pair of rows (of one head: Dv even) at a time.
__device__ void mla_up_project(const bf16* o_s, const bf16* __restrict__ w, bf16* __restrict__ out, int G, int Dv,
                               int C) {
    const Bf16Rows rows{w, C};
    const int lane = threadIdx.x % WARP_SIZE, warps = blockDim.x / WARP_SIZE;
    for (int u = threadIdx.x / WARP_SIZE; u < G * Dv / 2; u += warps) {
        const bf16* xr[GG_MT];
#pragma unroll
        for (int m = 0; m < GG_MT; ++m) xr[m] = o_s + (2 * u / Dv) * C;
        float a0[GG_MT], a1[GG_MT];
        dot_two_rows(rows, 2 * u, 2 * u + 1, xr, 1, C, a0, a1);
        if (lane == 0) {
            out[2 * u] = __float2bfloat16(a0[0]);
            out[2 * u + 1] = __float2bfloat16(a1[0]);
        }
    }
}

// Dynamic shared memory (the host computes the same total, in bytes):
//   k_s bf16 [CHUNK, L] | q_s [G, L] | s_s [G, CHUNK] | m_s [G] | l_s [G] | a_s [G] | acc [G, C]  (fp32)
__device__ void mla_attend(const bf16* __restrict__ q, const bf16* __restrict__ latent_cache,
                           const int* __restrict__ block_tables, const int* __restrict__ context_lens,
                           bf16* __restrict__ out, float* __restrict__ part_acc, float* __restrict__ part_ml,
                           int H, int L, int C, int BS, int table_stride, int heads_per_block, int split_keys,
                           float scale, const bf16* __restrict__ w_uv, int Dv) {
    extern __shared__ float smem[];
    bf16* k_s = reinterpret_cast<bf16*>(smem);
    float* q_s = smem + MLA_CHUNK * L / 2;
    float* s_s = q_s + heads_per_block * L;
    float* m_s = s_s + heads_per_block * MLA_CHUNK;
    float* l_s = m_s + heads_per_block;
    float* a_s = l_s + heads_per_block;
    float* acc = a_s + heads_per_block;
    const int tid = threadIdx.x, lane = tid % WARP_SIZE, warp = tid / WARP_SIZE;
    const int b = blockIdx.x, h0 = blockIdx.y * heads_per_block;
    const int G = min(heads_per_block, H - h0);
    const int n = context_lens[b];
    const int k_begin = blockIdx.z * split_keys, k_end = min(n, k_begin + split_keys);
    const int* table = block_tables + (long long)b * table_stride;

    const bf16* qb = q + ((long long)b * H + h0) * L;
    for (int i = tid; i < G * L; i += MLA_THREADS) q_s[i] = to_f32(qb[i]) * scale;
    for (int h = tid; h < G; h += MLA_THREADS) {
        m_s[h] = neg_inf();
        l_s[h] = 0.0f;
    }
    for (int i = tid; i < G * C; i += MLA_THREADS) acc[i] = 0.0f;
    __syncthreads();

    const int nvec = L / 8;
    for (int c0 = k_begin; c0 < k_end; c0 += MLA_CHUNK) {
        const int nk = min(MLA_CHUNK, k_end - c0);
        for (int i = tid; i < nk * nvec; i += MLA_THREADS) {  // 1. this chunk's latent rows
            const int j = i / nvec, v = i % nvec, pos = c0 + j;
            const long long slot = (long long)table[pos / BS] * BS + pos % BS;
            reinterpret_cast<uint4*>(k_s + j * L)[v] = reinterpret_cast<const uint4*>(latent_cache + slot * L)[v];
        }
        __syncthreads();
        for (int i = tid; i < G * MLA_CHUNK; i += MLA_THREADS) {  // 2. scores
            const int h = i / MLA_CHUNK, j = i % MLA_CHUNK;
            float s = neg_inf();
            if (j < nk) {
                const float* qh = q_s + h * L;
                const bf16* kj = k_s + j * L;
                s = 0.0f;
                for (int d = 0; d < L; d += 8) {
                    float kv[8];
                    load8(kj + d, kv);
#pragma unroll
                    for (int e = 0; e < 8; ++e) s += qh[d + e] * kv[e];
                }
            }
            s_s[i] = s;
        }
        __syncthreads();
        for (int h = warp; h < G; h += MLA_WARPS) {  // 3. online softmax, one warp per head
            const float s = s_s[h * MLA_CHUNK + lane];
            const float m_old = m_s[h], m_new = fmaxf(m_old, warp_max(s));  // finite: nk >= 1
            const float p = lane < nk ? __expf(s - m_new) : 0.0f;
            s_s[h * MLA_CHUNK + lane] = p;
            const float sum = warp_sum(p);
            __syncwarp();  // every lane has read m_s[h] and l_s[h] before lane 0 rewrites them (shuffles order no memory)
            if (lane == 0) {
                const float alpha = __expf(m_old - m_new);  // 0 on the first chunk (m_old = -inf)
                m_s[h] = m_new;
                l_s[h] = l_s[h] * alpha + sum;
                a_s[h] = alpha;
            }
        }
        __syncthreads();
        for (int i = tid; i < G * C; i += MLA_THREADS) {  // 4. P.V over the latent columns
            const int h = i / C, c = i % C;
            const float* p = s_s + h * MLA_CHUNK;
            float a = acc[i] * a_s[h];
            for (int j = 0; j < nk; ++j) a += p[j] * to_f32(k_s[j * L + c]);
            acc[i] = a;
        }
        __syncthreads();
    }

    if (part_acc) {
        const long long row = ((long long)b * gridDim.z + blockIdx.z) * H + h0;  // [B, P, H] index
        for (int i = tid; i < G * C; i += MLA_THREADS) part_acc[row * C + i] = acc[i];
        for (int h = tid; h < G; h += MLA_THREADS) {
            part_ml[(row + h) * 2] = m_s[h];
            part_ml[(row + h) * 2 + 1] = l_s[h];
        }
    } else if (w_uv) {  // out [B, H, Dv]; o_s over k_s (MLA_CHUNK * L >= G * C: G <= MLA_CHUNK, C <= L)
        bf16* o_s = k_s;
        for (int i = tid; i < G * C; i += MLA_THREADS) {
            const float l = l_s[i / C];
            o_s[i] = __float2bfloat16(l > 0.0f ? acc[i] / l : 0.0f);
        }
        __syncthreads();
        mla_up_project(o_s, w_uv + (long long)h0 * Dv * C, out + ((long long)b * H + h0) * Dv, G, Dv, C);
    } else {
        bf16* ob = out + ((long long)b * H + h0) * C;
        for (int i = tid; i < G * C; i += MLA_THREADS) {
            const float l = l_s[i / C];
            ob[i] = __float2bfloat16(l > 0.0f ? acc[i] / l : 0.0f);
        }
    }
}

extern "C" __global__ void __launch_bounds__(MLA_THREADS) mla_attention(
    const bf16* __restrict__ q, const bf16* __restrict__ latent_cache, const int* __restrict__ block_tables,
    const int* __restrict__ context_lens, bf16* __restrict__ out, int H, int L, int C, int BS, int table_stride,
    int heads_per_block, float scale) {
    mla_attend(q, latent_cache, block_tables, context_lens, out, nullptr, nullptr, H, L, C, BS, table_stride,
               heads_per_block, 1 << 30, scale, nullptr, 0);
}

extern "C" __global__ void __launch_bounds__(MLA_THREADS) mla_attention_uv(
    const bf16* __restrict__ q, const bf16* __restrict__ latent_cache, const int* __restrict__ block_tables,
    const int* __restrict__ context_lens, const bf16* __restrict__ w_uv, bf16* __restrict__ out, int H, int L, int C,
    int BS, int table_stride, int heads_per_block, float scale, int Dv) {
    mla_attend(q, latent_cache, block_tables, context_lens, out, nullptr, nullptr, H, L, C, BS, table_stride,
               heads_per_block, 1 << 30, scale, w_uv, Dv);
}

extern "C" __global__ void __launch_bounds__(MLA_THREADS) mla_attention_split(
    const bf16* __restrict__ q, const bf16* __restrict__ latent_cache, const int* __restrict__ block_tables,
    const int* __restrict__ context_lens, float* __restrict__ part_acc, float* __restrict__ part_ml, int H, int L,
    int C, int BS, int table_stride, int heads_per_block, int split_keys, float scale) {
    mla_attend(q, latent_cache, block_tables, context_lens, nullptr, part_acc, part_ml, H, L, C, BS, table_stride,
               heads_per_block, split_keys, scale, nullptr, 0);
}

// grid (B, H): the partitions of (row b, head h) merged into o [C] (bf16, shared), then out[b, h] =
// w_uv[h] @ o [Dv]. C <= MLA_MAX_UV_C (host-checked).
#define MLA_MAX_UV_C 1024
extern "C" __global__ void __launch_bounds__(MLA_THREADS)
    mla_split_combine_uv(const float* __restrict__ part_acc, const float* __restrict__ part_ml,
                         const bf16* __restrict__ w_uv, bf16* __restrict__ out, int H, int C, int P, int Dv) {
    __shared__ __align__(16) bf16 o_s[MLA_MAX_UV_C];
    const int h = blockIdx.y;
    split_combine_row(part_acc, part_ml, o_s, H, C, P);
    __syncthreads();
    mla_up_project(o_s, w_uv + (long long)h * Dv * C, out + ((long long)blockIdx.x * H + h) * Dv, 1, Dv, C);
}
