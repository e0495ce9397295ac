/* cpu_kernels.h: raw CPU kernels on contiguous row-major buffers.
 *
 * These read like the math and know nothing of tensors, the tape or
 * errors: the op layer (engine/ops) checks shapes, dtypes and indices before
 * calling them. Backward kernels overwrite their outputs (the tape adds them
 * into accumulated gradients). Float kernels take f32; bf16 tensors are
 * widened to f32 by the op layer, so every kernel accumulates in f32 or
 * wider. Each kernel has a naive double-precision reference in
 * tests/c/ref_*.c and a test against it.
 */
#ifndef FSDP_CPU_KERNELS_H
#define FSDP_CPU_KERNELS_H

#include "convert.h"
#include <stdint.h>
#include <stddef.h>

/* ---- threads (threads.c) ---- */
typedef void (*cpu_range_fn)(void *ctx, int64_t begin, int64_t end);
/* Splits [0, n) into chunks of at least grain items over the pool; runs
 * inline when n <= grain or the pool has one thread. Not reentrant: a
 * nested call runs inline. */
void cpu_parallel_for(int64_t n, int64_t grain, cpu_range_fn fn, void *ctx);
int cpu_threads_get(void);
void cpu_threads_set(int n);       /* also sets OpenBLAS's thread count */

/* ---- bf16 (cast.c; bf16_to_f32, f32_to_bf16 in convert.h) ---- */
void cpu_cast_f32_to_bf16(uint16_t *out, const float *in, int64_t n);
void cpu_cast_bf16_to_f32(float *out, const uint16_t *in, int64_t n);
/* Any dtype to any dtype (fsdp_dtype codes), element by element. */
void cpu_cast_any(void *out, int out_dtype, const void *in, int in_dtype, int64_t n);

/* One kernel body for f32 and bf16 buffers: element j of p, widened to f32
 * as it is loaded (cpu_ld) or rounded once as it is stored (cpu_st), and p
 * advanced by off elements (cpu_at). A body written with these and inlined
 * with bf16 a constant compiles to a plain loop for each type. */
#define CPU_INLINE static inline __attribute__((always_inline))
CPU_INLINE float cpu_ld(const void *p, int64_t j, int bf16) {
    return bf16 ? bf16_to_f32(((const uint16_t *)p)[j]) : ((const float *)p)[j];
}
CPU_INLINE void cpu_st(void *p, int64_t j, float v, int bf16) {
    if (bf16) ((uint16_t *)p)[j] = f32_to_bf16(v);
    else ((float *)p)[j] = v;
}
CPU_INLINE const void *cpu_at(const void *p, int64_t off, int bf16) {
    return bf16 ? (const void *)((const uint16_t *)p + off) : (const void *)((const float *)p + off);
}
CPU_INLINE void *cpu_at_w(void *p, int64_t off, int bf16) {
    return bf16 ? (void *)((uint16_t *)p + off) : (void *)((float *)p + off);
}

/* ---- copy and fill (copy.c) ---- */
/* dst[i] = src[i] over shape, both strided (elements), elem_size bytes each.
 * Fast path when both are contiguous. */
void cpu_copy_strided(void *dst, const int64_t *dst_strides, const void *src, const int64_t *src_strides,
                      int ndim, const int64_t *shape, size_t elem_size);
void cpu_fill_f32(float *out, float v, int64_t n);
/* nbytes of zeros at dst (any alignment); large ones with streaming stores over the pool */
void cpu_zero(void *dst, size_t nbytes);

/* ---- matmul (matmul.c, matmul_dnnl.c) ---- */
/* For each batch b: C_b = alpha * op(A_b) @ op(B_b) + beta * C_b, where
 * op(A) is (M, K) (A stored (K, M) when trans_a), op(B) is (K, N) (B stored
 * (N, K) when trans_b), C is (M, N). Batch strides in elements; a stride of 0
 * shares one matrix over the batch. oneDNN or OpenBLAS by shape class.
 * FSDP_MATMUL_STATS=1: each distinct product's calls, time and GFLOP/s
 * (f32 and bf16) go to stderr at exit. */
