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

// A sampled token per row of float32 x[m, V] without the row leaving the device, as the host's
// sample_rows draws it when no top-k / top-p cut applies: p_t = exp((x_t - max) * inv_temp[r]),
// zero below min_p[r] (p's maximum is 1), and the token i with cumsum(p)[i-1] <= u[r] * sum(p)
// < cumsum(p)[i], walking in index order (never a zero p). Grid (m), block SAMPLE_THREADS.
#define SAMPLE_THREADS 256

__device__ __forceinline__ float sample_weight(float v, float top, float inv_temp, float min_p) {
    const float p = expf((v - top) * inv_temp);
    return p < min_p ? 0.0f : p;
}

extern "C" __global__ void sample_tokens(const float* x, const float* inv_temp, const float* min_p, const double* u,
                                         int* out, int V) {
    __shared__ float tops[SAMPLE_THREADS];
    __shared__ double sums[SAMPLE_THREADS];
    __shared__ double target;
    __shared__ int owner;
    const int tid = threadIdx.x, r = blockIdx.x;
    const float* row = x + (long long)r * V;
    const int chunk = (V + SAMPLE_THREADS - 1) / SAMPLE_THREADS;  // each thread owns a contiguous chunk
    const int lo = min(V, tid * chunk), hi = min(V, lo + chunk);
    float top = neg_inf();
    for (int i = lo; i < hi; ++i) top = fmaxf(top, row[i]);
    tops[tid] = top;
    __syncthreads();
    for (int s = SAMPLE_THREADS / 2; s > 0; s >>= 1) {
        if (tid < s) tops[tid] = fmaxf(tops[tid], tops[tid + s]);
        __syncthreads();
    }
    top = tops[0];
    const float it = inv_temp[r], mp = min_p[r];
    double sum = 0.0;
    for (int i = lo; i < hi; ++i) sum += sample_weight(row[i], top, it, mp);
    sums[tid] = sum;
    __syncthreads();
    if (tid == 0) {  // exclusive prefix sums, then the chunk holding the target
        double run = 0.0;
        for (int t = 0; t < SAMPLE_THREADS; ++t) {
            const double s = sums[t];
            sums[t] = run;
            run += s;
        }
        target = u[r] * run;
        owner = 0;
        for (int t = 0; t < SAMPLE_THREADS; ++t) {
            const double next = t + 1 < SAMPLE_THREADS ? sums[t + 1] : run;
            if (next > sums[t] && sums[t] <= target) owner = t;  // the last non-empty chunk starting at or before it
        }
    }
    __syncthreads();
    if (tid == owner) {
        double c = sums[tid];
        int last = -1;
        for (int i = lo; i < hi; ++i) {
            const float p = sample_weight(row[i], top, it, mp);
            if (p == 0.0f) continue;
            last = i;
            c += p;
            if (c > target) break;
        }
        out[r] = last;  // rounding past the end: the last possible token
    }
}
