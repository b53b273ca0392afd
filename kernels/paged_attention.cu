// Paged attention over the block-table KV cache: batched decode and single-sequence causal
// prefill share one block-level routine.
//
// Caches k_cache, v_cache [NB, BS, Hk, Dh]; position p of a sequence with block table bt is
// cache[bt[p / BS], p % BS]. GQA: query head h reads KV head h / G with G = H / Hk.
//
// One block per (query row, KV head) handles the G query heads sharing that KV head, so each
// K/V element is read once for the whole group. Keys are consumed in chunks of ATTN_CHUNK with
// an online softmax (running max and sum per head) and fp32 accumulation:
//   1. scores: thread t scores key c0 + t against the G (pre-scaled) queries in shared memory;
//   2. softmax update: one warp per head finds the chunk max, rescales, exponentiates;
//   3. P.V: threads split into token groups of Dh/4 threads, each owning 4 output dims.
// Dh must be a multiple of 8 and at most 256; G at most the entry point's MAXG (host-checked).
//
// Split decode (flash-decoding): with few sequences there are too few (sequence, KV head)
// blocks to fill the GPU, so attention_decode_split_g* also splits each context into
// partitions of split_keys keys, grid (B, Hk, P). Each block writes its partition's
// unnormalized output and its softmax max and sum (fp32). attention_split_combine then
// rescales the partitions to a common max and normalizes:
//   part_acc [B, P, H, Dh], part_ml [B, P, H, 2] (max, sum); a partition past the context
//   writes (acc 0, max -inf, sum 0), which the combine weighs 0.
#include "common.cuh"
#include "split_combine.cuh"

#define ATTN_THREADS 128
#define ATTN_WARPS (ATTN_THREADS / WARP_SIZE)
#define ATTN_CHUNK ATTN_THREADS

