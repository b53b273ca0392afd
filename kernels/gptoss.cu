// gpt-oss's kernels (eprt/ops/cupy_gptoss.py; the NumPy reference is eprt/ops/gptoss_ops.py):
//   router_topk_softmax_*   the k largest logits (ties to the lower id), softmax over those k
//   attention_sinks         paged attention with a sink logit per query head and an optional window
//   moe_gate_up_swiglu_*    expert gate/up GEMMs + biases + the clamped SwiGLU (bf16 or MXFP4 weights)
//   moe_down_bias_*         expert down GEMMs + biases
// The expert kernels run the sorted rows of moe_permute.cu like moe_grouped_gemm.cu does (one launch
// for every local expert, no host sync) through weight_rows.cuh's dot_two_rows; MXFP4 weights are
// read as stored and dequantized in registers: blocks [rows, K / 2] bytes (two e2m1 values, the low
// nibble first), scales [rows, K / 32] e8m0.
#include "weight_rows.cuh"

// ---- router -------------------------------------------------------------------------------------
#define TS_WARPS 4  // tokens per block of router_topk_softmax (one warp each)

// logits [T, E] -> weights [T, k] fp32, ids [T, k]; dynamic shared memory TS_WARPS * E floats; k <= 32.
template <typename TL>
__device__ void topk_softmax(const TL* __restrict__ logits, float* __restrict__ weights, int* __restrict__ ids,
                             int T, int E, int k) {
    extern __shared__ float smem[];
    const int lane = threadIdx.x % WARP_SIZE, warp = threadIdx.x / WARP_SIZE;
    const int t = blockIdx.x * TS_WARPS + warp;
    if (t >= T) return;  // whole warp leaves together; no block-wide barrier follows
    float* p = smem + warp * E;
    for (int e = lane; e < E; e += WARP_SIZE) p[e] = to_f32(logits[(long long)t * E + e]);
    __syncwarp();
    float mine = neg_inf();
    int my_id = 0;
    for (int j = 0; j < k; ++j) {  // k rounds of warp argmax; the winner is knocked out with -inf
        float best_v = neg_inf();
        int best_i = E;
        for (int e = lane; e < E; e += WARP_SIZE)
            if (beats(p[e], e, best_v, best_i)) {
                best_v = p[e];
                best_i = e;
            }
        warp_argmax(best_v, best_i);
        if (lane == j) {
            mine = best_v;
            my_id = best_i;
        }
        __syncwarp();
        if (lane == 0) p[best_i] = neg_inf();
        __syncwarp();
    }
    const float top = warp_max(mine);  // lanes >= k hold -inf
    const float ex = lane < k ? __expf(mine - top) : 0.0f;
    const float sum = warp_sum(ex);
    if (lane < k) {
        weights[(long long)t * k + lane] = ex / sum;
        ids[(long long)t * k + lane] = my_id;
    }
}

extern "C" __global__ void router_topk_softmax_bf16(const bf16* logits, float* weights, int* ids, int T, int E, int k) {
    topk_softmax<bf16>(logits, weights, ids, T, E, k);
}

extern "C" __global__ void router_topk_softmax_f32(const float* logits, float* weights, int* ids, int T, int E, int k) {
    topk_softmax<float>(logits, weights, ids, T, E, k);
}

// ---- attention with sinks -----------------------------------------------------------------------
#define SA_THREADS 128
#define SA_CHUNK 128  // keys per pass (one per thread)
#define SA_OUT 16     // outputs (query head, dim) per thread: G * Dh <= SA_THREADS * SA_OUT (host-checked)

