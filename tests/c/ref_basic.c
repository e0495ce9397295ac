/* ref_basic.c: see ref_basic.h. Slow and obvious on purpose. */
#include "ref_basic.h"
#include <math.h>
#include <string.h>

#define BF16_MAX 3.3895313892515355e38   /* (2 - 2^-7) * 2^127 */

double ref_bf16_round(double x) {
    if (isnan(x) || isinf(x) || x == 0.0) return x;
    double a = fabs(x);
    int ex;
    frexp(a, &ex);             /* a in [2^(ex-1), 2^ex) */
    int e = ex - 1;
    if (e < -126) e = -126;    /* subnormals share the smallest normal binade's spacing */
    double ulp = ldexp(1.0, e - 7);   /* 8 significant bits */
    double q = a / ulp;        /* exact: power-of-two scaling */
    double lo = floor(q), frac = q - lo;
    double k = frac > 0.5 ? lo + 1 : frac < 0.5 ? lo : (fmod(lo, 2.0) == 0 ? lo : lo + 1);
    double r = k * ulp;
    if (r > BF16_MAX) r = INFINITY;
    return copysign(r, x);
}

uint16_t ref_bf16_bits(double v) {
    if (isnan(v)) return 0x7fc0;
    uint16_t sign = signbit(v) ? 0x8000 : 0;
    double a = fabs(v);
    if (isinf(a)) return sign | 0x7f80;
    if (a == 0.0) return sign;
    if (a < ldexp(1.0, -126)) return sign | (uint16_t)(a / ldexp(1.0, -133));   /* subnormal */
    int ex;
    frexp(a, &ex);
    int e = ex - 1;
    uint16_t mant = (uint16_t)((a / ldexp(1.0, e) - 1.0) * 128.0);
    return sign | (uint16_t)((e + 127) << 7) | mant;
}

void ref_copy_strided(char *dst, const int64_t *dst_strides, const char *src, const int64_t *src_strides,
                      int ndim, const int64_t *shape, size_t elem_size) {
    int64_t numel = 1;
    for (int k = 0; k < ndim; k++) numel *= shape[k];
    for (int64_t flat = 0; flat < numel; flat++) {
        int64_t rem = flat, doff = 0, soff = 0;
        for (int k = ndim - 1; k >= 0; k--) {
            int64_t i = rem % shape[k];
            rem /= shape[k];
            doff += i * dst_strides[k];
            soff += i * src_strides[k];
        }
        memcpy(dst + doff * (int64_t)elem_size, src + soff * (int64_t)elem_size, elem_size);
    }
}

void ref_matmul(double *c, const double *a, const double *b, int64_t batch, int64_t M, int64_t N, int64_t K,
                int trans_a, int trans_b, double alpha, double beta,
                int64_t stride_a, int64_t stride_b, int64_t stride_c) {
    for (int64_t bi = 0; bi < batch; bi++) {
        const double *A = a + bi * stride_a, *B = b + bi * stride_b;
        double *C = c + bi * stride_c;
        for (int64_t i = 0; i < M; i++)
            for (int64_t j = 0; j < N; j++) {
                double s = 0;
                for (int64_t k = 0; k < K; k++) {
                    double aik = trans_a ? A[k * M + i] : A[i * K + k];
                    double bkj = trans_b ? B[j * K + k] : B[k * N + j];
                    s += aik * bkj;
                }
                C[i * N + j] = alpha * s + (beta == 0.0 ? 0.0 : beta * C[i * N + j]);
            }
    }
}

void ref_binary(int op, double *out, const double *a, const int64_t *a_strides,
                const double *b, const int64_t *b_strides, int ndim, const int64_t *shape) {
    int64_t numel = 1;
    for (int k = 0; k < ndim; k++) numel *= shape[k];
    for (int64_t flat = 0; flat < numel; flat++) {
        int64_t rem = flat, ao = 0, bo = 0;
        for (int k = ndim - 1; k >= 0; k--) {
            int64_t i = rem % shape[k];
            rem /= shape[k];
            ao += i * a_strides[k];
            bo += i * b_strides[k];
        }
        double x = a[ao], y = b[bo];
        out[flat] = op == 0 ? x + y : op == 1 ? x - y : op == 2 ? x * y : x / y;
    }
}

void ref_sum_dim(double *out, const double *in, int64_t outer, int64_t red, int64_t inner) {
    for (int64_t o = 0; o < outer; o++)
        for (int64_t j = 0; j < inner; j++) {
            double s = 0;
            for (int64_t r = 0; r < red; r++) s += in[(o * red + r) * inner + j];
            out[o * inner + j] = s;
        }
}

void ref_to_double(double *out, const float *in, int64_t n) {
    for (int64_t i = 0; i < n; i++) out[i] = in[i];
}

void ref_to_float(float *out, const double *in, int64_t n) {
    for (int64_t i = 0; i < n; i++) out[i] = (float)in[i];
}