// Dynamic shared memory, in floats (the host computes the same total):
//   q_s [G, Dh] | s_s [G, ATTN_CHUNK] | m_s [G] | l_s [G] | a_s [G] | red [ntg, G, Dh]
// Keys [k_begin, k_end) of one sequence for the G query heads of KV head kvh. With part_acc
// null: the normalized output, bf16, to out [G, Dh]. Otherwise the partition's unnormalized
// output to part_acc [G, Dh] and its (max, sum) per head to part_ml [G, 2], fp32.
template <int MAXG>
__device__ void attend_group(const bf16* __restrict__ q, const bf16* __restrict__ k_cache,
                             const bf16* __restrict__ v_cache, const int* __restrict__ block_table,
                             int k_begin, int k_end, bf16* __restrict__ out,
                             float* __restrict__ part_acc, float* __restrict__ part_ml, int G,
                             int Dh, int Hk, int kvh, int block_size, float scale) {
    extern __shared__ float smem[];
    float* q_s = smem;
    float* s_s = q_s + G * Dh;
    float* m_s = s_s + G * ATTN_CHUNK;
    float* l_s = m_s + G;
    float* a_s = l_s + G;
    float* red = a_s + G;
    const int tid = threadIdx.x, lane = tid % WARP_SIZE, warp = tid / WARP_SIZE;
    const long long slot_elems = (long long)Hk * Dh;
    const long long head_off = (long long)kvh * Dh;

    if (k_end <= k_begin) {  // nothing to attend to (uniform per block: the early exit is safe)
        if (part_acc) {
            for (int i = tid; i < G * Dh; i += ATTN_THREADS) part_acc[i] = 0.0f;
            for (int g = tid; g < G; g += ATTN_THREADS) {
                part_ml[2 * g] = neg_inf();
                part_ml[2 * g + 1] = 0.0f;
            }
        } else {
            for (int i = tid; i < G * Dh; i += ATTN_THREADS) out[i] = __float2bfloat16(0.0f);
        }
        return;
    }
    for (int i = tid; i < G * Dh; i += ATTN_THREADS) q_s[i] = to_f32(q[i]) * scale;
    for (int g = tid; g < G; g += ATTN_THREADS) {
        m_s[g] = neg_inf();
        l_s[g] = 0.0f;
    }
    // P.V layout: token group tg of Dh/4 threads; this thread owns dims [d0, d0 + 4).
    const int tpt = Dh / 4, ntg = ATTN_THREADS / tpt;
    const int tg = tid / tpt, d0 = (tid % tpt) * 4;
    float acc[MAXG][4];
#pragma unroll
    for (int g = 0; g < MAXG; ++g)
#pragma unroll
        for (int i = 0; i < 4; ++i) acc[g][i] = 0.0f;
    __syncthreads();

    for (int c0 = k_begin; c0 < k_end; c0 += ATTN_CHUNK) {
        const int n = min(ATTN_CHUNK, k_end - c0);
        // 1. scores of key c0 + tid
        if (tid < n) {
            const int pos = c0 + tid;
            const long long slot = (long long)block_table[pos / block_size] * block_size + pos % block_size;
            const bf16* kp = k_cache + slot * slot_elems + head_off;
            float s[MAXG];
#pragma unroll
            for (int g = 0; g < MAXG; ++g) s[g] = 0.0f;
            for (int d = 0; d < Dh; d += 8) {
                float kf[8];
                load8(kp + d, kf);
#pragma unroll
                for (int g = 0; g < MAXG; ++g) {
                    if (g < G) {
                        const float* qg = q_s + g * Dh + d;
#pragma unroll
                        for (int i = 0; i < 8; ++i) s[g] += qg[i] * kf[i];
                    }
                }
            }
#pragma unroll
            for (int g = 0; g < MAXG; ++g)
                if (g < G) s_s[g * ATTN_CHUNK + tid] = s[g];
        }
        __syncthreads();
        // 2. online softmax update, one warp per head
        for (int g = warp; g < G; g += ATTN_WARPS) {
            float* sg = s_s + g * ATTN_CHUNK;
            float mx = neg_inf();
            for (int t = lane; t < n; t += WARP_SIZE) mx = fmaxf(mx, sg[t]);
            const float m_old = m_s[g];
            const float m_new = fmaxf(m_old, warp_max(mx));
            float sum = 0.0f;
            for (int t = lane; t < n; t += WARP_SIZE) {
                const float p = __expf(sg[t] - m_new);
                sg[t] = p;
                sum += p;
            }
            sum = warp_sum(sum);
            __syncwarp();  // every lane has read m_s[g] before lane 0 overwrites it
            if (lane == 0) {
                const float alpha = __expf(m_old - m_new);  // 0 on the first chunk (m_old = -inf)
                a_s[g] = alpha;
                l_s[g] = l_s[g] * alpha + sum;
                m_s[g] = m_new;
            }
        }
        __syncthreads();
        // 3. acc = acc * alpha + P.V over this chunk
        if (tg < ntg) {
#pragma unroll
            for (int g = 0; g < MAXG; ++g) {
                if (g < G) {
                    const float alpha = a_s[g];
#pragma unroll
                    for (int i = 0; i < 4; ++i) acc[g][i] *= alpha;
                }
            }
            for (int t = tg; t < n; t += ntg) {
                const int pos = c0 + t;
                const long long slot = (long long)block_table[pos / block_size] * block_size + pos % block_size;
                float vf[4];
                load4(v_cache + slot * slot_elems + head_off + d0, vf);
#pragma unroll
                for (int g = 0; g < MAXG; ++g) {
                    if (g < G) {
                        const float p = s_s[g * ATTN_CHUNK + t];
#pragma unroll
                        for (int i = 0; i < 4; ++i) acc[g][i] += p * vf[i];
                    }
                }
            }
        }
        __syncthreads();  // s_s is overwritten by the next chunk
    }
    // 4. sum the token groups' partial outputs and normalize
    if (tg < ntg) {
#pragma unroll
        for (int g = 0; g < MAXG; ++g) {
            if (g < G) {
#pragma unroll
                for (int i = 0; i < 4; ++i) red[(tg * G + g) * Dh + d0 + i] = acc[g][i];
            }
        }
    }
    __syncthreads();
    for (int i = tid; i < G * Dh; i += ATTN_THREADS) {
        const int g = i / Dh, d = i % Dh;
        float sum = 0.0f;
        for (int j = 0; j < ntg; ++j) sum += red[(j * G + g) * Dh + d];
        if (part_acc)
            part_acc[i] = sum;
        else
            out[i] = __float2bfloat16(sum / l_s[g]);
    }
    if (part_acc) {
        for (int g = tid; g < G; g += ATTN_THREADS) {
            part_ml[2 * g] = m_s[g];
            part_ml[2 * g + 1] = l_s[g];
        }
    }
}

// Decode: grid (B, Hk). q, out [B, H, Dh]; block_tables [B, MB]; context_lens [B].
template <int MAXG>
__device__ void decode_block(const bf16* q, const bf16* k_cache, const bf16* v_cache,
                             const int* block_tables, const int* context_lens, bf16* out, int H,
                             int Hk, int Dh, int block_size, int max_blocks, float scale) {
    const int b = blockIdx.x, kvh = blockIdx.y, G = H / Hk;
    const long long row = ((long long)b * H + (long long)kvh * G) * Dh;
    attend_group<MAXG>(q + row, k_cache, v_cache, block_tables + (long long)b * max_blocks, 0,
                       context_lens[b], out + row, nullptr, nullptr, G, Dh, Hk, kvh, block_size,
                       scale);
}

