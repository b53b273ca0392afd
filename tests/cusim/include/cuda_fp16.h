// cusim's stand-in for CUDA's <cuda_fp16.h>: the half types and the conversions the kernels use.
#pragma once

#include <cstdint>
#include <cstring>

struct __half_raw {
    unsigned short x;
};
struct __half2_raw {
    unsigned short x, y;
};
struct __half {
    unsigned short __x;
    __half() = default;
    __half(__half_raw r) : __x(r.x) {}
};
struct alignas(4) __half2 {
    __half x, y;
    __half2() = default;
    __half2(__half2_raw r) { x.__x = r.x; y.__x = r.y; }
};

namespace cusim {
inline float f16_to_f32(uint32_t h);
}
inline float __half2float(__half h) { return cusim::f16_to_f32(h.__x); }
inline float2 __half22float2(__half2 h) { return float2{__half2float(h.x), __half2float(h.y)}; }
