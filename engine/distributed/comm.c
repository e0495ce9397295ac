/* comm.c: communicators and collectives (DESIGN.md, decisions 4 and 8).
 *
 * One interface, a backend table per kind of communicator:
 *   mpi     whenever MPI is initialized (any size, split ones included);
 *   single  a world of one rank without MPI: gathers and reductions are
 *           local copies, with the same checks and results.
 *
 * Every collective becomes a work item on ONE process-wide comm thread that
 * runs them in issue order. Each rank therefore enters its MPI collectives
 * in exactly the order the caller issued them, and the calling thread
 * blocks on MPI only inside fsdp_work_wait. A work holds its tensors until
 * it completes.
 *
 * Every collective on a communicator takes the next sequence number of that
 * communicator and a fingerprint (kind, communicator id, bytes, dtype, op or
 * root, label hash). With FSDP_DEBUG_COLLECTIVES=1 the comm thread first
 * all-gathers the fingerprints on the communicator and fails the work on
 * every rank, naming the first mismatch, instead of running a collective
 * whose ranks disagree. A wait longer than FSDP_WATCHDOG_SECONDS (default
 * 600; 0 turns it off) names the collective and ends the job.
 *
 * Argument checks are purely local and happen before anything is queued, so
 * a bad call fails on every rank that makes it without any rank hanging.
 *
 * bf16 reductions: MPI has no bf16 type, so the comm thread widens the
 * input to an f32 scratch buffer, reduces in f32 and rounds the result back
 * to bf16 once. Sums are thus as exact as f32 sums (one rounding at the end,
 * not one per rank).
 *
 * CUDA tensors (built with FSDP_HAVE_CUDA; comm_nccl.c): the same queue, the
 * same checks, sequence numbers and fingerprints (which include the device),
 * but the comm thread only enqueues: NCCL (FSDP_HAVE_NCCL) on one comm
 * stream, after an event recorded on the compute stream at issue; a
 * communicator gets its NCCL communicator on its first CUDA collective. A
 * one-rank communicator without MPI or NCCL copies on the device instead.
 * fsdp_work_wait then makes the compute stream wait for the collective's
 * "done" event and returns without stalling the host: whatever consumes
 * the result is a kernel on the compute stream, ordered after it. (With
 * FSDP_NCCL_BLOCKING_WAIT=1 it blocks until the GPU has finished instead,
 * polling under the watchdog: for debugging.) The tensors stay held until
 * the compute stream has been ordered after the collective, or the GPU has
 * finished it, so the caching allocator cannot hand their memory to a
 * kernel that would run before the collective is done. The watchdog covers
 * both halves: the waiting thread measures the time until the comm thread
 * has enqueued the collective (NCCL communicator creation included), and
 * the comm thread polls the events of collectives in flight on the GPU,
 * measuring from the moment the compute stream reached them; either one
 * names the collective and ends the job, as does an asynchronous NCCL
 * error. A collective whose tensors sit on different devices is refused.
 */
#define _POSIX_C_SOURCE 200809L   /* clock_gettime, nanosleep, pthread_condattr_setclock under -std=c11 */
#include "internal.h"
#include "comm_internal.h"
#include "cpu_kernels.h"
#include "comm_nccl.h"
#include <errno.h>
#include <limits.h>
#include <mpi.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

/* ---- MPI errors ---- */

static const char *mpi_error_string(long code) {
    static _Thread_local char buf[MPI_MAX_ERROR_STRING + 32];
    int len = 0;
    if (MPI_Error_string((int)code, buf, &len) != MPI_SUCCESS) snprintf(buf, sizeof buf, "MPI error %ld", code);
    return buf;
}

/* The one check for MPI calls: file:line, the call and MPI's message. */
#define MPI_CHECK(call) FSDP_CHECK_CALL(call, rc_ == MPI_SUCCESS, mpi_error_string)

/* ---- kinds, fingerprints ---- */

typedef enum {
    K_ALL_GATHER, K_REDUCE_SCATTER, K_ALL_REDUCE, K_BROADCAST, K_BARRIER, K_DOUBLES, K_SPLIT, K_FREE
} work_kind;
static const char *const kind_names[] = {"all_gather", "reduce_scatter", "all_reduce", "broadcast",
                                         "barrier", "all_reduce_doubles", "split", "free"};

enum { DT_NONE = -1, DT_F64 = 100 };   /* fingerprint dtypes beyond fsdp_dtype */
/* Element types a backend reduces (bf16 is widened to f32 before). */
typedef enum { RT_F32, RT_F64, RT_I32, RT_I64 } reduce_type;

#define LABEL_KEEP 48

/* What ranks compare in debug mode; plain bytes, all-gathered as MPI_BYTE. */
typedef struct fingerprint {
    uint64_t comm_id, seq, bytes, label_hash;
    int32_t kind, dtype, arg, device;      /* arg: reduce op, broadcast root */
    char label[LABEL_KEEP];                /* truncated copy, for messages */
} fingerprint;

static uint64_t hash_str(const char *s) {  /* FNV-1a */
    uint64_t h = 0xcbf29ce484222325ull;
    for (; *s; s++) h = (h ^ (unsigned char)*s) * 0x100000001b3ull;
    return h;
}

