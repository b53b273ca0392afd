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
        const float c = to_f32(cs[j]), s = to_f32(cs[half + j]);
        out[a] = __float2bfloat16(x1 * c - x2 * s);
        out[a + half] = __float2bfloat16(x2 * c + x1 * s);
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
