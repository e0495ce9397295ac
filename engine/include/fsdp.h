/* fsdp.h: the public C API of the fsdp-lua engine, and its FFI surface.
 *
 * Rules (DESIGN.md, "Decided" 1 and 2): C99, opaque handles, every call
 * returns an fsdp_status, results come back through out-parameters, no
 * structs by value, no varargs, no callbacks. On failure the call returns a
 * non-zero status and fsdp_last_error() names the op, shapes, dtypes,
 * device and rank. Nothing here terminates the process on bad input.
 *
 * The Lua binding (lua/fsdp/cdef.lua) is generated from the region between
 * the FFI markers by tools/gen_binding.lua; a test fails when they drift.
 *
 * Ownership: every fsdp_tensor** out-parameter receives a new reference,
 * which the caller gives back with fsdp_tensor_release().
 */
#ifndef FSDP_H
#define FSDP_H

#include <stdint.h>
#include <stddef.h>

#ifdef __cplusplus
extern "C" {
#endif

/* FFI-BEGIN */
typedef enum fsdp_status {
    FSDP_OK = 0,
    FSDP_ERR_INVALID = 1,     /* a bad argument: NULL, out of range, unknown enum */
    FSDP_ERR_SHAPE = 2,       /* shapes that do not fit the op */
    FSDP_ERR_DTYPE = 3,       /* a dtype the op does not take, or a mismatch */
    FSDP_ERR_DEVICE = 4,      /* tensors on different devices, or no such device */
    FSDP_ERR_OOM = 5,         /* the allocator's cap or the system said no */
    FSDP_ERR_INDEX = 6,       /* an index (token id, target) out of range */
    FSDP_ERR_LAYOUT = 7,      /* strides the op cannot take (e.g. writing a broadcast view) */
    FSDP_ERR_IO = 8,          /* files */
    FSDP_ERR_STATE = 9,       /* a call at the wrong time (e.g. backward twice) */
    FSDP_ERR_UNSUPPORTED = 10,/* not built in, or not implemented for this device */
    FSDP_ERR_COMM = 11        /* MPI, NCCL */
} fsdp_status;

typedef enum fsdp_dtype {
    FSDP_F32 = 0,
    FSDP_BF16 = 1,
    FSDP_I32 = 2,
    FSDP_I64 = 3,
    FSDP_U16 = 4,
    FSDP_DTYPE_COUNT = 5
} fsdp_dtype;

typedef enum fsdp_device {
    FSDP_DEVICE_CPU = 0,
    FSDP_DEVICE_CUDA = 1,
    FSDP_DEVICE_COUNT = 2
} fsdp_device;

/* What an allocation is for; the allocator keeps statistics per tag. */
typedef enum fsdp_tag {
    FSDP_TAG_PARAM = 0,
    FSDP_TAG_GRAD = 1,
    FSDP_TAG_OPTIMIZER = 2,
    FSDP_TAG_ACTIVATION = 3,
    FSDP_TAG_COMM = 4,
    FSDP_TAG_OTHER = 5,
    FSDP_TAG_COUNT = 6
} fsdp_tag;

typedef enum fsdp_binary_op {
    FSDP_ADD = 0,
    FSDP_SUB = 1,
    FSDP_MUL = 2,
    FSDP_DIV = 3
} fsdp_binary_op;

typedef struct fsdp_tensor fsdp_tensor;

/* ---- errors and runtime ---- */
const char *fsdp_last_error(void);           /* message of the last failure on this thread */
fsdp_status fsdp_version(const char **out);
fsdp_status fsdp_set_num_threads(int n);     /* CPU kernel threads, OpenBLAS included */
fsdp_status fsdp_get_num_threads(int *out);
/* Initializes MPI when the process was started by mpirun, else a world of one. */
fsdp_status fsdp_runtime_init(int *rank, int *world);
fsdp_status fsdp_runtime_rank(int *rank, int *world);
fsdp_status fsdp_runtime_finalize(void);
/* Ends the whole job (MPI_Abort under mpirun) after printing msg. */
fsdp_status fsdp_runtime_abort(const char *msg, int exit_code);

/* ---- allocator ---- */
/* tag = -1 gives the totals over all tags. */
fsdp_status fsdp_mem_stats(int device, int tag, int64_t *current, int64_t *peak, int64_t *reserved);
fsdp_status fsdp_mem_reset_peak(int device);
fsdp_status fsdp_mem_set_cap(int device, int64_t cap_bytes);   /* 0 = no cap */
fsdp_status fsdp_mem_get_cap(int device, int64_t *cap_bytes);
fsdp_status fsdp_mem_empty_cache(int device);
/* Tag given to tensors made by ops on this thread (default ACTIVATION). */
fsdp_status fsdp_mem_set_default_tag(int tag, int *previous);

/* ---- tensors ---- */
fsdp_status fsdp_tensor_empty(fsdp_tensor **out, int dtype, int ndim, const int64_t *shape, int device, int tag);
fsdp_status fsdp_tensor_zeros(fsdp_tensor **out, int dtype, int ndim, const int64_t *shape, int device, int tag);
/* Copies nbytes of contiguous row-major data in. */
fsdp_status fsdp_tensor_from_data(fsdp_tensor **out, int dtype, int ndim, const int64_t *shape,
                                  const void *data, int64_t nbytes, int device, int tag);
/* Copies the tensor out, contiguous row-major, into dst of capacity nbytes. */
fsdp_status fsdp_tensor_to_data(fsdp_tensor *t, void *dst, int64_t nbytes);
fsdp_status fsdp_tensor_retain(fsdp_tensor *t);
fsdp_status fsdp_tensor_release(fsdp_tensor *t);
fsdp_status fsdp_tensor_ndim(fsdp_tensor *t, int *out);
fsdp_status fsdp_tensor_shape(fsdp_tensor *t, int64_t *shape);    /* room for 8 */
fsdp_status fsdp_tensor_strides(fsdp_tensor *t, int64_t *strides); /* in elements, room for 8 */
fsdp_status fsdp_tensor_dtype(fsdp_tensor *t, int *out);
fsdp_status fsdp_tensor_device(fsdp_tensor *t, int *out);
fsdp_status fsdp_tensor_tag(fsdp_tensor *t, int *out);
fsdp_status fsdp_tensor_numel(fsdp_tensor *t, int64_t *out);
fsdp_status fsdp_tensor_is_contiguous(fsdp_tensor *t, int *out);
/* Address of element 0 of the view (host memory only). */
fsdp_status fsdp_tensor_data_ptr(fsdp_tensor *t, void **out);
/* Value of a one-element tensor. */
fsdp_status fsdp_tensor_item(fsdp_tensor *t, double *out);
/* Writes a one-line description, e.g. "f32[3,4] cpu", into buf. */
fsdp_status fsdp_tensor_describe(fsdp_tensor *t, char *buf, int64_t size);

/* ---- views (share storage; differentiable) ---- */
/* One entry of shape may be -1. Copies when the layout does not allow a view. */
fsdp_status fsdp_reshape(fsdp_tensor **out, fsdp_tensor *t, int ndim, const int64_t *shape);
fsdp_status fsdp_permute(fsdp_tensor **out, fsdp_tensor *t, int ndim, const int *perm);
fsdp_status fsdp_transpose(fsdp_tensor **out, fsdp_tensor *t, int dim0, int dim1);
fsdp_status fsdp_narrow(fsdp_tensor **out, fsdp_tensor *t, int dim, int64_t start, int64_t length);
fsdp_status fsdp_expand(fsdp_tensor **out, fsdp_tensor *t, int ndim, const int64_t *shape);
fsdp_status fsdp_contiguous(fsdp_tensor **out, fsdp_tensor *t);
/* Same storage, cut from the tape. */
fsdp_status fsdp_detach(fsdp_tensor **out, fsdp_tensor *t);

/* ---- in-place, never recorded ---- */
fsdp_status fsdp_fill(fsdp_tensor *t, double value);
/* dst <- src, broadcasting src to dst's shape and converting dtypes. */
fsdp_status fsdp_copy(fsdp_tensor *dst, fsdp_tensor *src);
/* Element i of t (row-major over t's shape) gets a value that depends only on
 * (seed, stream, offset + i): a shard initializes its slice of a parameter
 * exactly as the unsharded parameter would be. */
fsdp_status fsdp_init_normal(fsdp_tensor *t, double mean, double std, uint64_t seed, uint64_t stream, int64_t offset);
fsdp_status fsdp_init_uniform(fsdp_tensor *t, double low, double high, uint64_t seed, uint64_t stream, int64_t offset);

/* ---- ops (new output; recorded on the tape when gradients are enabled) ---- */
fsdp_status fsdp_binary(fsdp_tensor **out, int op, fsdp_tensor *a, fsdp_tensor *b); /* broadcasting */
fsdp_status fsdp_add(fsdp_tensor **out, fsdp_tensor *a, fsdp_tensor *b);
fsdp_status fsdp_sub(fsdp_tensor **out, fsdp_tensor *a, fsdp_tensor *b);
fsdp_status fsdp_mul(fsdp_tensor **out, fsdp_tensor *a, fsdp_tensor *b);
fsdp_status fsdp_div(fsdp_tensor **out, fsdp_tensor *a, fsdp_tensor *b);
fsdp_status fsdp_scale(fsdp_tensor **out, fsdp_tensor *a, double s);          /* a * s */
fsdp_status fsdp_add_scalar(fsdp_tensor **out, fsdp_tensor *a, double s);     /* a + s */
/* ndims = 0 reduces over every dim. Negative dims count from the end. */
fsdp_status fsdp_sum(fsdp_tensor **out, fsdp_tensor *t, int ndims, const int *dims, int keepdim);
fsdp_status fsdp_mean(fsdp_tensor **out, fsdp_tensor *t, int ndims, const int *dims, int keepdim);
/* a: (..., M, K) (or (..., K, M) when trans_a), b: (..., K, N) (or (..., N, K)
 * when trans_b), or b 2-D and shared by every batch; out: (..., M, N). */
fsdp_status fsdp_matmul(fsdp_tensor **out, fsdp_tensor *a, fsdp_tensor *b, int trans_a, int trans_b);
fsdp_status fsdp_gelu(fsdp_tensor **out, fsdp_tensor *x);                     /* tanh form */
fsdp_status fsdp_silu(fsdp_tensor **out, fsdp_tensor *x);
fsdp_status fsdp_softmax(fsdp_tensor **out, fsdp_tensor *x);                  /* over the last dim */
fsdp_status fsdp_log_softmax(fsdp_tensor **out, fsdp_tensor *x);              /* over the last dim */
/* weight and bias (C) may be NULL. */
fsdp_status fsdp_layernorm(fsdp_tensor **out, fsdp_tensor *x, fsdp_tensor *weight, fsdp_tensor *bias, double eps);
fsdp_status fsdp_rmsnorm(fsdp_tensor **out, fsdp_tensor *x, fsdp_tensor *weight, double eps);
/* table (V, C), ids integer (...): out (..., C). */
fsdp_status fsdp_embedding(fsdp_tensor **out, fsdp_tensor *table, fsdp_tensor *ids);
/* logits (N, V), targets integer (N): mean loss over targets != ignore_index.
 * Only the first valid_vocab columns take part (0 = all V): padded vocabulary. */
fsdp_status fsdp_cross_entropy(fsdp_tensor **out, fsdp_tensor *logits, fsdp_tensor *targets,
                               int64_t ignore_index, int64_t valid_vocab);
/* q, k, v (B, H, T, D): out (B, H, T, D). scale <= 0 means 1/sqrt(D). */
fsdp_status fsdp_attention(fsdp_tensor **out, fsdp_tensor *q, fsdp_tensor *k, fsdp_tensor *v, int causal, double scale);
/* Inverted dropout; the mask depends only on (seed, offset + i). */
fsdp_status fsdp_dropout(fsdp_tensor **out, fsdp_tensor *x, double p, uint64_t seed, int64_t offset);
fsdp_status fsdp_cast(fsdp_tensor **out, fsdp_tensor *t, int dtype);

/* ---- in place on whole tensors (never recorded) ---- */
fsdp_status fsdp_scale_(fsdp_tensor *t, double s);                         /* t *= s */
fsdp_status fsdp_axpy_(fsdp_tensor *y, fsdp_tensor *x, double alpha);       /* y += alpha * x, same shape */
/* Sum of squares, accumulated in double (gradient norms). */
fsdp_status fsdp_sumsq(fsdp_tensor *t, double *out);

/* ---- optimizers: one fused pass over flat f32 buffers (a shard or a whole
 * parameter; shapes may differ, element counts must match) ---- */
/* AdamW as PyTorch defines it: decoupled decay p -= lr*wd*p, bias-corrected
 * moments; step counts from 1. */
fsdp_status fsdp_adamw_step(fsdp_tensor *param, fsdp_tensor *grad, fsdp_tensor *exp_avg, fsdp_tensor *exp_avg_sq,
                            double lr, double beta1, double beta2, double eps, double weight_decay, int64_t step);
/* SGD as PyTorch defines it; momentum_buf may be NULL when momentum is 0.
 * first_step initializes the buffer with the gradient. */
fsdp_status fsdp_sgd_step(fsdp_tensor *param, fsdp_tensor *grad, fsdp_tensor *momentum_buf, double lr,
                          double momentum, double dampening, double weight_decay, int nesterov, int first_step);

/* ---- autograd tape ---- */
fsdp_status fsdp_tensor_set_requires_grad(fsdp_tensor *t, int on);
fsdp_status fsdp_tensor_requires_grad(fsdp_tensor *t, int *out);
/* *out = NULL when no gradient has been accumulated yet. */
fsdp_status fsdp_tensor_grad(fsdp_tensor *t, fsdp_tensor **out);
fsdp_status fsdp_tensor_set_grad(fsdp_tensor *t, fsdp_tensor *grad);          /* grad may be NULL */
fsdp_status fsdp_set_grad_enabled(int on, int *previous);
fsdp_status fsdp_grad_enabled(int *out);
/* Entries on the current tape. */
fsdp_status fsdp_tape_size(int64_t *out);
fsdp_status fsdp_tape_clear(void);
/* A fresh tape above the current one (a nested forward, e.g. recomputation). */
fsdp_status fsdp_tape_push(void);
fsdp_status fsdp_tape_pop(void);
/* Backward from root (grad NULL means ones; root then must have one element).
 * Call fsdp_backward_step until *custom_id is -1: each other value is the id
 * of a Lua-defined op whose backward the caller runs before stepping again. */
fsdp_status fsdp_backward_begin(fsdp_tensor *root, fsdp_tensor *grad);
fsdp_status fsdp_backward_step(int *custom_id);
/* Abandons a backward in progress and clears the tape. */
fsdp_status fsdp_backward_abort(void);
/* Records an op computed elsewhere (by Lua) whose backward is Lua code. */
fsdp_status fsdp_custom_record(int custom_id, int n_in, fsdp_tensor **inputs, int n_out, fsdp_tensor **outputs);
/* While paused on a custom op: gradient of its output i (*out NULL = zero),
 * and accumulation of the gradient of its input i. */
fsdp_status fsdp_custom_grad_output(int i, fsdp_tensor **out);
fsdp_status fsdp_custom_add_grad_input(int i, fsdp_tensor *grad);
/* FFI-END */

#ifdef __cplusplus
}
#endif
#endif /* FSDP_H */
