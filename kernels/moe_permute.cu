// Token permutation by expert, for this rank's El local experts.
//
// A routing slot s = t*k + j is (token t, choice j) with global expert ids[s]; it is local
// when 0 <= ids[s] - expert_start < El. moe_permute groups the local slots by local expert:
//   offsets [El + 1]      expert e owns sorted rows [offsets[e], offsets[e+1]); offsets[El] = P
//   sorted_slot [P]       the slot of each sorted row (ascending slot order within an expert)
//   slot_pos [T*k]        the sorted row of each slot, -1 when the slot's expert is not local
// The result is deterministic: counting uses shared-memory atomics (order-free) and the
// placement walks the slots in order, 32 at a time, with warp match/rank instead of atomics.
// One block; dynamic shared memory 2 * El ints.
#include "common.cuh"

extern "C" __global__ void moe_permute(const int* __restrict__ ids, int n_slots, int expert_start,
                                       int El, int* __restrict__ offsets,
                                       int* __restrict__ sorted_slot, int* __restrict__ slot_pos) {
    extern __shared__ int counts[];  // counts [El] | cursor [El]
    int* cursor = counts + El;
    const int tid = threadIdx.x, lane = tid % WARP_SIZE;
    for (int e = tid; e < El; e += blockDim.x) counts[e] = 0;
    __syncthreads();
    for (int s = tid; s < n_slots; s += blockDim.x) {
        const int e = ids[s] - expert_start;
        if (e >= 0 && e < El) atomicAdd(&counts[e], 1);
    }
    __syncthreads();
    if (tid >= WARP_SIZE) return;  // warp 0 does the scan and the ordered placement

    // Exclusive scan of counts, 32 experts at a time.
    int carry = 0;
    for (int base = 0; base < El; base += WARP_SIZE) {
        const int e = base + lane;
        const int c = e < El ? counts[e] : 0;
        int incl = c;
#pragma unroll
        for (int o = 1; o < WARP_SIZE; o <<= 1) {
            const int up = __shfl_up_sync(FULL_MASK, incl, o);
            if (lane >= o) incl += up;
        }
        if (e < El) {
            offsets[e] = carry + incl - c;
            cursor[e] = carry + incl - c;
        }
        carry += __shfl_sync(FULL_MASK, incl, WARP_SIZE - 1);
    }
    if (lane == 0) offsets[El] = carry;
    __syncwarp();

    // Ordered placement: lanes holding the same expert rank themselves by lane id.
    const unsigned lower = (1u << lane) - 1u;
    for (int base = 0; base < n_slots; base += WARP_SIZE) {
        const int s = base + lane;
        int e = s < n_slots ? ids[s] - expert_start : -1;
        const bool local = e >= 0 && e < El;
        if (!local) e = -1;
        const unsigned peers = __match_any_sync(FULL_MASK, e);
        int pos = -1;
        if (local) pos = cursor[e] + __popc(peers & lower);
        __syncwarp();  // all reads of cursor precede the update
        if (local && lane == 31 - __clz(peers)) cursor[e] += __popc(peers);
        __syncwarp();
        if (s < n_slots) {
            slot_pos[s] = pos;
            if (local) sorted_slot[pos] = s;
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
