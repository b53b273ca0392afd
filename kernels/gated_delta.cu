// Gated DeltaNet, Qwen3-Next's linear attention (docs/hybrid.md). Recurrent state float32, activations
// bf16, fp32 math. A prefill chunk is one sequence (B = 1, T tokens); a decode step is B sequences of
// one token; slots[B] names each sequence's state rows.
//   causal_conv1d:    x [B, T, C] bf16, w [C, K] bf16, state [S, K-1, C] f32 (in place) -> out [B, T, C] bf16:
//                     out = silu(depthwise causal conv over state ++ x); state = the last K-1 inputs
//   delta_rule_gates: b, a [N, Hv] bf16, a_log, dt_bias [Hv] bf16 -> g = -exp(a_log) softplus(a + dt_bias),
//                     beta = sigmoid(b), both [N, Hv] f32
//   gated_delta_rule: q, k [B, T, Hk, dk] bf16, v [B, T, Hv, dv] bf16, g, beta [B, T, Hv] f32,
//                     state [S, Hv, dk, dv] f32 (in place) -> out [B, T, Hv, dv] bf16; q, k L2-normalized,
//                     q scaled by dk^-1/2; per token S = e^g S; S += k (beta (v - k^T S))^T; o = q^T S.
//                     The columns of S are independent: one block per (value head, sequence, group
//                     of DELTA_COLS columns); a column's dk rows live in the registers of DELTA_SPLIT
//                     adjacent threads (DK 128: two threads of 64 rows; their dot products meet by a
//                     shuffle). The recurrent form, token after token (not the chunked tensor-core form)
//   gated_rms_norm:   x, gate [R, D] bf16, w [D] bf16 -> rms_norm(x) * w * silu(gate) bf16
//   sigmoid_mul_bf16: out = x * sigmoid(gate), x, gate, out [n] bf16
#include "common.cuh"

// Register arrays only (no local memory): the conv width and the state column's length are
// template constants, one entry point per supported value (causal_conv1d_k{2,3,4},
// gated_delta_rule_dk{32,64,128}: dk up to the cap, the rest of the column zero).
template <int K>
__device__ void causal_conv1d_t(const bf16* __restrict__ x, const bf16* __restrict__ w, float* __restrict__ state,
                                const int* __restrict__ slots, bf16* __restrict__ out, int T, int C) {
    const int c = blockIdx.x * blockDim.x + threadIdx.x;
    const int b = blockIdx.y;
    if (c >= C) return;
    float* st = state + (long long)slots[b] * (K - 1) * C + c;
    float win[K - 1];  // the K-1 previous inputs, oldest first
    float wk[K];
#pragma unroll
    for (int j = 0; j < K - 1; ++j) win[j] = st[(long long)j * C];
#pragma unroll
    for (int j = 0; j < K; ++j) wk[j] = to_f32(w[(long long)c * K + j]);
    const long long base = (long long)b * T * C + c;
    for (int t = 0; t < T; ++t) {
        const float xt = to_f32(x[base + (long long)t * C]);
        float acc = wk[K - 1] * xt;
#pragma unroll
        for (int j = 0; j < K - 1; ++j) acc += wk[j] * win[j];
        out[base + (long long)t * C] = __float2bfloat16(silu(acc));
#pragma unroll
        for (int j = 0; j + 1 < K - 1; ++j) win[j] = win[j + 1];
        win[K - 2] = xt;
    }
#pragma unroll
    for (int j = 0; j < K - 1; ++j) st[(long long)j * C] = win[j];
}

#define CONV_ENTRY(K)                                                                                         \
    extern "C" __global__ void causal_conv1d_k##K(const bf16* x, const bf16* w, float* state, const int* slots, \
                                                  bf16* out, int T, int C) {                                  \
        causal_conv1d_t<K>(x, w, state, slots, out, T, C);                                                    \
    }
CONV_ENTRY(2)
CONV_ENTRY(3)
CONV_ENTRY(4)

extern "C" __global__ void delta_rule_gates(const bf16* __restrict__ b, const bf16* __restrict__ a,
                                            const bf16* __restrict__ a_log, const bf16* __restrict__ dt_bias,
                                            float* __restrict__ g, float* __restrict__ beta, long long n, int Hv) {
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += (long long)gridDim.x * blockDim.x) {
        const int h = (int)(i % Hv);
        const float z = to_f32(a[i]) + to_f32(dt_bias[h]);
        const float softplus = z > 20.0f ? z : log1pf(__expf(z));  // torch's threshold
        g[i] = -__expf(to_f32(a_log[h])) * softplus;
        beta[i] = 1.0f / (1.0f + __expf(-to_f32(b[i])));
    }
}

#define DELTA_COLS 128  // state columns per block
#define DELTA_SPLIT(DK) ((DK) > 64 ? 2 : 1)  // threads per column: at most 64 state rows each
#define DELTA_THREADS(DK) (DELTA_COLS * DELTA_SPLIT(DK))

