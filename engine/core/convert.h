/* convert.h: element conversions shared by the CPU kernels, the CUDA kernels
 * (host and device code) and the CUDA emulation, so that every path rounds
 * and saturates the same way. C, C++ and CUDA. */
#ifndef FSDP_CONVERT_H
#define FSDP_CONVERT_H

#include <stdint.h>
#include <string.h>

#if defined(__CUDACC__)
#define FSDP_CONVERT static __host__ __device__ __forceinline__
#else
#define FSDP_CONVERT static inline
#endif

FSDP_CONVERT float bf16_to_f32(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

/* round to nearest even; NaN stays NaN (quieted) */
FSDP_CONVERT uint16_t f32_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40);
    uint32_t rounding = 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)((u + rounding) >> 16);
}

/* float -> integer truncates toward zero like a C cast; values a C cast
 * would leave undefined (NaN, out of range) saturate instead (NaN -> 0). */
FSDP_CONVERT int64_t f_to_i64(double v) {
    if (v != v) return 0;
    if (v >= 9223372036854775808.0) return INT64_MAX;
    if (v < -9223372036854775808.0) return INT64_MIN;
    return (int64_t)v;
}
FSDP_CONVERT int32_t f_to_i32(double v) {
    if (v != v) return 0;
    if (v >= 2147483648.0) return INT32_MAX;
    if (v <= -2147483649.0) return INT32_MIN;
    return (int32_t)v;
}
FSDP_CONVERT uint16_t f_to_u16(double v) {
    if (v != v || v <= -1.0) return 0;
    if (v >= 65536.0) return UINT16_MAX;
    return (uint16_t)v;
}

#endif
