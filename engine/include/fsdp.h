/* fsdp.h: the public C API of the fsdp-lua engine, and its FFI surface.
 *
 * Rules (DESIGN.md, decisions 1 and 2): C99, opaque handles, every call
 * returns an fsdp_status, results come back through out-parameters, no
 * structs by value, no varargs, no callbacks. On failure the call returns a
 * non-zero status and fsdp_last_error() names the op, shapes, dtypes,
 * device and rank. Nothing here terminates the process on bad input.
 *
 * The Lua binding (lua/fsdp/cdef.lua) is generated from the region between
 * the FFI markers by tools/dev/gen_binding.lua; a test fails when they drift.
 *
 * Ownership: every fsdp_tensor** out-parameter receives a new reference,
 * which the caller gives back with fsdp_tensor_release().
 *
 * A worked example: y = sum(x W) on every rank, its gradient, and the
 * gradient averaged across ranks (one process without mpirun is a world
 * of one; the same code runs under `mpirun -np N`).
 *
 *     #define TRY(call) do { if ((call) != FSDP_OK) {                         \
 *             fprintf(stderr, "%s\n", fsdp_last_error()); return 1; } } while (0)
 *     int rank, world;
 *     TRY(fsdp_runtime_init(&rank, &world));
 *     int64_t xs[2] = {4, 3}, ws[2] = {3, 5};                    // x (4, 3), W (3, 5)
 *     fsdp_tensor *x, *w, *xw, *y, *dw;
 *     TRY(fsdp_tensor_zeros(&x, FSDP_F32, 2, xs, FSDP_DEVICE_CPU, FSDP_TAG_ACTIVATION));
 *     TRY(fsdp_tensor_zeros(&w, FSDP_F32, 2, ws, FSDP_DEVICE_CPU, FSDP_TAG_PARAM));
 *     TRY(fsdp_init_normal(w, 0.0, 0.02, 1234, 0, 0));          // seed, stream, offset
 *     TRY(fsdp_fill(x, 1.0 + rank));
 *     TRY(fsdp_tensor_set_requires_grad(w, 1));                 // ops on w are taped
 *     TRY(fsdp_matmul(&xw, x, w, 0, 0));                        // (4, 5)
 *     TRY(fsdp_sum(&y, xw, 0, NULL, 0));                        // () : every dim
 *     int custom = 0;                                           // backward walks the tape
 *     TRY(fsdp_backward_begin(y, NULL));
 *     while (custom != -1) TRY(fsdp_backward_step(&custom));    // -1: done (no Lua ops here)
 *     TRY(fsdp_tensor_grad(w, &dw));                            // dW = x^T 1, (3, 5)
 *     fsdp_comm *comm; fsdp_work *work;
 *     TRY(fsdp_comm_world(&comm));
 *     TRY(fsdp_all_reduce(&work, comm, dw, FSDP_REDUCE_AVG, "dW"));   // asynchronous
 *     TRY(fsdp_work_wait(work));                                // dW averaged over ranks
 *     TRY(fsdp_work_free(work));
 *     // ... fsdp_tensor_release each tensor, fsdp_comm_free(comm), fsdp_runtime_finalize()
 *
 * A bad call returns its status and leaves the process running: for example
 * fsdp_matmul of (4, 3) by (5, 3) fails with FSDP_ERR_SHAPE, and
 * fsdp_last_error() names the op, both shapes, the dtypes and the device.
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
    FSDP_DEVICE_META = 2,     /* counts what kernels would cost, computes nothing (see below) */
    FSDP_DEVICE_COUNT = 3
} fsdp_device;

