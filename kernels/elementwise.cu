// Small element-wise ops of the forward pass, grid-stride over the outputs, fp32 math.
//   clip_bf16:        out = clamp(x, -limit, limit), NaN kept   x, out [n] bf16 (OLMoE clip_qkv)
//   sigmoid_gate_add: out[t, :] += sigmoid(gate[t]) * s[t, :]    out [T, D] f32, s [T, D] bf16,
//                                                                gate [T] bf16 (Qwen2-MoE shared expert)
#include "common.cuh"

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
