/* device.h: the kernel table of a device.
 *
 * The op layer checks arguments and stages dtypes; the table does the work.
 * Every entry has the signature of its CPU kernel in cpu_kernels.h, with
 * pointers into the device's memory; a device's kernels run in order on its
 * compute stream, and the entries that return a value (sums, counts) wait
 * for it. The CPU table (engine/cpu/cpu_device.c) is always there; the CUDA
 * table registers itself when the CUDA backend is built and a GPU exists. */
#ifndef FSDP_DEVICE_H
#define FSDP_DEVICE_H

#include <stddef.h>
#include <stdint.h>

/* What matmul_epilogue_bf16 does after the product P = alpha op(A) op(B) + beta C, all row-major:
 * op(A) (M, K), op(B) (K, N), C and D (M, N); C is read only when beta != 0 and may equal D. */
enum fsdp_epilogue {
    FSDP_EPILOGUE_BIAS = 1,      /* D = P + bias[n]                                   bias (N)        */
    FSDP_EPILOGUE_GELU_AUX_BIAS, /* aux = P + bias[n]; D = gelu(aux), tanh form       bias (N), aux (M, N) */
    FSDP_EPILOGUE_DGELU_BGRAD,   /* D = P * gelu'(aux); dbias[n] = sum_m D[m, n]      aux (M, N), dbias (N) */
    FSDP_EPILOGUE_BGRAD_A,       /* D = P; dbias[m] = sum_k op(A)[m, k]               dbias (M)       */
    FSDP_EPILOGUE_GELU_BIAS,     /* D = gelu(P + bias[n]), no GELU input kept         bias (N)        */
};
/* (gelu: the tanh form of engine/core/gelu.h. cuBLASLt's GELU epilogue is that form too: PyTorch's
 * addmm with a GELU activation runs that epilogue, and where it cannot, gelu(approximate="tanh").)
 * The operands are packed (leading dimensions: the rows' lengths), one matrix, no batch. */

