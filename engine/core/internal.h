/* internal.h: what the engine's parts share and the public header hides. */
#ifndef FSDP_INTERNAL_H
#define FSDP_INTERNAL_H

#include "fsdp.h"
#include "device.h"
#include <stdatomic.h>
#include <stdbool.h>

#define FSDP_MAX_DIMS 8

/* ---- errors (error.c) ---- */
/* Sets this thread's message (printf-style, rank appended) and returns st. */
fsdp_status fsdp_set_error(fsdp_status st, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
/* One check for every foreign library: on failure, records file:line, the
 * failing call and the library's own message, and returns FSDP_ERR_COMM. */
#define FSDP_CHECK_CALL(call, ok_expr, what_fn)                                            \
    do {                                                                                   \
        long rc_ = (long)(call);                                                           \
        if (!(ok_expr))                                                                    \
            return fsdp_set_error(FSDP_ERR_COMM, "%s:%d: %s failed: %s", __FILE__, __LINE__, \
                                  #call, what_fn(rc_));                                    \
    } while (0)
/* Propagates a failing engine call. */
#define FSDP_TRY(call)                         \
    do {                                       \
        fsdp_status st_ = (call);              \
        if (st_ != FSDP_OK) return st_;        \
    } while (0)

const char *fsdp_dtype_name(int dtype);
const char *fsdp_device_name(int device);
const char *fsdp_tag_name(int tag);
size_t fsdp_dtype_size(int dtype);
bool fsdp_dtype_is_float(int dtype);
int fsdp_current_rank(void);   /* for messages; 0 before runtime init */
void fsdp_set_current_rank(int rank);   /* the runtime, at init */

/* ---- allocator (alloc.c) ---- */
/* Caching allocator per device with statistics per tag and an optional cap. */
fsdp_status fsdp_alloc(int device, int tag, size_t nbytes, void **out);
void fsdp_free(int device, int tag, void *ptr, size_t nbytes);
/* Host memory that device accel copies asynchronously (its table's
 * host_alloc: pinned), cached and counted like any host block of tag in
 * the CPU's statistics and cap. FSDP_ERR_UNSUPPORTED when accel has none. */
fsdp_status fsdp_alloc_pinned(int accel, int tag, size_t nbytes, void **out);
void fsdp_free_pinned(int accel, int tag, void *ptr, size_t nbytes);
int fsdp_default_tag(void);

/* ---- storage and tensors (tensor.c) ---- */
struct fsdp_row_slicer;
typedef struct fsdp_storage {
    atomic_int refcount;
    void *data;
    size_t nbytes;
    int device;
    int tag;
    const struct fsdp_row_slicer *slicer;   /* a sliced unit's full buffer (sched.c), or NULL */
    /* Integer contents that host code gave whole (fsdp_tensor_from_data, a
     * copy from the host): their least and greatest value, so that index
     * checks on a device need not read the values back (a host sync). Any
     * later write into the storage clears it (storage_written). */
    bool host_range;
    int64_t range_lo, range_hi;
    /* Bumped by every write into the storage (storage_written): what a
     * value derived from the contents records to know it is still current. */
    uint64_t version;
    /* An FSDP master shard's compute copy (sched.c): the same elements in
     * copy_dtype, owned by this storage (it outlives the schedule with the
     * optimizer's views of the master). It holds the master's values while
     * copy_version == version: a gather casts it when it does not, and
     * AdamW writes it with the master, so that it stays current; any other
     * write leaves it stale. copy_readers counts what reads it now (an
     * all-gather in flight, a full buffer that is the copy): nothing writes
     * it then, AdamW leaves it stale instead. NULL when there is none. */
    struct fsdp_storage *copy;
    int copy_dtype;
    uint64_t copy_version;
    int copy_readers;
} fsdp_storage;

/* A sharded unit read and reduced by slices (the chunked classifier and
 * embedding, engine/ops/classifier.c): its full buffer's storage carries
 * this while the schedule lives; the buffer itself is never gathered whole
 * for those ops. A slice is elements [lo, lo + n) of every rank's shard. */
typedef struct fsdp_row_slicer {
    /* *out (blocks * n, compute dtype, tag param): the slice of every shard, in rank order */
    fsdp_status (*gather)(const struct fsdp_row_slicer *sl, int64_t lo, int64_t n, fsdp_tensor **out);
    /* adds the rank average of g (blocks * n, f32, the same layout) into this
     * rank's gradient shard [lo, lo + n) */
    fsdp_status (*reduce)(const struct fsdp_row_slicer *sl, int64_t lo, int64_t n, fsdp_tensor *g);
    void *sched;
    int unit;
    int64_t blocks;    /* ranks in the shard group */
    int64_t shard_n;   /* elements per rank */
} fsdp_row_slicer;

struct fsdp_tensor {
    atomic_int refcount;
    fsdp_storage *storage;
    int64_t offset;                    /* in elements */
    int ndim;
    int64_t shape[FSDP_MAX_DIMS];
    int64_t strides[FSDP_MAX_DIMS];    /* in elements */
    int dtype;
    /* autograd */
    bool requires_grad;                /* a leaf the user marked, or an op output */
    bool is_leaf;                      /* made by the user, not by a recorded op */
    struct fsdp_tensor *grad;          /* .grad of a leaf */
    struct fsdp_tensor *bgrad;         /* gradient being accumulated during backward */
    bool unwritten;                    /* a .grad whose values are not written yet (an FSDP unit's flat gradient,
                                          not zeroed): the first gradient is written into it, not added */
    bool graph_freed;                  /* the node that made it was freed (its backward ran) */
};

fsdp_status tensor_new(fsdp_tensor **out, int dtype, int ndim, const int64_t *shape, int device, int tag, bool zero);
/* The host range of s: the n values of dtype at host (integer dtypes only;
 * other dtypes leave it unknown). */
void storage_set_host_range(fsdp_storage *s, int dtype, const void *host, int64_t n);
/* s was (or is about to be) written: its host range is no longer known,
 * and whatever was derived from it at an older version is stale (a
 * master's compute copy). */
static inline void storage_written(fsdp_storage *s) {
    s->host_range = false;
    s->version++;
}
/* Whether s has a compute copy that holds its current values. */
static inline bool storage_copy_current(const fsdp_storage *s) { return s->copy && s->copy_version == s->version; }
/* Bounds of every value t can hold, when known without reading them (a
 * view's values lie in its storage's range); false otherwise. */
static inline bool tensor_host_range(const struct fsdp_tensor *t, int64_t *lo, int64_t *hi);
/* A new tensor object over t's storage with the given geometry. */
fsdp_tensor *tensor_view(fsdp_tensor *t, int ndim, const int64_t *shape, const int64_t *strides, int64_t offset);
void tensor_retain(fsdp_tensor *t);
void tensor_release(fsdp_tensor *t);
int64_t tensor_numel(const fsdp_tensor *t);
bool tensor_is_contiguous(const fsdp_tensor *t);
static inline bool tensor_host_range(const fsdp_tensor *t, int64_t *lo, int64_t *hi) {
    if (!t->storage->host_range) return false;
    *lo = t->storage->range_lo;
    *hi = t->storage->range_hi;
    return true;
}
static inline void *tensor_data(const fsdp_tensor *t) {
    return (char *)t->storage->data + t->offset * (int64_t)fsdp_dtype_size(t->dtype);
}
static inline int tensor_device(const fsdp_tensor *t) { return t->storage->device; }
/* Whether ops take the host's path on device: the CPU, or the counting
 * device standing for it (it mimics the CPU's kernel set and so must see
 * the CPU's requests; its entries then read host values without touching
 * device memory). */
bool device_is_host_like(int device);
/* The kernel table of t's device (callers have checked that it exists). */
#define KERNELS(t) device_kernels(tensor_device(t))
void contiguous_strides(int ndim, const int64_t *shape, int64_t *strides);
/* Whether the dims of shape (none negative; zero-sized ones counted as 1)
 * multiply to at most 2^60: then numel, strides and byte sizes of any
 * dtype fit in int64, even for a tensor of zero elements. */
bool shape_fits(int ndim, const int64_t *shape);
/* "f32[3,4] cpu" */
const char *tensor_desc(const fsdp_tensor *t, char *buf, size_t size);
/* "[3,4]" */
const char *shape_str(int ndim, const int64_t *shape, char *buf, size_t size);
/* Contiguous copy of t (or t itself, retained, when already contiguous). */
fsdp_status tensor_contiguous(fsdp_tensor **out, fsdp_tensor *t);
/* Contiguous f32 copy of a float tensor (t itself, retained, when it is one). */
fsdp_status tensor_as_f32(fsdp_tensor **out, fsdp_tensor *t);
/* Contiguous i64 copy of an integer tensor. */
fsdp_status tensor_as_i64(fsdp_tensor **out, fsdp_tensor *t);
/* New contiguous tensor of dtype holding src converted (src f32 contiguous). */
fsdp_status tensor_from_f32(fsdp_tensor **out, fsdp_tensor *src_f32, int dtype);

/* ---- tape (tape.c) ---- */
#define FSDP_NODE_MAX_IN 6   /* fsdp_mlp: x, two weights, two biases, the residual */
#define FSDP_NODE_MAX_OUT 4
#define FSDP_NODE_MAX_SAVED 4

typedef struct fsdp_node fsdp_node;
/* Computes the gradients of the node's inputs from those of its outputs. */
typedef fsdp_status (*fsdp_backward_fn)(fsdp_node *node);

struct fsdp_node {
    const char *op;
    fsdp_backward_fn backward;         /* NULL for a Lua-defined op */
    int custom_id;
    int n_in, n_out;
    fsdp_tensor *in[FSDP_NODE_MAX_IN];     /* retained */
    fsdp_tensor *out[FSDP_NODE_MAX_OUT];   /* retained */
    fsdp_tensor *saved[FSDP_NODE_MAX_SAVED]; /* retained; extra state (mean, lse ...) */
    double f[8];                       /* op parameters */
    int64_t i[FSDP_MAX_DIMS * 2];
    /* a marker (FSDP schedule action): run whenever the walk reaches it */
    fsdp_status (*marker)(void *ctx);
    void *marker_ctx;
    void (*marker_release)(void *ctx);
};

/* Records a marker: backward calls fn(ctx) when its walk reaches this point,
 * whether or not gradients flow there (the FSDP actions around a unit's
 * backward). release(ctx), if given, runs when the node is dropped. */
fsdp_status tape_record_marker(const char *op, fsdp_status (*fn)(void *ctx), void *ctx, void (*release)(void *ctx));
/* fn(ctx) runs once after the current tape's next backward walk completes
 * (not when it is aborted or cleared; then release(ctx) runs instead). */
fsdp_status tape_on_finish(fsdp_status (*fn)(void *ctx), void *ctx, void (*release)(void *ctx));

/* True when gradients are enabled and some input requires them. */
bool tape_wants(int n_in, fsdp_tensor *const *in);
/* Gradients whose every element the host knows during a backward walk:
 * the implicit one of backward() on a scalar, and what a scale by a host
 * constant makes of such a gradient. An op that can fold its output's
 * gradient into a GEMM's alpha (the fused classifier) asks instead of making
 * a pass over a large tensor. tape_note_value records g (retained until the
 * walk ends; ignored outside one); tape_known_value looks g up (not known
 * once its storage was written since: storage_written). */
void tape_note_value(fsdp_tensor *g, double v);
bool tape_known_value(const fsdp_tensor *g, double *v);
/* Appends a node (inputs and outputs retained, outputs marked as requiring
 * grad). Returns NULL only when out of memory (error set). */
fsdp_node *tape_record(const char *op, fsdp_backward_fn fn, int n_in, fsdp_tensor *const *in,
                       int n_out, fsdp_tensor *const *out);
/* The device the current op runs on (this thread): op_check sets it from
 * the op's tensors, the tape from a node's before its backward. */
int fsdp_op_device(void);
void fsdp_set_op_device(int device);
/* Gradient of output i, or NULL when nothing flowed into it (zero). */
fsdp_tensor *node_grad_out(fsdp_node *node, int i);
/* Whether input i needs a gradient. */
bool node_needs_grad(fsdp_node *node, int i);
/* Adds g (shape of input i, any float dtype) into input i's gradient; takes
 * ownership of g. */
fsdp_status node_add_grad(fsdp_node *node, int i, fsdp_tensor *g);
/* Where input i's gradient may be added in place by the op itself (a GEMM
 * with beta = 1 instead of a product and an add): the .grad a leaf input
 * already has, when it has the input's shape and dtype, is contiguous and
 * is not an expanded view; NULL otherwise. An op that writes into it gives
 * no gradient for i (node_add_grad would add it twice). */
fsdp_tensor *node_grad_accumulator(fsdp_node *node, int i, int dtype);
/* node_grad_accumulator for an op that writes every element of it (a
 * GEMM): *beta is 0 when the .grad is unwritten (its first gradient; the
 * flag is cleared: the caller must write it now), else 1. */
fsdp_tensor *node_grad_target(fsdp_node *node, int i, int dtype, float *beta);
/* The tensor node_grad_accumulator and node_grad_target would return, with
 * no side effect (nothing zeroed or claimed): to check an op's other
 * conditions before it claims the .grad. */
fsdp_tensor *node_grad_peek(fsdp_node *node, int i, int dtype);
/* The gradient a non-leaf input i already holds (a residual stream's, given
 * by the op that used it later), when the op may add into it in place: of
 * the input's shape, dtype and device, contiguous, written, and held by
 * nothing else (tensor and storage); NULL otherwise. An op that adds into
 * it gives no gradient for i. */
fsdp_tensor *node_grad_held(fsdp_node *node, int i, int dtype);
/* Adds g into t's gradient accumulator (bgrad, or .grad for a leaf); takes g. */
fsdp_status tensor_accumulate_grad(fsdp_tensor *t, fsdp_tensor *g);

#endif