/* What an allocation is for; the allocator keeps statistics per tag. */
typedef enum fsdp_tag {
    FSDP_TAG_ALL = -1,        /* statistics only: the totals over every tag */
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

/* The activation of fsdp_linear. */
typedef enum fsdp_linear_act {
    FSDP_LINEAR_NONE = 0,
    FSDP_LINEAR_GELU = 1
} fsdp_linear_act;

typedef enum fsdp_reduce_op {
    FSDP_REDUCE_SUM = 0,
    FSDP_REDUCE_AVG = 1,
    FSDP_REDUCE_MAX = 2
} fsdp_reduce_op;

/* Kinds of collectives, for the traffic counts of fsdp_comm_counts. */
typedef enum fsdp_collective {
    FSDP_COLL_ALL_GATHER = 0,
    FSDP_COLL_REDUCE_SCATTER = 1,
    FSDP_COLL_ALL_REDUCE = 2,
    FSDP_COLL_BROADCAST = 3,
    FSDP_COLL_BARRIER = 4,
    FSDP_COLL_ALL_REDUCE_DOUBLES = 5,
    FSDP_COLL_COUNT = 6
} fsdp_collective;

typedef struct fsdp_tensor fsdp_tensor;
typedef struct fsdp_comm fsdp_comm;     /* a group of ranks and its backend */
typedef struct fsdp_work fsdp_work;     /* an asynchronous collective */
typedef struct fsdp_sched fsdp_sched;   /* the sharded units of one model and their schedule */

typedef enum fsdp_prefetch {
    FSDP_PREFETCH_NONE = 0,
    FSDP_PREFETCH_BACKWARD_PRE = 1,    /* gather the next unit before this unit's backward */
    FSDP_PREFETCH_BACKWARD_POST = 2    /* ... after this unit's backward */
} fsdp_prefetch;

/* ---- errors and runtime ---- */
const char *fsdp_last_error(void);           /* message of the last failure on this thread */
fsdp_status fsdp_version(const char **out);
fsdp_status fsdp_set_num_threads(int n);     /* CPU kernel threads, OpenBLAS included */
fsdp_status fsdp_get_num_threads(int *out);
/* The device new tensors and sharded models use by default: CUDA (this
 * rank's GPU, by local rank) when the CUDA backend is built and a GPU is
 * there, else the CPU. */
fsdp_status fsdp_default_device(int *out);
fsdp_status fsdp_set_default_device(fsdp_device device);
/* Whether a device can be used (*available 0 or 1) and, into desc (size
 * bytes, may be NULL), what it is: "cpu (8 threads)", "cuda:0 NVIDIA H200
 * (132 SMs, 139 GiB)", or why it cannot be used ("not built", "no GPU:
 * cudaGetDeviceCount: ..."). */
fsdp_status fsdp_device_info(fsdp_device device, int *available, char *desc, int64_t size);
/* Initializes MPI when the process was started by mpirun, else a world of one. */
fsdp_status fsdp_runtime_init(int *rank, int *world);
fsdp_status fsdp_runtime_rank(int *rank, int *world);
/* This rank's place among the ranks of its node (the processes sharing its
 * memory, MPI_COMM_TYPE_SHARED), whatever launched them: 0 and 1 in a world
 * of one. The GPU a rank takes is its local rank. */
fsdp_status fsdp_runtime_local(int *local_rank, int *local_size);
fsdp_status fsdp_runtime_finalize(void);
/* Ends the whole job (MPI_Abort under mpirun) after printing msg. */
fsdp_status fsdp_runtime_abort(const char *msg, int exit_code);

/* ---- allocator ---- */
/* tag = FSDP_TAG_ALL (-1) gives the totals over all tags. */
fsdp_status fsdp_mem_stats(fsdp_device device, fsdp_tag tag, int64_t *current, int64_t *peak, int64_t *reserved);
fsdp_status fsdp_mem_reset_peak(fsdp_device device);
fsdp_status fsdp_mem_set_cap(fsdp_device device, int64_t cap_bytes);   /* 0 = no cap */
fsdp_status fsdp_mem_get_cap(fsdp_device device, int64_t *cap_bytes);
fsdp_status fsdp_mem_empty_cache(fsdp_device device);
/* Tag given to tensors made by ops on this thread (default ACTIVATION). */
fsdp_status fsdp_mem_set_default_tag(fsdp_tag tag, int *previous);

/* ---- files and checksums (checkpoints, safetensors, token shards) ----
 * POSIX file calls behind handles, so that Lua declares no libc: reads and
 * writes that retry until every byte moved, fsync, renames that are atomic
 * and durable, mkdir -p, removal of a tree, sorted directory listings.
 * Every failure names the call, the path and the system's reason. */
typedef struct fsdp_file fsdp_file;           /* an open file */
typedef struct fsdp_dir_listing fsdp_dir_listing;   /* the names in a directory */
typedef struct fsdp_hasher fsdp_hasher;       /* a running XXH64 */

typedef enum fsdp_file_mode {
    FSDP_FILE_READ = 0,      /* an existing file, for reading */
    FSDP_FILE_CREATE = 1     /* created or truncated (mode 0644), for writing */
} fsdp_file_mode;

typedef enum fsdp_path_kind {
    FSDP_PATH_NONE = 0,      /* nothing there */
    FSDP_PATH_FILE = 1,
    FSDP_PATH_DIR = 2,
    FSDP_PATH_OTHER = 3      /* a device, socket, ... */
} fsdp_path_kind;

fsdp_status fsdp_file_open(fsdp_file **out, const char *path, fsdp_file_mode mode);
/* Frees the handle; a failed close of a written file is an error. NULL is fine. */
fsdp_status fsdp_file_close(fsdp_file *f);
fsdp_status fsdp_file_size(fsdp_file *f, int64_t *bytes);
/* Reads n bytes at offset into dst; *got < n only at the end of the file. */
fsdp_status fsdp_file_pread(fsdp_file *f, void *dst, int64_t n, int64_t offset, int64_t *got);
/* Writes all n bytes at offset. */
fsdp_status fsdp_file_pwrite(fsdp_file *f, const void *src, int64_t n, int64_t offset);
/* Writes all n bytes after the furthest byte this handle has written. */
fsdp_status fsdp_file_append(fsdp_file *f, const void *src, int64_t n);
/* fsync: the bytes written are on disk. */
fsdp_status fsdp_file_sync(fsdp_file *f);
/* path gets exactly these n bytes or stays as it was: written to path.tmp,
 * synced, renamed over path, the directory synced. */
fsdp_status fsdp_file_write_atomic(const char *path, const void *src, int64_t n);
/* What path names (following links) and, for a file, its size (bytes may be NULL). */
fsdp_status fsdp_path_stat(const char *path, fsdp_path_kind *kind, int64_t *bytes);
/* mkdir -p (mode 0755); an existing directory is fine. */
fsdp_status fsdp_path_mkdirs(const char *path);
/* rm -rf: a file or a whole tree; links are removed, never followed; a
 * path that does not exist is fine; "/", "." and ".." are refused. */
fsdp_status fsdp_path_remove_tree(const char *path);
/* rename(2) (atomic within one filesystem, replacing a file or an empty
 * directory at to), then the directory holding to is synced. */
fsdp_status fsdp_path_rename(const char *from, const char *to);
/* fsync of a file or directory by name (a directory: the names in it). */
fsdp_status fsdp_path_sync(const char *path);
/* The names in a directory, sorted bytewise, without "." and "..". */
fsdp_status fsdp_dir_list(fsdp_dir_listing **out, const char *path);
fsdp_status fsdp_dir_listing_count(fsdp_dir_listing *l, int64_t *n);
/* Name i (0-based), valid until the list is freed. */
fsdp_status fsdp_dir_listing_name(fsdp_dir_listing *l, int64_t i, const char **name);
fsdp_status fsdp_dir_listing_free(fsdp_dir_listing *l);
/* XXH64 (the 64-bit xxHash, digests as xxhsum prints them) of n bytes. */
fsdp_status fsdp_hash64(const void *data, int64_t n, uint64_t seed, uint64_t *out);
/* The same over bytes fed in pieces: new (or reset), update..., digest
 * (the hash of everything fed so far; feeding may go on). */
fsdp_status fsdp_hasher_new(fsdp_hasher **out, uint64_t seed);
fsdp_status fsdp_hasher_reset(fsdp_hasher *h, uint64_t seed);
fsdp_status fsdp_hasher_update(fsdp_hasher *h, const void *data, int64_t n);
fsdp_status fsdp_hasher_digest(fsdp_hasher *h, uint64_t *out);
fsdp_status fsdp_hasher_free(fsdp_hasher *h);

/* ---- the counting ("meta") device (DESIGN.md, decisions 11 and 13) ----
 * Tensors on FSDP_DEVICE_META hold no data: its allocator is the engine's
 * caching allocator with per-tag statistics as on any device, over address
 * space nobody can read, and its kernels compute nothing. Each kernel table
 * entry counts calls, bytes read and written, FLOPs, kernel launches and
 * host syncs, as the kernel would cost on a GPU. Values read back (item,
 * copies to the host, sums) are zeros. The planner runs real steps on it. */
/* Offer the kernel set of device (cpu, the default, or cuda: entries that
 * device lacks are missing here too, so the op layer takes the same path,
 * e.g. bf16 matmul natively on CUDA, through f32 on the CPU). cuda fails
 * when the CUDA table is not built in (no nvcc at build time). */
fsdp_status fsdp_meta_mimic(fsdp_device device);
fsdp_status fsdp_meta_mimicked(int *device);
fsdp_status fsdp_meta_reset(void);                /* zeroes every counter */
/* Entries are numbered 0 .. *n - 1 (raw_alloc, raw_free, then the table's). */
fsdp_status fsdp_meta_entry_count(int *n);
/* Entry i's name ("matmul_bf16"), family ("gemm_bf16"), whether the table
 * offers it now (present 0/1) and counters[7]: calls, bytes read, bytes
 * written, FLOPs, launches, host syncs since the last reset, and the part
 * of the bytes read that the entry's L2 rule serves from L2 (0 where it
 * states none; the flash attention's, in engine/meta/meta_device.c). Any
 * out may be NULL. */
fsdp_status fsdp_meta_entry(int i, const char **name, const char **family, int *present, int64_t *counters);

/* ---- the planner's timeline ----
 * While recording, this process's counting-device kernel calls and its
 * collectives' issues and waits are kept in the order they happen, for
 * fsdp.plan's time model. Each event is FSDP_TIMELINE_FIELDS int64 values:
 *   kernel: kind, entry (fsdp_meta_entry's numbering), bytes read, bytes
 *           written, FLOPs, launches, host syncs, 0
 *   issue:  kind, collective (fsdp_collective), communicator id (48 bits),
 *           sequence number, bytes as counted, shape (its size << 32 | the
 *           world rank of its first member << 16 | the stride between its
 *           members, 0xffff when uneven), dtype, its label's hash (48 bits)
 *   wait:   kind, 0, communicator id, sequence number, 0, 0, 0, 0 */
enum { FSDP_TIMELINE_FIELDS = 8 };
typedef enum fsdp_timeline_kind {
    FSDP_TIMELINE_KERNEL = 1,
    FSDP_TIMELINE_ISSUE = 2,
    FSDP_TIMELINE_WAIT = 3
} fsdp_timeline_kind;
fsdp_status fsdp_timeline_record(int on);    /* on: clears the record and starts; 0: stops */
fsdp_status fsdp_timeline_length(int64_t *n);
/* Events first .. first + count - 1 into out (count * FSDP_TIMELINE_FIELDS). */
fsdp_status fsdp_timeline_read(int64_t first, int64_t count, int64_t *out);

/* ---- tensors ---- */
fsdp_status fsdp_tensor_empty(fsdp_tensor **out, fsdp_dtype dtype, int ndim, const int64_t *shape, fsdp_device device, fsdp_tag tag);
fsdp_status fsdp_tensor_zeros(fsdp_tensor **out, fsdp_dtype dtype, int ndim, const int64_t *shape, fsdp_device device, fsdp_tag tag);
/* Copies nbytes of contiguous row-major data in. */
fsdp_status fsdp_tensor_from_data(fsdp_tensor **out, fsdp_dtype dtype, int ndim, const int64_t *shape,
                                  const void *data, int64_t nbytes, fsdp_device device, fsdp_tag tag);
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
/* Address of element 0 of the view (host memory only). The caller may
 * write through it, so whatever was derived from the contents (a master's
 * compute copy) counts as stale from this call on. */
fsdp_status fsdp_tensor_data_ptr(fsdp_tensor *t, void **out);
/* The same address, for reading only: nothing becomes stale (checkpoint
 * saves, exports, tolist). */
fsdp_status fsdp_tensor_read_ptr(fsdp_tensor *t, const void **out);
/* Value of a one-element tensor. */
fsdp_status fsdp_tensor_item(fsdp_tensor *t, double *out);
/* Writes a one-line description, e.g. "f32[3,4] cpu", into buf. */
fsdp_status fsdp_tensor_describe(fsdp_tensor *t, char *buf, int64_t size);
/* A copy of t on device (an fsdp_device): contiguous, same dtype, shape and
 * memory tag, its own storage, not recorded on the tape (no gradient flows
 * through it). Same device: a contiguous copy. Between two devices neither
 * of which is the CPU, through a host buffer. */
fsdp_status fsdp_tensor_to_device(fsdp_tensor **out, fsdp_tensor *t, fsdp_device device);

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
/* dst <- src, broadcasting src to dst's shape and converting dtypes; src
 * on another device is moved to dst's first. */
fsdp_status fsdp_copy(fsdp_tensor *dst, fsdp_tensor *src);
/* Element i of t (row-major over t's shape) gets a value that depends only on
 * (seed, stream, offset + i): a shard initializes its slice of a parameter
 * exactly as the unsharded parameter would be. */
fsdp_status fsdp_init_normal(fsdp_tensor *t, double mean, double std, uint64_t seed, uint64_t stream, int64_t offset);
fsdp_status fsdp_init_uniform(fsdp_tensor *t, double low, double high, uint64_t seed, uint64_t stream, int64_t offset);

/* ---- ops (new output; recorded on the tape when gradients are enabled) ---- */
fsdp_status fsdp_binary(fsdp_tensor **out, fsdp_binary_op op, fsdp_tensor *a, fsdp_tensor *b); /* broadcasting */
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
fsdp_status fsdp_relu(fsdp_tensor **out, fsdp_tensor *x);                     /* max(x, 0); a NaN stays NaN */
fsdp_status fsdp_softmax(fsdp_tensor **out, fsdp_tensor *x);                  /* over the last dim */
fsdp_status fsdp_log_softmax(fsdp_tensor **out, fsdp_tensor *x);              /* over the last dim */
/* weight and bias (C) may be NULL. */
fsdp_status fsdp_layernorm(fsdp_tensor **out, fsdp_tensor *x, fsdp_tensor *weight, fsdp_tensor *bias, double eps);
fsdp_status fsdp_rmsnorm(fsdp_tensor **out, fsdp_tensor *x, fsdp_tensor *weight, double eps);
/* A Linear's bias with what follows it, one pass over x (..., C), the
 * matmul's output without its bias, with bias (C) (after llm.c):
 * bias_gelu: gelu(x + bias) (tanh form); bias_residual: res + (x + bias),
 * res of x's shape. The same values as fsdp_add then fsdp_gelu or fsdp_add,
 * but for x + bias, kept in f32 (not rounded to bf16 first). */
fsdp_status fsdp_bias_gelu(fsdp_tensor **out, fsdp_tensor *x, fsdp_tensor *bias);
fsdp_status fsdp_bias_residual(fsdp_tensor **out, fsdp_tensor *x, fsdp_tensor *bias, fsdp_tensor *res);
/* A Linear layer as one op: y = [res +] act(x W^T + bias), x (..., in),
 * weight (out, in), bias (out) or NULL, res (..., out) or NULL (of y's
 * shape: not broadcast), act FSDP_LINEAR_NONE or FSDP_LINEAR_GELU (tanh
 * form). bf16 with a bias on a device with GEMM epilogues (CUDA's cuBLASLt):
 * one GEMM each way with the bias, GELU or residual and the bias gradient
 * inside it, one tape node. Elsewhere the same values as fsdp_matmul then
 * fsdp_bias_gelu or fsdp_bias_residual (or the unfused ops), which is what
 * it runs there. */
fsdp_status fsdp_linear(fsdp_tensor **out, fsdp_tensor *x, fsdp_tensor *weight, fsdp_tensor *bias,
                        fsdp_tensor *res, int act);
/* GPT-2's MLP as one op: y = [res +] gelu(x W_fc^T + b_fc) W_proj^T + b_proj,
 * x (..., in), w_fc (hidden, in), w_proj (out, hidden), the biases or NULL,
 * res (..., out) or NULL. bf16 with both biases on a device with GEMM
 * epilogues: two epilogue GEMMs forward, and the GELU backward with c_fc's
 * bias gradient inside c_proj's dx GEMM; elsewhere two fsdp_linear. */
fsdp_status fsdp_mlp(fsdp_tensor **out, fsdp_tensor *x, fsdp_tensor *w_fc, fsdp_tensor *b_fc, fsdp_tensor *w_proj,
                     fsdp_tensor *b_proj, fsdp_tensor *res);
/* table (V, C), ids integer (...): out (..., C). */
fsdp_status fsdp_embedding(fsdp_tensor **out, fsdp_tensor *table, fsdp_tensor *ids);
/* logits (N, V), targets integer (N): mean loss over targets != ignore_index.
 * Only the first valid_vocab columns take part (0 = all V): padded vocabulary. */
fsdp_status fsdp_cross_entropy(fsdp_tensor **out, fsdp_tensor *logits, fsdp_tensor *targets,
                               int64_t ignore_index, int64_t valid_vocab);
/* The LM head and its loss by vocabulary chunks (llm.c's fused classifier):
 * x (N, C), weight (V, C), targets integer (N): the mean over targets !=
 * ignore_index of cross_entropy(x @ weight^T), computed chunk_rows rows of
 * weight at a time with an online log-sum-exp, so that the (N, V) logits
 * never exist; backward recomputes each chunk's logits. The same value as
 * fsdp_matmul + fsdp_cross_entropy. weight may be a parameter of a sliced
 * unit (fsdp_sched_add_sliced_unit): then each chunk is gathered, and its
 * gradient reduce-scattered, on its own (chunk_rows rows over the group). */
fsdp_status fsdp_chunked_cross_entropy(fsdp_tensor **out, fsdp_tensor *x, fsdp_tensor *weight, fsdp_tensor *targets,
                                       int64_t chunk_rows, int64_t ignore_index, int64_t valid_vocab);
/* The same loss over the whole vocabulary at once (llm.c's fused
 * classifier): the (N, V) logits = x @ weight^T stay inside the op and are
 * never handed out. With gradients recorded, one pass over each row writes
 * its loss and then dlogits (for a loss gradient of one) over the logits;
 * the backward reads only those, folding the loss's gradient into the
 * GEMMs' alpha when the host knows it (loss:backward(), a loss scaled by a
 * constant) and scaling dlogits on the device otherwise. Without gradients
 * it writes no dlogits. The loss stays on the device (no host sync) when the
 * targets' host range leaves out ignore_index; otherwise the targets are read
 * once, as fsdp_cross_entropy reads them. The value of fsdp_matmul +
 * fsdp_cross_entropy, and the same gradients (bit for bit for a loss
 * gradient of one). */
fsdp_status fsdp_classifier_cross_entropy(fsdp_tensor **out, fsdp_tensor *x, fsdp_tensor *weight,
                                          fsdp_tensor *targets, int64_t ignore_index, int64_t valid_vocab);
/* fsdp_embedding by chunks of chunk_rows rows of table (a sliced unit's
 * parameter too); backward reduces each chunk's gradient on its own. */
fsdp_status fsdp_chunked_embedding(fsdp_tensor **out, fsdp_tensor *table, fsdp_tensor *ids, int64_t chunk_rows);
/* logits (N, V) = x (N, C) @ weight (V, C)^T by chunks (a sliced unit's
 * parameter too), without gradients (evaluation, sampling). */
fsdp_status fsdp_chunked_logits(fsdp_tensor **out, fsdp_tensor *x, fsdp_tensor *weight, int64_t chunk_rows);
/* q, k, v (B, H, T, D): out (B, H, T, D). scale <= 0 means 1/sqrt(D). */
fsdp_status fsdp_attention(fsdp_tensor **out, fsdp_tensor *q, fsdp_tensor *k, fsdp_tensor *v, int causal, double scale);
/* Attention from the packed output of a fused q, k, v projection: qkv
 * (B, T, 3C) holds per token the n_head heads of q, then of k, then of v
 * (C = n_head D); out (B, T, C) holds head h at columns [h D, (h+1) D), the
 * layout an output projection reads. The same values as fsdp_attention on
 * the split heads, without the split and permute copies; on CUDA in bf16 it
 * runs on the tensor cores: fused flash kernels that keep no (T, T) matrix
 * where the head dim is a multiple of 16 up to 128, batched GEMMs otherwise
 * (or everywhere with FSDP_CUDA_ATTENTION=gemm in the environment).
 * scale <= 0 means 1/sqrt(D). */
fsdp_status fsdp_attention_qkv(fsdp_tensor **out, fsdp_tensor *qkv, int64_t n_head, int causal, double scale);
/* Inverted dropout; the mask depends only on (seed, offset + i). */
fsdp_status fsdp_dropout(fsdp_tensor **out, fsdp_tensor *x, double p, uint64_t seed, int64_t offset);
fsdp_status fsdp_cast(fsdp_tensor **out, fsdp_tensor *t, fsdp_dtype dtype);

/* ---- in place on whole tensors (never recorded) ---- */
fsdp_status fsdp_scale_(fsdp_tensor *t, double s);                         /* t *= s */
fsdp_status fsdp_axpy_(fsdp_tensor *y, fsdp_tensor *x, double alpha);       /* y += alpha * x, same shape */
/* Sum of squares, accumulated in double (gradient norms). */
fsdp_status fsdp_sumsq(fsdp_tensor *t, double *out);
/* The sum of fsdp_sumsq over n tensors (one device, float), in one pass on
 * devices that have it: one wait for the value instead of one per tensor.
 * NULL entries are skipped (parameters without a gradient). */
fsdp_status fsdp_sumsq_many(fsdp_tensor *const *ts, int n, double *out);

/* ---- optimizers: one fused pass over flat f32 buffers (a shard or a whole
 * parameter; shapes may differ, element counts must match) ---- */
/* AdamW as PyTorch defines it: decoupled decay p -= lr*wd*p, bias-corrected
 * moments; step counts from 1. */
fsdp_status fsdp_adamw_step(fsdp_tensor *param, fsdp_tensor *grad, fsdp_tensor *exp_avg, fsdp_tensor *exp_avg_sq,
                            double lr, double beta1, double beta2, double eps, double weight_decay, int64_t step);
/* fsdp_adamw_step over n parameters at once (one device): parameter i with
 * grads[i], exp_avgs[i], exp_avg_sqs[i], learning rate lrs[i], weight decay
 * weight_decays[i] and step steps[i]; the betas and eps are shared. All are
 * checked before any is updated; devices that have it update them all in a
 * few launches (CUDA: one per 64 tensors), the others one tensor at a time.
 * Every gradient is read as grad * grad_scale (finite, >= 0; 1: as it is),
 * the gradients themselves left as they are: a clip by global norm without
 * a pass of its own. Results equal fsdp_scale_(grads[i], grad_scale) and
 * then fsdp_adamw_step, for each i, bit for bit where grads[i] is f32 (the
 * scaled value of another dtype's gradient is not rounded to that dtype). */
fsdp_status fsdp_adamw_step_many(fsdp_tensor *const *params, fsdp_tensor *const *grads, fsdp_tensor *const *exp_avgs,
                                 fsdp_tensor *const *exp_avg_sqs, const double *lrs, const double *weight_decays,
                                 const int64_t *steps, int n, double beta1, double beta2, double eps,
                                 double grad_scale);
/* SGD as PyTorch defines it; momentum_buf may be NULL when momentum is 0.
 * first_step initializes the buffer with the gradient. */
fsdp_status fsdp_sgd_step(fsdp_tensor *param, fsdp_tensor *grad, fsdp_tensor *momentum_buf, double lr,
                          double momentum, double dampening, double weight_decay, int nesterov, int first_step);

/* ---- communicators (DESIGN.md, decision 4) ----
 * MPI carries CPU tensors when the job runs under mpirun; otherwise the
 * world is a single rank. NCCL carries CUDA tensors (when built in; its
 * unique id travels over MPI), on a comm stream ordered after the compute
 * stream; a collective's tensors must all be on one device. Collectives
 * are issued in order onto one comm thread and overlap compute; each
 * returns a work handle to wait on (pass work == NULL to wait before
 * returning). For CUDA tensors, waiting orders the compute stream after the
 * collective rather than blocking the host (FSDP_NCCL_BLOCKING_WAIT=1
 * blocks). A work keeps its tensors alive until it completes; with
 * FSDP_COMM_SYNC=1 every collective completes before it returns (no
 * overlap: buffers are held exactly as a plan counts them, see fsdp.plan),
 * as a counting communicator's always do.
 *
 * Ranks agree before data moves, always: every collective carries a
 * sequence number and a fingerprint (kind, communicator, element count and
 * bytes, dtype, reduce op or root, device), and one small exchange per
 * collective checks that every rank issued the same one. A mismatch fails
 * that collective on every rank, naming both sides, with no data moved
 * (the ranks stay in step). FSDP_DEBUG_COLLECTIVES=1 also compares labels
 * and adds the last collectives to the message. A rank waiting for others
 * does not spin a core. FSDP_WATCHDOG_SECONDS (default 120; 0: off; below
 * 1 refused) bounds that wait: then every waiting rank reports which ranks
 * have not arrived and what each rank is doing or last finished, and ends
 * the job. A rank that leaves early (returns, or calls exit) is named by
 * the others at their next collective with it. */
fsdp_status fsdp_comm_world(fsdp_comm **out);
/* Ranks passing the same color form a communicator, ordered by key.
 * Collective over parent; a negative color fails on that rank (after taking
 * part, so the others do not wait). */
fsdp_status fsdp_comm_split(fsdp_comm **out, fsdp_comm *parent, int color, int key);
/* The same, given every rank's color and key (n: the parent's size; every
 * rank passes the same tables). The only split a counting communicator
 * takes, since one process cannot see the other ranks' colors. */
fsdp_status fsdp_comm_split_all(fsdp_comm **out, fsdp_comm *parent, const int *colors, const int *keys, int n);
/* A counting communicator: world ranks of which this process plays rank,
 * alone. Collectives move nothing and wait for nobody; their results are
 * those of a world whose ranks all hold what this rank holds (all-gather:
 * copies of this rank's block; sum: world times the value; average, max,
 * broadcast: the value), so real steps run on it and say what they would
 * send (fsdp_comm_counts). CPU tensors, or tensors of a device that only
 * counts (left untouched); not CUDA tensors. */
fsdp_status fsdp_comm_new_counting(fsdp_comm **out, int world, int rank);
fsdp_status fsdp_comm_info(fsdp_comm *c, int *rank, int *size);
/* Collectives of one kind (fsdp_collective) run on c and on every
 * communicator split from it, and their bytes per rank: all-gather the
 * gathered output, reduce-scatter the input, all-reduce and broadcast the
 * tensor, all_reduce_doubles 8 per value. */
fsdp_status fsdp_comm_counts(fsdp_comm *c, fsdp_collective kind, int64_t *calls, int64_t *bytes);
fsdp_status fsdp_comm_reset_counts(fsdp_comm *c);
fsdp_status fsdp_comm_free(fsdp_comm *c);
/* dst (size * n elements) <- every rank's src (n elements), in rank order. */
fsdp_status fsdp_all_gather(fsdp_work **work, fsdp_comm *c, fsdp_tensor *dst, fsdp_tensor *src, const char *label);
/* dst (n elements) <- this rank's n-element block of the sum (or average)
 * of every rank's src (size * n elements). f32 and bf16 (over MPI, bf16
 * sums in f32 and rounds once; NCCL sums bf16 natively). */
fsdp_status fsdp_reduce_scatter(fsdp_work **work, fsdp_comm *c, fsdp_tensor *dst, fsdp_tensor *src, fsdp_reduce_op op,
                                const char *label);
fsdp_status fsdp_all_reduce(fsdp_work **work, fsdp_comm *c, fsdp_tensor *t, fsdp_reduce_op op, const char *label);
/* Compressed gradient reduction (ZeRO++ qgZ, top-k with error feedback). */
typedef enum fsdp_compress {
    FSDP_COMPRESS_NONE = 0,
    FSDP_COMPRESS_INT8 = 1,   /* int8 values, one f32 absmax scale per block of `block` elements */
    FSDP_COMPRESS_TOPK = 2    /* the ceil(density * n) entries of largest magnitude: int32 index, f32 value */
} fsdp_compress;
/* fsdp_reduce_scatter whose contributions travel compressed: each rank
 * compresses its src's block for every rank once (int8: blocks restart at
 * each rank's block; topk: per rank's block), sends each to its owner (an
 * all-to-all: nothing is compressed twice), and the owner decompresses the
 * size parts and adds them in f32 in rank order, then divides for an
 * average: dst <- that sum (or average). residual (f32, size * n elements,
 * or NULL: no error feedback): src + residual is what is compressed, and
 * residual <- (src + residual) - what was sent. f32 tensors on the host,
 * dst, src and residual not overlapping; block a power of two >= 1; density
 * in (0, 1]. The fingerprint's bytes are the wire bytes, so ranks that
 * compress differently fail the agreement. */
fsdp_status fsdp_reduce_scatter_compressed(fsdp_work **work, fsdp_comm *c, fsdp_tensor *dst, fsdp_tensor *src,
                                           fsdp_tensor *residual, fsdp_compress mode, int64_t block, double density,
                                           fsdp_reduce_op op, const char *label);
/* The bytes one rank's part of n elements takes on the wire (the scales,
 * then the int8 values padded to 4 bytes; or k index-value pairs). */
fsdp_status fsdp_compress_part_bytes(fsdp_compress mode, int64_t n, int64_t block, double density, int64_t *bytes);
fsdp_status fsdp_broadcast(fsdp_work **work, fsdp_comm *c, fsdp_tensor *t, int root, const char *label);
fsdp_status fsdp_barrier(fsdp_comm *c);
/* n doubles combined across ranks in place (sum, avg or max), synchronously. */
fsdp_status fsdp_all_reduce_doubles(fsdp_comm *c, double *values, int n, fsdp_reduce_op op);
fsdp_status fsdp_work_wait(fsdp_work *w);
fsdp_status fsdp_work_test(fsdp_work *w, int *done);
fsdp_status fsdp_work_free(fsdp_work *w);
/* Process-wide traffic since the last reset: bytes all-gathered (received),
 * bytes reduced (sent into reduce-scatter and all-reduce), and seconds the
 * caller spent blocked in fsdp_work_wait. */
fsdp_status fsdp_comm_stats(int64_t *gathered_bytes, int64_t *reduced_bytes, double *wait_seconds);
/* Seconds communication was busy since the last reset: the time covered
 * by at least one collective's run (the comm thread in a collective, from
 * the ranks' agreement to its end; a CUDA collective from when the comm
 * stream reached it to its end, as the comm thread's 2 ms poll sees them).
 * Busy minus the wait of fsdp_comm_stats is the communication hidden
 * behind compute. */
fsdp_status fsdp_comm_busy(double *busy_seconds);
/* Collectives run on comm lanes, one comm thread each: lane 0 runs all of
 * them but hybrid_shard's replica reductions of CPU tensors, which run on
 * lane 1 (FSDP_COMM_REPLICA_LANE) so that an all-reduce across a slow
 * inter-node link does not hold up the gathers queued behind it. Per lane
 * since the last reset: seconds its collectives ran (busy) and seconds the
 * caller waited for them in fsdp_work_wait (wait). */
enum { FSDP_COMM_LANES = 2, FSDP_COMM_REPLICA_LANE = 1 };
fsdp_status fsdp_comm_lane_stats(int lane, double *busy_seconds, double *wait_seconds);
/* The same traffic as it moves on the wire: equal to fsdp_comm_stats's
 * figures except for compressed collectives (their compressed bytes). */
fsdp_status fsdp_comm_wire_stats(int64_t *wire_gathered_bytes, int64_t *wire_reduced_bytes);
/* fsdp_comm_counts's bytes of one kind as they moved on the wire. */
fsdp_status fsdp_comm_wire_counts(fsdp_comm *c, fsdp_collective kind, int64_t *bytes);
/* With a reason: every fsdp_work_wait of this process, now or later, fails
 * at once with that reason instead of waiting (the REPL, when a peer rank
 * failed a chunk this rank still runs). A collective given up this way may
 * still wait on the comm thread for ranks that never issue it: until every
 * rank's comm thread is idle again (fsdp_comm_pending, fsdp_comm_cancel),
 * the communicators are not usable. With reason NULL: waits wait again;
 * *abandoned (optional) says how many waits were given up since the reason
 * was set. */
fsdp_status fsdp_comm_abandon(const char *reason, int64_t *abandoned);
/* What this rank's comm thread has not finished: *works queued or running
 * (0: idle), the oldest one's communicator id and sequence number (*seq
 * UINT64_MAX when it takes none), and *moving (optional) = 1 while its data
 * moves (every rank has arrived). */
fsdp_status fsdp_comm_pending(int64_t *works, uint64_t *comm_id, uint64_t *seq, int *moving);
/* When this rank is a member of communicator comm_id and has not issued its
 * collective seq yet (it issued seq - 1 and no more), issues in its place
 * one that fails the agreement on every rank, with no data moved, so that
 * ranks waiting in that collective go on and every rank's sequence numbers
 * agree again; *joined (optional) = 1 then. Otherwise nothing (0). The
 * REPL, after a chunk that failed on some ranks only: each rank reports
 * fsdp_comm_pending, and each cancels what the others wait for, until all
 * are idle. */
fsdp_status fsdp_comm_cancel(uint64_t comm_id, uint64_t seq, int *joined);
fsdp_status fsdp_comm_reset_stats(void);

/* ---- the timeline (Chrome / Perfetto trace JSON) ----
 * fsdp_trace_start (on every rank) records ops, backward nodes, collectives
 * and the waits for them; fsdp_trace_stop (on every rank) sends each rank's
 * events to rank 0, which writes them to path as one file: one process per
 * rank, tracks "compute", "comm" and "steps". FSDP_TRACE=FILE in the
 * environment starts it at runtime init and stops it at finalize.
 * fsdp_trace_step marks the end of a step (the "steps" track). Off, each
 * hook costs one test of a flag. */
fsdp_status fsdp_trace_start(const char *path);
fsdp_status fsdp_trace_step(int64_t step);
fsdp_status fsdp_trace_stop(void);

/* ---- sharded units and their schedule (DESIGN.md, "What sharding means here") ----
 * A unit's parameters are flattened into one buffer padded to a multiple of
 * the shard group size N; this rank keeps its 1/N slice: the f32 master,
 * its gradient (both persistent) and, in Lua, the optimizer state. Before a
 * unit runs, its shards are all-gathered (in the compute dtype) into the
 * full buffer, whose parameters are views; afterwards it is freed. The
 * actions around each unit's backward are tape markers, so the schedule
 * runs in C: gather (and prefetch) before, reduce-scatter (averaged, in the
 * reduce dtype) into the gradient shard after. With a replica communicator
 * (hybrid sharding) the reduced shard is then averaged across replicas. */
fsdp_status fsdp_sched_new(fsdp_sched **out, fsdp_comm *shard_comm, fsdp_comm *replica_comm, fsdp_dtype compute_dtype,
                           fsdp_dtype reduce_dtype, fsdp_prefetch backward_prefetch, int forward_prefetch, int limit);
fsdp_status fsdp_sched_free(fsdp_sched *s);
/* Where master and gradient shards live (and so the optimizer state): the
 * compute device (the default) or FSDP_DEVICE_CPU, offloading them to host
 * memory. Only before the first unit is added. */
fsdp_status fsdp_sched_set_shard_device(fsdp_sched *s, fsdp_device device);
/* A world of one (DESIGN.md, decision 10): on a shard group of one rank,
 * with f32 compute and reduction and shards on the compute device, on = 1
 * makes each unit's parameters views of its master shard and points their
 * gradients straight into the gradient shard: nothing is gathered, copied
 * or freed around a unit, and the memory is that of the unsharded model.
 * With replicas (no_shard, hybrid_shard of groups of one) each unit's
 * gradient shard is then all-reduced (averaged) in place once its backward
 * is done: 16 bytes per parameter, as DDP. (A backward abandoned halfway
 * leaves its partial gradients, as on an unsharded model.) Only before the
 * first unit is added; refused where the conditions do not hold.
 * Without direct mode a shard group of one copies locally rather than
 * calling its communicator, unless FSDP_FORCE_COLLECTIVES=1 is set (so that
 * one GPU can exercise NCCL). */
fsdp_status fsdp_sched_set_direct(fsdp_sched *s, int on);
/* The masters' compute copies. With a compute dtype narrower than f32
 * (bf16), a unit can keep its f32 master shard's values in the compute
 * dtype beside it (2 bytes per element of the shard, on the shard's
 * device): fsdp_adamw_step(_many) writes it as it updates the master (bit
 * for bit the cast), and each gather sends it as it is instead of casting
 * the master first; a shard group of one on the compute device then uses
 * it as the full buffer itself, nothing copied. Any other write into a
 * master (fill, copy, init, a collective, scale_/axpy_, SGD, a pointer from
 * fsdp_tensor_data_ptr, an AdamW step while a gather still reads the copy)
 * leaves the copy stale, and the next gather casts it again. FSDP_COPY_AUTO
 * (the default): kept with a compute dtype other than f32 and shards on the
 * compute device, not with offloaded shards (host memory there). ON keeps
 * them wherever the shards are; OFF casts at each gather. Only before the
 * first unit is added. */
typedef enum fsdp_copy_mode {
    FSDP_COPY_OFF = 0,
    FSDP_COPY_ON = 1,
    FSDP_COPY_AUTO = 2
} fsdp_copy_mode;
fsdp_status fsdp_sched_set_compute_copy(fsdp_sched *s, fsdp_copy_mode mode);
/* Compressed gradient reduction (fsdp_reduce_scatter_compressed) of every
 * unit's reduce-scatter; error_feedback 1 keeps a residual per unit (f32,
 * the padded unit, tag grad) of what this rank did not send, added before
 * the next compression. A shard group of one reduces nothing: no effect.
 * Not with direct mode, offloaded shards or shards off the host. Only
 * before the first unit is added. */
fsdp_status fsdp_sched_set_compress(fsdp_sched *s, fsdp_compress mode, int64_t block, double density,
                                    int error_feedback);
/* A unit's error-feedback residual: *residual a new reference (NULL when
 * none was made yet: the first compressed reduction makes it, zeroed).
 * fsdp_sched_set_residual makes it if needed and copies values (f32,
 * padded elements) into it; NULL values: zeros. */
fsdp_status fsdp_unit_residual(fsdp_sched *s, int unit, fsdp_tensor **residual);
fsdp_status fsdp_unit_set_residual(fsdp_sched *s, int unit, fsdp_tensor *values);
/* A unit's compute copy as it is now: *copy a new reference (NULL when the
 * unit keeps none, or none was made yet: the first gather makes it), and
 * *current 1 when it holds the master's present values (else the next
 * gather casts it again). Either out may be NULL. */
fsdp_status fsdp_unit_compute_copy(fsdp_sched *s, int unit, fsdp_tensor **copy, int *current);
/* A unit of n parameters with these element counts, in order; keep: leave it
 * gathered from forward to backward (the root; shard_grad_op). */
fsdp_status fsdp_sched_add_unit(fsdp_sched *s, const char *name, int n_params, const int64_t *numels, int keep,
                                int *index);
/* A unit of one parameter (a table of rows of `row` elements, numel in all)
 * padded so that every shard holds whole rows, read by the chunked ops a
 * slice at a time (fsdp_chunked_cross_entropy, fsdp_chunked_embedding): a
 * slice is the same rows of every rank's shard, gathered on their own, and
 * its gradient is reduce-scattered into the gradient shard as soon as it is
 * computed (also under no_sync: the sums are the same). It has no forward
 * hooks of its own; unshard/reshard gather it whole as any unit. Not with
 * offloaded shards. */
fsdp_status fsdp_sched_add_sliced_unit(fsdp_sched *s, const char *name, int64_t numel, int64_t row, int *index);
fsdp_status fsdp_unit_info(fsdp_sched *s, int unit, int64_t *total, int64_t *padded, int64_t *shard_numel,
                           int64_t *shard_offset);
/* Marks a unit frozen: its parameters get no gradient (their views do not
 * require grad), it has no gradient shard and no reduce-scatter; it is still
 * gathered for forward and backward (inputs' gradients need its values).
 * owner: the unit holding the trainable parameters of the same module, or
 * -1; prefetching either gathers both, and the pair counts once against the
 * limit. Only before the unit's first forward. */
fsdp_status fsdp_unit_set_frozen(fsdp_sched *s, int unit, int owner);
/* The persistent f32 master shard and gradient shard (new references; the
 * gradient is NULL for a frozen unit). */
fsdp_status fsdp_unit_shard(fsdp_sched *s, int unit, fsdp_tensor **master, fsdp_tensor **grad);
/* Parameter i as a view of the unit's full buffer, requiring grad; usable
 * only while the unit is gathered. */
fsdp_status fsdp_unit_param(fsdp_sched *s, int unit, int i, int ndim, const int64_t *shape, fsdp_tensor **out);
/* Forward hooks: gather (waiting for it), prefetch, and the tape markers. */
fsdp_status fsdp_unit_pre_forward(fsdp_sched *s, int unit);
fsdp_status fsdp_unit_post_forward(fsdp_sched *s, int unit);
/* Activation recomputation around the forward hooks that follow:
 * FSDP_RECOMPUTE_NONE, FSDP_RECOMPUTE_FORWARD (a forward without gradients
 * whose module is recomputed in backward: units kept for backward stay
 * gathered), FSDP_RECOMPUTE_REPLAY (that recomputation, just before its
 * backward: units stay gathered for it, kept ones are not regathered, and
 * the order used for prefetch is left as the forward made it). */
typedef enum fsdp_recompute_mode {
    FSDP_RECOMPUTE_NONE = 0,
    FSDP_RECOMPUTE_FORWARD = 1,
    FSDP_RECOMPUTE_REPLAY = 2
} fsdp_recompute_mode;
fsdp_status fsdp_sched_set_recompute(fsdp_sched *s, fsdp_recompute_mode mode);
/* Gather or free a unit outside the schedule (evaluation, export). */
fsdp_status fsdp_unit_unshard(fsdp_sched *s, int unit);
fsdp_status fsdp_unit_reshard(fsdp_sched *s, int unit);
/* The gather of fsdp_unit_unshard, issued without waiting (FSDP2's
 * unshard(async_op=True)): its all-gather runs while the caller computes;
 * fsdp_unit_wait (or the unit's next forward, or fsdp_unit_unshard) waits
 * for it. The unit stays gathered until its forward ends or
 * fsdp_unit_reshard (a kept unit: until its backward). */
fsdp_status fsdp_unit_unshard_async(fsdp_sched *s, int unit);
fsdp_status fsdp_unit_wait(fsdp_sched *s, int unit);
/* Explicit prefetch (FSDP2's set_modules_to_forward_prefetch and
 * set_modules_to_backward_prefetch): when unit's forward (backward = 0) or
 * backward (backward = 1) starts, the n units listed are gathered, in that
 * order, instead of the next unit in the last forward's order; the gather
 * limit does not apply to them (they were asked for). n = 0: none;
 * n = -1: back to the default. A unit that is not in the schedule, or the
 * unit itself, is an error. */
fsdp_status fsdp_unit_set_prefetch(fsdp_sched *s, int unit, int backward, int n, const int *units);
/* reshard_after_forward as a group (ZeRO++ hpZ): a forward still gathers
 * each unit from the whole shard group, but then keeps this rank's part of
 * it over `group` (a subgroup of G consecutive ranks of the shard group, G
 * dividing its size; the compute dtype, tag param) for the backward, which
 * regathers within the group: padded / G more elements held per unit from
 * forward to backward, the backward's gather over G ranks instead of N.
 * NULL: the default (free the unit after its forward). Between steps only. */
fsdp_status fsdp_sched_set_reshard_group(fsdp_sched *s, fsdp_comm *group);
/* sync = 0: backward keeps accumulating full gradients locally (no
 * communication per micro-batch); the next backward with sync = 1 reduces
 * the sum. */
fsdp_status fsdp_sched_set_sync(fsdp_sched *s, int sync);
/* Zeroes every gradient shard and drops gradients kept locally by
 * backwards run without sync (a discarded micro-batch must not reach the
 * next reduction). */
fsdp_status fsdp_sched_zero_grad(fsdp_sched *s);
/* Units gathered now, and the most gathered at once since the last reset. */
fsdp_status fsdp_sched_stats(fsdp_sched *s, int *gathered_now, int *gathered_peak, int reset);
/* Every unit of every live schedule back to its shard, hpZ parts dropped
 * and issued gathers waited for and freed: for ranks brought back in step
 * after a chunk that failed on some of them (the REPL, after
 * fsdp_repl_rejoin), whose units may be gathered on some ranks only. A
 * gather the rejoin cancelled is no error; one still running is. */
fsdp_status fsdp_sched_reshard_all(void);

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
