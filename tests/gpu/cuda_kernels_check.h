/* cuda_kernels_check.h: what the CUDA kernel tests (test_cuda_kernels_*.c,
 * one kernel family per file, run by test_cuda_kernels.c's main) share: the
 * two kernel tables, the random stream, host and device buffers of a case
 * (cuda_case.h: all freed by free_case()), and the comparisons.
 *
 * Every test runs an entry of the CUDA table against the CPU table's entry
 * of the same name on random non-zero inputs of awkward sizes (1, odd,
 * prime, a few thousand). Outputs start as NaN on both sides, so a skipped
 * element fails. The tolerances of a family are at the top of its file;
 * the bf16 entries' rule is below. */
#ifndef FSDP_TEST_CUDA_KERNELS_CHECK_H
#define FSDP_TEST_CUDA_KERNELS_CHECK_H

#include "cpu_kernels.h"
#include "cuda_internal.h"
#include "device.h"
#include "fsdp.h"
#include "internal.h"
#include "cuda_case.h"
#include "testutil.h"
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

/* Cases of GPT-2 size, on the GPU only (the emulation runs a thread at a time). */
#if defined(FSDP_CUDA_EMU) && !defined(FSDP_TEST_BIG)
#define BIG(...)
#else
#define BIG(...) __VA_ARGS__,
#endif

extern const fsdp_device_kernels *C;   /* the CPU table (G, the CUDA table: cuda_case.h) */
extern test_rng rng;                   /* one stream, drawn in the order main runs the tests */

/* ---- buffers of the case ---- */

float *hrand(int64_t n, float scale);   /* n random non-zero values in [-scale, scale] */
float *hnan(int64_t n);
float *hcopy(const float *x, int64_t n);
void *dup_bytes(const void *h, size_t bytes);   /* a device copy of host bytes */
float *dupf(const float *h, int64_t n);
float *dnan(int64_t n);
float *back(const void *d, int64_t n);   /* n f32 values of the device, on the host */

/* ---- comparisons ---- */

/* Counts values with |got - want| > rtol |want| + atol * scale (NaN must be
 * NaN on both sides); scale < 0 means max |want|. */
void check_f(const char *what, const float *got, const float *want, int64_t n, double rtol, double atol,
             double scale);
void check_bits(const char *what, const void *got, const void *want, size_t bytes);
/* per element bound: |got - want| <= tol * bound[i] */
void check_bound(const char *what, const float *got, const float *want, const double *bound, int64_t n,
                 double tol);

/* ---- bf16 entries ----
 * Each against the CPU's f32 kernel on the same bf16 values, the f32 result
 * rounded to bf16 (to nearest even) as the reference. Tolerances:
 *   binary ops, scale, add_scalar: bit for bit (one f32 op, one rounding).
 *   everything else: within one bf16 ulp (2^-7 relative: the GPU's f32 math
 *   may differ from the CPU's by an f32 ulp, which can move the rounding),
 *   plus 2^-8 of the output's largest value where sums cancel (softmax and
 *   norm backward), or the bounds named. */
#define ULP16 (1.0 / 128)

float *round_bf16_host(float *x, int64_t n);   /* in place; returns x */
float *hrand16(int64_t n, float scale);          /* hrand's values rounded to bf16 */
uint16_t *dup16(const float *h, int64_t n);      /* h holds bf16 values: a device copy of their bits */
uint16_t *dnan16(int64_t n);
float *back_bf16(const void *d, int64_t n);      /* n bf16 values of the device, as floats on the host */

/* ---- the families, in the order main runs them ---- */

void test_memory(void);   /* test_cuda_kernels_memory.c */
void test_cast(void);
void test_copy_strided(void);
void test_fill(void);
void test_matmul(void);   /* test_cuda_kernels_matmul.c */
void test_binary(void);   /* test_cuda_kernels_elementwise.c */
void test_scalar_ops(void);
void test_sum_dim(void);
void test_sum_all(void);
void test_sumsq_many(void);
void test_activations(void);   /* test_cuda_kernels_nn.c */
void test_softmax(void);
void test_norms(void);
void test_embedding(void);   /* test_cuda_kernels_loss.c */
void test_embedding_backward_sorted(void);
void test_cross_entropy(void);
void test_cross_entropy_online(void);
void test_classifier(void);
void test_attention(void);   /* test_cuda_kernels_attention.c */
void test_attention_qkv(void);
void test_attention_flash(void);
void test_bf16_elementwise(void);   /* test_cuda_kernels_elementwise.c */
void test_bf16_nn(void);            /* test_cuda_kernels_nn.c */
void test_fused(void);
void test_random(void);   /* test_cuda_kernels_memory.c */
void test_optim(void);    /* test_cuda_kernels_optim.c */
void test_adamw_many(void);

int bench(int tiny);                      /* test_cuda_kernels_bench.c: --bench */
int flash_once(int argc, char **argv);    /* --flash B H T D */

#endif