void cpu_matmul_f32(float *c, const float *a, const float *b, int64_t batch, int64_t M, int64_t N, int64_t K,
                    int trans_a, int trans_b, float alpha, float beta,
                    int64_t stride_a, int64_t stride_b, int64_t stride_c);
/* What FSDP_MATMUL_STATS has counted so far (zeros when it is off). */
void cpu_matmul_stats_totals(int64_t *calls, double *flop, double *seconds);
/* 1 when cpu_matmul_f32 gives this product to oneDNN, 0 for OpenBLAS. */
int cpu_matmul_f32_route(int64_t batch, int64_t M, int64_t N, int64_t K, int trans_a, int trans_b);
/* The same, always OpenBLAS sgemm. */
void cpu_matmul_f32_blas(float *c, const float *a, const float *b, int64_t batch, int64_t M, int64_t N, int64_t K,
                         int trans_a, int trans_b, float alpha, float beta,
                         int64_t stride_a, int64_t stride_b, int64_t stride_c);
/* bf16 A, B, C with f32 accumulation and one rounding per element of C:
 * oneDNN's bf16 matmul where the CPU has bf16 instructions (AVX512-BF16,
 * AMX), else widened to f32 for cpu_matmul_f32. */
void cpu_matmul_bf16(uint16_t *c, const uint16_t *a, const uint16_t *b, int64_t batch, int64_t M, int64_t N,
                     int64_t K, int trans_a, int trans_b, float alpha, float beta,
                     int64_t stride_a, int64_t stride_b, int64_t stride_c);
/* One matmul on oneDNN (bf16 != 0: bf16 buffers, else f32), primitive cached
 * per shape; 0 on success, non-zero when oneDNN is absent or cannot do it
 * (the caller then uses OpenBLAS). */
int cpu_matmul_dnnl(int bf16, void *c, const void *a, const void *b, int64_t batch, int64_t M, int64_t N, int64_t K,
                    int trans_a, int trans_b, float alpha, float beta, int64_t stride_a, int64_t stride_b,
                    int64_t stride_c);
/* 1 when oneDNN is built in and its CPU engine started (FSDP_NO_DNNL=1 turns it off). */
int cpu_matmul_dnnl_available(void);
/* oneDNN's implementation name for a plain (M, K) @ (K, N), or "none". */
const char *cpu_matmul_dnnl_impl(int bf16, int64_t M, int64_t N, int64_t K);

/* ---- elementwise (elementwise.c) ---- */
/* out (shape, contiguous) = a op b, where a and b are read through strides
 * that are 0 along broadcast dims. op is an fsdp_binary_op. */
void cpu_binary_f32(int op, float *out, const float *a, const int64_t *a_strides,
                    const float *b, const int64_t *b_strides, int ndim, const int64_t *shape);
void cpu_scale_f32(float *out, const float *a, float s, int64_t n);          /* out = a * s */
void cpu_add_scalar_f32(float *out, const float *a, float s, int64_t n);     /* out = a + s */
void cpu_axpy_f32(float *y, const float *x, float alpha, int64_t n);         /* y += alpha * x */
/* y (f32) += alpha * x (bf16), x widened in registers; y and x do not overlap */
void cpu_axpy_f32_bf16(float *y, const uint16_t *x, float alpha, int64_t n);

/* ---- reductions (reduce.c) ---- */
/* in (outer, red, inner) -> out (outer, inner): sum over the middle dim. */
void cpu_sum_dim_f32(float *out, const float *in, int64_t outer, int64_t red, int64_t inner);
/* bf16 in and out: each output summed in double, rounded to f32 and then to
 * bf16 (two roundings, as on CUDA); _acc adds the sum to what out holds */
void cpu_sum_dim_bf16(uint16_t *out, const uint16_t *in, int64_t outer, int64_t red, int64_t inner);
void cpu_sum_dim_acc_bf16(uint16_t *out, const uint16_t *in, int64_t outer, int64_t red, int64_t inner);
double cpu_sum_all_f32(const float *in, int64_t n);
double cpu_sumsq_f32(const float *in, int64_t n);

