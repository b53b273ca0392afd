// MoE router: softmax over all E experts in fp32, the top k (ties to the lower expert id),
// optionally renormalized so the k weights sum to 1.
// logits [T, E] (bf16 or fp32) -> weights [T, k] fp32, ids [T, k] int32.
// One warp per token, ROUTER_WARPS tokens per block; the warp keeps the token's E
// probabilities in shared memory (dynamic: ROUTER_WARPS * E floats). k <= 32 (host-checked).
#include "moe_permute.cuh"

#define ROUTER_WARPS 4

// One warp routes token t; p: the warp's E floats of shared memory.
template <typename TL>
__device__ void router_row(const TL* __restrict__ logits, float* __restrict__ weights, int* __restrict__ ids,
                           long long t, int E, int k, int renormalize, float* p) {
    const int lane = threadIdx.x % WARP_SIZE;
    const TL* row = logits + t * E;

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
        weights[t * k + lane] = renormalize ? my_w / picked : my_w;
        ids[t * k + lane] = my_id;
    }
}

template <typename TL>
__device__ void router_token(const TL* __restrict__ logits, float* __restrict__ weights,
                             int* __restrict__ ids, int T, int E, int k, int renormalize) {
    extern __shared__ float smem[];
    const int warp = threadIdx.x / WARP_SIZE;
    const int t = blockIdx.x * ROUTER_WARPS + warp;
    if (t >= T) return;  // whole warp leaves together; no block-wide barrier follows
    router_row<TL>(logits, weights, ids, t, E, k, renormalize, smem + warp * E);
}

extern "C" __global__ void router_topk_bf16(const bf16* logits, float* weights, int* ids, int T,
                                            int E, int k, int renormalize) {
    router_token<bf16>(logits, weights, ids, T, E, k, renormalize);
}

extern "C" __global__ void router_topk_f32(const float* logits, float* weights, int* ids, int T,
                                           int E, int k, int renormalize) {
    router_token<float>(logits, weights, ids, T, E, k, renormalize);
}

// DeepSeek-style grouped routing (Ops.router_grouped). scores = softmax or sigmoid of the logits
// (fp32); choice = scores + bias (bias [E] fp32, e_score_correction_bias, or zeros); the E experts
// form n_group contiguous groups (n_group <= 32: lane g scores group g by its max, or the sum of
// its two largest choice values); all but the topk_group best groups (ties to the lower group)
// are set to -inf; ids = the k largest choice values (ties to the lower id); weights = their
// scores, divided by their sum + 1e-20 if renormalize, times scaling.
// One warp per token, dynamic shared memory ROUTER_WARPS * 2 * E floats (scores | choice).
// A chosen expert's choice is set to NaN, which the selection skips.
__device__ __forceinline__ bool choice_beats(float v, int i, float best_v, int best_i) {
    return v == v && (v > best_v || (v == best_v && i < best_i));
}

struct GroupedArgs {  // router_grouped's parameters
    int E, k, sigmoid, n_group, topk_group, top2_sum, renormalize;
    float scaling;
};

