// cusim's stand-in for CUDA's <cuda_fp8.h>: the fp8 <-> half / float conversions the kernels use,
// exact (e4m3 and e5m2 values are all representable as half), NaN as 0x7fff.
#pragma once

#include <cuda_fp16.h>

typedef unsigned char __nv_fp8_storage_t;
typedef unsigned short __nv_fp8x2_storage_t;
enum __nv_fp8_interpretation_t { __NV_E4M3, __NV_E5M2 };
enum __nv_saturation_t { __NV_NOSAT, __NV_SATFINITE };

namespace cusim {
inline float e4m3_to_f32(uint32_t b);
inline uint32_t f32_to_f16_exact(float v);
}

inline __half_raw __nv_cvt_fp8_to_halfraw(__nv_fp8_storage_t x, __nv_fp8_interpretation_t kind) {
    __half_raw r;
    r.x = kind == __NV_E4M3 ? (unsigned short)cusim::f32_to_f16_exact(cusim::e4m3_to_f32(x)) : (unsigned short)(x << 8);
    return r;
}
inline __half2_raw __nv_cvt_fp8x2_to_halfraw2(__nv_fp8x2_storage_t x, __nv_fp8_interpretation_t kind) {
    __half2_raw r;
    r.x = __nv_cvt_fp8_to_halfraw((__nv_fp8_storage_t)(x & 0xffu), kind).x;
    r.y = __nv_cvt_fp8_to_halfraw((__nv_fp8_storage_t)(x >> 8), kind).x;
    return r;
}

// float -> e4m3, round to nearest even; __NV_SATFINITE clamps to +-448, NaN -> 0x7f
inline __nv_fp8_storage_t __nv_cvt_float_to_fp8(float x, __nv_saturation_t sat, __nv_fp8_interpretation_t kind) {
    if (kind != __NV_E4M3) return 0x7f;   // only e4m3 is simulated
    if (x != x) return 0x7f;
    const unsigned char sign = std::signbit(x) ? 0x80 : 0;
    float a = std::fabs(x);
    if (a > 448.0f) {
        if (sat == __NV_SATFINITE) return sign | 0x7e;
        return sign | 0x7f;
    }
    int e;
    std::frexp(a, &e);   // a = m * 2^e, m in [0.5, 1): exponent of a is e - 1
    const int exp = e - 1 < -6 ? -6 : e - 1;   // below 2^-6: subnormal steps of 2^-9
    const float step = std::ldexp(1.0f, exp - 3);
    float q = std::nearbyint(a / step) * step;   // ties to even (the default rounding mode)
    if (q > 448.0f) q = 448.0f;
    if (q == 0.0f) return sign;
    int qe;
    const float qm = std::frexp(q, &qe);
    if (qe - 1 < -6) return sign | (unsigned char)std::lround(q * 512.0f);
    return sign | (unsigned char)(((qe - 1 + 7) << 3) | ((int)std::lround((qm * 2.0f - 1.0f) * 8.0f) & 7));
}
inline __nv_fp8x2_storage_t __nv_cvt_float2_to_fp8x2(float2 x, __nv_saturation_t sat, __nv_fp8_interpretation_t kind) {
    return (__nv_fp8x2_storage_t)(__nv_cvt_float_to_fp8(x.x, sat, kind) | (__nv_cvt_float_to_fp8(x.y, sat, kind) << 8));
}
