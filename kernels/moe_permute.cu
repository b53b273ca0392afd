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
#include "moe_permute.cuh"

extern "C" __global__ void moe_permute(const int* __restrict__ ids, int n_slots, int expert_start,
                                       int El, int* __restrict__ offsets,
                                       int* __restrict__ sorted_slot, int* __restrict__ slot_pos) {
    extern __shared__ int smem[];
    permute_slots(ids, n_slots, expert_start, El, offsets, sorted_slot, slot_pos, smem);
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