// One warp routes token t; sc: the warp's 2 E floats of shared memory (scores | choice).
template <typename TL>
__device__ void router_grouped_row(const TL* __restrict__ logits, const float* __restrict__ bias,
                                   float* __restrict__ weights, int* __restrict__ ids, long long t,
                                   const GroupedArgs a, float* sc) {
    const int E = a.E, k = a.k, sigmoid = a.sigmoid, n_group = a.n_group, topk_group = a.topk_group;
    const int top2_sum = a.top2_sum, renormalize = a.renormalize;
    const float scaling = a.scaling;
    const int lane = threadIdx.x % WARP_SIZE;
    float* ch = sc + E;
    const TL* row = logits + t * E;

    if (sigmoid) {
        for (int e = lane; e < E; e += WARP_SIZE) sc[e] = 1.0f / (1.0f + __expf(-to_f32(row[e])));
    } else {
        float mx = neg_inf();
        for (int e = lane; e < E; e += WARP_SIZE) mx = fmaxf(mx, to_f32(row[e]));
        mx = warp_max(mx);
        float sum = 0.0f;
        for (int e = lane; e < E; e += WARP_SIZE) {
            const float v = __expf(to_f32(row[e]) - mx);
            sc[e] = v;
            sum += v;
        }
        const float inv = 1.0f / warp_sum(sum);
        for (int e = lane; e < E; e += WARP_SIZE) sc[e] *= inv;
    }
    for (int e = lane; e < E; e += WARP_SIZE) ch[e] = sc[e] + bias[e];
    __syncwarp();

    if (n_group > 1) {
        const int gsize = E / n_group;
        float gv = neg_inf();
        int gi = WARP_SIZE;  // lanes without a group never win
        if (lane < n_group) {
            float best1 = neg_inf(), best2 = neg_inf();
            for (int e = lane * gsize; e < (lane + 1) * gsize; ++e) {
                const float v = ch[e];
                if (v > best1) {
                    best2 = best1;
                    best1 = v;
                } else if (v > best2) {
                    best2 = v;
                }
            }
            gv = top2_sum && gsize > 1 ? best1 + best2 : best1;
            gi = lane;
        }
        bool keep = false;
        for (int r = 0; r < topk_group; ++r) {
            float bv = gv;
            int bi = gi;
            warp_argmax(bv, bi);
            if (lane == bi) {
                keep = true;
                gv = neg_inf();
                gi = WARP_SIZE + 1;  // out of the running
            }
        }
        const unsigned kept = __ballot_sync(FULL_MASK, keep);
        __syncwarp();
        for (int e = lane; e < E; e += WARP_SIZE)
            if (!((kept >> (e / gsize)) & 1u)) ch[e] = neg_inf();
        __syncwarp();
    }

    float my_w = 0.0f, picked = 0.0f;
    int my_id = 0;
    for (int j = 0; j < k; ++j) {
        float best_v = neg_inf();
        int best_i = E;
        for (int e = lane; e < E; e += WARP_SIZE) {
            if (choice_beats(ch[e], e, best_v, best_i)) {
                best_v = ch[e];
                best_i = e;
            }
        }
#pragma unroll
        for (int o = WARP_SIZE / 2; o > 0; o >>= 1) {
            const float ov = __shfl_xor_sync(FULL_MASK, best_v, o);
            const int oi = __shfl_xor_sync(FULL_MASK, best_i, o);
            if (oi < E && (best_i >= E || choice_beats(ov, oi, best_v, best_i))) {
                best_v = ov;
                best_i = oi;
            }
        }
        const float w = best_i < E ? sc[best_i] : 0.0f;  // every choice NaN: weight 0 on expert 0
        if (lane == j) {
            my_w = w;
            my_id = best_i < E ? best_i : 0;
        }
        picked += w;
        __syncwarp();
        if (lane == 0 && best_i < E) ch[best_i] = __int_as_float(0x7fc00000);  // NaN: taken
        __syncwarp();
    }
    if (lane < k) {
        weights[t * k + lane] = (renormalize ? my_w / (picked + 1e-20f) : my_w) * scaling;
        ids[t * k + lane] = my_id;
    }
}

template <typename TL>
__device__ void router_grouped_token(const TL* __restrict__ logits, const float* __restrict__ bias,
                                     float* __restrict__ weights, int* __restrict__ ids, int T, int E, int k,
                                     int sigmoid, int n_group, int topk_group, int top2_sum, int renormalize,
                                     float scaling) {
    extern __shared__ float smem[];
    const int warp = threadIdx.x / WARP_SIZE;
    const int t = blockIdx.x * ROUTER_WARPS + warp;
    if (t >= T) return;  // whole warp leaves together; no block-wide barrier follows
    const GroupedArgs a{E, k, sigmoid, n_group, topk_group, top2_sum, renormalize, scaling};
    router_grouped_row<TL>(logits, bias, weights, ids, t, a, smem + warp * 2 * E);
}

extern "C" __global__ void router_grouped_bf16(const bf16* logits, const float* bias, float* weights, int* ids,
                                               int T, int E, int k, int sigmoid, int n_group, int topk_group,
                                               int top2_sum, int renormalize, float scaling) {
    router_grouped_token<bf16>(logits, bias, weights, ids, T, E, k, sigmoid, n_group, topk_group, top2_sum,
                               renormalize, scaling);
}

extern "C" __global__ void router_grouped_f32(const float* logits, const float* bias, float* weights, int* ids,
                                              int T, int E, int k, int sigmoid, int n_group, int topk_group,
                                              int top2_sum, int renormalize, float scaling) {
    router_grouped_token<float>(logits, bias, weights, ids, T, E, k, sigmoid, n_group, topk_group, top2_sum,
                                renormalize, scaling);
}