template <int DK>
__device__ void gated_delta_rule_t(const bf16* __restrict__ q, const bf16* __restrict__ k, const bf16* __restrict__ v,
                                   const float* __restrict__ g, const float* __restrict__ beta,
                                   float* __restrict__ state, const int* __restrict__ slots, bf16* __restrict__ out,
                                   int T, int Hk, int Hv, int dk, int dv) {
    constexpr int SPLIT = DELTA_SPLIT(DK), ROWS = DK / SPLIT;
    extern __shared__ float smem[];  // q [dk] | k [dk] of the current token
    __shared__ float scratch[WARP_SIZE];
    float* qs = smem;
    float* ks = smem + dk;
    const int h = blockIdx.x, b = blockIdx.y;
    const int j = blockIdx.z * DELTA_COLS + threadIdx.x / SPLIT;  // this thread's state column
    const int r0 = (threadIdx.x % SPLIT) * ROWS;                  // and its rows [r0, r0 + ROWS)
    const int kh = h / (Hv / Hk);
    const bool col = j < dv;
    float S[ROWS];
    float* st = state + ((long long)slots[b] * Hv + h) * dk * dv + j;
#pragma unroll
    for (int i = 0; i < ROWS; ++i) S[i] = col && r0 + i < dk ? st[(long long)(r0 + i) * dv] : 0.0f;
    const float q_scale = rsqrtf((float)dk);
    for (int t = 0; t < T; ++t) {
        const long long row = (long long)b * T + t;
        float sq = 0.0f, sk = 0.0f;
        for (int i = threadIdx.x; i < dk; i += blockDim.x) {
            const float qi = to_f32(q[(row * Hk + kh) * dk + i]), ki = to_f32(k[(row * Hk + kh) * dk + i]);
            qs[i] = qi;
            ks[i] = ki;
            sq += qi * qi;
            sk += ki * ki;
        }
        const float nq = rsqrtf(block_sum(sq, scratch) + 1e-6f) * q_scale;  // (block_sum syncs: qs, ks ready)
        const float nk = rsqrtf(block_sum(sk, scratch) + 1e-6f);
        const long long gh = row * Hv + h;
        const float decay = __expf(g[gh]);
        float kv = 0.0f;
#pragma unroll
        for (int i = 0; i < ROWS; ++i) {
            S[i] *= decay;
            kv += r0 + i < dk ? S[i] * ks[r0 + i] : 0.0f;
        }
        if (SPLIT > 1) kv += __shfl_xor_sync(FULL_MASK, kv, 1);  // every lane: whole warps run here
        const float delta = col ? (to_f32(v[gh * dv + j]) - kv * nk) * beta[gh] : 0.0f;
        float o = 0.0f;
#pragma unroll
        for (int i = 0; i < ROWS; ++i) {
            if (r0 + i < dk) {
                S[i] += ks[r0 + i] * nk * delta;
                o += S[i] * qs[r0 + i];
            }
        }
        if (SPLIT > 1) o += __shfl_xor_sync(FULL_MASK, o, 1);
        if (col && r0 == 0) out[gh * dv + j] = __float2bfloat16(o * nq);
        __syncthreads();  // the next token overwrites qs and ks
    }
#pragma unroll
    for (int i = 0; i < ROWS; ++i)
        if (col && r0 + i < dk) st[(long long)(r0 + i) * dv] = S[i];
}

// THREADS = DELTA_THREADS(DK), spelled out: __launch_bounds__ takes it as a plain number
#define DELTA_ENTRY(DK, THREADS)                                                                                \
    static_assert(THREADS == DELTA_THREADS(DK), "DELTA_ENTRY's block size");                                   \
    extern "C" __global__ void __launch_bounds__(THREADS, 1)                                                    \
        gated_delta_rule_dk##DK(const bf16* q, const bf16* k, const bf16* v, const float* g, const float* beta, \
                                float* state, const int* slots, bf16* out, int T, int Hk, int Hv, int dk, int dv) { \
        gated_delta_rule_t<DK>(q, k, v, g, beta, state, slots, out, T, Hk, Hv, dk, dv);                        \
    }
DELTA_ENTRY(32, 128)
DELTA_ENTRY(64, 128)
DELTA_ENTRY(128, 256)

extern "C" __global__ void gated_rms_norm(const bf16* __restrict__ x, const bf16* __restrict__ w,
                                          const bf16* __restrict__ gate, bf16* __restrict__ out, int D, float eps) {
    __shared__ float scratch[WARP_SIZE];
    const long long off = (long long)blockIdx.x * D;
    float ss = 0.0f;
    for (int d = threadIdx.x; d < D; d += blockDim.x) {
        const float v = to_f32(x[off + d]);
        ss += v * v;
    }
    const float inv = rsqrtf(block_sum(ss, scratch) / D + eps);
    for (int d = threadIdx.x; d < D; d += blockDim.x)
        out[off + d] = __float2bfloat16(to_f32(x[off + d]) * inv * to_f32(w[d]) * silu(to_f32(gate[off + d])));
}

extern "C" __global__ void sigmoid_mul_bf16(const bf16* __restrict__ x, const bf16* __restrict__ gate,
                                            bf16* __restrict__ out, long long n) {
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += (long long)gridDim.x * blockDim.x)
        out[i] = __float2bfloat16(to_f32(x[i]) / (1.0f + __expf(-to_f32(gate[i]))));
}
