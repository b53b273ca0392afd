// vLLM's logits processing on the device (eprt/engine/sampling.py holds the NumPy reference):
// the rows that need it are gathered to float32, masked by bit words and edited per (row,
// token) pair; the greedy ones then take argmax_f32, so no [V] row leaves the device.
// m gathered rows, V vocabulary, W = ceil(V / 32) mask words, P edited pairs.
#include "common.cuh"

// out[i, :] = float(logits[rows[i], :]). Grid (m), any whole-warp block.
template <typename TL>
__device__ void gather_row(const TL* __restrict__ logits, const int* __restrict__ rows, float* __restrict__ out,
                           int V) {
    const TL* src = logits + (long long)rows[blockIdx.x] * V;
    float* dst = out + (long long)blockIdx.x * V;
    for (int t = threadIdx.x; t < V; t += blockDim.x) dst[t] = to_f32(src[t]);
}

extern "C" __global__ void gather_rows_bf16(const bf16* logits, const int* rows, float* out, int V) {
    gather_row<bf16>(logits, rows, out, V);
}

extern "C" __global__ void gather_rows_f32(const float* logits, const int* rows, float* out, int V) {
    gather_row<float>(logits, rows, out, V);
}

// x[rows[i], t] = -inf where bit t % 32 of bits[i, t / 32] is clear (xgrammar's bitmask layout).
// Grid (R), any whole-warp block.
extern "C" __global__ void mask_tokens(float* x, const int* rows, const unsigned* bits, int V, int W) {
    float* row = x + (long long)rows[blockIdx.x] * V;
    const unsigned* words = bits + (long long)blockIdx.x * W;
    for (int t = threadIdx.x; t < V; t += blockDim.x)
        if (!((words[t >> 5] >> (t & 31)) & 1u)) row[t] = neg_inf();
}

// One thread per pair p: v = x[rows[p], tokens[p]]; -inf if banned, else ((v + bias) divided by
// scale when positive, times scale otherwise) - subtract; rounded per operation as NumPy does.
extern "C" __global__ void edit_tokens(float* x, const int* rows, const int* tokens, const unsigned char* banned,
                                       const float* bias, const float* scale, const float* subtract, int P, int V) {
    const int p = blockIdx.x * blockDim.x + threadIdx.x;
    if (p >= P) return;
    float* at = x + (long long)rows[p] * V + tokens[p];
    if (banned[p]) {
        *at = neg_inf();
        return;
    }
    float v = __fadd_rn(*at, bias[p]);
    v = v > 0.0f ? __fdiv_rn(v, scale[p]) : __fmul_rn(v, scale[p]);
    *at = __fsub_rn(v, subtract[p]);
}
