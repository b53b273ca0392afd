// cusim's stand-in for CUDA's <cuda_bf16.h>: the bfloat16 types and the conversions the
// kernels use, with the device's rounding (fp32 -> bf16 round to nearest even).
#pragma once

#include <cstdint>
#include <cstring>

struct __nv_bfloat16 {
    uint16_t __x;
};
struct alignas(4) __nv_bfloat162 {
    __nv_bfloat16 x, y;
};

inline float __bfloat162float(__nv_bfloat16 h) {
    const uint32_t bits = (uint32_t)h.__x << 16;
    float f;
    std::memcpy(&f, &bits, 4);
    return f;
}

inline __nv_bfloat16 __float2bfloat16(float f) {
    uint32_t bits;
    std::memcpy(&bits, &f, 4);
    __nv_bfloat16 h;
    if ((bits & 0x7fffffffu) > 0x7f800000u) {
        h.__x = 0x7fff;   // NaN (cvt.rn.bf16.f32 returns the canonical NaN)
    } else {
        h.__x = (uint16_t)((bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16);
    }
    return h;
}
inline __nv_bfloat16 __float2bfloat16_rn(float f) { return __float2bfloat16(f); }

inline float2 __bfloat1622float2(__nv_bfloat162 h) {
    return float2{__bfloat162float(h.x), __bfloat162float(h.y)};
}
inline __nv_bfloat162 __floats2bfloat162_rn(float a, float b) {
    return __nv_bfloat162{__float2bfloat16(a), __float2bfloat16(b)};
}
inline __nv_bfloat162 __float22bfloat162_rn(float2 f) { return __floats2bfloat162_rn(f.x, f.y); }
