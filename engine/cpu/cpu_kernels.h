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
#include "device.h"
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

/* ---- the table's entries (kernels.def), declared as cpu_<name> ---- */
#define FSDP_KERNEL(ret, name, params, has) FSDP_ON_CPU_##has(ret cpu_##name params;)
#include "kernels.def"
/* How the CPU bodies do them, by file:
 * copy.c: copy_strided, dst[i] = src[i] over shape, both strided
 * (elements), with a fast path when both are contiguous; zero, large ones
 * with streaming stores over the pool. */

/* ---- matmul (matmul.c, matmul_dnnl.c) ---- */
/* matmul_f32: for each batch b: C_b = alpha * op(A_b) @ op(B_b) + beta * C_b, where
 * op(A) is (M, K) (A stored (K, M) when trans_a), op(B) is (K, N) (B stored
 * (N, K) when trans_b), C is (M, N). Batch strides in elements; a stride of 0
 * shares one matrix over the batch. oneDNN or OpenBLAS by shape class.
 * FSDP_MATMUL_STATS=1: each distinct product's calls, time and GFLOP/s
 * (f32 and bf16) go to stderr at exit. */
/* What FSDP_MATMUL_STATS has counted so far (zeros when it is off). */
void cpu_matmul_stats_totals(int64_t *calls, double *flop, double *seconds);
/* 1 when cpu_matmul_f32 gives this product to oneDNN, 0 for OpenBLAS. */
int cpu_matmul_f32_route(int64_t batch, int64_t M, int64_t N, int64_t K, int trans_a, int trans_b);
/* The same, always OpenBLAS sgemm. */
void cpu_matmul_f32_blas(float *c, const float *a, const float *b, int64_t batch, int64_t M, int64_t N, int64_t K,
                         int trans_a, int trans_b, float alpha, float beta,
                         int64_t stride_a, int64_t stride_b, int64_t stride_c);
/* matmul_bf16: bf16 A, B, C with f32 accumulation and one rounding per element of C:
 * oneDNN's bf16 matmul where the CPU has bf16 instructions (AVX512-BF16,
 * AMX), else widened to f32 for cpu_matmul_f32. */
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

/* elementwise.c: binary_*, out (shape, contiguous) = a op b, a and b read
 * through strides that are 0 along broadcast dims, op an fsdp_binary_op;
 * axpy_f32_bf16, y and x do not overlap.
 * reduce.c: sum_dim_*, in (outer, red, inner) -> out (outer, inner), the bf16
 * ones summed in double, rounded to f32 and then to bf16 (as on CUDA).
 * activation.c, softmax.c (over the last dim of (rows, cols)), norm.c (the
 * same; weight, bias, dweight, dbias may be NULL; mean, rstd (rows) saved).
 * embedding.c (ids range-checked by the op layer): embedding_backward_*
 * zeroes dtable (V, dim) and scatter-adds the dout rows; bf16 sums each
 * id's rows in f32 and rounds once; _acc adds into dtable as it is.
 * loss.c: logits (N, V), only the first valid_v columns count; losses 0
 * where ignored; dlogits = g (softmax - onehot), g = dloss[0] / count, 0 in
 * ignored rows and padded columns.
 * attention.c: q, k, v, out (B, H, T, D); lse (B, H, T) saved. */

/* ---- random (random.c): Philox4x32-10, value i depends on (seed, stream, i) ---- */
void cpu_philox4x32(uint64_t seed, uint64_t stream, uint64_t counter, uint32_t out[4]);
/* dropout_f32: out = x * keep / (1 - p), keep drawn from (seed, stream 0xd50, offset + i). */

/* bf16 twins (the same files): bf16 tensors as uint16_t, f32 statistics
 * (mean, rstd, lse, losses). The math is the f32 kernel's, in f32 or wider:
 * each element is widened as it is loaded (a shift) and rounded once, to
 * nearest even, as it is stored, in registers; no f32 copy of a tensor.
 * cross_entropy_fused_*: both passes on each row in turn (the row still in
 * cache), dlogits written over the logits. */

/* ---- vocabulary-chunked classifier and embedding (classifier.c) ----
 * A slice of a (V, dim) table: `blocks` runs of block_rows rows, run b from
 * table row b * block_stride + row0, packed one after the other. */
/* classifier_lse_f32: online log-sum-exp over the slice's logits (N, blocks *
 * block_rows): updates the running max m (start -inf), sum s (start 0) and
 * the target's logit tlogit of rows n, counting only table rows < valid_v.
 * classifier_finish_f32: lse = m + log s, losses = lse - tlogit (0 where
 * ignored); returns the count not ignored. classifier_dlogits_f32: g
 * (exp(logits - lse) - onehot) for the slice, g = dloss[0] / count; 0 in
 * padded and ignored rows; dlogits may be logits. embedding_slice_forward:
 * out[k] = the slice's row of ids[k] where the slice holds it (others
 * untouched); _backward: drows (blocks * block_rows, dim) zeroed, then the
 * dout rows whose ids the slice holds scatter-added. */

/* ---- optimizers (optim.c) ---- */
/* adamw_f32, PyTorch's update: p = p*decay - step_size * m / (sqrt(v)*inv_sqrt_bc2 + eps),
 * with decay = 1 - lr*wd, step_size = lr / (1 - beta1^t), inv_sqrt_bc2 = 1/sqrt(1 - beta2^t),
 * on the gradient g * grad_scale (a clip coefficient; 1 reads g as it is). */
/* sgd_f32, PyTorch's update; buf NULL when momentum is 0; first initializes buf with d. */

/* ---- a Linear's bias fused with what follows it (fused.c) ----
 * x (rows, cols) without its bias, bias (cols) over the rows; x + bias in f32.
 * bias_gelu_backward: dx = dout gelu'(x + bias) rounded to the dtype; dbias
 * (NULL: none) = column sums of that dx in double (acc: onto dbias's
 * values), rounded to f32 and then to the dtype (bf16: two roundings). bias_residual: out = res + (x + bias). */

#endif