// Routing, the expert-load count and the permutation of this rank's slots in one launch (decode:
// issue 39's launch budget): one block of W warps routes token t on warp t % W (router_row or
// router_grouped_row, so weights and ids are router_topk's / router_grouped's bits), adds each
// choice to counts[count_E] when count_E > 0 (count_experts: ids outside [0, count_E) skipped), then
// permutes as moe_permute does (offsets [El + 1], sorted_slot [<= T*k], slot_pos [T*k]).
// Dynamic shared memory: max(W * per-warp routing floats, (W + 1) * El ints), host-computed.
__device__ void count_and_permute(const int* __restrict__ ids, int n, int* __restrict__ counts, int count_E,
                                  int expert_start, int El, int* offsets, int* sorted_slot, int* slot_pos,
                                  int* smem) {
    __syncthreads();  // every token's ids written (global memory, visible to the block after the barrier)
    if (count_E > 0)
        for (int i = threadIdx.x; i < n; i += blockDim.x) {
            const int e = ids[i];
            if (e >= 0 && e < count_E) atomicAdd(counts + e, 1);
        }
    permute_slots(ids, n, expert_start, El, offsets, sorted_slot, slot_pos, smem);
}

#define ROUTE_PERMUTE_TAIL                                                                                  \
    int* counts, int count_E, int expert_start, int El, int* offsets, int* sorted_slot, int* slot_pos

template <typename TL>
__device__ void route_permute_topk(const TL* logits, float* weights, int* ids, int T, int E, int k,
                                   int renormalize, ROUTE_PERMUTE_TAIL) {
    extern __shared__ float smem[];
    const int W = blockDim.x / WARP_SIZE, warp = threadIdx.x / WARP_SIZE;
    for (int t = warp; t < T; t += W) {
        router_row<TL>(logits, weights, ids, t, E, k, renormalize, smem + warp * E);
        __syncwarp();  // the warp's routing floats are reused by its next token
    }
    count_and_permute(ids, T * k, counts, count_E, expert_start, El, offsets, sorted_slot, slot_pos, (int*)smem);
}

template <typename TL>
__device__ void route_permute_grouped(const TL* logits, const float* bias, float* weights, int* ids, int T,
                                      const GroupedArgs a, ROUTE_PERMUTE_TAIL) {
    extern __shared__ float smem[];
    const int W = blockDim.x / WARP_SIZE, warp = threadIdx.x / WARP_SIZE;
    for (int t = warp; t < T; t += W) {
        router_grouped_row<TL>(logits, bias, weights, ids, t, a, smem + warp * 2 * a.E);
        __syncwarp();
    }
    count_and_permute(ids, T * a.k, counts, count_E, expert_start, El, offsets, sorted_slot, slot_pos, (int*)smem);
}

#define ROUTE_PERMUTE_ARGS counts, count_E, expert_start, El, offsets, sorted_slot, slot_pos
extern "C" __global__ void route_permute_topk_bf16(const bf16* logits, float* weights, int* ids, int T, int E,
                                                   int k, int renormalize, ROUTE_PERMUTE_TAIL) {
    route_permute_topk<bf16>(logits, weights, ids, T, E, k, renormalize, ROUTE_PERMUTE_ARGS);
}

extern "C" __global__ void route_permute_topk_f32(const float* logits, float* weights, int* ids, int T, int E,
                                                  int k, int renormalize, ROUTE_PERMUTE_TAIL) {
    route_permute_topk<float>(logits, weights, ids, T, E, k, renormalize, ROUTE_PERMUTE_ARGS);
}

extern "C" __global__ void route_permute_grouped_bf16(const bf16* logits, const float* bias, float* weights,
                                                      int* ids, int T, int E, int k, int sigmoid, int n_group,
                                                      int topk_group, int top2_sum, int renormalize, float scaling,
                                                      ROUTE_PERMUTE_TAIL) {
    const GroupedArgs a{E, k, sigmoid, n_group, topk_group, top2_sum, renormalize, scaling};
    route_permute_grouped<bf16>(logits, bias, weights, ids, T, a, ROUTE_PERMUTE_ARGS);
}

extern "C" __global__ void route_permute_grouped_f32(const float* logits, const float* bias, float* weights,
                                                     int* ids, int T, int E, int k, int sigmoid, int n_group,
                                                     int topk_group, int top2_sum, int renormalize, float scaling,
                                                     ROUTE_PERMUTE_TAIL) {
    const GroupedArgs a{E, k, sigmoid, n_group, topk_group, top2_sum, renormalize, scaling};
    route_permute_grouped<float>(logits, bias, weights, ids, T, a, ROUTE_PERMUTE_ARGS);
}
