/* ref_basic.h: naive double-precision references for the basic CPU kernels
 * (cast, copy, matmul, elementwise, reductions). Plain loops over index
 * tuples, written without looking at the kernels, so that a bug has to be
 * made twice, differently, to go unnoticed. */
#ifndef FSDP_REF_BASIC_H
#define FSDP_REF_BASIC_H
#include <stdint.h>
#include <stddef.h>

/* Nearest bf16 value of x (ties to even), found as the nearer of the two
 * bf16 neighbours of x on the grid of its binade; overflow gives +-inf,
 * NaN stays NaN. Returned as a double (bf16 values are exact in double). */
double ref_bf16_round(double x);
/* The bf16 bit pattern of a bf16-exact double (sign, 8-bit exponent, 7-bit
 * mantissa), built arithmetically. */
uint16_t ref_bf16_bits(double v);

/* dst[idx] = src[idx] for every index tuple of shape; strides in elements. */
void ref_copy_strided(char *dst, const int64_t *dst_strides, const char *src, const int64_t *src_strides,
                      int ndim, const int64_t *shape, size_t elem_size);

/* For each batch b: C_b = alpha * op(A_b) @ op(B_b) + beta * C_b; same
 * layout conventions as cpu_matmul_f32. */
void ref_matmul(double *c, const double *a, const double *b, int64_t batch, int64_t M, int64_t N, int64_t K,
                int trans_a, int trans_b, double alpha, double beta,
                int64_t stride_a, int64_t stride_b, int64_t stride_c);

/* out (shape, contiguous) = a op b with a and b read through strides. */
void ref_binary(int op, double *out, const double *a, const int64_t *a_strides,
                const double *b, const int64_t *b_strides, int ndim, const int64_t *shape);

/* in (outer, red, inner) -> out (outer, inner). */
void ref_sum_dim(double *out, const double *in, int64_t outer, int64_t red, int64_t inner);

/* float <-> double helpers for feeding references */
void ref_to_double(double *out, const float *in, int64_t n);
void ref_to_float(float *out, const double *in, int64_t n);

#endif