/* ---- activations (activation.c) ---- */
void cpu_gelu_forward_f32(float *out, const float *x, int64_t n);   /* tanh form */
void cpu_gelu_backward_f32(float *dx, const float *x, const float *dout, int64_t n);
void cpu_silu_forward_f32(float *out, const float *x, int64_t n);
void cpu_silu_backward_f32(float *dx, const float *x, const float *dout, int64_t n);

/* ---- softmax (softmax.c), over the last dim of (rows, cols) ---- */
void cpu_softmax_forward_f32(float *out, const float *x, int64_t rows, int64_t cols);
void cpu_softmax_backward_f32(float *dx, const float *y, const float *dy, int64_t rows, int64_t cols);
void cpu_log_softmax_forward_f32(float *out, const float *x, int64_t rows, int64_t cols);
void cpu_log_softmax_backward_f32(float *dx, const float *y, const float *dy, int64_t rows, int64_t cols);

/* ---- normalization (norm.c), over the last dim of (rows, cols) ---- */
/* weight, bias (cols) may be NULL; mean, rstd (rows) are saved for backward. */
void cpu_layernorm_forward_f32(float *out, float *mean, float *rstd, const float *x,
                               const float *weight, const float *bias, int64_t rows, int64_t cols, float eps);
/* dweight, dbias may be NULL (then not computed). */
void cpu_layernorm_backward_f32(float *dx, float *dweight, float *dbias, const float *dout, const float *x,
                                const float *weight, const float *mean, const float *rstd,
                                int64_t rows, int64_t cols);
void cpu_rmsnorm_forward_f32(float *out, float *rstd, const float *x, const float *weight,
                             int64_t rows, int64_t cols, float eps);
void cpu_rmsnorm_backward_f32(float *dx, float *dweight, const float *dout, const float *x,
                              const float *weight, const float *rstd, int64_t rows, int64_t cols);

/* ---- embedding (embedding.c); ids already range-checked ---- */
void cpu_embedding_forward_f32(float *out, const int64_t *ids, int64_t n, const float *table, int64_t dim);
/* dtable (V, dim) = scatter-add of dout rows at ids (dtable zeroed here first). */
void cpu_embedding_backward_f32(float *dtable, int64_t vocab, const int64_t *ids, int64_t n,
                                const float *dout, int64_t dim);
/* bf16 tables: each id's rows of dout summed in f32 and added with one
 * rounding per element; _acc adds into dtable as it is, the other
 * overwrites all of it */
void cpu_embedding_backward_bf16(uint16_t *dtable, int64_t vocab, const int64_t *ids, int64_t n,
                                 const uint16_t *dout, int64_t dim);
void cpu_embedding_backward_acc_f32(float *dtable, const int64_t *ids, int64_t n, const float *dout, int64_t dim);
void cpu_embedding_backward_acc_bf16(uint16_t *dtable, const int64_t *ids, int64_t n, const uint16_t *dout,
                                     int64_t dim);

/* ---- cross-entropy (loss.c) ---- */
/* logits (N, V), only the first valid_v columns count. Writes lse (N) and
 * losses (N) (0 where ignored); returns the number of rows not ignored. */
int64_t cpu_cross_entropy_forward_f32(float *losses, float *lse, const float *logits, const int64_t *targets,
                                      int64_t N, int64_t V, int64_t valid_v, int64_t ignore_index);
/* dlogits = g * (softmax - onehot) for rows not ignored, 0 elsewhere and
 * in padded columns; g = dloss[0] / count, the share of the mean's gradient. */
void cpu_cross_entropy_backward_f32(float *dlogits, const float *logits, const float *lse, const int64_t *targets,
                                    int64_t N, int64_t V, int64_t valid_v, int64_t ignore_index, const float *dloss,
                                    int64_t count);