static uint64_t hash_mix(uint64_t a, uint64_t b) {
    uint64_t z = a ^ (b + 0x9e3779b97f4a7c15ull + (a << 6) + (a >> 2));
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

static const char *op_name(int op) {
    return op == FSDP_REDUCE_SUM ? "sum" : op == FSDP_REDUCE_AVG ? "avg" : op == FSDP_REDUCE_MAX ? "max" : "?op";
}

static const char *fp_dtype_name(int dt) {
    return dt == DT_F64 ? "f64" : dt == DT_NONE ? "" : fsdp_dtype_name(dt);
}

/* "all_gather 'h.3' 4096 B f32" (+ " sum" for reductions, " root 1"). */
static void fp_describe(const fingerprint *f, bool with_seq, char *buf, size_t size) {
    char extra[32] = "";
    if (f->kind == K_REDUCE_SCATTER || f->kind == K_ALL_REDUCE || f->kind == K_DOUBLES)
        snprintf(extra, sizeof extra, " %s", op_name(f->arg));
    else if (f->kind == K_BROADCAST)
        snprintf(extra, sizeof extra, " root %d", f->arg);
    char seq[32] = "";
    if (with_seq) snprintf(seq, sizeof seq, "#%llu ", (unsigned long long)f->seq);
    const char *kind = f->kind >= K_ALL_GATHER && f->kind <= K_FREE ? kind_names[f->kind] : "?kind";
    snprintf(buf, size, "%s%s '%s' %llu B%s%s%s%s", seq, kind, f->label, (unsigned long long)f->bytes,
             f->dtype == DT_NONE ? "" : " ", fp_dtype_name(f->dtype), extra,
             f->device == FSDP_DEVICE_CUDA ? " cuda" : "");
}

/* ---- communicators and backends ---- */

#define COMM_MAGIC 0x636f6d6du   /* "comm": catches use after free, best effort */
#define COMM_NAME 96

typedef struct comm_backend comm_backend;

struct fsdp_comm {
    uint32_t magic;
    const comm_backend *be;
    MPI_Comm mpi;                 /* MPI_COMM_NULL for the single backend */
    int rank, size;
    uint64_t id;                  /* equal on every member rank */
    uint64_t next_seq;            /* guarded by the queue lock */
    bool is_world;
    atomic_int world_refs;        /* handles given out for the world */
    char name[COMM_NAME];
#ifdef FSDP_HAVE_CUDA
    gpu_comm *gpu;                /* the NCCL side, made on the first CUDA collective (comm thread) */
#endif
};

/* Raw transfers on host buffers; the generic layer below has checked
 * everything, widened bf16 and resolved overlaps. Run on the comm thread. */
struct comm_backend {
    const char *name;
    /* dst (size blocks) <- every rank's block; src NULL: already in place. */
    fsdp_status (*all_gather)(fsdp_comm *c, void *dst, const void *src, int64_t block_bytes, size_t elem);
    /* dst (block) <- this rank's block of the sum of src (size blocks). */
    fsdp_status (*reduce_scatter_f32)(fsdp_comm *c, float *dst, const float *src, int64_t block);
    /* buf (n) <- elementwise sum or max over ranks (op SUM or MAX). */
    fsdp_status (*all_reduce)(fsdp_comm *c, void *buf, int64_t n, reduce_type rt, int op);
    fsdp_status (*broadcast)(fsdp_comm *c, void *buf, int64_t bytes, int root);
    fsdp_status (*barrier)(fsdp_comm *c);
    /* all (size entries) <- every rank's fingerprint. */
    fsdp_status (*gather_fingerprints)(fsdp_comm *c, const fingerprint *mine, fingerprint *all);
    /* Fills child's backend fields (mpi, rank, size). */
    fsdp_status (*split)(fsdp_comm *parent, int color, int key, fsdp_comm *child);
    fsdp_status (*destroy)(fsdp_comm *c);
};

/* -- mpi -- */

static MPI_Datatype mpi_unit(size_t elem) {   /* moves bytes, elem at a time */
    return elem == 8 ? MPI_UINT64_T : elem == 4 ? MPI_UINT32_T : elem == 2 ? MPI_UINT16_T : MPI_BYTE;
}

static fsdp_status mpi_all_gather(fsdp_comm *c, void *dst, const void *src, int64_t block_bytes, size_t elem) {
    /* MPI counts are ints: beyond 2 GiB per rank, count elements instead of
     * bytes (the caller bounds elements per rank to INT_MAX). */
    MPI_Datatype t = block_bytes <= INT_MAX ? MPI_BYTE : mpi_unit(elem);
    int count = (int)(block_bytes <= INT_MAX ? block_bytes : block_bytes / (int64_t)elem);
    if (src)
        MPI_CHECK(MPI_Allgather(src, count, t, dst, count, t, c->mpi));
    else
        MPI_CHECK(MPI_Allgather(MPI_IN_PLACE, 0, MPI_DATATYPE_NULL, dst, count, t, c->mpi));
    return FSDP_OK;
}

static fsdp_status mpi_reduce_scatter_f32(fsdp_comm *c, float *dst, const float *src, int64_t block) {
    MPI_CHECK(MPI_Reduce_scatter_block(src, dst, (int)block, MPI_FLOAT, MPI_SUM, c->mpi));
    return FSDP_OK;
}

static fsdp_status mpi_all_reduce(fsdp_comm *c, void *buf, int64_t n, reduce_type rt, int op) {
    MPI_Datatype t = rt == RT_F32 ? MPI_FLOAT : rt == RT_F64 ? MPI_DOUBLE : rt == RT_I32 ? MPI_INT32_T : MPI_INT64_T;
    size_t esz = rt == RT_F32 || rt == RT_I32 ? 4 : 8;
    MPI_Op mop = op == FSDP_REDUCE_MAX ? MPI_MAX : MPI_SUM;
    const int64_t chunk = (int64_t)1 << 30;   /* int counts; every rank cuts the same chunks */
    for (int64_t at = 0; at < n; at += chunk) {
        int64_t len = n - at < chunk ? n - at : chunk;
        MPI_CHECK(MPI_Allreduce(MPI_IN_PLACE, (char *)buf + at * (int64_t)esz, (int)len, t, mop, c->mpi));
    }
    return FSDP_OK;
}

static fsdp_status mpi_broadcast(fsdp_comm *c, void *buf, int64_t bytes, int root) {
    const int64_t chunk = (int64_t)1 << 30;
    for (int64_t at = 0; at < bytes; at += chunk) {
        int64_t len = bytes - at < chunk ? bytes - at : chunk;
        MPI_CHECK(MPI_Bcast((char *)buf + at, (int)len, MPI_BYTE, root, c->mpi));
    }
    return FSDP_OK;
}

static fsdp_status mpi_barrier(fsdp_comm *c) {
    MPI_CHECK(MPI_Barrier(c->mpi));
    return FSDP_OK;
}

static fsdp_status mpi_gather_fingerprints(fsdp_comm *c, const fingerprint *mine, fingerprint *all) {
    MPI_CHECK(MPI_Allgather(mine, (int)sizeof *mine, MPI_BYTE, all, (int)sizeof *mine, MPI_BYTE, c->mpi));
    return FSDP_OK;
}

static fsdp_status mpi_split(fsdp_comm *parent, int color, int key, fsdp_comm *child) {
    MPI_Comm nc = MPI_COMM_NULL;
    MPI_CHECK(MPI_Comm_split(parent->mpi, color < 0 ? MPI_UNDEFINED : color, key, &nc));
    if (nc == MPI_COMM_NULL)
        return fsdp_set_error(FSDP_ERR_INVALID, "fsdp_comm_split on comm %s(%d): color %d, expected >= 0",
                              parent->name, parent->size, color);
    child->mpi = nc;
    /* Errors come back as codes here too, as runtime.c sets on the world. */
    MPI_CHECK(MPI_Comm_set_errhandler(nc, MPI_ERRORS_RETURN));
    MPI_CHECK(MPI_Comm_rank(nc, &child->rank));
    MPI_CHECK(MPI_Comm_size(nc, &child->size));
    return FSDP_OK;
}

static fsdp_status mpi_destroy(fsdp_comm *c) {
    if (c->mpi != MPI_COMM_NULL && c->mpi != MPI_COMM_WORLD) MPI_CHECK(MPI_Comm_free(&c->mpi));
    return FSDP_OK;
}

static const comm_backend mpi_backend = {
    "mpi", mpi_all_gather, mpi_reduce_scatter_f32, mpi_all_reduce, mpi_broadcast, mpi_barrier,
    mpi_gather_fingerprints, mpi_split, mpi_destroy,
};

/* -- single rank: a world of one; every collective is a copy or nothing -- */

static fsdp_status single_all_gather(fsdp_comm *c, void *dst, const void *src, int64_t block_bytes, size_t elem) {
    (void)c, (void)elem;
    if (src) memmove(dst, src, (size_t)block_bytes);
    return FSDP_OK;
}

static fsdp_status single_reduce_scatter_f32(fsdp_comm *c, float *dst, const float *src, int64_t block) {
    (void)c;
    memmove(dst, src, (size_t)block * sizeof(float));
    return FSDP_OK;
}

static fsdp_status single_all_reduce(fsdp_comm *c, void *buf, int64_t n, reduce_type rt, int op) {
    (void)c, (void)buf, (void)n, (void)rt, (void)op;
    return FSDP_OK;
}

static fsdp_status single_broadcast(fsdp_comm *c, void *buf, int64_t bytes, int root) {
    (void)c, (void)buf, (void)bytes, (void)root;
    return FSDP_OK;
}

static fsdp_status single_barrier(fsdp_comm *c) {
    (void)c;
    return FSDP_OK;
}

static fsdp_status single_gather_fingerprints(fsdp_comm *c, const fingerprint *mine, fingerprint *all) {
    (void)c;
    *all = *mine;
    return FSDP_OK;
}

static fsdp_status single_split(fsdp_comm *parent, int color, int key, fsdp_comm *child) {
    (void)parent, (void)color, (void)key;
    child->mpi = MPI_COMM_NULL;
    child->rank = 0;
    child->size = 1;
    return FSDP_OK;
}

static fsdp_status single_destroy(fsdp_comm *c) {
    (void)c;
    return FSDP_OK;
}

static const comm_backend single_backend = {
    "single", single_all_gather, single_reduce_scatter_f32, single_all_reduce, single_broadcast, single_barrier,
    single_gather_fingerprints, single_split, single_destroy,
};

/* ---- configuration from the environment (read once) ---- */

static pthread_once_t config_once = PTHREAD_ONCE_INIT;
static bool g_debug;
static bool g_blocking_wait;            /* FSDP_NCCL_BLOCKING_WAIT: host waits for CUDA collectives */
static double g_watchdog_s = 600;
static pthread_condattr_t g_condattr;   /* waits measured on CLOCK_MONOTONIC */

static void config_init(void) {
    const char *d = getenv("FSDP_DEBUG_COLLECTIVES");
    g_debug = d && d[0] && strcmp(d, "0") != 0;
    const char *b = getenv("FSDP_NCCL_BLOCKING_WAIT");
    g_blocking_wait = b && b[0] && strcmp(b, "0") != 0;
    const char *w = getenv("FSDP_WATCHDOG_SECONDS");
    if (w && w[0]) {
        char *end = NULL;
        double v = strtod(w, &end);
        if (end != w) g_watchdog_s = v;   /* <= 0: no watchdog */
    }
    pthread_condattr_init(&g_condattr);
    pthread_condattr_setclock(&g_condattr, CLOCK_MONOTONIC);
}

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static struct timespec abs_time(double t) {
    struct timespec ts;
    ts.tv_sec = (time_t)t;
    ts.tv_nsec = (long)((t - (double)ts.tv_sec) * 1e9);
    if (ts.tv_nsec >= 1000000000L) { ts.tv_sec++; ts.tv_nsec -= 1000000000L; }
    return ts;
}

/* ---- statistics ---- */

static pthread_mutex_t stats_mu = PTHREAD_MUTEX_INITIALIZER;
static int64_t g_gathered, g_reduced;
static double g_wait_s;

fsdp_status fsdp_comm_stats(int64_t *gathered_bytes, int64_t *reduced_bytes, double *wait_seconds) {
    pthread_mutex_lock(&stats_mu);
    if (gathered_bytes) *gathered_bytes = g_gathered;
    if (reduced_bytes) *reduced_bytes = g_reduced;
    if (wait_seconds) *wait_seconds = g_wait_s;
    pthread_mutex_unlock(&stats_mu);
    return FSDP_OK;
}

fsdp_status fsdp_comm_reset_stats(void) {
    pthread_mutex_lock(&stats_mu);
    g_gathered = g_reduced = 0;
    g_wait_s = 0;
    pthread_mutex_unlock(&stats_mu);
    return FSDP_OK;
}

/* ---- works ---- */

struct fsdp_work {
    atomic_int refs;              /* the caller's handle + the queue's */
    struct fsdp_work *next;
    work_kind kind;
    fsdp_comm *comm;              /* valid until the work ran (a free is queued after) */
    fingerprint fp;
    bool counted;                 /* takes a sequence number */
    char comm_name[COMM_NAME];    /* for the watchdog, after the comm is gone */
    int comm_size;
    /* arguments */
    fsdp_tensor *t_dst, *t_src;   /* retained until completion */
    fsdp_tensor *t_scratch;       /* CUDA: device scratch for overlapping buffers, or NULL */
    void *dst;
    const void *src;
    int64_t n;                    /* elements: per-rank block (gather, scatter) or total */
    int dtype, op, root, color, key;
    double *doubles;
    fsdp_comm *split_out;
    /* completion */
    pthread_mutex_t mu;
    pthread_cond_t cv;
    bool done, observed;
    fsdp_status status;
    char msg[2048];
    /* CUDA collectives (the tensors' device; fingerprint too) */
    int device;
#ifdef FSDP_HAVE_CUDA
    gpu_work *gw;                 /* events: ready (compute stream), done (comm stream) */
    double started;               /* comm thread: when the compute stream reached it (0: not yet) */
    struct fsdp_work *gnext;      /* comm thread: in flight on the GPU */
#endif
};

static void work_unref(fsdp_work *w) {
    if (atomic_fetch_sub(&w->refs, 1) != 1) return;
    tensor_release(w->t_dst);
    tensor_release(w->t_src);
    tensor_release(w->t_scratch);
#ifdef FSDP_HAVE_CUDA
    gpu_work_free(w->gw);
#endif
    pthread_mutex_destroy(&w->mu);
    pthread_cond_destroy(&w->cv);
    free(w);
}

static fsdp_status work_new(fsdp_work **out, work_kind kind, fsdp_comm *c, const char *label, int64_t bytes,
                            int dtype, int arg, const char *opname) {
    pthread_once(&config_once, config_init);
    fsdp_work *w = calloc(1, sizeof *w);
    if (!w) return fsdp_set_error(FSDP_ERR_OOM, "%s: out of host memory for a work handle", opname);
    atomic_init(&w->refs, 1);
    pthread_mutex_init(&w->mu, NULL);
    pthread_cond_init(&w->cv, &g_condattr);
    w->kind = kind;
    w->comm = c;
    w->counted = kind != K_FREE;
    snprintf(w->comm_name, sizeof w->comm_name, "%s", c->name);
    w->comm_size = c->size;
    if (!label) label = "";
    w->fp.comm_id = c->id;
    w->fp.bytes = (uint64_t)bytes;
    w->fp.label_hash = hash_str(label);
    w->fp.kind = kind;
    w->fp.dtype = dtype;
    w->fp.arg = arg;
    snprintf(w->fp.label, sizeof w->fp.label, "%s", label);
    *out = w;
    return FSDP_OK;
}

/* Gives the work's tensors back (once; from whichever thread gets there
 * first: the comm thread at completion, or a waiting thread once the
 * compute stream is ordered after a CUDA collective). */
static void work_drop_tensors(fsdp_work *w) {
    pthread_mutex_lock(&w->mu);
    fsdp_tensor *a = w->t_dst, *b = w->t_src, *c = w->t_scratch;
    w->t_dst = w->t_src = w->t_scratch = NULL;
    pthread_mutex_unlock(&w->mu);
    tensor_release(a);
    tensor_release(b);
    tensor_release(c);
}

/* Whether a CUDA collective reached the comm stream, so that its tensors
 * must live until the GPU is done with it. */
static bool work_on_gpu(const fsdp_work *w) {
#ifdef FSDP_HAVE_CUDA
    return w->gw && gpu_work_recorded(w->gw);
#else
    (void)w;
    return false;
#endif
}

/* ---- the comm thread and its queue ---- */

static pthread_mutex_t q_mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t q_cv = PTHREAD_COND_INITIALIZER;     /* work arrived, or stop */
static pthread_cond_t q_idle = PTHREAD_COND_INITIALIZER;   /* queue drained */
static fsdp_work *q_head, *q_tail;
static bool q_running, q_stop, q_busy;
static pthread_t q_thread;
static fingerprint q_current;         /* what the thread runs now, for the watchdog */
static char q_current_comm[COMM_NAME];
static int q_current_size;

/* Copies this thread's last error into the work, without the " [rank N]"
 * fsdp_set_error appended: the waiting thread's fsdp_set_error adds it back. */
static int last_error_len(const char **e) {
    char suffix[32];
    snprintf(suffix, sizeof suffix, " [rank %d]", fsdp_current_rank());
    *e = fsdp_last_error();
    size_t n = strlen(*e), k = strlen(suffix);
    if (n >= k && strcmp(*e + n - k, suffix) == 0) n -= k;
    return (int)n;
}

static void work_take_error(fsdp_work *w, fsdp_status st) {
    const char *e;
    int n = last_error_len(&e);
    char what[160];
    fp_describe(&w->fp, false, what, sizeof what);
    snprintf(w->msg, sizeof w->msg, "%s (collective #%llu on comm %s(%d)): %.*s", what,
             (unsigned long long)w->fp.seq, w->comm_name, w->comm_size, n, e);
    w->status = st;
}

static bool fp_equal(const fingerprint *a, const fingerprint *b) {
    return a->comm_id == b->comm_id && a->seq == b->seq && a->bytes == b->bytes &&
           a->label_hash == b->label_hash && a->kind == b->kind && a->dtype == b->dtype && a->arg == b->arg &&
           a->device == b->device;
}

/* Debug mode: every rank compares every rank's fingerprint with rank 0's
 * and all agree on the first mismatch. */
static fsdp_status check_fingerprints(fsdp_work *w) {
    fsdp_comm *c = w->comm;
    fingerprint *all = calloc((size_t)c->size, sizeof *all);
    if (!all) return fsdp_set_error(FSDP_ERR_OOM, "out of host memory for %d fingerprints", c->size);
    fsdp_status st = c->be->gather_fingerprints(c, &w->fp, all);
    for (int r = 1; st == FSDP_OK && r < c->size; r++) {
        if (fp_equal(&all[0], &all[r])) continue;
        bool seq = all[0].seq != all[r].seq;
        char a[160], b[160];
        fp_describe(&all[0], seq, a, sizeof a);
        fp_describe(&all[r], seq, b, sizeof b);
        st = fsdp_set_error(FSDP_ERR_COMM, "collective #%llu on comm %s(%d): rank 0 issued %s but rank %d issued %s",
                            (unsigned long long)w->fp.seq, c->name, c->size, a, r, b);
        /* Already complete: do not let run_work() wrap it in a second
         * description of the same collective. */
        const char *e;
        int n = last_error_len(&e);
        snprintf(w->msg, sizeof w->msg, "%.*s", n, e);
        w->status = st;
    }
    free(all);
    return st;
}

static void widen_bf16(float *out, const uint16_t *in, int64_t n) {
    for (int64_t i = 0; i < n; i++) out[i] = bf16_to_f32(in[i]);
}
static void narrow_bf16(uint16_t *out, const float *in, int64_t n) {
    for (int64_t i = 0; i < n; i++) out[i] = f32_to_bf16(in[i]);
}
static void divide_f32(float *x, int64_t n, int d) {
    if (d == 1) return;
    for (int64_t i = 0; i < n; i++) x[i] /= (float)d;
}

static bool overlaps(const void *a, int64_t an, const void *b, int64_t bn) {
    const char *pa = a, *pb = b;
    return an > 0 && bn > 0 && pa < pb + bn && pb < pa + an;
}

/* Scratch on the comm thread, counted under the comm tag. */
typedef struct { void *p; size_t n; } scratch;
static fsdp_status scratch_get(scratch *s, size_t nbytes) {
    s->n = nbytes;
    return fsdp_alloc(FSDP_DEVICE_CPU, FSDP_TAG_COMM, nbytes, &s->p);
}
static void scratch_put(scratch *s) {
    if (s->p) fsdp_free(FSDP_DEVICE_CPU, FSDP_TAG_COMM, s->p, s->n);
    s->p = NULL;
}

static fsdp_status run_all_gather(fsdp_work *w) {
    fsdp_comm *c = w->comm;
    size_t esz = fsdp_dtype_size(w->dtype);
    int64_t block = w->n * (int64_t)esz;
    char *dst = w->dst;
    const void *src = w->src;
    if (src == dst + (int64_t)c->rank * block) return c->be->all_gather(c, dst, NULL, block, esz);
    if (!overlaps(src, block, dst, block * c->size)) return c->be->all_gather(c, dst, src, block, esz);
    /* src lies inside dst but not at this rank's block: send a copy. */
    scratch s = {0};
    FSDP_TRY(scratch_get(&s, (size_t)block));
    memcpy(s.p, src, (size_t)block);
    fsdp_status st = c->be->all_gather(c, dst, s.p, block, esz);
    scratch_put(&s);
    return st;
}

static fsdp_status run_reduce_scatter(fsdp_work *w) {
    fsdp_comm *c = w->comm;
    int64_t n = w->n, total = n * c->size;
    scratch in = {0}, out = {0};
    fsdp_status st = FSDP_OK;
    if (w->dtype == FSDP_F32) {
        float *dst = w->dst;
        bool alias = overlaps(w->dst, n * 4, w->src, total * 4);   /* MPI wants distinct buffers */
        if (alias) st = scratch_get(&out, (size_t)n * 4);
        float *res = alias ? out.p : dst;
        if (st == FSDP_OK) st = c->be->reduce_scatter_f32(c, res, w->src, n);
        if (st == FSDP_OK && w->op == FSDP_REDUCE_AVG) divide_f32(res, n, c->size);
        if (st == FSDP_OK && alias) memcpy(dst, res, (size_t)n * 4);
    } else {   /* bf16: reduce in f32, round once */
        st = scratch_get(&in, (size_t)total * 4);
        if (st == FSDP_OK) st = scratch_get(&out, (size_t)n * 4);
        if (st == FSDP_OK) {
            widen_bf16(in.p, w->src, total);
            st = c->be->reduce_scatter_f32(c, out.p, in.p, n);
        }
        if (st == FSDP_OK && w->op == FSDP_REDUCE_AVG) divide_f32(out.p, n, c->size);
        if (st == FSDP_OK) narrow_bf16(w->dst, out.p, n);
    }
    scratch_put(&in);
    scratch_put(&out);
    return st;
}

static fsdp_status run_all_reduce(fsdp_work *w) {
    fsdp_comm *c = w->comm;
    int op = w->op == FSDP_REDUCE_MAX ? FSDP_REDUCE_MAX : FSDP_REDUCE_SUM;
    switch (w->dtype) {
    case FSDP_F32:
        FSDP_TRY(c->be->all_reduce(c, w->dst, w->n, RT_F32, op));
        if (w->op == FSDP_REDUCE_AVG) divide_f32(w->dst, w->n, c->size);
        return FSDP_OK;
    case FSDP_BF16: {
        scratch s = {0};
        FSDP_TRY(scratch_get(&s, (size_t)w->n * 4));
        widen_bf16(s.p, w->dst, w->n);
        fsdp_status st = c->be->all_reduce(c, s.p, w->n, RT_F32, op);
        if (st == FSDP_OK) {
            if (w->op == FSDP_REDUCE_AVG) divide_f32(s.p, w->n, c->size);
            narrow_bf16(w->dst, s.p, w->n);
        }
        scratch_put(&s);
        return st;
    }
    case FSDP_I32: return c->be->all_reduce(c, w->dst, w->n, RT_I32, op);
    case FSDP_I64: return c->be->all_reduce(c, w->dst, w->n, RT_I64, op);
    default: return fsdp_set_error(FSDP_ERR_DTYPE, "all_reduce: dtype %s", fsdp_dtype_name(w->dtype));
    }
}

static fsdp_status run_doubles(fsdp_work *w) {
    fsdp_comm *c = w->comm;
    int op = w->op == FSDP_REDUCE_MAX ? FSDP_REDUCE_MAX : FSDP_REDUCE_SUM;
    FSDP_TRY(c->be->all_reduce(c, w->doubles, w->n, RT_F64, op));
    if (w->op == FSDP_REDUCE_AVG)
        for (int64_t i = 0; i < w->n; i++) w->doubles[i] /= (double)c->size;
    return FSDP_OK;
}

static fsdp_status run_split(fsdp_work *w) {
    fsdp_comm *p = w->comm;
    if (w->color < 0 && p->be != &mpi_backend)   /* alone: nobody waits */
        return fsdp_set_error(FSDP_ERR_INVALID, "fsdp_comm_split on comm %s(%d): color %d, expected >= 0", p->name,
                              p->size, w->color);
    fsdp_comm *child = calloc(1, sizeof *child);
    if (!child) return fsdp_set_error(FSDP_ERR_OOM, "out of host memory for a communicator");
    fsdp_status st = p->be->split(p, w->color, w->key, child);
    if (st != FSDP_OK) {
        free(child);
        return st;
    }
    child->magic = COMM_MAGIC;
    child->be = p->be;
    /* Same on every member: same parent, same split (sequence), same color. */
    child->id = hash_mix(hash_mix(p->id, w->fp.seq), (uint64_t)(uint32_t)w->color);
    snprintf(child->name, sizeof child->name, "%.48s.split%llu.color%d", p->name, (unsigned long long)w->fp.seq,
             w->color);
    w->split_out = child;
    return FSDP_OK;
}

/* ---- CUDA collectives on the comm thread ---- */

#ifdef FSDP_HAVE_CUDA
/* Enqueues w on the comm stream (comm_nccl.c); the GPU runs it later. */
static fsdp_status run_gpu(fsdp_work *w) {
    fsdp_comm *c = w->comm;
    gpu_call call = {
        .dst = w->dst, .src = w->src, .scratch = w->t_scratch ? tensor_data(w->t_scratch) : NULL, .n = w->n,
        .dtype = w->dtype, .op = w->op, .root = w->root, .rank = c->rank, .size = c->size, .mpi = c->mpi,
        .nccl = c->be == &mpi_backend && gpu_nccl_built(),
    };
    switch (w->kind) {
    case K_ALL_GATHER: call.kind = GPU_ALL_GATHER; break;
    case K_REDUCE_SCATTER: call.kind = GPU_REDUCE_SCATTER; break;
    case K_ALL_REDUCE: call.kind = GPU_ALL_REDUCE; break;
    case K_BROADCAST: call.kind = GPU_BROADCAST; break;
    default: return fsdp_set_error(FSDP_ERR_INVALID, "%s on CUDA tensors", kind_names[w->kind]);
    }
    return gpu_run(&c->gpu, w->gw, &call);
}

/* CUDA collectives the GPU has not finished yet, in issue order (one comm
 * stream: they finish in this order). Comm thread only. */
static fsdp_work *g_inflight, *g_inflight_tail;

static void inflight_push(fsdp_work *w) {
    atomic_fetch_add(&w->refs, 1);
    w->gnext = NULL;
    if (g_inflight_tail) g_inflight_tail->gnext = w;
    else g_inflight = w;
    g_inflight_tail = w;
}

/* A fault the job cannot survive: the message, then the end of the job. */
static void gpu_fatal(fsdp_work *w, const char *what, double waited) {
    char desc[160];
    fp_describe(&w->fp, true, desc, sizeof desc);
    if (waited > 0)
        fprintf(stderr, "fsdp watchdog: rank %d: collective %s on comm %s(%d) has run on the GPU for %.0f s "
                "without completing (the comm stream waits for the other ranks); aborting the job\n",
                fsdp_current_rank(), desc, w->comm_name, w->comm_size, waited);
    else
        fprintf(stderr, "fsdp: rank %d: collective %s on comm %s(%d) failed on the GPU: %s; aborting the job\n",
                fsdp_current_rank(), desc, w->comm_name, w->comm_size, what);
    fsdp_runtime_abort(NULL, 1);
}

/* Retires finished collectives (their tensors go back), watches the oldest
 * unfinished one. Never blocks. */
static void poll_inflight(void) {
    while (g_inflight) {
        fsdp_work *w = g_inflight;
        bool started = false;
        int r = gpu_work_poll(w->gw, &started);
        if (r < 0) gpu_fatal(w, fsdp_last_error(), 0);
        if (r > 0) {
            g_inflight = w->gnext;
            if (!g_inflight) g_inflight_tail = NULL;
            work_drop_tensors(w);
            work_unref(w);
            continue;
        }
        double now = now_s();
        if (started && w->started == 0) w->started = now;
        /* w->comm lives while w is in flight: freeing a communicator drains first */
        if (w->comm && gpu_comm_check(w->comm->gpu) != FSDP_OK) gpu_fatal(w, fsdp_last_error(), 0);
        if (g_watchdog_s > 0 && w->started > 0 && now - w->started > g_watchdog_s)
            gpu_fatal(w, "", now - w->started);
        break;
    }
}

static void drain_inflight(void) {
    while (g_inflight) {
        poll_inflight();
        if (g_inflight) {
            struct timespec ts = {0, 200000};
            nanosleep(&ts, NULL);
        }
    }
}
#endif

static void run_work(fsdp_work *w) {
    fsdp_comm *c = w->comm;
    fsdp_status st = FSDP_OK;
    if (g_debug && w->counted && c->size > 1) {
        st = check_fingerprints(w);
        if (st != FSDP_OK) {
            if (w->status == FSDP_OK) work_take_error(w, st);   /* the fingerprint gather itself failed */
            return;
        }
    }
    size_t esz = fsdp_dtype_size(w->dtype);
#ifdef FSDP_HAVE_CUDA
    if (w->device == FSDP_DEVICE_CUDA) {
        st = run_gpu(w);
        if (st != FSDP_OK) work_take_error(w, st);
        else {
            int64_t bytes = w->n * (int64_t)esz;
            pthread_mutex_lock(&stats_mu);
            if (w->kind == K_ALL_GATHER) g_gathered += bytes * w->comm_size;
            if (w->kind == K_REDUCE_SCATTER) g_reduced += bytes * w->comm_size;
            if (w->kind == K_ALL_REDUCE) g_reduced += bytes;
            pthread_mutex_unlock(&stats_mu);
        }
        return;
    }
#endif
    switch (w->kind) {
    case K_ALL_GATHER: st = run_all_gather(w); break;
    case K_REDUCE_SCATTER: st = run_reduce_scatter(w); break;
    case K_ALL_REDUCE: st = run_all_reduce(w); break;
    case K_BROADCAST: st = c->be->broadcast(c, w->dst, w->n * (int64_t)esz, w->root); break;
    case K_BARRIER: st = c->be->barrier(c); break;
    case K_DOUBLES: st = run_doubles(w); break;
    case K_SPLIT: st = run_split(w); break;
    case K_FREE:
#ifdef FSDP_HAVE_CUDA
        drain_inflight();   /* nothing of it may still run on the GPU, NCCL or device copies */
        if (c->gpu) {
            st = gpu_comm_destroy(c->gpu);
            c->gpu = NULL;
        }
        if (st == FSDP_OK) st = c->be->destroy(c);
        else c->be->destroy(c);
#else
        st = c->be->destroy(c);
#endif
        c->magic = 0;
        free(c);
        w->comm = NULL;
        break;
    }
    if (st != FSDP_OK) {
        work_take_error(w, st);
        return;
    }
    int64_t gathered = 0, reduced = 0;
    if (w->kind == K_ALL_GATHER) gathered = w->n * (int64_t)esz * w->comm_size;
    if (w->kind == K_REDUCE_SCATTER) reduced = w->n * (int64_t)esz * w->comm_size;
    if (w->kind == K_ALL_REDUCE) reduced = w->n * (int64_t)esz;
    if (gathered || reduced) {
        pthread_mutex_lock(&stats_mu);
        g_gathered += gathered;
        g_reduced += reduced;
        pthread_mutex_unlock(&stats_mu);
    }
}

/* Whether CUDA collectives are still in flight (comm thread only). */
static bool gpu_busy(void) {
#ifdef FSDP_HAVE_CUDA
    return g_inflight != NULL;
#else
    return false;
#endif
}

static void *comm_thread_main(void *arg) {
    (void)arg;
    pthread_mutex_lock(&q_mu);
    for (;;) {
        if (!q_head) {
            /* stop once the queue is drained and the GPU has finished */
            if (q_stop && !gpu_busy()) break;
            q_busy = false;
            pthread_cond_broadcast(&q_idle);
            if (gpu_busy()) {
#ifdef FSDP_HAVE_CUDA
                /* poll the collectives in flight every 2 ms (q_cv: realtime clock) */
                struct timespec dl;
                clock_gettime(CLOCK_REALTIME, &dl);
                dl.tv_nsec += 2000000L;
                if (dl.tv_nsec >= 1000000000L) { dl.tv_sec++; dl.tv_nsec -= 1000000000L; }
                pthread_cond_timedwait(&q_cv, &q_mu, &dl);
                pthread_mutex_unlock(&q_mu);
                poll_inflight();
                pthread_mutex_lock(&q_mu);
#endif
            } else {
                pthread_cond_wait(&q_cv, &q_mu);
            }
            continue;
        }
        fsdp_work *w = q_head;
        q_head = w->next;
        if (!q_head) q_tail = NULL;
        q_busy = true;
        q_current = w->fp;
        snprintf(q_current_comm, sizeof q_current_comm, "%s", w->comm_name);
        q_current_size = w->comm_size;
        pthread_mutex_unlock(&q_mu);

        run_work(w);
        /* Completion: the tensors go back now, not when the handle is freed;
         * those of a CUDA collective once the GPU is done with them. */
        if (work_on_gpu(w)) {
#ifdef FSDP_HAVE_CUDA
            inflight_push(w);
#endif
        } else {
            work_drop_tensors(w);
        }
        pthread_mutex_lock(&w->mu);
        w->done = true;
        pthread_cond_broadcast(&w->cv);
        pthread_mutex_unlock(&w->mu);
        work_unref(w);
#ifdef FSDP_HAVE_CUDA
        poll_inflight();
#endif

        pthread_mutex_lock(&q_mu);
    }
    q_busy = false;
    pthread_cond_broadcast(&q_idle);
    pthread_mutex_unlock(&q_mu);
    return NULL;
}

/* Queues w (sequence number taken under the queue lock, so numbers follow
 * queue order) and either hands it to the caller or waits for it. */
static fsdp_status issue(fsdp_work **out, fsdp_work *w, const char *opname) {
    pthread_mutex_lock(&q_mu);
    if (!q_running) {
        q_stop = false;
        int rc = pthread_create(&q_thread, NULL, comm_thread_main, NULL);
        if (rc != 0) {
            pthread_mutex_unlock(&q_mu);
            work_unref(w);
            return fsdp_set_error(FSDP_ERR_COMM, "%s: cannot start the comm thread: %s", opname, strerror(rc));
        }
        q_running = true;
    }
    if (w->counted) w->fp.seq = w->comm->next_seq++;
    atomic_fetch_add(&w->refs, 1);   /* the queue's reference */
    w->next = NULL;
    if (q_tail) q_tail->next = w;
    else q_head = w;
    q_tail = w;
    q_busy = true;
    pthread_cond_signal(&q_cv);
    pthread_mutex_unlock(&q_mu);
    if (out) {
        *out = w;
        return FSDP_OK;
    }
    fsdp_status st = fsdp_work_wait(w);
    work_unref(w);
    return st;
}

/* ---- the watchdog ---- */

static void watchdog_fire(fsdp_work *w, double waited) {
    char msg[512];
    snprintf(msg, sizeof msg,
             "fsdp watchdog: rank %d waited %.0f s on collective #%llu %s '%s' (%llu bytes) on comm %s(%d); "
             "aborting the job",
             fsdp_current_rank(), waited, (unsigned long long)w->fp.seq, kind_names[w->kind], w->fp.label,
             (unsigned long long)w->fp.bytes, w->comm_name, w->comm_size);
    fprintf(stderr, "%s\n", msg);
    /* The waited collective may sit behind another one that is stuck. */
    pthread_mutex_lock(&q_mu);
    if (q_busy && (q_current.seq != w->fp.seq || q_current.comm_id != w->fp.comm_id)) {
        char what[160];
        fp_describe(&q_current, true, what, sizeof what);
        fprintf(stderr, "fsdp watchdog: rank %d's comm thread is still in collective %s on comm %s(%d)\n",
                fsdp_current_rank(), what, q_current_comm, q_current_size);
    }
    pthread_mutex_unlock(&q_mu);
    fsdp_runtime_abort(NULL, 1);   /* MPI_Abort under mpirun, else exit */
}

/* ---- public: works ---- */

/* A CUDA collective the comm thread has enqueued: order the compute stream
 * after it (or, with FSDP_NCCL_BLOCKING_WAIT, wait for the GPU here, under
 * the watchdog); then its tensors may go back. */
static fsdp_status gpu_wait(fsdp_work *w, double t0) {
#ifdef FSDP_HAVE_CUDA
    fsdp_status st = FSDP_OK;
    if (g_blocking_wait) {
        for (;;) {
            int r = gpu_work_poll(w->gw, NULL);
            if (r > 0) break;
            if (r < 0) {
                st = FSDP_ERR_COMM;
                break;
            }
            if (g_watchdog_s > 0 && now_s() - t0 > g_watchdog_s) watchdog_fire(w, now_s() - t0);
            struct timespec ts = {0, 20000};
            nanosleep(&ts, NULL);
        }
    } else {
        st = gpu_work_wait(w->gw);
    }
    if (st != FSDP_OK) {
        /* the buffers stay held (until the handle goes): the GPU may still use them */
        const char *e;
        int n = last_error_len(&e);
        char what[160];
        fp_describe(&w->fp, false, what, sizeof what);
        return fsdp_set_error(st, "%s (collective #%llu on comm %s(%d)): %.*s", what, (unsigned long long)w->fp.seq,
                              w->comm_name, w->comm_size, n, e);
    }
    work_drop_tensors(w);
    return FSDP_OK;
#else
    (void)w, (void)t0;
    return FSDP_OK;
#endif
}

fsdp_status fsdp_work_wait(fsdp_work *w) {
    if (!w) return fsdp_set_error(FSDP_ERR_INVALID, "fsdp_work_wait: work is NULL");
    pthread_once(&config_once, config_init);
    double t0 = now_s();
    pthread_mutex_lock(&w->mu);
    while (!w->done) {
        if (g_watchdog_s > 0) {
            struct timespec dl = abs_time(t0 + g_watchdog_s);
            int rc = pthread_cond_timedwait(&w->cv, &w->mu, &dl);
            if (rc == ETIMEDOUT && !w->done) {
                pthread_mutex_unlock(&w->mu);
                watchdog_fire(w, now_s() - t0);
                pthread_mutex_lock(&w->mu);
            }
        } else {
            pthread_cond_wait(&w->cv, &w->mu);
        }
    }
    w->observed = true;
    fsdp_status st = w->status;
    pthread_mutex_unlock(&w->mu);
    fsdp_status gst = work_on_gpu(w) ? gpu_wait(w, t0) : FSDP_OK;
    double dt = now_s() - t0;
    pthread_mutex_lock(&stats_mu);
    g_wait_s += dt;
    pthread_mutex_unlock(&stats_mu);
    /* The comm thread's message, re-set on this thread. */
    if (st != FSDP_OK) return fsdp_set_error(st, "%s", w->msg);
    return gst;
}

/* *done = 1 once complete; a completed work that failed returns its error. */
fsdp_status fsdp_work_test(fsdp_work *w, int *done) {
    if (!w || !done) return fsdp_set_error(FSDP_ERR_INVALID, "fsdp_work_test: %s is NULL", w ? "done" : "work");
    pthread_mutex_lock(&w->mu);
    bool is_done = w->done;
    fsdp_status st = w->done ? w->status : FSDP_OK;
    pthread_mutex_unlock(&w->mu);
    if (is_done && work_on_gpu(w)) {   /* enqueued: done once the GPU is */
#ifdef FSDP_HAVE_CUDA
        int r = gpu_work_poll(w->gw, NULL);
        if (r == 0) is_done = false;
        if (r < 0 && st == FSDP_OK) {
            const char *e;
            int n = last_error_len(&e);
            snprintf(w->msg, sizeof w->msg, "%.*s", n, e);
            st = FSDP_ERR_COMM;
        }
        if (r > 0) work_drop_tensors(w);
#endif
    }
    *done = is_done;
    if (is_done) {
        pthread_mutex_lock(&w->mu);
        w->observed = true;
        pthread_mutex_unlock(&w->mu);
    }
    if (st != FSDP_OK) return fsdp_set_error(st, "%s", w->msg);
    return FSDP_OK;
}

/* Waits when needed; returns the collective's error only when nobody saw it
 * through fsdp_work_wait or fsdp_work_test. */
fsdp_status fsdp_work_free(fsdp_work *w) {
    if (!w) return FSDP_OK;
    pthread_mutex_lock(&w->mu);
    bool seen = w->observed;
    pthread_mutex_unlock(&w->mu);
    fsdp_status st = fsdp_work_wait(w);
    work_unref(w);
    return seen ? FSDP_OK : st;
}

/* ---- public: communicators ---- */

static fsdp_comm g_world_comm;
static pthread_mutex_t world_mu = PTHREAD_MUTEX_INITIALIZER;

static fsdp_status comm_check(fsdp_comm *c, const char *opname) {
    if (!c) return fsdp_set_error(FSDP_ERR_INVALID, "%s: communicator is NULL", opname);
    if (c->magic != COMM_MAGIC)
        return fsdp_set_error(FSDP_ERR_INVALID, "%s: not a live communicator (freed already?)", opname);
    if (c->be == &mpi_backend) {
        int fin = 0;
        MPI_Finalized(&fin);
        if (fin)
            return fsdp_set_error(FSDP_ERR_STATE, "%s on comm %s(%d): MPI is finalized already", opname, c->name,
                                  c->size);
    }
    return FSDP_OK;
}

fsdp_status fsdp_comm_world(fsdp_comm **out) {
    if (!out) return fsdp_set_error(FSDP_ERR_INVALID, "fsdp_comm_world: out is NULL");
    *out = NULL;
    pthread_mutex_lock(&world_mu);
    fsdp_comm *c = &g_world_comm;
    if (c->magic != COMM_MAGIC) {
        /* MPI under mpirun, else a world of one. Only here, before any
         * collective: later the comm thread alone talks to MPI. */
        fsdp_status st = fsdp_runtime_init(NULL, NULL);
        if (st != FSDP_OK) {
            pthread_mutex_unlock(&world_mu);
            return st;
        }
        int inited = 0, fin = 0;
        MPI_Initialized(&inited);
        MPI_Finalized(&fin);
        if (fin) {
            pthread_mutex_unlock(&world_mu);
            return fsdp_set_error(FSDP_ERR_STATE, "fsdp_comm_world: MPI is finalized already");
        }
        if (inited) {
            /* The comm thread makes every MPI call, but never at the same time
             * as another thread: SERIALIZED is the least it needs. */
            int level = MPI_THREAD_SINGLE;
            MPI_Query_thread(&level);
            if (level < MPI_THREAD_SERIALIZED) {
                pthread_mutex_unlock(&world_mu);
                return fsdp_set_error(FSDP_ERR_COMM,
                                      "fsdp_comm_world: MPI was initialized with thread level %d; the comm "
                                      "thread needs MPI_THREAD_SERIALIZED (%d) or more",
                                      level, MPI_THREAD_SERIALIZED);
            }
            int rank = 0, size = 1;
            MPI_Comm_rank(MPI_COMM_WORLD, &rank);
            MPI_Comm_size(MPI_COMM_WORLD, &size);
            c->be = &mpi_backend;
            c->mpi = MPI_COMM_WORLD;   /* used as is: nobody else sends on it */
            c->rank = rank;
            c->size = size;
        } else {
            c->be = &single_backend;
            c->mpi = MPI_COMM_NULL;
            c->rank = 0;
            c->size = 1;
        }
        c->id = hash_str("world");
        c->is_world = true;
        snprintf(c->name, sizeof c->name, "world");
        atomic_init(&c->world_refs, 0);
        c->magic = COMM_MAGIC;
    }
    atomic_fetch_add(&c->world_refs, 1);
    pthread_mutex_unlock(&world_mu);
    *out = c;
    return FSDP_OK;
}

fsdp_status fsdp_comm_split(fsdp_comm **out, fsdp_comm *parent, int color, int key) {
    if (!out) return fsdp_set_error(FSDP_ERR_INVALID, "fsdp_comm_split: out is NULL");
    *out = NULL;
    FSDP_TRY(comm_check(parent, "fsdp_comm_split"));
    /* A negative color is refused only after the split ran: the other ranks
     * are in it too, and must not wait for this one forever. */
    fsdp_work *w;
    FSDP_TRY(work_new(&w, K_SPLIT, parent, "", 0, DT_NONE, 0, "fsdp_comm_split"));
    w->color = color;
    w->key = key;
    atomic_fetch_add(&w->refs, 1);   /* keep it past issue() to read the result */
    fsdp_status st = issue(NULL, w, "fsdp_comm_split");
    if (st == FSDP_OK) *out = w->split_out;
    work_unref(w);
    return st;
}

fsdp_status fsdp_comm_info(fsdp_comm *c, int *rank, int *size) {
    FSDP_TRY(comm_check(c, "fsdp_comm_info"));
    if (rank) *rank = c->rank;
    if (size) *size = c->size;
    return FSDP_OK;
}

fsdp_status fsdp_comm_free(fsdp_comm *c) {
    if (!c) return FSDP_OK;
    if (c->magic != COMM_MAGIC)
        return fsdp_set_error(FSDP_ERR_INVALID, "fsdp_comm_free: not a live communicator (freed twice?)");
    if (c->is_world) {
        /* The world stays: its sequence numbers must go on counting. */
        if (atomic_fetch_sub(&c->world_refs, 1) <= 0) {
            atomic_fetch_add(&c->world_refs, 1);
            return fsdp_set_error(FSDP_ERR_INVALID, "fsdp_comm_free: the world communicator was freed more often "
                                                    "than fsdp_comm_world handed it out");
        }
        return FSDP_OK;
    }
    int finalized = 0;
    MPI_Finalized(&finalized);
    if (finalized) {   /* MPI is gone (handles freed at exit): nothing to tell it */
        c->magic = 0;
        free(c);
        return FSDP_OK;
    }
    fsdp_work *w;
    FSDP_TRY(work_new(&w, K_FREE, c, "", 0, DT_NONE, 0, "fsdp_comm_free"));
    c->magic = 0;   /* no new collectives from here; queued ones still run */
    return issue(NULL, w, "fsdp_comm_free");
}

int comm_rank_of(fsdp_comm *c) { return c ? c->rank : -1; }
int comm_size_of(fsdp_comm *c) { return c ? c->size : -1; }
const char *comm_name_of(fsdp_comm *c) { return c ? c->name : "?"; }

/* ---- public: collectives ---- */

static fsdp_status check_tensor(const char *opname, const char *label, const char *what, fsdp_tensor *t,
                                fsdp_comm *c) {
    char d[200];
    if (!t)
        return fsdp_set_error(FSDP_ERR_INVALID, "%s '%s' on comm %s(%d): %s is NULL", opname, label, c->name,
                              c->size, what);
    int dev = tensor_device(t);
    if (dev != FSDP_DEVICE_CPU) {
#ifdef FSDP_HAVE_CUDA
        bool nccl = c->be == &mpi_backend && gpu_nccl_built();
        if (dev != FSDP_DEVICE_CUDA || (c->size > 1 && !nccl))
            return fsdp_set_error(FSDP_ERR_DEVICE, "%s '%s' on comm %s(%d): %s %s: the %s backend carries CPU "
                                  "tensors, and NCCL, which carries CUDA tensors between ranks, is not built into "
                                  "this engine", opname, label, c->name, c->size, what, tensor_desc(t, d, sizeof d),
                                  c->be->name);
#else
        return fsdp_set_error(FSDP_ERR_DEVICE, "%s '%s' on comm %s(%d): %s %s: the %s backend carries CPU tensors "
                              "(NCCL is not built into this engine)", opname, label, c->name, c->size, what,
                              tensor_desc(t, d, sizeof d), c->be->name);
#endif
    }
    if (!tensor_is_contiguous(t))
        return fsdp_set_error(FSDP_ERR_LAYOUT, "%s '%s' on comm %s(%d): %s %s is not contiguous", opname, label,
                              c->name, c->size, what, tensor_desc(t, d, sizeof d));
    if (!t->storage->data && t->storage->nbytes > 0)
        return fsdp_set_error(FSDP_ERR_STATE, "%s '%s' on comm %s(%d): %s %s belongs to a resharded unit (no data)",
                              opname, label, c->name, c->size, what, tensor_desc(t, d, sizeof d));
    return FSDP_OK;
}

static fsdp_status prepare(fsdp_work **work, fsdp_comm *c, const char *opname) {
    if (work) *work = NULL;
    return comm_check(c, opname);
}

/* One device per collective. */
static fsdp_status check_same_device(const char *opname, const char *label, fsdp_comm *c, fsdp_tensor *dst,
                                     fsdp_tensor *src) {
    if (tensor_device(dst) == tensor_device(src)) return FSDP_OK;
    char a[200], b[200];
    return fsdp_set_error(FSDP_ERR_DEVICE, "%s '%s' on comm %s(%d): dst %s is on %s but src %s is on %s: a "
                          "collective's tensors must be on one device", opname, label, c->name, c->size,
                          tensor_desc(dst, a, sizeof a), fsdp_device_name(tensor_device(dst)),
                          tensor_desc(src, b, sizeof b), fsdp_device_name(tensor_device(src)));
}

/* Last step before issue() for a collective on tensors: a CUDA one records
 * its "ready" event on the compute stream now, behind every kernel issued
 * so far, and gets device scratch when its buffers overlap in a way NCCL
 * does not take in place. On failure w is gone. */
static fsdp_status work_device(fsdp_work *w, int device, bool need_scratch, const char *opname) {
    w->device = device;
    w->fp.device = device;
    if (device != FSDP_DEVICE_CUDA) return FSDP_OK;
#ifdef FSDP_HAVE_CUDA
    fsdp_status st = FSDP_OK;
    if (need_scratch) st = tensor_new(&w->t_scratch, w->dtype, 1, &w->n, device, FSDP_TAG_COMM, false);
    if (st == FSDP_OK) st = gpu_work_begin(&w->gw);
    if (st != FSDP_OK) {
        const char *e;
        int n = last_error_len(&e);
        char msg[1024];
        snprintf(msg, sizeof msg, "%.*s", n, e);
        st = fsdp_set_error(st, "%s '%s' on comm %s(%d): %s", opname, w->fp.label, w->comm_name, w->comm_size, msg);
        work_unref(w);
    }
    return st;
#else
    (void)need_scratch;
    work_unref(w);
    return fsdp_set_error(FSDP_ERR_DEVICE, "%s: CUDA is not built into this engine", opname);
#endif
}

fsdp_status fsdp_all_gather(fsdp_work **work, fsdp_comm *c, fsdp_tensor *dst, fsdp_tensor *src, const char *label) {
    static const char *op = "fsdp_all_gather";
    FSDP_TRY(prepare(work, c, op));
    if (!label) label = "";
    FSDP_TRY(check_tensor(op, label, "dst", dst, c));
    FSDP_TRY(check_tensor(op, label, "src", src, c));
    FSDP_TRY(check_same_device(op, label, c, dst, src));
    char a[200], b[200];
    if (dst->dtype != src->dtype)
        return fsdp_set_error(FSDP_ERR_DTYPE, "%s '%s' on comm %s(%d): dst %s and src %s differ in dtype", op, label,
                              c->name, c->size, tensor_desc(dst, a, sizeof a), tensor_desc(src, b, sizeof b));
    int64_t n = tensor_numel(src);
    if (tensor_numel(dst) != n * c->size)
        return fsdp_set_error(FSDP_ERR_SHAPE,
                              "%s '%s' on comm %s(%d): dst %s has %lld elements, expected size * src numel = "
                              "%d * %lld = %lld (src %s)",
                              op, label, c->name, c->size, tensor_desc(dst, a, sizeof a),
                              (long long)tensor_numel(dst), c->size, (long long)n, (long long)n * c->size,
                              tensor_desc(src, b, sizeof b));
    if (n > INT_MAX)
        return fsdp_set_error(FSDP_ERR_UNSUPPORTED, "%s '%s' on comm %s(%d): src %s has more than %d elements",
                              op, label, c->name, c->size, tensor_desc(src, b, sizeof b), INT_MAX);
    fsdp_work *w;
    FSDP_TRY(work_new(&w, K_ALL_GATHER, c, label, n * c->size * (int64_t)fsdp_dtype_size(dst->dtype), dst->dtype, 0,
                      op));
    tensor_retain(dst);
    tensor_retain(src);
    w->t_dst = dst;
    w->t_src = src;
    w->dst = tensor_data(dst);
    w->src = tensor_data(src);
    w->n = n;
    w->dtype = dst->dtype;
    int64_t block = n * (int64_t)fsdp_dtype_size(dst->dtype);
    bool in_place = (const char *)w->src == (char *)w->dst + (int64_t)c->rank * block;
    FSDP_TRY(work_device(w, tensor_device(dst), !in_place && overlaps(w->src, block, w->dst, block * c->size), op));
    return issue(work, w, op);
}

static fsdp_status check_reduce_op(const char *opname, const char *label, fsdp_comm *c, int op, bool max_ok) {
    if (op == FSDP_REDUCE_SUM || op == FSDP_REDUCE_AVG || (max_ok && op == FSDP_REDUCE_MAX)) return FSDP_OK;
    return fsdp_set_error(FSDP_ERR_INVALID, "%s '%s' on comm %s(%d): reduce op %d, expected %s", opname, label,
                          c->name, c->size, op, max_ok ? "sum (0), avg (1) or max (2)" : "sum (0) or avg (1)");
}

fsdp_status fsdp_reduce_scatter(fsdp_work **work, fsdp_comm *c, fsdp_tensor *dst, fsdp_tensor *src, int op,
                                const char *label) {
    static const char *name = "fsdp_reduce_scatter";
    FSDP_TRY(prepare(work, c, name));
    if (!label) label = "";
    FSDP_TRY(check_tensor(name, label, "dst", dst, c));
    FSDP_TRY(check_tensor(name, label, "src", src, c));
    FSDP_TRY(check_same_device(name, label, c, dst, src));
    FSDP_TRY(check_reduce_op(name, label, c, op, false));
    char a[200], b[200];
    if (dst->dtype != src->dtype || (src->dtype != FSDP_F32 && src->dtype != FSDP_BF16))
        return fsdp_set_error(FSDP_ERR_DTYPE, "%s '%s' on comm %s(%d): dst %s, src %s: expected both f32 or both bf16",
                              name, label, c->name, c->size, tensor_desc(dst, a, sizeof a),
                              tensor_desc(src, b, sizeof b));
    int64_t n = tensor_numel(dst);
    if (tensor_numel(src) != n * c->size)
        return fsdp_set_error(FSDP_ERR_SHAPE,
                              "%s '%s' on comm %s(%d): src %s has %lld elements, expected size * dst numel = "
                              "%d * %lld = %lld (dst %s)",
                              name, label, c->name, c->size, tensor_desc(src, b, sizeof b),
                              (long long)tensor_numel(src), c->size, (long long)n, (long long)n * c->size,
                              tensor_desc(dst, a, sizeof a));
    if (n > INT_MAX)
        return fsdp_set_error(FSDP_ERR_UNSUPPORTED, "%s '%s' on comm %s(%d): dst %s has more than %d elements", name,
                              label, c->name, c->size, tensor_desc(dst, a, sizeof a), INT_MAX);
    fsdp_work *w;
    FSDP_TRY(work_new(&w, K_REDUCE_SCATTER, c, label, n * c->size * (int64_t)fsdp_dtype_size(src->dtype),
                      src->dtype, op, name));
    tensor_retain(dst);
    tensor_retain(src);
    w->t_dst = dst;
    w->t_src = src;
    w->dst = tensor_data(dst);
    w->src = tensor_data(src);
    w->n = n;
    w->dtype = src->dtype;
    w->op = op;
    int64_t block = n * (int64_t)fsdp_dtype_size(src->dtype);
    bool in_place = (char *)w->dst == (const char *)w->src + (int64_t)c->rank * block;
    FSDP_TRY(work_device(w, tensor_device(src), !in_place && overlaps(w->dst, block, w->src, block * c->size),
                         name));
    return issue(work, w, name);
}

/* The collectives that work on one tensor in place (all-reduce, broadcast);
 * arg is the reduce op or the root. */
static fsdp_status issue_in_place(fsdp_work **work, work_kind kind, fsdp_comm *c, const char *label, fsdp_tensor *t,
                                  int arg, const char *name) {
    fsdp_work *w;
    int64_t n = tensor_numel(t);
    FSDP_TRY(work_new(&w, kind, c, label, n * (int64_t)fsdp_dtype_size(t->dtype), t->dtype, arg, name));
    tensor_retain(t);
    w->t_dst = t;
    w->dst = tensor_data(t);
    w->n = n;
    w->dtype = t->dtype;
    if (kind == K_BROADCAST) w->root = arg;
    else w->op = arg;
    FSDP_TRY(work_device(w, tensor_device(t), false, name));
    return issue(work, w, name);
}

fsdp_status fsdp_all_reduce(fsdp_work **work, fsdp_comm *c, fsdp_tensor *t, int op, const char *label) {
    static const char *name = "fsdp_all_reduce";
    FSDP_TRY(prepare(work, c, name));
    if (!label) label = "";
    FSDP_TRY(check_tensor(name, label, "t", t, c));
    char a[200];
    if (fsdp_dtype_is_float(t->dtype)) {
        FSDP_TRY(check_reduce_op(name, label, c, op, true));
    } else if (t->dtype == FSDP_I32 || t->dtype == FSDP_I64) {
        if (op != FSDP_REDUCE_SUM && op != FSDP_REDUCE_MAX)
            return fsdp_set_error(FSDP_ERR_INVALID, "%s '%s' on comm %s(%d): t %s: reduce op %d (%s), integers take "
                                  "sum (0) or max (2)", name, label, c->name, c->size,
                                  tensor_desc(t, a, sizeof a), op, op_name(op));
    } else {
        return fsdp_set_error(FSDP_ERR_DTYPE, "%s '%s' on comm %s(%d): t %s: expected f32, bf16, i32 or i64", name,
                              label, c->name, c->size, tensor_desc(t, a, sizeof a));
    }
    return issue_in_place(work, K_ALL_REDUCE, c, label, t, op, name);
}

fsdp_status fsdp_broadcast(fsdp_work **work, fsdp_comm *c, fsdp_tensor *t, int root, const char *label) {
    static const char *name = "fsdp_broadcast";
    FSDP_TRY(prepare(work, c, name));
    if (!label) label = "";
    FSDP_TRY(check_tensor(name, label, "t", t, c));
    char a[200];
    if (root < 0 || root >= c->size)
        return fsdp_set_error(FSDP_ERR_INVALID, "%s '%s' on comm %s(%d): t %s: root %d, expected 0..%d", name, label,
                              c->name, c->size, tensor_desc(t, a, sizeof a), root, c->size - 1);
    return issue_in_place(work, K_BROADCAST, c, label, t, root, name);
}

fsdp_status fsdp_barrier(fsdp_comm *c) {
    FSDP_TRY(comm_check(c, "fsdp_barrier"));
    fsdp_work *w;
    FSDP_TRY(work_new(&w, K_BARRIER, c, "", 0, DT_NONE, 0, "fsdp_barrier"));
    return issue(NULL, w, "fsdp_barrier");
}

/* On the comm thread too, so it keeps its place among queued collectives. */
fsdp_status fsdp_all_reduce_doubles(fsdp_comm *c, double *values, int n, int op) {
    static const char *name = "fsdp_all_reduce_doubles";
    FSDP_TRY(comm_check(c, name));
    if (n < 0 || (n > 0 && !values))
        return fsdp_set_error(FSDP_ERR_INVALID, "%s on comm %s(%d): %d values at %p", name, c->name, c->size, n,
                              (void *)values);
    FSDP_TRY(check_reduce_op(name, "", c, op, true));
    fsdp_work *w;
    FSDP_TRY(work_new(&w, K_DOUBLES, c, "", (int64_t)n * 8, DT_F64, op, name));
    w->doubles = values;
    w->n = n;
    w->op = op;
    return issue(NULL, w, name);
}

/* ---- shutdown ---- */

void comm_shutdown(void) {
    pthread_once(&config_once, config_init);
    pthread_mutex_lock(&q_mu);
    if (!q_running) {
        pthread_mutex_unlock(&q_mu);
        return;
    }
    /* Drain first, under the watchdog: a collective some rank never joins
     * must not turn finalize into a hang. */
    double t0 = now_s();
    while (q_busy || q_head) {
        if (g_watchdog_s > 0) {
            /* q_idle uses the default (realtime) clock: wait in short slices. */
            struct timespec rt;
            clock_gettime(CLOCK_REALTIME, &rt);
            rt.tv_sec += 1;
            pthread_cond_timedwait(&q_idle, &q_mu, &rt);
            if ((q_busy || q_head) && now_s() - t0 > g_watchdog_s) {
                char what[160];
                fp_describe(&q_current, true, what, sizeof what);
                fprintf(stderr, "fsdp watchdog: rank %d waited %.0f s at shutdown for collective %s on comm %s(%d); "
                        "aborting the job\n", fsdp_current_rank(), now_s() - t0, what, q_current_comm,
                        q_current_size);
                pthread_mutex_unlock(&q_mu);
                fsdp_runtime_abort(NULL, 1);
            }
        } else {
            pthread_cond_wait(&q_idle, &q_mu);
        }
    }
    q_stop = true;
    pthread_cond_signal(&q_cv);
    pthread_mutex_unlock(&q_mu);
    pthread_join(q_thread, NULL);
    pthread_mutex_lock(&q_mu);
    q_running = false;
    q_stop = false;
    pthread_mutex_unlock(&q_mu);
}

