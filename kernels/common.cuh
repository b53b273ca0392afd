// Helpers shared by every kernel: bf16 <-> fp32 conversion, vector loads and warp/block
// reductions. Activations and weights are __nv_bfloat16 in memory; all arithmetic is fp32.
#pragma once

#include <cuda_bf16.h>

typedef __nv_bfloat16 bf16;

#define WARP_SIZE 32
#define FULL_MASK 0xffffffffu

// -inf without <math.h> (NVRTC has no host headers).
__device__ __forceinline__ float neg_inf() { return __int_as_float(0xff800000); }

// Load one element of either activation dtype as fp32 (templated kernels take bf16 or fp32).
__device__ __forceinline__ float to_f32(bf16 v) { return __bfloat162float(v); }
__device__ __forceinline__ float to_f32(float v) { return v; }

// Eight consecutive bf16 values (one 16-byte load) widened to fp32.
// The address must be 16-byte aligned: the host side checks base pointers and row lengths.
__device__ __forceinline__ void load8(const bf16* p, float out[8]) {
    uint4 raw = *reinterpret_cast<const uint4*>(p);
    const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&raw);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        float2 f = __bfloat1622float2(h[i]);
        out[2 * i] = f.x;
        out[2 * i + 1] = f.y;
    }
}

// Four consecutive bf16 values (one 8-byte load) widened to fp32; 8-byte aligned address.
__device__ __forceinline__ void load4(const bf16* p, float out[4]) {
    uint2 raw = *reinterpret_cast<const uint2*>(p);
    const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&raw);
    float2 a = __bfloat1622float2(h[0]);
    float2 b = __bfloat1622float2(h[1]);
    out[0] = a.x;
    out[1] = a.y;
    out[2] = b.x;
    out[3] = b.y;
}

// One rotate-half RoPE pair (x1 at column j, x2 at j + half): rope.cu and the fused
// qk_norm_rope_kv both call this, so they round the same expression the same way.
__device__ __forceinline__ void rope_rotate(float x1, float x2, float c, float s, bf16* o1, bf16* o2) {
    *o1 = __float2bfloat16(x1 * c - x2 * s);
    *o2 = __float2bfloat16(x2 * c + x1 * s);
}

__device__ __forceinline__ float silu(float g) { return g / (1.0f + __expf(-g)); }

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int o = WARP_SIZE / 2; o > 0; o >>= 1) v += __shfl_xor_sync(FULL_MASK, v, o);
    return v;
}

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
    for (int o = WARP_SIZE / 2; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(FULL_MASK, v, o));
    return v;
}

// (value, index) argmax step used by top-k and argmax: the larger value wins, a tie goes to
// the lower index, and NaN counts as the largest value (as numpy.argmax treats it).
__device__ __forceinline__ bool beats(float v, int i, float best_v, int best_i) {
    bool vn = v != v, bn = best_v != best_v;
    if (vn != bn) return vn;
    if (vn || v == best_v) return i < best_i;
    return v > best_v;
}

__device__ __forceinline__ void warp_argmax(float& v, int& i) {
#pragma unroll
    for (int o = WARP_SIZE / 2; o > 0; o >>= 1) {
        float ov = __shfl_xor_sync(FULL_MASK, v, o);
        int oi = __shfl_xor_sync(FULL_MASK, i, o);
        if (beats(ov, oi, v, i)) {
            v = ov;
            i = oi;
        }
    }
}

// Sum over the whole block; every thread gets the result. blockDim.x must be a multiple of 32.
// `scratch` holds at least 32 floats and is reused, so callers sync before reusing it.
__device__ __forceinline__ float block_sum(float v, float* scratch) {
    const int lane = threadIdx.x % WARP_SIZE, warp = threadIdx.x / WARP_SIZE;
    const int nwarps = blockDim.x / WARP_SIZE;
    v = warp_sum(v);
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    float total = lane < nwarps ? scratch[lane] : 0.0f;
    total = warp_sum(total);
    __syncthreads();
    return total;
}
