// moe_permute's block-wide permutation (moe_permute.cu) as a device function, also run by
// router.cu's fused route_permute kernels after their routing.
#pragma once
#include "common.cuh"


// The local expert of slot s, or -1 when s >= end or its expert is on another rank.
__device__ __forceinline__ int local_expert(const int* __restrict__ ids, int s, int end, int expert_start,
                                            int El) {
    const int e = s < end ? ids[s] - expert_start : -1;
    return e >= 0 && e < El ? e : -1;
}

// The whole block permutes; smem holds (blockDim.x / 32 + 1) * El ints.
__device__ void permute_slots(const int* __restrict__ ids, int n_slots, int expert_start, int El,
                              int* __restrict__ offsets, int* __restrict__ sorted_slot, int* __restrict__ slot_pos,
                              int* smem) {
    const int W = blockDim.x / WARP_SIZE;
    int* cnt = smem;            // [W][El]
    int* base = smem + W * El;  // [El]
    const int tid = threadIdx.x, lane = tid % WARP_SIZE, warp = tid / WARP_SIZE;
    const int chunk = (n_slots + W - 1) / W;
    const int lo = min(warp * chunk, n_slots), hi = min(lo + chunk, n_slots);
    const unsigned lower = (1u << lane) - 1u;
    int* mine = cnt + warp * El;

    // 1. per-warp counts
    for (int e = lane; e < El; e += WARP_SIZE) mine[e] = 0;
    __syncwarp();
    for (int b = lo; b < hi; b += WARP_SIZE) {
        const int e = local_expert(ids, b + lane, hi, expert_start, El);
        const unsigned peers = __match_any_sync(FULL_MASK, e);
        if (e >= 0 && lane == 31 - __clz(peers)) mine[e] += __popc(peers);
        __syncwarp();
    }
    __syncthreads();

    // 2. per expert: exclusive scan over the warps; totals into base[e]
    for (int e = tid; e < El; e += blockDim.x) {
        int run = 0;
        for (int w = 0; w < W; ++w) {
            const int c = cnt[w * El + e];
            cnt[w * El + e] = run;
            run += c;
        }
        base[e] = run;
    }
    __syncthreads();
    if (warp == 0) {   // exclusive scan of the totals, 32 experts at a time
        int carry = 0;
        for (int b = 0; b < El; b += WARP_SIZE) {
            const int e = b + lane;
            const int c = e < El ? base[e] : 0;
            int incl = c;
#pragma unroll
            for (int o = 1; o < WARP_SIZE; o <<= 1) {
                const int up = __shfl_up_sync(FULL_MASK, incl, o);
                if (lane >= o) incl += up;
            }
            if (e < El) {
                offsets[e] = carry + incl - c;
                base[e] = carry + incl - c;
            }
            carry += __shfl_sync(FULL_MASK, incl, WARP_SIZE - 1);
        }
        if (lane == 0) offsets[El] = carry;
    }
    __syncthreads();

    // 3. ordered placement
    for (int b = lo; b < hi; b += WARP_SIZE) {
        const int s = b + lane, e = local_expert(ids, s, hi, expert_start, El);
        const unsigned peers = __match_any_sync(FULL_MASK, e);
        const int pos = e >= 0 ? base[e] + mine[e] + __popc(peers & lower) : -1;
        __syncwarp();  // all reads of the cursor precede the update
        if (e >= 0 && lane == 31 - __clz(peers)) mine[e] += __popc(peers);
        __syncwarp();
        if (s < hi) {
            slot_pos[s] = pos;
            if (e >= 0) sorted_slot[pos] = s;
        }
    }
}