// Row r of q [R, H, Dh] (bf16) attends to keys [lo, lens[r]) of its table, lo = max(0, lens[r] - window)
// (window 0: 0): tables [R, MB] with row stride table_stride (0: one table for every row, a prefill);
// caches [NB, BS, Hk, Dh]. softmax over the scores and sinks[h] (fp32, denominator only). grid (R, Hk):
// one block per row and KV head, its G = H / Hk query heads. out [R, H, Dh] bf16. Dynamic shared
// memory: G * Dh + G * SA_CHUNK + 3 * G floats and SA_CHUNK long longs. __launch_bounds__(.., 1): without
// the minimum ptxas spilled 8 bytes on sm_80.
extern "C" __global__ void __launch_bounds__(SA_THREADS, 1) attention_sinks(
    const bf16* __restrict__ q, const bf16* __restrict__ k_cache, const bf16* __restrict__ v_cache,
    const int* __restrict__ tables, int table_stride, const int* __restrict__ lens, const float* __restrict__ sinks,
    bf16* __restrict__ out, int H, int Hk, int Dh, int BS, int window, float scale) {
    extern __shared__ float sa[];
    const int r = blockIdx.x, kh = blockIdx.y, G = H / Hk, tid = threadIdx.x;
    const int lane = tid % WARP_SIZE, warp = tid / WARP_SIZE, nwarps = SA_THREADS / WARP_SIZE;
    float* qs = sa;                         // [G, Dh] scaled queries
    float* s = qs + G * Dh;                 // [G, SA_CHUNK] scores, then probabilities
    float* m = s + G * SA_CHUNK;            // [G] running maxima
    float* l = m + G;                       // [G] running sums
    float* alpha = l + G;                   // [G] this chunk's rescale
    long long* base = reinterpret_cast<long long*>(alpha + G + (G & 1));  // [SA_CHUNK] key row offsets
    const int* table = tables + (long long)r * table_stride;
    const int len = lens[r], lo = window > 0 ? max(0, len - window) : 0;
    for (int i = tid; i < G * Dh; i += SA_THREADS)
        qs[i] = to_f32(q[((long long)r * H + kh * G) * Dh + i]) * scale;
    for (int g = tid; g < G; g += SA_THREADS) {
        m[g] = neg_inf();
        l[g] = 0.0f;
    }
    float acc[SA_OUT];
#pragma unroll
    for (int i = 0; i < SA_OUT; ++i) acc[i] = 0.0f;
    __syncthreads();
    for (int c0 = lo; c0 < len; c0 += SA_CHUNK) {
        const int key = c0 + tid;
        if (key < len) {
            base[tid] = (((long long)table[key / BS] * BS + key % BS) * Hk + kh) * Dh;
            for (int g = 0; g < G; ++g) {
                float dot = 0.0f;
                for (int d = 0; d < Dh; d += 8) {
                    float kv[8];
                    load8(k_cache + base[tid] + d, kv);
#pragma unroll
                    for (int i = 0; i < 8; ++i) dot += qs[g * Dh + d + i] * kv[i];
                }
                s[g * SA_CHUNK + tid] = dot;
            }
        } else {
            for (int g = 0; g < G; ++g) s[g * SA_CHUNK + tid] = neg_inf();
        }
        __syncthreads();
        for (int g = warp; g < G; g += nwarps) {  // each head's chunk maximum, probabilities and sum
            float cm = neg_inf();
            for (int j = lane; j < SA_CHUNK; j += WARP_SIZE) cm = fmaxf(cm, s[g * SA_CHUNK + j]);
            const float mnew = fmaxf(m[g], warp_max(cm));
            float sum = 0.0f;
            for (int j = lane; j < SA_CHUNK; j += WARP_SIZE) {
                const float e = __expf(s[g * SA_CHUNK + j] - mnew);
                s[g * SA_CHUNK + j] = e;
                sum += e;
            }
            sum = warp_sum(sum);
            if (lane == 0) {
                alpha[g] = __expf(m[g] - mnew);
                l[g] = l[g] * alpha[g] + sum;
                m[g] = mnew;
            }
        }
        __syncthreads();
        const int n = min(SA_CHUNK, len - c0);
#pragma unroll
        for (int i = 0; i < SA_OUT; ++i) {
            const int o = tid + i * SA_THREADS, g = o / Dh, d = o % Dh;
            if (o < G * Dh) {
                float a = acc[i] * alpha[g];
                for (int j = 0; j < n; ++j) a += s[g * SA_CHUNK + j] * to_f32(v_cache[base[j] + d]);
                acc[i] = a;
            }
        }
        __syncthreads();
    }
#pragma unroll
    for (int i = 0; i < SA_OUT; ++i) {
        const int o = tid + i * SA_THREADS, g = o / Dh;
        if (o < G * Dh) {
            const float sink = sinks[kh * G + g], top = fmaxf(m[g], sink);
            const float keep = __expf(m[g] - top);
            const float denom = l[g] * keep + __expf(sink - top);
            out[((long long)r * H + kh * G) * Dh + o] = __float2bfloat16(acc[i] * keep / denom);
        }
    }
}

