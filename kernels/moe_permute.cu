// Token permutation by expert, for this rank's El local experts.
//
// A routing slot s = t*k + j is (token t, choice j) with global expert ids[s]; it is local
// when 0 <= ids[s] - expert_start < El. moe_permute groups the local slots by local expert:
//   offsets [El + 1]      expert e owns sorted rows [offsets[e], offsets[e+1]); offsets[El] = P
//   sorted_slot [P]       the slot of each sorted row (ascending slot order within an expert)
//   slot_pos [T*k]        the sorted row of each slot, -1 when the slot's expert is not local
// One block of W warps (blockDim.x = 32 W); warp w owns the contiguous slots
// [w * chunk, (w + 1) * chunk). The result is deterministic, without atomics on positions:
//   1. each warp counts its slots per expert (lanes holding the same expert group with
//      __match_any_sync, the group's highest lane adds the group's size): cnt[w][e];
//   2. per expert, an exclusive scan over the warps turns cnt[w][e] into where warp w's
//      slots of e start among e's rows; warp 0 scans the expert totals into offsets;
//   3. each warp walks its slots again, 32 at a time, placing lane i of a group after the
//      group's lower lanes, and advances its cursor by the group's size.
// Dynamic shared memory: (W + 1) * El ints (cnt [W][El] | base [El]); the host picks W.
#include "common.cuh"

// The local expert of slot s, or -1 when s >= end or its expert is on another rank.
__device__ __forceinline__ int local_expert(const int* __restrict__ ids, int s, int end, int expert_start,
                                            int El) {
    const int e = s < end ? ids[s] - expert_start : -1;
    return e >= 0 && e < El ? e : -1;
}

extern "C" __global__ void moe_permute(const int* __restrict__ ids, int n_slots, int expert_start,
                                       int El, int* __restrict__ offsets,
                                       int* __restrict__ sorted_slot, int* __restrict__ slot_pos) {
    extern __shared__ int smem[];
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

// Gathered path: xs[p] = x[sorted_slot[p] / k] for the P sorted rows. x [T, D], xs [P, D].
// One block per row; 16-byte copies (D a multiple of 8, host-checked).
extern "C" __global__ void moe_gather_rows(const bf16* __restrict__ x,
                                           const int* __restrict__ sorted_slot,
                                           bf16* __restrict__ xs, int D, int k) {
    const long long p = blockIdx.x;
    const long long t = sorted_slot[p] / k;
    const uint4* src = reinterpret_cast<const uint4*>(x + t * D);
    uint4* dst = reinterpret_cast<uint4*>(xs + p * D);
    for (int i = threadIdx.x; i < D / 8; i += blockDim.x) dst[i] = src[i];
}
