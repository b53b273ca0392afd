// MoE router: softmax over all E experts in fp32, the top k (ties to the lower expert id),
// optionally renormalized so the k weights sum to 1.
// logits [T, E] (bf16 or fp32) -> weights [T, k] fp32, ids [T, k] int32.
// One warp per token, ROUTER_WARPS tokens per block; the warp keeps the token's E
// probabilities in shared memory (dynamic: ROUTER_WARPS * E floats). k <= 32 (host-checked).
#include "common.cuh"

#define ROUTER_WARPS 4

template <typename TL>
__device__ void router_token(const TL* __restrict__ logits, float* __restrict__ weights,
                             int* __restrict__ ids, int T, int E, int k, int renormalize) {
    extern __shared__ float smem[];
    const int lane = threadIdx.x % WARP_SIZE, warp = threadIdx.x / WARP_SIZE;
    const int t = blockIdx.x * ROUTER_WARPS + warp;
    if (t >= T) return;  // whole warp leaves together; no block-wide barrier follows
    float* p = smem + warp * E;
    const TL* row = logits + (long long)t * E;

    float mx = neg_inf();
    for (int e = lane; e < E; e += WARP_SIZE) {
        const float v = to_f32(row[e]);
        p[e] = v;
        mx = fmaxf(mx, v);
    }
    mx = warp_max(mx);
    float sum = 0.0f;
    for (int e = lane; e < E; e += WARP_SIZE) {
        const float v = __expf(p[e] - mx);
        p[e] = v;
        sum += v;
    }
    const float inv = 1.0f / warp_sum(sum);
    for (int e = lane; e < E; e += WARP_SIZE) p[e] *= inv;
    __syncwarp();

    // k rounds of warp argmax; the winner is knocked out with -1 (probabilities are >= 0).
    float my_w = 0.0f, picked = 0.0f;
    int my_id = 0;
    for (int j = 0; j < k; ++j) {
        float best_v = -2.0f;
        int best_i = E;
        for (int e = lane; e < E; e += WARP_SIZE) {
            if (beats(p[e], e, best_v, best_i)) {
                best_v = p[e];
                best_i = e;
            }
        }
        warp_argmax(best_v, best_i);  // every lane now holds the winner
        if (lane == j) {
            my_w = best_v;
            my_id = best_i;
        }
        picked += best_v;
        __syncwarp();
        if (lane == 0) p[best_i] = -1.0f;
        __syncwarp();
    }
    if (lane < k) {
        weights[(long long)t * k + lane] = renormalize ? my_w / picked : my_w;
        ids[(long long)t * k + lane] = my_id;
    }
}

extern "C" __global__ void router_topk_bf16(const bf16* logits, float* weights, int* ids, int T,
                                            int E, int k, int renormalize) {
    router_token<bf16>(logits, weights, ids, T, E, k, renormalize);
}

extern "C" __global__ void router_topk_f32(const float* logits, float* weights, int* ids, int T,
                                           int E, int k, int renormalize) {
    router_token<float>(logits, weights, ids, T, E, k, renormalize);
}
