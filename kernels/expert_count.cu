// Expert-load statistics: counts[E] += how often each expert id occurs in ids[n] (one MoE
// layer's top-k choices, [T, k] flattened). Grid-stride over the ids; an id outside [0, E)
// is not counted. int32 counts, atomicAdd: the order of the additions does not matter.
#include "common.cuh"

extern "C" __global__ void count_experts(const int* __restrict__ ids, int n, int num_experts, int* __restrict__ counts) {
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) {
        const int e = ids[i];
        if (e >= 0 && e < num_experts) atomicAdd(counts + e, 1);
    }
}