// Split decode: grid (B, Hk, P); partition p holds keys [p * split_keys, (p + 1) * split_keys).
template <int MAXG>
__device__ void decode_split_block(const bf16* q, const bf16* k_cache, const bf16* v_cache,
                                   const int* block_tables, const int* context_lens,
                                   float* part_acc, float* part_ml, int H, int Hk, int Dh,
                                   int block_size, int max_blocks, int split_keys, float scale) {
    const int b = blockIdx.x, kvh = blockIdx.y, p = blockIdx.z, P = gridDim.z, G = H / Hk;
    const int begin = p * split_keys, end = min(begin + split_keys, context_lens[b]);
    const long long part = ((long long)b * P + p) * H + (long long)kvh * G;   // [b, p, kvh * G]
    attend_group<MAXG>(q + ((long long)b * H + (long long)kvh * G) * Dh, k_cache, v_cache,
                       block_tables + (long long)b * max_blocks, begin, end, nullptr,
                       part_acc + part * Dh, part_ml + part * 2, G, Dh, Hk, kvh, block_size,
                       scale);
}

// Prefill of one sequence: grid (T, Hk). q, out [T, H, Dh]; query t sits at position
// start_pos + t and attends to positions [0, start_pos + t]; block_table [MB].
template <int MAXG>
__device__ void prefill_block(const bf16* q, const bf16* k_cache, const bf16* v_cache,
                              const int* block_table, int start_pos, bf16* out, int H, int Hk,
                              int Dh, int block_size, float scale) {
    const int t = blockIdx.x, kvh = blockIdx.y, G = H / Hk;
    const long long row = ((long long)t * H + (long long)kvh * G) * Dh;
    attend_group<MAXG>(q + row, k_cache, v_cache, block_table, 0, start_pos + t + 1, out + row,
                       nullptr, nullptr, G, Dh, Hk, kvh, block_size, scale);
}

// One decode and one prefill entry point per cap on the group size G (the host picks the
// smallest cap >= G; the cap sizes the per-thread register arrays). The bounds name one block
// per SM at least: without the minimum, ptxas capped the split g16 kernel at 128 registers and spilled.
#define ATTENTION_ENTRIES(MAXG)                                                                  \
    extern "C" __global__ void __launch_bounds__(ATTN_THREADS, 1) attention_decode_g##MAXG(        \
        const bf16* q, const bf16* k_cache, const bf16* v_cache, const int* block_tables,       \
        const int* context_lens, bf16* out, int H, int Hk, int Dh, int block_size,              \
        int max_blocks, float scale) {                                                           \
        decode_block<MAXG>(q, k_cache, v_cache, block_tables, context_lens, out, H, Hk, Dh,     \
                           block_size, max_blocks, scale);                                       \
    }                                                                                            \
    extern "C" __global__ void __launch_bounds__(ATTN_THREADS, 1) attention_decode_split_g##MAXG(  \
        const bf16* q, const bf16* k_cache, const bf16* v_cache, const int* block_tables,       \
        const int* context_lens, float* part_acc, float* part_ml, int H, int Hk, int Dh,        \
        int block_size, int max_blocks, int split_keys, float scale) {                           \
        decode_split_block<MAXG>(q, k_cache, v_cache, block_tables, context_lens, part_acc,     \
                                 part_ml, H, Hk, Dh, block_size, max_blocks, split_keys, scale); \
    }                                                                                            \
    extern "C" __global__ void __launch_bounds__(ATTN_THREADS, 1) attention_prefill_g##MAXG(       \
        const bf16* q, const bf16* k_cache, const bf16* v_cache, const int* block_table,        \
        int start_pos, bf16* out, int H, int Hk, int Dh, int block_size, float scale) {         \
        prefill_block<MAXG>(q, k_cache, v_cache, block_table, start_pos, out, H, Hk, Dh,        \
                            block_size, scale);                                                  \
    }

ATTENTION_ENTRIES(4)
ATTENTION_ENTRIES(8)
ATTENTION_ENTRIES(16)

// The partitions of a split decode, merged: grid (B, H), one block per (sequence, head)
// (split_combine.cuh's split_combine_row). P <= ATTN_MAX_SPLITS (host-checked).
extern "C" __global__ void __launch_bounds__(ATTN_THREADS) attention_split_combine(
    const float* __restrict__ part_acc, const float* __restrict__ part_ml, bf16* __restrict__ out,
    int H, int Dh, int P) {
    split_combine_row(part_acc, part_ml, out + ((long long)blockIdx.x * H + blockIdx.y) * Dh, H, Dh, P);
}
