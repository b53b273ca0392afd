// Small element-wise ops of the forward pass, grid-stride over the outputs, fp32 math.
//   clip_bf16:        out = clamp(x, -limit, limit), NaN kept   x, out [n] bf16 (OLMoE clip_qkv)
//   sigmoid_gate_add: out[t, :] += sigmoid(gate[t]) * s[t, :]    out [T, D] f32, s [T, D] bf16,
//                                                                gate [T] bf16 (Qwen2-MoE shared expert)
//   add_{x}_{y}:      out = x + y, out of x's dtype (f32 or bf16)  (DeepSeek/GLM ungated shared experts)
#include "common.cuh"

__device__ __forceinline__ void store_as(float* p, float v) { *p = v; }
__device__ __forceinline__ void store_as(bf16* p, float v) { *p = __float2bfloat16(v); }

extern "C" __global__ void clip_bf16(const bf16* __restrict__ x, bf16* __restrict__ out, long long n,
                                     float limit) {
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += (long long)gridDim.x * blockDim.x) {
        const float v = to_f32(x[i]);
        out[i] = v != v ? x[i] : __float2bfloat16(fminf(fmaxf(v, -limit), limit));   // NaN stays NaN
    }
}

extern "C" __global__ void sigmoid_gate_add(float* __restrict__ out, const bf16* __restrict__ s,
                                            const bf16* __restrict__ gate, long long n, int D) {
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += (long long)gridDim.x * blockDim.x) {
        const float g = to_f32(gate[i / D]);
        out[i] += to_f32(s[i]) / (1.0f + __expf(-g));
    }
}

// add_{x}_{y}: out = x + y in fp32, stored as x's dtype   x, out [n], y [n] (an ungated shared expert)
template <typename TX, typename TY>
__device__ void add_elements(const TX* __restrict__ x, const TY* __restrict__ y, TX* __restrict__ out, long long n) {
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += (long long)gridDim.x * blockDim.x) {
        const float v = to_f32(x[i]) + to_f32(y[i]);
        store_as(out + i, v);
    }
}

#define ADD_ENTRY(NAME, TX, TY)                                                                   \
    extern "C" __global__ void NAME(const TX* __restrict__ x, const TY* __restrict__ y,          \
                                    TX* __restrict__ out, long long n) {                          \
        add_elements<TX, TY>(x, y, out, n);                                                       \
    }
ADD_ENTRY(add_f32_f32, float, float)
ADD_ENTRY(add_f32_bf16, float, bf16)
ADD_ENTRY(add_bf16_f32, bf16, float)
ADD_ENTRY(add_bf16_bf16, bf16, bf16)

// rank_sum_f32: out = parts[0] + parts[1] + ... + parts[P-1], added left to right in rank order in
// fp32: the bits of P - 1 add_f32_f32 launches in one (the device combine's rank-ordered sum).
// parts [P, n], out [n].
extern "C" __global__ void rank_sum_f32(const float* __restrict__ parts, float* __restrict__ out, long long n,
                                        int P) {
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += (long long)gridDim.x * blockDim.x) {
        float v = parts[i];
        for (int r = 1; r < P; ++r) v += parts[(long long)r * n + i];
        out[i] = v;
    }
}
