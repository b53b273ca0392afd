// Gated activation of the expert / dense MLP: out = silu(x[:, :I]) * x[:, I:].
// x [T, 2I] bf16 -> out [T, I] bf16, fp32 math. Grid-stride over the T*I outputs.
#include "common.cuh"

extern "C" __global__ void silu_and_mul(const bf16* __restrict__ x, bf16* __restrict__ out,
                                        long long n, int I) {
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += (long long)gridDim.x * blockDim.x) {
        const long long t = i / I, j = i % I;
        const float g = to_f32(x[t * 2 * I + j]);
        const float u = to_f32(x[t * 2 * I + I + j]);
        out[i] = __float2bfloat16(silu(g) * u);
    }
}
