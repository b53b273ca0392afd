// A split decode's partitions merged for one (sequence b, head h) = (blockIdx.x, blockIdx.y)
// (paged_attention.cu's attention_split_combine, mla_attention.cu's mla_split_combine_uv):
// o[d] = sum_p w_p * acc_p[d] / sum_p w_p * l_p with w_p = exp(m_p - max_p m_p), bf16, d < Dh.
// part_acc [B, P, H, Dh], part_ml [B, P, H, 2] (max, sum); a partition past the context holds
// (acc 0, max -inf, sum 0), which weighs 0. P <= ATTN_MAX_SPLITS (host-checked). o: global or
// shared memory.
#pragma once

#include "common.cuh"

#define ATTN_MAX_SPLITS 256

__device__ void split_combine_row(const float* __restrict__ part_acc, const float* __restrict__ part_ml, bf16* o,
                                  int H, int Dh, int P) {
    __shared__ float w_s[ATTN_MAX_SPLITS];
    __shared__ float inv_s;
    const int b = blockIdx.x, h = blockIdx.y, tid = threadIdx.x;
    const long long stride = (long long)H;  // from partition p to p + 1, in (acc row, ml pair)s
    const float* ml = part_ml + ((long long)b * P * H + h) * 2;
    if (tid == 0) {  // P is small (context / split_keys): one thread weighs the partitions
        float mx = neg_inf();
        for (int p = 0; p < P; ++p) mx = fmaxf(mx, ml[p * stride * 2]);
        float total = 0.0f;
        for (int p = 0; p < P; ++p) {
            const float m = ml[p * stride * 2];
            const float w = m == neg_inf() ? 0.0f : __expf(m - mx);  // empty partition: 0
            w_s[p] = w;
            total += w * ml[p * stride * 2 + 1];
        }
        inv_s = total > 0.0f ? 1.0f / total : 0.0f;  // an empty context gives a zero row
    }
    __syncthreads();
    const float* acc = part_acc + ((long long)b * P * H + h) * Dh;
    for (int d = tid; d < Dh; d += blockDim.x) {
        float sum = 0.0f;
        for (int p = 0; p < P; ++p) sum += w_s[p] * acc[p * stride * Dh + d];
        o[d] = __float2bfloat16(sum * inv_s);
    }
}