/* ---- attention (attention.c) ---- */
/* q, k, v, out (B, H, T, D); lse (B, H, T) saved for backward. */
void cpu_attention_forward_f32(float *out, float *lse, const float *q, const float *k, const float *v,
                               int64_t B, int64_t H, int64_t T, int64_t D, int causal, float scale);
void cpu_attention_backward_f32(float *dq, float *dk, float *dv, const float *dout, const float *q,
                                const float *k, const float *v, const float *out, const float *lse,
                                int64_t B, int64_t H, int64_t T, int64_t D, int causal, float scale);

/* ---- random (random.c): Philox4x32-10, value i depends on (seed, stream, i) ---- */
void cpu_philox4x32(uint64_t seed, uint64_t stream, uint64_t counter, uint32_t out[4]);
void cpu_init_normal_f32(float *out, int64_t n, float mean, float std, uint64_t seed, uint64_t stream, int64_t offset);
void cpu_init_uniform_f32(float *out, int64_t n, float low, float high, uint64_t seed, uint64_t stream, int64_t offset);
/* out = x * keep / (1 - p), keep drawn from (seed, stream 0xd50, offset + i). */
void cpu_dropout_f32(float *out, const float *x, int64_t n, float p, uint64_t seed, int64_t offset);

/* ---- bf16 twins (same files): bf16 tensors as uint16_t, f32 statistics
 * (mean, rstd, lse, losses). The math is the f32 kernel's, in f32 or wider:
 * each element is widened as it is loaded (a shift) and rounded once, to
 * nearest even, as it is stored, in registers; no f32 copy of a tensor. ---- */
void cpu_binary_bf16(int op, uint16_t *out, const uint16_t *a, const int64_t *a_strides,
                     const uint16_t *b, const int64_t *b_strides, int ndim, const int64_t *shape);
void cpu_gelu_forward_bf16(uint16_t *out, const uint16_t *x, int64_t n);
void cpu_gelu_backward_bf16(uint16_t *dx, const uint16_t *x, const uint16_t *dout, int64_t n);
void cpu_layernorm_forward_bf16(uint16_t *out, float *mean, float *rstd, const uint16_t *x, const uint16_t *weight,
                                const uint16_t *bias, int64_t rows, int64_t cols, float eps);
void cpu_layernorm_backward_bf16(uint16_t *dx, uint16_t *dweight, uint16_t *dbias, const uint16_t *dout,
                                 const uint16_t *x, const uint16_t *weight, const float *mean, const float *rstd,
                                 int64_t rows, int64_t cols);
int64_t cpu_cross_entropy_forward_bf16(float *losses, float *lse, const uint16_t *logits, const int64_t *targets,
                                       int64_t N, int64_t V, int64_t valid_v, int64_t ignore_index);
void cpu_cross_entropy_backward_bf16(uint16_t *dlogits, const uint16_t *logits, const float *lse,
                                     const int64_t *targets, int64_t N, int64_t V, int64_t valid_v,
                                     int64_t ignore_index, const float *dloss, int64_t count);
/* Both on each row in turn (the row still in cache), dlogits written over
 * the logits: the values of the two kernels with dloss[0] = 1. */
void cpu_cross_entropy_fused_f32(float *losses, float *logits, const int64_t *targets, int64_t N, int64_t V,
                                 int64_t valid_v, int64_t ignore_index, int64_t count);
void cpu_cross_entropy_fused_bf16(float *losses, uint16_t *logits, const int64_t *targets, int64_t N, int64_t V,
                                  int64_t valid_v, int64_t ignore_index, int64_t count);

/* ---- vocabulary-chunked classifier and embedding (classifier.c) ----
 * A slice of a (V, dim) table: `blocks` runs of block_rows rows, run b from
 * table row b * block_stride + row0, packed one after the other. */
/* Online log-sum-exp over the slice's logits (N, blocks * block_rows): updates
 * the running max m (start -inf), sum s (start 0) and the target's logit
 * tlogit of rows n, counting only table rows < valid_v. */
