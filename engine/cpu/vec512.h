/* vec512.h: 16-lane AVX-512 helpers for the CPU kernels that are bound by
 * their arithmetic (an exp per element) rather than by memory: loads and
 * stores of f32 and bf16 with a lane mask for the tail (so that every
 * element goes through the same instructions and a kernel's f32 and bf16
 * variants agree bit for bit), bf16 rounding as convert.h does it, and an
 * exp. Only when the compiler targets AVX-512 (F and BW); the kernels keep
 * their scalar loops beside for every other target. */
#ifndef FSDP_VEC512_H
#define FSDP_VEC512_H

#if defined(__AVX512F__) && defined(__AVX512BW__)
#define FSDP_VEC512 1
#include <immintrin.h>
#include <stdint.h>

/* lanes [0, n) of 16 (n may exceed 16) */
static inline __mmask16 v16_mask(int64_t n) { return n >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << n) - 1u); }

static inline __m512 v16_load(const float *p, __mmask16 k) { return _mm512_maskz_loadu_ps(k, p); }
static inline void v16_store(float *p, __mmask16 k, __m512 v) { _mm512_mask_storeu_ps(p, k, v); }

/* bf16 -> f32: the bits are the top half */
static inline __m512 v16_load_bf16(const uint16_t *p, __mmask16 k) {
    __m512i w = _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(k, p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
}

/* f32 -> bf16, round to nearest even, NaN kept NaN (quieted): f32_to_bf16 */
static inline void v16_store_bf16(uint16_t *p, __mmask16 k, __m512 v) {
    __m512i u = _mm512_castps_si512(v);
    __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    __m512i rounded = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff))), 16);
    __m512i quiet = _mm512_or_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(0x40));
    __mmask16 nan = _mm512_cmpgt_epu32_mask(_mm512_and_si512(u, _mm512_set1_epi32(0x7fffffff)),
                                            _mm512_set1_epi32(0x7f800000));
    __m512i h = _mm512_mask_blend_epi32(nan, rounded, quiet);
    _mm256_mask_storeu_epi16(p, k, _mm512_cvtepi32_epi16(h));
}

/* e^x within 1 ulp (c.test_kernels_nn): x = n ln2 + r, |r| <= ln2/2, e^r by Cephes' expf
 * polynomial, times 2^n by scalef (exact, and it overflows to inf and
 * underflows through the subnormals as the true value does). x is first
 * clamped to [-104, 89], beyond which e^x rounds to 0 or inf anyway (and
 * an infinite x would turn r into a NaN); the operand order of min/max
 * passes a NaN x through. */
static inline __m512 v16_exp(__m512 x) {
    x = _mm512_max_ps(_mm512_set1_ps(-104.0f), _mm512_min_ps(_mm512_set1_ps(89.0f), x));
    __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                    _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);   /* ln2 in two parts */
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.9875691500e-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
    __m512 e = _mm512_add_ps(_mm512_fmadd_ps(p, _mm512_mul_ps(r, r), r), _mm512_set1_ps(1.0f));
    return _mm512_scalef_ps(e, n);
}

/* 16 lanes from element j of an f32 (bf16 = 0) or bf16 (bf16 = 1) buffer:
 * one kernel body serves both element types */
static inline __m512 v16_load_as(const void *p, int64_t j, __mmask16 k, int bf16) {
    return bf16 ? v16_load_bf16((const uint16_t *)p + j, k) : v16_load((const float *)p + j, k);
}
static inline void v16_store_as(void *p, int64_t j, __mmask16 k, __m512 v, int bf16) {
    if (bf16) v16_store_bf16((uint16_t *)p + j, k, v);
    else v16_store((float *)p + j, k, v);
}

/* 1 / (1 + e^-z) */
static inline __m512 v16_sigmoid(__m512 z) {
    __m512 one = _mm512_set1_ps(1.0f);
    return _mm512_div_ps(one, _mm512_add_ps(one, v16_exp(_mm512_sub_ps(_mm512_setzero_ps(), z))));
}
/* GELU (tanh form) as activation.c writes it, x sigmoid(2u) with
 * u = sqrt(2/pi) (x + 0.044715 x^3), and its derivative
 * s + 2 x s (1 - s) du/dx, s = sigmoid(2u): shared by the plain and the
 * bias-fused kernels (fused.c), f32 and bf16, so all four agree bit for bit */
static inline __m512 v16_gelu(__m512 x) {
    const __m512 c = _mm512_set1_ps(0.7978845608028654f), a = _mm512_set1_ps(0.044715f);
    __m512 x3 = _mm512_mul_ps(_mm512_mul_ps(x, x), x);
    __m512 u = _mm512_mul_ps(c, _mm512_fmadd_ps(a, x3, x));
    return _mm512_mul_ps(x, v16_sigmoid(_mm512_add_ps(u, u)));
}

static inline __m512 v16_gelu_grad(__m512 x) {
    const __m512 c = _mm512_set1_ps(0.7978845608028654f), a = _mm512_set1_ps(0.044715f);
    const __m512 a3 = _mm512_set1_ps(3.0f * 0.044715f), one = _mm512_set1_ps(1.0f);
    __m512 x2 = _mm512_mul_ps(x, x);
    __m512 u = _mm512_mul_ps(c, _mm512_fmadd_ps(a, _mm512_mul_ps(x2, x), x));
    __m512 du = _mm512_mul_ps(c, _mm512_fmadd_ps(a3, x2, one));
    __m512 s = v16_sigmoid(_mm512_add_ps(u, u));
    __m512 t = _mm512_mul_ps(_mm512_mul_ps(_mm512_add_ps(x, x), s), _mm512_sub_ps(one, s));
    return _mm512_fmadd_ps(t, du, s);
}
#endif

#endif
