// Rotary position embedding, GPT-NeoX "rotate half" form over the full head dim.
// x, out [T, H, Dh]; positions [T]; cos_sin [P, Dh] = cos in columns [0, Dh/2), sin in [Dh/2, Dh).
// One block per token; the cos/sin table may be bf16 or fp32.
#include "common.cuh"

template <typename TCS>
__device__ void rope_token(const bf16* __restrict__ x, const int* __restrict__ positions,
                           const TCS* __restrict__ cos_sin, bf16* __restrict__ out, int H, int Dh) {
    const int half = Dh / 2;
    const long long base = (long long)blockIdx.x * H * Dh;
    const TCS* cs = cos_sin + (long long)positions[blockIdx.x] * Dh;
    for (int i = threadIdx.x; i < H * half; i += blockDim.x) {
        const int h = i / half, j = i % half;
        const long long a = base + (long long)h * Dh + j;
        const float x1 = to_f32(x[a]), x2 = to_f32(x[a + half]);
        rope_rotate(x1, x2, to_f32(cs[j]), to_f32(cs[half + j]), out + a, out + a + half);
    }
}

extern "C" __global__ void rope_cs_bf16(const bf16* x, const int* positions, const bf16* cos_sin,
                                        bf16* out, int H, int Dh) {
    rope_token<bf16>(x, positions, cos_sin, out, H, Dh);
}

extern "C" __global__ void rope_cs_f32(const bf16* x, const int* positions, const float* cos_sin,
                                       bf16* out, int H, int Dh) {
    rope_token<float>(x, positions, cos_sin, out, H, Dh);
}

// The attention prologue in one launch: per-head RMSNorm of q and k (optional: Qwen3's q/k norm),
// RoPE over the first rd columns of every q and k head (partial rotary: the rest copied), the roped
// q to q_out, and this step's k and v into the paged cache at slot_mapping[t] (negative: padding,
// not written). What rms_norm + rope + rope + kv_write compute, bit for bit: the norm's sum runs in
// rms_norm's order (a group of nt = its block size threads per head, lane-strided, warp sums, the
// two warps' sums added when nt is 64) and is rounded to bf16 before the rotation.
// q [T, H, Dh], k, v [T, Hk, Dh] with row strides sq, sk, sv (elements: views of one qkv product);
// q_norm, k_norm [Dh] (read only when norm); cos_sin [P, rd]; q_out [T, H, Dh];
// k_cache, v_cache [NB*BS, Hk*Dh]. One block of QKR_THREADS per token; Dh <= 256 (host-checked).
#define QKR_THREADS 128
template <typename TCS>
__device__ void qk_norm_rope_kv_token(const bf16* __restrict__ q, const bf16* __restrict__ k,
                                      const bf16* __restrict__ v, const bf16* __restrict__ q_norm,
                                      const bf16* __restrict__ k_norm, const int* __restrict__ positions,
                                      const TCS* __restrict__ cos_sin, bf16* __restrict__ q_out,
                                      bf16* __restrict__ k_cache, bf16* __restrict__ v_cache,
                                      const int* __restrict__ slot_mapping, int H, int Hk, int Dh, int rd,
                                      long long sq, long long sk, long long sv, int nt, int norm, float eps) {
    __shared__ float heads[4 * QKR_THREADS];  // QKR_THREADS / nt heads of Dh <= 4 nt floats each
    __shared__ float warp_sums[QKR_THREADS / WARP_SIZE];
    const long long t = blockIdx.x;
    const int slot = slot_mapping[t], groups = blockDim.x / nt, g = threadIdx.x / nt, lane = threadIdx.x % nt;
    const int half = rd / 2;
    const TCS* cs = cos_sin + (long long)positions[t] * rd;
    float* hb = heads + g * Dh;
    for (int h0 = 0; h0 < H + Hk; h0 += groups) {
        const int h = h0 + g;
        const bool live = h < H + Hk, is_q = h < H;
        const bf16* src = is_q ? q + t * sq + (long long)h * Dh : k + t * sk + (long long)(h - H) * Dh;
        const bf16* w = is_q ? q_norm : k_norm;
        float ss = 0.0f;
        if (live && norm)
            for (int d = lane; d < Dh; d += nt) {
                const float x = to_f32(src[d]);
                ss += x * x;
            }
        ss = warp_sum(ss);
        if (nt > WARP_SIZE) {  // rms_norm's block_sum over its two warps: s0 + s1
            if (threadIdx.x % WARP_SIZE == 0) warp_sums[threadIdx.x / WARP_SIZE] = ss;
            __syncthreads();
            ss = warp_sums[2 * g] + warp_sums[2 * g + 1];
        }
        const float inv = rsqrtf(ss / Dh + eps);
        if (live)
            for (int d = lane; d < Dh; d += nt) {
                const float x = to_f32(src[d]);
                hb[d] = norm ? to_f32(__float2bfloat16(x * inv * to_f32(w[d]))) : x;
            }
        __syncthreads();
        bf16* dst = !live ? nullptr
                    : is_q ? q_out + (t * H + h) * Dh
                    : slot >= 0 ? k_cache + (long long)slot * Hk * Dh + (long long)(h - H) * Dh
                                : nullptr;
        if (dst != nullptr) {
            for (int j = lane; j < half; j += nt)
                rope_rotate(hb[j], hb[j + half], to_f32(cs[j]), to_f32(cs[half + j]), dst + j, dst + j + half);
            for (int d = rd + lane; d < Dh; d += nt) dst[d] = __float2bfloat16(hb[d]);
        }
        __syncthreads();
    }
    if (slot >= 0)
        for (int i = threadIdx.x; i < Hk * Dh; i += blockDim.x) v_cache[(long long)slot * Hk * Dh + i] = v[t * sv + i];
}

#define QK_NORM_ROPE_KV(NAME, TCS)                                                                            \
    extern "C" __global__ void __launch_bounds__(QKR_THREADS)                                                \
        NAME(const bf16* q, const bf16* k, const bf16* v, const bf16* q_norm, const bf16* k_norm,              \
             const int* positions, const TCS* cos_sin, bf16* q_out, bf16* k_cache, bf16* v_cache,            \
             const int* slot_mapping, int H, int Hk, int Dh, int rd, long long sq, long long sk, long long sv, \
             int nt, int norm, float eps) {                                                                  \
        qk_norm_rope_kv_token<TCS>(q, k, v, q_norm, k_norm, positions, cos_sin, q_out, k_cache, v_cache,      \
                                   slot_mapping, H, Hk, Dh, rd, sq, sk, sv, nt, norm, eps);                  \
    }
QK_NORM_ROPE_KV(qk_norm_rope_kv_bf16, bf16)
QK_NORM_ROPE_KV(qk_norm_rope_kv_f32, float)