void cpu_classifier_lse_f32(float *m, float *s, float *tlogit, const float *logits, const int64_t *targets,
                            int64_t N, int64_t blocks, int64_t block_rows, int64_t block_stride, int64_t row0,
                            int64_t valid_v, int64_t ignore_index);
/* lse = m + log s, losses = lse - tlogit (0 where ignored); returns the count not ignored. */
int64_t cpu_classifier_finish_f32(float *lse, float *losses, const float *m, const float *s, const float *tlogit,
                                  const int64_t *targets, int64_t N, int64_t ignore_index);
/* dlogits = g (exp(logits - lse) - onehot) for the slice, g = dloss[0] / count;
 * 0 in padded rows and ignored rows. dlogits may be logits. */
void cpu_classifier_dlogits_f32(float *dlogits, const float *logits, const float *lse, const int64_t *targets,
                                int64_t N, int64_t blocks, int64_t block_rows, int64_t block_stride, int64_t row0,
                                int64_t valid_v, int64_t ignore_index, const float *dloss, int64_t count);
/* out[k] = the slice's row of ids[k] where the slice holds it (others untouched). */
void cpu_embedding_slice_forward_f32(float *out, const int64_t *ids, int64_t n, const float *rows, int64_t dim,
                                     int64_t blocks, int64_t block_rows, int64_t block_stride, int64_t row0);
/* drows (blocks * block_rows, dim) = scatter-add of dout rows whose ids the slice holds (zeroed here first). */
void cpu_embedding_slice_backward_f32(float *drows, const int64_t *ids, int64_t n, const float *dout, int64_t dim,
                                      int64_t blocks, int64_t block_rows, int64_t block_stride, int64_t row0);

/* ---- optimizers (optim_kernels.c) ---- */
/* AdamW, PyTorch's update: p = p*decay - step_size * m / (sqrt(v)*inv_sqrt_bc2 + eps),
 * with decay = 1 - lr*wd, step_size = lr / (1 - beta1^t), inv_sqrt_bc2 = 1/sqrt(1 - beta2^t),
 * on the gradient g * grad_scale (a clip coefficient; 1 reads g as it is). */
void cpu_adamw_f32(float *p, const float *g, float *m, float *v, int64_t n, float beta1, float beta2, float eps,
                   float decay, float step_size, float inv_sqrt_bc2, float grad_scale);
/* SGD, PyTorch's update; buf NULL when momentum is 0; first initializes buf with d. */
void cpu_sgd_f32(float *p, const float *g, float *buf, int64_t n, float lr, float momentum, float dampening,
                 float weight_decay, int nesterov, int first);

/* ---- a Linear's bias fused with what follows it (fused.c) ----
 * x (rows, cols) without its bias, bias (cols) over the rows; x + bias in f32.
 * bias_gelu_backward: dx = dout gelu'(x + bias) rounded to the dtype; dbias
 * (NULL: none) = column sums of that dx in double (acc: onto dbias's
 * values), rounded to f32 and then to the dtype (bf16: two roundings). bias_residual: out = res + (x + bias). */
void cpu_bias_gelu_forward_f32(float *out, const float *x, const float *bias, int64_t rows, int64_t cols);
void cpu_bias_gelu_forward_bf16(uint16_t *out, const uint16_t *x, const uint16_t *bias, int64_t rows,
                                int64_t cols);
void cpu_bias_gelu_backward_f32(float *dx, float *dbias, const float *dout, const float *x, const float *bias,
                                int64_t rows, int64_t cols, int acc);
void cpu_bias_gelu_backward_bf16(uint16_t *dx, uint16_t *dbias, const uint16_t *dout, const uint16_t *x,
                                 const uint16_t *bias, int64_t rows, int64_t cols, int acc);
void cpu_bias_residual_f32(float *out, const float *x, const float *bias, const float *res, int64_t rows,
                           int64_t cols);
void cpu_bias_residual_bf16(uint16_t *out, const uint16_t *x, const uint16_t *bias, const uint16_t *res,
                            int64_t rows, int64_t cols);

#endif