typedef struct fsdp_device_kernels {
    const char *name;
    /* memory */
    void *(*raw_alloc)(size_t nbytes);
    void (*raw_free)(void *ptr);
    void (*zero)(void *dst, size_t nbytes);
    void (*copy_from_host)(void *dst, const void *host_src, size_t nbytes);
    void (*copy_to_host)(void *host_dst, const void *src, size_t nbytes);
    void (*synchronize)(void);
    /* Pinned host memory and the transfers through it (optional: NULL where
     * a device has none, and transfers go through copy_from_host and
     * copy_to_host). host_alloc: host memory the device copies to and from
     * asynchronously (page-locked: cudaHostAlloc), or NULL when refused;
     * host_free waits for the device's copies first (cudaFreeHost does).
     * The copies are enqueued on the compute stream, in its order, and
     * return at once with a fence: until it has passed the host neither
     * writes the source nor reads the destination. fence_wait(f, 1) waits
     * for it; fence_wait(f, 0) only asks (0: not yet). Either frees the
     * fence once it has passed (then it returns 1). */
    void *(*host_alloc)(size_t nbytes);
    void (*host_free)(void *ptr);
    void *(*copy_from_host_async)(void *dst, const void *pinned_src, size_t nbytes);
    void *(*copy_to_host_async)(void *pinned_dst, const void *src, size_t nbytes);
    int (*fence_wait)(void *fence, int block);
    /* cast.c, copy.c */
    void (*cast_any)(void *out, int out_dtype, const void *in, int in_dtype, int64_t n);
    void (*copy_strided)(void *dst, const int64_t *dst_strides, const void *src, const int64_t *src_strides, int ndim,
                         const int64_t *shape, size_t elem_size);
    void (*fill_f32)(float *out, float v, int64_t n);
    /* matmul.c */
    void (*matmul_f32)(float *c, const float *a, const float *b, int64_t batch, int64_t M, int64_t N, int64_t K,
                       int trans_a, int trans_b, float alpha, float beta, int64_t stride_a, int64_t stride_b,
                       int64_t stride_c);
    /* The same on bf16 buffers with f32 accumulation (one rounding, at the
     * end). Optional: NULL where bf16 goes through f32. */
    void (*matmul_bf16)(uint16_t *c, const uint16_t *a, const uint16_t *b, int64_t batch, int64_t M, int64_t N,
                        int64_t K, int trans_a, int trans_b, float alpha, float beta, int64_t stride_a,
                        int64_t stride_b, int64_t stride_c);
    /* bf16 in and out, f32 accumulation; dbias is written (not added), bf16. Returns 1 when it ran,
     * 0 when this device cannot fuse this epilogue at this shape/alignment (nothing written: the op
     * layer then composes matmul_bf16 with the unfused kernels). NULL where a device has none. */
    int (*matmul_epilogue_bf16)(uint16_t *d, const uint16_t *a, const uint16_t *b, const uint16_t *c,
                                int64_t M, int64_t N, int64_t K, int trans_a, int trans_b, float alpha,
                                float beta, int epilogue, const uint16_t *bias, uint16_t *aux, uint16_t *dbias);
    /* elementwise.c, reduce.c */
    void (*binary_f32)(int op, float *out, const float *a, const int64_t *a_strides, const float *b,
                       const int64_t *b_strides, int ndim, const int64_t *shape);
    void (*scale_f32)(float *out, const float *a, float s, int64_t n);
    void (*add_scalar_f32)(float *out, const float *a, float s, int64_t n);
    void (*axpy_f32)(float *y, const float *x, float alpha, int64_t n);
    void (*sum_dim_f32)(float *out, const float *in, int64_t outer, int64_t red, int64_t inner);
    double (*sum_all_f32)(const float *in, int64_t n);
    double (*sumsq_f32)(const float *in, int64_t n);
    /* bf16 versions of the above (f32 math, one rounding per result);
     * optional: NULL where bf16 goes through f32. Sums accumulate as the
     * f32 ones do (in double), then round to f32 and to bf16: two roundings,
     * on every device. */
    void (*binary_bf16)(int op, uint16_t *out, const uint16_t *a, const int64_t *a_strides, const uint16_t *b,
                        const int64_t *b_strides, int ndim, const int64_t *shape);
    void (*scale_bf16)(uint16_t *out, const uint16_t *a, float s, int64_t n);
    void (*add_scalar_bf16)(uint16_t *out, const uint16_t *a, float s, int64_t n);
    void (*axpy_bf16)(uint16_t *y, const uint16_t *x, float alpha, int64_t n);
    void (*sum_dim_bf16)(uint16_t *out, const uint16_t *in, int64_t outer, int64_t red, int64_t inner);
    /* sum over i < n of sumsq(ptrs[i], counts[i]), ptrs and counts host
     * arrays of f32 device buffers: one pass over them all (CUDA: a launch
     * per 14 tensors and one to add the partials), one value back
     * (gradient norms: one wait instead of one per tensor). Summed in
     * double in an order fixed by the sizes. Optional: NULL where the op
     * layer calls sumsq_f32 per tensor. */
    double (*sumsq_many_f32)(const float *const *ptrs, const int64_t *counts, int n);
    /* y (f32) += alpha * x (bf16), x widened in registers: a bf16 gradient
     * added into an f32 gradient shard without a widened copy. Optional
     * (NULL: the op layer widens x into a staging tensor and calls axpy_f32). */
    void (*axpy_f32_bf16)(float *y, const uint16_t *x, float alpha, int64_t n);
    /* activation.c, softmax.c */
    void (*gelu_forward_f32)(float *out, const float *x, int64_t n);
    void (*gelu_backward_f32)(float *dx, const float *x, const float *dout, int64_t n);
    void (*silu_forward_f32)(float *out, const float *x, int64_t n);
    void (*silu_backward_f32)(float *dx, const float *x, const float *dout, int64_t n);
    void (*softmax_forward_f32)(float *out, const float *x, int64_t rows, int64_t cols);
    void (*softmax_backward_f32)(float *dx, const float *y, const float *dy, int64_t rows, int64_t cols);
    void (*log_softmax_forward_f32)(float *out, const float *x, int64_t rows, int64_t cols);
    void (*log_softmax_backward_f32)(float *dx, const float *y, const float *dy, int64_t rows, int64_t cols);
    /* bf16 versions (optional) */
    void (*gelu_forward_bf16)(uint16_t *out, const uint16_t *x, int64_t n);
    void (*gelu_backward_bf16)(uint16_t *dx, const uint16_t *x, const uint16_t *dout, int64_t n);
    void (*silu_forward_bf16)(uint16_t *out, const uint16_t *x, int64_t n);
    void (*silu_backward_bf16)(uint16_t *dx, const uint16_t *x, const uint16_t *dout, int64_t n);
    void (*softmax_forward_bf16)(uint16_t *out, const uint16_t *x, int64_t rows, int64_t cols);
    void (*softmax_backward_bf16)(uint16_t *dx, const uint16_t *y, const uint16_t *dy, int64_t rows, int64_t cols);
    void (*log_softmax_forward_bf16)(uint16_t *out, const uint16_t *x, int64_t rows, int64_t cols);
    void (*log_softmax_backward_bf16)(uint16_t *dx, const uint16_t *y, const uint16_t *dy, int64_t rows,
                                      int64_t cols);
    /* norm.c */
    void (*layernorm_forward_f32)(float *out, float *mean, float *rstd, const float *x, const float *weight,
                                  const float *bias, int64_t rows, int64_t cols, float eps);
    void (*layernorm_backward_f32)(float *dx, float *dweight, float *dbias, const float *dout, const float *x,
                                   const float *weight, const float *mean, const float *rstd, int64_t rows,
                                   int64_t cols);
    void (*rmsnorm_forward_f32)(float *out, float *rstd, const float *x, const float *weight, int64_t rows,
                                int64_t cols, float eps);
    void (*rmsnorm_backward_f32)(float *dx, float *dweight, const float *dout, const float *x, const float *weight,
                                 const float *rstd, int64_t rows, int64_t cols);
    /* bf16 versions (optional): tensors bf16, mean and rstd f32; the weight
     * and bias gradients are summed in double, then rounded to f32 and to
     * bf16 (two roundings, on every device) */
    void (*layernorm_forward_bf16)(uint16_t *out, float *mean, float *rstd, const uint16_t *x, const uint16_t *weight,
                                   const uint16_t *bias, int64_t rows, int64_t cols, float eps);
    void (*layernorm_backward_bf16)(uint16_t *dx, uint16_t *dweight, uint16_t *dbias, const uint16_t *dout,
                                    const uint16_t *x, const uint16_t *weight, const float *mean, const float *rstd,
                                    int64_t rows, int64_t cols);
    void (*rmsnorm_forward_bf16)(uint16_t *out, float *rstd, const uint16_t *x, const uint16_t *weight, int64_t rows,
                                 int64_t cols, float eps);
    void (*rmsnorm_backward_bf16)(uint16_t *dx, uint16_t *dweight, const uint16_t *dout, const uint16_t *x,
                                  const uint16_t *weight, const float *rstd, int64_t rows, int64_t cols);
    /* embedding.c, loss.c, attention.c */
    void (*embedding_forward_f32)(float *out, const int64_t *ids, int64_t n, const float *table, int64_t dim);
    void (*embedding_backward_f32)(float *dtable, int64_t vocab, const int64_t *ids, int64_t n, const float *dout,
                                   int64_t dim);
    int64_t (*cross_entropy_forward_f32)(float *losses, float *lse, const float *logits, const int64_t *targets,
                                         int64_t N, int64_t V, int64_t valid_v, int64_t ignore_index);
    /* dloss: the loss's gradient, one element in the device's memory; each
     * row not ignored gets dloss[0] / count (count 0: nothing) */
    void (*cross_entropy_backward_f32)(float *dlogits, const float *logits, const float *lse, const int64_t *targets,
                                       int64_t N, int64_t V, int64_t valid_v, int64_t ignore_index,
                                       const float *dloss, int64_t count);
    void (*attention_forward_f32)(float *out, float *lse, const float *q, const float *k, const float *v, int64_t B,
                                  int64_t H, int64_t T, int64_t D, int causal, float scale);
    void (*attention_backward_f32)(float *dq, float *dk, float *dv, const float *dout, const float *q,
                                   const float *k, const float *v, const float *out, const float *lse, int64_t B,
                                   int64_t H, int64_t T, int64_t D, int causal, float scale);
    /* Attention from the packed qkv (B, T, 3C) of a fused projection (head h
     * of q, k, v at columns h D, C + h D, 2C + h D; C = H D), bf16 in memory,
     * f32 math, out (B, T, C) with head h at column h D. The forward saves
     * the probabilities probs (B, H, T, T) bf16; scores, dprobs (f32) and
     * dscores (bf16), all (B, H, T, T), are scratch the caller provides, and
     * the backward writes all of dqkv. Optional (NULL: the op layer unpacks
     * q, k, v and runs attention_*_f32). */
    void (*attention_qkv_forward_bf16)(uint16_t *out, uint16_t *probs, float *scores, const uint16_t *qkv,
                                       int64_t B, int64_t H, int64_t T, int64_t D, int causal, float scale);
    void (*attention_qkv_backward_bf16)(uint16_t *dqkv, float *dprobs, uint16_t *dscores, const uint16_t *dout,
                                        const uint16_t *qkv, const uint16_t *probs, int64_t B, int64_t H, int64_t T,
                                        int64_t D, int causal, float scale);
    /* Fused (flash-style) attention on the tensor cores from the same packed
     * qkv: no (T, T) buffer at all. The forward writes out (B, T, C) bf16 and
     * lse (B, H, T) f32 (log sum exp of the scaled scores of each query row);
     * the backward recomputes the scores tile by tile from qkv and lse,
     * writes all of dqkv (B, T, 3C) bf16, and uses drow (B, H, T) f32,
     * scratch the caller provides, for dO . O. Optional; takes only the shapes
     * attention_flash_covers accepts, with 16-byte aligned bf16 buffers. */
    void (*attention_flash_forward_bf16)(uint16_t *out, float *lse, const uint16_t *qkv, int64_t B, int64_t H,
                                         int64_t T, int64_t D, int causal, float scale);
    void (*attention_flash_backward_bf16)(uint16_t *dqkv, float *drow, const uint16_t *dout, const uint16_t *qkv,
                                          const uint16_t *out, const float *lse, int64_t B, int64_t H, int64_t T,
                                          int64_t D, int causal, float scale);
    /* cross-entropy on bf16 logits (optional): losses and lse f32, dlogits bf16 */
    int64_t (*cross_entropy_forward_bf16)(float *losses, float *lse, const uint16_t *logits, const int64_t *targets,
                                          int64_t N, int64_t V, int64_t valid_v, int64_t ignore_index);
    void (*cross_entropy_backward_bf16)(uint16_t *dlogits, const uint16_t *logits, const float *lse,
                                        const int64_t *targets, int64_t N, int64_t V, int64_t valid_v,
                                        int64_t ignore_index, const float *dloss, int64_t count);
    /* classifier.c: the vocabulary-chunked LM head and embedding (slice
     * geometry in cpu_kernels.h). Optional: NULL where a device has none
     * (the ops then refuse with a message naming the device). */
    void (*classifier_lse_f32)(float *m, float *s, float *tlogit, const float *logits, const int64_t *targets,
                               int64_t N, int64_t blocks, int64_t block_rows, int64_t block_stride, int64_t row0,
                               int64_t valid_v, int64_t ignore_index);
    int64_t (*classifier_finish_f32)(float *lse, float *losses, const float *m, const float *s, const float *tlogit,
                                     const int64_t *targets, int64_t N, int64_t ignore_index);
    void (*classifier_dlogits_f32)(float *dlogits, const float *logits, const float *lse, const int64_t *targets,
                                   int64_t N, int64_t blocks, int64_t block_rows, int64_t block_stride, int64_t row0,
                                   int64_t valid_v, int64_t ignore_index, const float *dloss, int64_t count);
    void (*embedding_slice_forward_f32)(float *out, const int64_t *ids, int64_t n, const float *rows, int64_t dim,
                                        int64_t blocks, int64_t block_rows, int64_t block_stride, int64_t row0);
    void (*embedding_slice_backward_f32)(float *drows, const int64_t *ids, int64_t n, const float *dout,
                                         int64_t dim, int64_t blocks, int64_t block_rows, int64_t block_stride,
                                         int64_t row0);
    /* cross_entropy_forward_* for callers that know the count of rows not
     * ignored (the op layer, from the targets' host range): the same losses
     * and lse, and nothing comes back to the host (no sync). Optional (NULL:
     * the op layer calls cross_entropy_forward_*). */
    void (*cross_entropy_rows_f32)(float *losses, float *lse, const float *logits, const int64_t *targets, int64_t N,
                                   int64_t V, int64_t valid_v, int64_t ignore_index);
    void (*cross_entropy_rows_bf16)(float *losses, float *lse, const uint16_t *logits, const int64_t *targets,
                                    int64_t N, int64_t V, int64_t valid_v, int64_t ignore_index);
    /* The loss and its gradient in one pass over the logits (the fused
     * classifier of llm.c): losses as cross_entropy_rows_*, then, from the
     * row just read, dlogits for a loss gradient of one written over the
     * logits (in place): the values cross_entropy_backward_* gives with the
     * row's lse, dloss[0] = 1 and count. The caller knows count (the rows
     * not ignored); nothing comes back to the host. Optional (NULL: the op
     * layer runs the forward and the backward kernels in turn). */
    void (*cross_entropy_fused_f32)(float *losses, float *logits, const int64_t *targets, int64_t N, int64_t V,
                                    int64_t valid_v, int64_t ignore_index, int64_t count);
    void (*cross_entropy_fused_bf16)(float *losses, uint16_t *logits, const int64_t *targets, int64_t N, int64_t V,
                                     int64_t valid_v, int64_t ignore_index, int64_t count);
    /* the embedding's gradient for a bf16 table: dtable (vocab, dim)
     * overwritten, each id's rows of dout summed in f32, rounded once.
     * Optional (NULL: staged through f32). */
    void (*embedding_backward_bf16)(uint16_t *dtable, int64_t vocab, const int64_t *ids, int64_t n,
                                    const uint16_t *dout, int64_t dim);
    /* embedding_forward_f32 for a bf16 table: out (n, dim) bf16 gets the
     * rows the ids pick, as they are (ids checked by the op layer).
     * Optional (NULL: the host gathers rows in place, another device widens
     * the table and narrows the rows). */
    void (*embedding_forward_bf16)(uint16_t *out, const int64_t *ids, int64_t n, const uint16_t *table, int64_t dim);
    /* random.c */
    void (*init_normal_f32)(float *out, int64_t n, float mean, float std, uint64_t seed, uint64_t stream,
                            int64_t offset);
    void (*init_uniform_f32)(float *out, int64_t n, float low, float high, uint64_t seed, uint64_t stream,
                             int64_t offset);
    void (*dropout_f32)(float *out, const float *x, int64_t n, float p, uint64_t seed, int64_t offset);
    /* optim_kernels.c; the AdamW kernels read each gradient as g * grad_scale
     * (the clip coefficient, folded into the pass; 1: as stored), rounded to
     * f32 as a scale pass over g would leave it */
    void (*adamw_f32)(float *p, const float *g, float *m, float *v, int64_t n, float beta1, float beta2, float eps,
                      float decay, float step_size, float inv_sqrt_bc2, float grad_scale);
    void (*sgd_f32)(float *p, const float *g, float *buf, int64_t n, float lr, float momentum, float dampening,
                    float weight_decay, int nesterov, int first);
    /* adamw_f32 over n flat f32 tensors at once: tensor i is p[i], g[i],
     * m[i], v[i] of counts[i] elements with its own decay[i], step_size[i]
     * and inv_sqrt_bc2[i] (host arrays of device pointers and values; the
     * betas, eps and grad_scale are shared). The same float expressions as
     * adamw_f32, element for element. pb (may be NULL) and pb[i], when not
     * NULL, receive the bf16 rounding of each new p (f32_to_bf16: what
     * cast_any writes; an FSDP master's compute copy). CUDA: one launch per
     * 56 tensors. Optional (NULL: the op layer calls adamw_f32 per tensor,
     * then cast_any for pb). */
    void (*adamw_many_f32)(float *const *p, uint16_t *const *pb, const float *const *g, float *const *m,
                           float *const *v, const int64_t *counts, const float *decay, const float *step_size,
                           const float *inv_sqrt_bc2, int n, float beta1, float beta2, float eps, float grad_scale);
    /* Gradients added where they are kept (a .grad that exists: an FSDP
     * unit's gradient slice) instead of made and then added: sum_dim_bf16 and
     * layernorm_backward_bf16 with out, dweight and dbias (either may be
     * NULL) receiving old + sum, one rounding each. Optional (NULL: the op
     * layer computes the gradient and adds it). */
    void (*sum_dim_acc_bf16)(uint16_t *out, const uint16_t *in, int64_t outer, int64_t red, int64_t inner);
    void (*layernorm_backward_acc_bf16)(uint16_t *dx, uint16_t *dweight, uint16_t *dbias, const uint16_t *dout,
                                        const uint16_t *x, const uint16_t *weight, const float *mean,
                                        const float *rstd, int64_t rows, int64_t cols);
    /* layernorm_backward_bf16 with dx added into what dx holds (the
     * gradient a residual stream already has: old + dx in f32, one
     * rounding) instead of written and then added by the tape; dweight and
     * dbias written (acc 0) or added to (acc 1). Optional. */
    void (*layernorm_backward_addx_bf16)(uint16_t *dx, uint16_t *dweight, uint16_t *dbias, const uint16_t *dout,
                                         const uint16_t *x, const uint16_t *weight, const float *mean,
                                         const float *rstd, int64_t rows, int64_t cols, int acc);
    /* embedding_backward_bf16 added into dtable: only the rows of the ids
     * are touched (old + each id's sum, one rounding) */
    void (*embedding_backward_acc_bf16)(uint16_t *dtable, const int64_t *ids, int64_t n, const uint16_t *dout,
                                        int64_t dim);
    /* embedding_backward_f32 added into dtable as it is (only the rows of
     * the ids are touched; no zeroed table and no second pass). Optional. */
    void (*embedding_backward_acc_f32)(float *dtable, const int64_t *ids, int64_t n, const float *dout, int64_t dim);
    /* fused.c: a Linear's bias with what follows it, in one pass (after
     * llm.c). x (rows, cols) is the matmul's output without its bias, bias
     * (cols) broadcast over the rows. Optional (NULL: the op layer adds the
     * bias and runs the next op on its own).
     * bias_gelu_forward: out = gelu(x + bias), x + bias kept in f32. */
    void (*bias_gelu_forward_f32)(float *out, const float *x, const float *bias, int64_t rows, int64_t cols);
    void (*bias_gelu_forward_bf16)(uint16_t *out, const uint16_t *x, const uint16_t *bias, int64_t rows,
                                   int64_t cols);
    /* dx = dout gelu'(x + bias), rounded to the dtype; dbias (NULL: none)
     * gets the column sums of that dx in double (acc: added onto dbias's
     * values in double), rounded to f32 and then to the dtype (bf16: two
     * roundings, on every device) */
    void (*bias_gelu_backward_f32)(float *dx, float *dbias, const float *dout, const float *x, const float *bias,
                                   int64_t rows, int64_t cols, int acc);
    void (*bias_gelu_backward_bf16)(uint16_t *dx, uint16_t *dbias, const uint16_t *dout, const uint16_t *x,
                                    const uint16_t *bias, int64_t rows, int64_t cols, int acc);
    /* out = res + (x + bias), one rounding: a projection's bias and the
     * residual add after it (res (rows, cols)) */
    void (*bias_residual_f32)(float *out, const float *x, const float *bias, const float *res, int64_t rows,
                              int64_t cols);
    void (*bias_residual_bf16)(uint16_t *out, const uint16_t *x, const uint16_t *bias, const uint16_t *res,
                               int64_t rows, int64_t cols);
} fsdp_device_kernels;