// ---- experts ------------------------------------------------------------------------------------
// e2m1 code -> fp32, exact: bit 3 the sign, 2 exponent bits (bias 1), 1 mantissa bit; codes 0/1 are 0, 0.5.
__device__ __forceinline__ float e2m1_to_f32(unsigned int c) {
    const unsigned int e = (c >> 1) & 3u, mant = c & 1u;
    const unsigned int bits = e ? ((e + 126u) << 23) | (mant << 22) : (mant ? 0x3f000000u : 0u);
    return __int_as_float(bits | ((c & 8u) << 28));
}

// e8m0 scale byte -> 2^(s - 127) (0 is 2^-127, a subnormal; 255, NaN, is refused at load).
__device__ __forceinline__ float e8m0_to_f32(unsigned int s) {
    return s ? __int_as_float(s << 23) : __int_as_float(0x00400000);
}

// MXFP4 rows for weight_rows.cuh's dot_two_rows, in both of its reader interfaces: load8(row, d, out),
// and row(r) / kblock(d) / load8(Row, d, kb, out) (a row resolved once, its scale column per 8 columns).
struct Mxfp4Rows {
    const unsigned char* blocks;  // [rows, K / 2]
    const unsigned char* scales;  // [rows, K / 32]
    int K;
    struct Row {
        const unsigned char* blocks;  // the row's K / 2 bytes
        const unsigned char* scales;  // its K / 32 scales
    };
    __device__ __forceinline__ Row row(int r) const {
        return Row{blocks + (long long)r * (K / 2), scales + (long long)r * (K / 32)};
    }
    __device__ __forceinline__ int kblock(int d) const { return d / 32; }
    __device__ __forceinline__ void load8(const Row& r, int d, int kb, float out[8]) const {
        const unsigned int raw = *reinterpret_cast<const unsigned int*>(r.blocks + d / 2);
        const float sc = e8m0_to_f32(r.scales[kb]);
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            const unsigned int byte = (raw >> (8 * i)) & 0xffu;
            out[2 * i] = e2m1_to_f32(byte & 0xfu) * sc;
            out[2 * i + 1] = e2m1_to_f32(byte >> 4) * sc;
        }
    }
    __device__ __forceinline__ void load8(int r, int d, float out[8]) const { load8(row(r), d, kblock(d), out); }
};

#define SW_THREADS 128
#define SW_WARPS (SW_THREADS / WARP_SIZE)

// Expert e = blockIdx.y's sorted rows [offsets[e], offsets[e + 1]) (moe_permute.cu), units_per_warp
// consecutive output units per warp. gate_up: h[p, u] = clamped SwiGLU of (x[tok_p] . w[u] + b[u],
// x[tok_p] . w[I + u] + b[I + u]), tok_p = sorted_slot[p] / k; units I. down: y[p, n] = h[p] . w[n] + b[n]
// (fp32), units ceil(D / 2) column pairs. b: the expert's biases, fp32.
template <bool GATE_UP, typename W>
__device__ void expert_rows(const bf16* __restrict__ in, const int* __restrict__ sorted_slot,
                            const int* __restrict__ offsets, const W& w, const float* __restrict__ b, void* out, int D,
                            int I, int k, int units_per_warp, float alpha, float limit) {
    const int e = blockIdx.y;
    const int start = offsets[e], count = offsets[e + 1] - start;
    if (count == 0) return;
    const int lane = threadIdx.x % WARP_SIZE, warp = threadIdx.x / WARP_SIZE;
    const int units = GATE_UP ? I : (D + 1) / 2, K = GATE_UP ? D : I;
    const int first = (blockIdx.x * SW_WARPS + warp) * units_per_warp, last = min(first + units_per_warp, units);
    for (int u = first; u < last; ++u) {
        const int r0 = GATE_UP ? u : 2 * u, r1 = GATE_UP ? I + u : min(2 * u + 1, D - 1);
        for (int m0 = 0; m0 < count; m0 += GG_MT) {
            const int mt = min(GG_MT, count - m0);
            const bf16* xr[GG_MT];
#pragma unroll
            for (int j = 0; j < GG_MT; ++j) {
                const int p = start + m0 + min(j, mt - 1);
                xr[j] = in + (long long)(GATE_UP ? sorted_slot[p] / k : p) * K;
            }
            float a0[GG_MT], a1[GG_MT];
            dot_two_rows(w, r0, r1, xr, mt, K, a0, a1);
#pragma unroll
            for (int j = 0; j < GG_MT; ++j) {
                if (j >= mt || lane != j) continue;
                const long long p = start + m0 + j;
                if (GATE_UP) {
                    const float g = fminf(a0[j] + b[r0], limit);
                    const float up = fminf(fmaxf(a1[j] + b[r1], -limit), limit);
                    const float act = (up + 1.0f) * (g / (1.0f + __expf(-alpha * g)));
                    reinterpret_cast<bf16*>(out)[p * I + u] = __float2bfloat16(act);
                } else {
                    float* yr = reinterpret_cast<float*>(out) + p * D;
                    yr[r0] = a0[j] + b[r0];
                    if (r1 != r0) yr[r1] = a1[j] + b[r1];
                }
            }
        }
    }
}

