// Greedy sampling: argmax over the vocabulary, the first maximum wins (NaN counts as the
// maximum, as in numpy.argmax). logits [B, V] (bf16 or fp32) -> out [B] int32.
// One block per row; blockDim.x a multiple of 32 and at most 1024.
#include "common.cuh"

template <typename TL>
__device__ void argmax_row(const TL* __restrict__ logits, int* __restrict__ out, int V) {
    __shared__ float best_vs[WARP_SIZE];
    __shared__ int best_is[WARP_SIZE];
    const int lane = threadIdx.x % WARP_SIZE, warp = threadIdx.x / WARP_SIZE;
    const TL* row = logits + (long long)blockIdx.x * V;
    float best_v = neg_inf();
    int best_i = V;
    for (int i = threadIdx.x; i < V; i += blockDim.x) {
        const float v = to_f32(row[i]);
        if (beats(v, i, best_v, best_i)) {
            best_v = v;
            best_i = i;
        }
    }
    warp_argmax(best_v, best_i);
    if (lane == 0) {
        best_vs[warp] = best_v;
        best_is[warp] = best_i;
    }
    __syncthreads();
    if (warp == 0) {
        const int nwarps = blockDim.x / WARP_SIZE;
        best_v = lane < nwarps ? best_vs[lane] : neg_inf();
        best_i = lane < nwarps ? best_is[lane] : V;
        warp_argmax(best_v, best_i);
        if (lane == 0) out[blockIdx.x] = best_i;  // a -inf entry still beats the (-inf, V) start
    }
}

extern "C" __global__ void argmax_bf16(const bf16* logits, int* out, int V) {
    argmax_row<bf16>(logits, out, V);
}

extern "C" __global__ void argmax_f32(const float* logits, int* out, int V) {
    argmax_row<float>(logits, out, V);
}