/* cuBLASLt's workspace (cuBLAS's own size on Hopper: room for its split-K
 * algorithms). The CUDA matmul_epilogue_bf16 takes it from the engine's
 * allocator, tag other, at its first call that runs, and holds it for the
 * process, so fsdp.memory and the planner count it; the counting device
 * does the same at its first such call after each fsdp_meta_mimic. When it
 * does not fit (a cap), the entry returns 0: the unfused ops run. */
#define FSDP_EPILOGUE_WORKSPACE_BYTES ((size_t)32 << 20)

/* What the CUDA matmul_epilogue_bf16 fuses (engine/cuda/cuda_matmul_lt.cu), so
 * that the counting device takes the path a GPU takes: M, N, K from 1 to
 * 2^31 - 1; every buffer it touches (a, b, d, c when beta != 0, bias, aux,
 * dbias) 16-byte aligned, the alignment its cuBLASLt algorithms are chosen
 * for; with a GELU input (aux), N divisible by 8 (cuBLASLt's rule for the
 * aux leading dimension, here N: the rows of the column-major D); for
 * BGRAD_A, alpha 1 (its bias gradient is of op(A), unscaled). The device
 * may still find no algorithm and return 0. */
static inline int matmul_epilogue_covers(const void *d, const void *a, const void *b, const void *c, int64_t M,
                                         int64_t N, int64_t K, float alpha, float beta, int epilogue,
                                         const void *bias, const void *aux, const void *dbias) {
    if (M < 1 || N < 1 || K < 1 || M > INT32_MAX || N > INT32_MAX || K > INT32_MAX) return 0;
    int gelu = epilogue == FSDP_EPILOGUE_GELU_AUX_BIAS || epilogue == FSDP_EPILOGUE_DGELU_BGRAD;   /* with aux */
    int with_bias = epilogue == FSDP_EPILOGUE_BIAS || epilogue == FSDP_EPILOGUE_GELU_AUX_BIAS ||
                    epilogue == FSDP_EPILOGUE_GELU_BIAS;
    int with_dbias = epilogue == FSDP_EPILOGUE_DGELU_BGRAD || epilogue == FSDP_EPILOGUE_BGRAD_A;
    const void *bufs[7] = {d, a, b, beta != 0.0f ? c : NULL, with_bias ? bias : NULL, gelu ? aux : NULL,
                           with_dbias ? dbias : NULL};
    for (int i = 0; i < 7; i++)
        if ((uintptr_t)bufs[i] % 16 != 0) return 0;
    if (gelu && N % 8 != 0) return 0;
    if (epilogue == FSDP_EPILOGUE_BGRAD_A && alpha != 1.0f) return 0;
    return epilogue >= FSDP_EPILOGUE_BIAS && epilogue <= FSDP_EPILOGUE_GELU_BIAS;
}

/* The shapes of attention_flash_*_bf16: head dim D a multiple of 16 up to
 * 128, any T, B, H >= 1, with element offsets within int64 and at most
 * 2^31 - 1 blocks of 64 rows. */
static inline int attention_flash_covers(int64_t B, int64_t H, int64_t T, int64_t D) {
    if (B < 1 || H < 1 || T < 1 || D < 16 || D > 128 || D % 16 != 0) return 0;
    if (B > INT64_MAX / H / T / (3 * D)) return 0;
    int64_t tiles = (T + 63) / 64;
    return H <= INT32_MAX / tiles && B <= INT32_MAX / tiles / H;
}

/* The table of a device, or NULL when it is not built or has no hardware. */
const fsdp_device_kernels *device_kernels(int device);
/* Makes a device's table available (called by a backend at start-up). */
void device_register(int device, const fsdp_device_kernels *k);

#endif