// x [T, D] bf16; w_gate_up [El, 2I, D] bf16; b_gate_up [El, 2I] fp32; h [P, I] bf16.
extern "C" __global__ void __launch_bounds__(SW_THREADS, 1) moe_gate_up_swiglu_bf16(
    const bf16* __restrict__ x, const int* __restrict__ sorted_slot, const int* __restrict__ offsets,
    const bf16* __restrict__ w_gate_up, const float* __restrict__ b_gate_up, bf16* __restrict__ h, int D, int I, int k,
    int units_per_warp, float alpha, float limit) {
    const Bf16Rows w{w_gate_up + (long long)blockIdx.y * 2 * I * D, D};
    expert_rows<true>(x, sorted_slot, offsets, w, b_gate_up + (long long)blockIdx.y * 2 * I, h, D, I, k,
                      units_per_warp, alpha, limit);
}

// MXFP4 gate_up: blocks [El, 2I, D / 2] bytes, scales [El, 2I, D / 32].
extern "C" __global__ void __launch_bounds__(SW_THREADS, 1) moe_gate_up_swiglu_mxfp4(
    const bf16* __restrict__ x, const int* __restrict__ sorted_slot, const int* __restrict__ offsets,
    const unsigned char* __restrict__ blocks, const unsigned char* __restrict__ scales,
    const float* __restrict__ b_gate_up, bf16* __restrict__ h, int D, int I, int k, int units_per_warp, float alpha,
    float limit) {
    const long long rows = (long long)blockIdx.y * 2 * I;
    const Mxfp4Rows w{blocks + rows * (D / 2), scales + rows * (D / 32), D};
    expert_rows<true>(x, sorted_slot, offsets, w, b_gate_up + rows, h, D, I, k, units_per_warp, alpha, limit);
}

// h [P, I] bf16; w_down [El, D, I] bf16; b_down [El, D] fp32; y [P, D] fp32.
extern "C" __global__ void __launch_bounds__(SW_THREADS, 1) moe_down_bias_bf16(
    const bf16* __restrict__ h, const int* __restrict__ offsets, const bf16* __restrict__ w_down,
    const float* __restrict__ b_down, float* __restrict__ y, int D, int I, int units_per_warp) {
    const Bf16Rows w{w_down + (long long)blockIdx.y * D * I, I};
    expert_rows<false>(h, nullptr, offsets, w, b_down + (long long)blockIdx.y * D, y, D, I, 1, units_per_warp, 0.0f,
                       0.0f);
}

// MXFP4 down: blocks [El, D, I / 2] bytes, scales [El, D, I / 32].
extern "C" __global__ void __launch_bounds__(SW_THREADS, 1) moe_down_bias_mxfp4(
    const bf16* __restrict__ h, const int* __restrict__ offsets, const unsigned char* __restrict__ blocks,
    const unsigned char* __restrict__ scales, const float* __restrict__ b_down, float* __restrict__ y, int D, int I,
    int units_per_warp) {
    const long long rows = (long long)blockIdx.y * D;
    const Mxfp4Rows w{blocks + rows * (I / 2), scales + rows * (I / 32), I};
    expert_rows<false>(h, nullptr, offsets, w, b_down + rows, y, D, I, 1, units_per_warp, 0.0f, 0.0f);
}
