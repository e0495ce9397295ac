/* comm_impl.h: what the communicator's own files share (comm*.c); the rest
 * of the engine sees comm_internal.h and fsdp.h only. The backend
 * interface is comm_backend.h. */
#ifndef FSDP_COMM_IMPL_H
#define FSDP_COMM_IMPL_H

#include "comm_backend.h"
#include "comm_internal.h"
#include "timeline.h"
#include <pthread.h>
#include <stdint.h>

/* ---- kinds and fingerprints (comm_debug.c) ---- */

typedef enum {
    K_ALL_GATHER, K_REDUCE_SCATTER, K_ALL_REDUCE, K_BROADCAST, K_BARRIER, K_DOUBLES, K_SPLIT, K_FREE,
    K_CANCEL,  /* stands in for a collective this rank never issued: fails its agreement (fsdp_comm_cancel) */
    K_GROUP_END   /* closes the CUDA collectives issued in a group (comm_group_end): not counted, no agreement */
} work_kind;
#define K_COUNTED (K_DOUBLES + 1)   /* kinds with traffic counts: fsdp_collective_kind's values */
extern const char *const comm_kind_names[];

enum { DT_NONE = -1, DT_F64 = 100 };   /* fingerprint dtypes beyond fsdp_dtype */
/* a compressed reduce-scatter's fingerprint dtype: DT_COMPRESSED + its fsdp_compress mode */
enum { DT_COMPRESSED = 110 };

#define LABEL_KEEP 48
#define COMM_NAME 96

/* What identifies a collective across ranks: plain bytes, exchanged as
 * MPI_BYTE in the detailed check. */
typedef struct fingerprint {
    uint64_t comm_id, seq, bytes, label_hash;
    int32_t kind, dtype, arg, device;      /* arg: reduce op, broadcast root */
    char label[LABEL_KEEP];                /* truncated copy, for messages */
} fingerprint;

/* What a rank is doing, as it answers another rank's watchdog. */
typedef enum { RS_IDLE, RS_ARRIVING, RS_MOVING, RS_LEAVING } rank_state;
struct comm_status {
    int32_t rank, state;          /* rank_state */
    double seconds;               /* in this state so far */
    fingerprint current;          /* RS_ARRIVING, RS_MOVING: the collective */
    fingerprint last;             /* the last collective this rank finished (seq UINT64_MAX: none) */
    char current_comm[40], last_comm[40];
    int32_t current_size, last_size;
    int32_t failed;               /* collectives that failed on this rank so far */
};
/* This rank's status now (comm_queue.c). */
void comm_status_fill(comm_status *s);

uint64_t comm_hash_str(const char *s);
uint64_t comm_hash_mix(uint64_t a, uint64_t b);
const char *comm_op_name(int op);
/* "#3 all_gather 'h.3' 4096 B f32" (+ " sum" for reductions, " root 1"). */
void comm_fp_describe(const fingerprint *f, bool with_seq, char *buf, size_t size);

/* ---- communicators ---- */

#define COMM_MAGIC 0x636f6d6du   /* "comm": catches use after free, best effort */

/* Traffic of a communicator and of every one split from it (shared,
 * reference counted: children may outlive their parent). */
typedef struct comm_counts {
    atomic_int refs;
    atomic_llong calls[K_COUNTED], bytes[K_COUNTED];
    atomic_llong wire[K_COUNTED];   /* bytes as they moved (compressed ones smaller) */
} comm_counts;

struct fsdp_comm {
    uint32_t magic;
    const comm_backend *be;       /* host collectives: mpi, single or count */
    const comm_backend *dev;      /* CUDA collectives: nccl; NULL without CUDA */
    MPI_Comm mpi;                 /* MPI_COMM_NULL unless be is mpi */
    int rank, size;
    uint64_t id;                  /* equal on every member rank */
    uint64_t next_seq;            /* guarded by the queue lock */
    bool is_world;
    atomic_int world_refs;        /* handles given out for the world */
    char name[COMM_NAME];
    comm_gpu *gpu;                /* the NCCL side, made on the first CUDA collective (comm thread) */
    comm_counts *counts;
    int *members;                 /* world rank of each rank of c; NULL: c's ranks are world ranks */
    fingerprint last_done;        /* the last collective finished on c (seq UINT64_MAX: none; comm thread) */
    int lane;                     /* the comm thread its collectives run on (comm_set_lane; 0 by default) */
    struct fsdp_comm *next_live;  /* the list of live communicators (comm_live_*) */
};

/* Live communicators between ranks (not counting ones), found by id: the
 * REPL's fsdp_comm_cancel names a communicator by its id, the same on every
 * member. comm_live_find returns a communicator not being freed, or NULL;
 * the caller holds the lock (comm_live_lock) while it uses it. */
void comm_live_add(fsdp_comm *c);
void comm_live_remove(fsdp_comm *c);
void comm_live_lock(bool lock);
fsdp_comm *comm_live_find(uint64_t id);

comm_counts *comm_counts_new(void);
void comm_counts_unref(comm_counts *k);   /* NULL: nothing */

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
    bool accumulate;              /* reduce-scatter: dst += the result (comm_reduce_scatter_add) */
    int compress;                 /* reduce-scatter: fsdp_compress mode (comm_compress.c) */
    int64_t compress_block;       /* int8: elements per scale */
    double density;               /* topk: the fraction of each part sent */
    fsdp_tensor *t_recv;          /* compressed: the parts received (src holds the parts sent, packed at issue) */
    int64_t wire_bytes;           /* bytes on the wire (all ranks' parts); 0: the logical bytes */
    double *doubles;
    fsdp_comm *split_out;
    /* completion */
    pthread_mutex_t mu;
    pthread_cond_t cv;
    bool done, observed;
    bool orphaned;                /* its caller gave up waiting (fsdp_comm_abandon): a split's child is the queue's */
    fsdp_status status;
    char msg[2048];
    /* CUDA collectives (the tensors' device; fingerprint too) */
    int device;
    comm_gpu_work *gw;            /* events: ready (compute stream), done (comm stream) */
    bool grouped;                 /* issued inside comm_group_begin/end: launched with the group's other members */
    uint64_t group_serial;        /* which group of the issuing thread */
    bool deferred;                /* comm thread: agreed, waiting for its group's launch */
    double started;               /* comm thread: when the compute stream reached it (0: not yet) */
    double launched;              /* comm thread: when it was put on the comm stream */
    struct fsdp_work *gnext;      /* comm thread: in flight on the GPU */
    /* lanes (comm_queue.c) */
    int lane;                     /* its communicator's, at issue */
    uint64_t order;               /* issue order across lanes */
    struct fsdp_work *after[COMM_LANES];   /* works of other lanes it waits for (retained), or NULL */
};

/* Before the calling thread waits for w: the members of its open group
 * issued so far are launched, so that w completes (comm_queue.c). */
void comm_group_before_wait(const fsdp_work *w);

/* ---- configuration (comm_queue.c; read once from the environment) ---- */

typedef struct comm_config {
    bool debug;            /* FSDP_DEBUG_COLLECTIVES: labels compared too, history in messages */
    bool blocking_wait;    /* FSDP_NCCL_BLOCKING_WAIT: host waits for CUDA collectives */
    double watchdog_s;     /* FSDP_WATCHDOG_SECONDS; 0: off */
    bool sync;             /* FSDP_COMM_SYNC: every collective completes before it returns */
    int lanes;             /* FSDP_COMM_LANES: comm threads (1 or 2; comm_set_lane) */
    char error[160];       /* a setting that was refused ("" when all are fine) */
} comm_config;
const comm_config *comm_cfg(void);
double comm_now(void);   /* CLOCK_MONOTONIC seconds */
/* A condition variable whose timed waits use CLOCK_MONOTONIC (comm_now). */
void comm_cond_init(pthread_cond_t *cv);

/* ---- works (comm_work.c) ---- */

fsdp_status comm_work_new(fsdp_work **out, work_kind kind, fsdp_comm *c, const char *label, int64_t bytes, int dtype,
                          int arg, const char *opname);
void comm_work_unref(fsdp_work *w);
/* Gives the work's tensors back (once; from whichever thread gets there
 * first). */
void comm_work_drop_tensors(fsdp_work *w);
/* Whether a CUDA collective reached the comm stream, so that its tensors
 * must live until the GPU is done with it. */
bool comm_work_on_gpu(const fsdp_work *w);
/* The comm thread's error (status st, fsdp_last_error) kept in w for the
 * waiting thread, with a description of the collective. */
void comm_work_take_error(fsdp_work *w, fsdp_status st);
/* A collective that ran: the process-wide traffic and the family's counts
 * (c NULL: the communicator is gone, only the process-wide figures). */
void comm_count_traffic(fsdp_work *w, fsdp_comm *c);
/* A CUDA collective ran on the GPU from t0 to t1 (comm_now seconds):
 * fsdp_comm_busy's time (lane 0's). */
void comm_count_busy(double t0, double t1);
/* A host collective's run on a lane's thread begins at t0 / ends at t1;
 * counted: whether it is busy time (it moved data and did not fail). The
 * union over lanes is fsdp_comm_busy's; each lane's own, its lane figure. */
void comm_busy_begin(double t0);
void comm_busy_end(int lane, double t0, double t1, bool counted);
/* This thread's last error without the " [rank N]" fsdp_set_error appends. */
int comm_last_error_len(const char **e);

/* ---- the queue (comm_queue.c) ---- */

/* Whether w's run is communication (fsdp_comm_busy): the collectives, not
 * the queue's bookkeeping (frees, splits, group ends, cancels). */
static inline bool counts_busy(const fsdp_work *w) {
    return w->kind != K_FREE && w->kind != K_SPLIT && w->kind != K_GROUP_END && w->kind != K_CANCEL &&
           w->status == FSDP_OK;
}

/* Queues w on its lane without waiting; the caller's reference stays its own. */
fsdp_status comm_enqueue(fsdp_work *w, const char *opname);
/* w ran (or failed, or was launched with its group), on its comm thread:
 * the watchdog's record, the tensors back, the waiter woken. */
void comm_queue_complete(fsdp_work *w);

/* Queues w (its sequence number taken in queue order) and either hands it
 * to the caller (out) or waits for it (out NULL). On failure w is gone. */
fsdp_status comm_issue(fsdp_work **out, fsdp_work *w, const char *opname);
/* Whether this thread is in comm_issue's own wait (a counting collective
 * completing at issue), which is none of the caller's. */
bool comm_waiting_at_issue(void);
/* Queues w only when its communicator's next sequence number is seq
 * (*issued), without waiting; the caller's reference is dropped either way. */
fsdp_status comm_issue_if_next(fsdp_work *w, uint64_t seq, bool *issued, const char *opname);
/* The works this rank's comm thread has not finished (*n, 0: idle), the
 * oldest one's communicator id and sequence number (seq UINT64_MAX when it
 * takes none), and whether data is moving now (*moving). */
void comm_queue_pending(int64_t *n, uint64_t *comm_id, uint64_t *seq, bool *moving);
bool comm_overlaps(const void *a, int64_t an, const void *b, int64_t bn);
/* The last few collectives this rank finished, oldest first, one per line
 * (debug mode keeps them; "" otherwise). */
void comm_history(char *buf, size_t size);
/* Called by the idle comm thread every 100 ms (NULL: nothing to call). */
void comm_set_service(void (*fn)(void));
/* What the comm thread runs now (busy) or ran last, for the watchdog. */
void comm_queue_current(bool *busy, fingerprint *fp, char *comm_name, size_t name_size, int *comm_size);

/* ---- host collectives on the comm thread (comm_run_host.c) ---- */

fsdp_status comm_run_all_gather(fsdp_work *w);
fsdp_status comm_run_reduce_scatter(fsdp_work *w);
fsdp_status comm_run_all_reduce(fsdp_work *w);
fsdp_status comm_run_doubles(fsdp_work *w);
/* A counting run on a host-like device: the scratch the host path would hold. */
fsdp_status comm_count_scratch(fsdp_work *w);

/* ---- CUDA collectives on the comm thread (comm_run_gpu.c; lane 0's thread) ---- */

/* Enqueues w on the comm stream; the GPU runs it later. */
fsdp_status comm_gpu_run(fsdp_work *w);
/* w reached the comm stream: held until the GPU has finished it. */
void comm_gpu_inflight_push(fsdp_work *w);
bool comm_gpu_inflight(void);
/* Retires the collectives the GPU finished, watches the oldest other; never blocks. */
void comm_gpu_poll(void);
/* Waits until nothing is in flight. */
void comm_gpu_drain(void);
/* Launches the group's agreed members kept so far. */
void comm_gpu_flush_group(void);
/* Keeps agreed member w for its group's launch (true). */
bool comm_gpu_group_add(fsdp_work *w);
/* At issue: whether w joins the calling thread's open group. */
void comm_gpu_group_mark(fsdp_work *w, bool has_handle);
/* The bytes a work reads (src) and writes (dst). */
void comm_work_ranges(const fsdp_work *w, const void **rd, int64_t *rn, const void **wr, int64_t *wn);

/* ---- compressed reduce-scatter (comm_compress.c) ---- */

/* One rank's part of n elements on the wire (fsdp_compress_part_bytes). */
int64_t comm_compress_part_bytes(int mode, int64_t n, int64_t block, double density);
/* At issue, on the caller's thread (so that a plan sees the same memory as
 * a run): every rank's part of src (size * n f32), plus the residual res
 * when not NULL (which keeps what was not sent), compressed into send. */
fsdp_status comm_compress_pack(void *send, const float *src, float *res, int mode, int64_t n, int size, int64_t block,
                               double density);
/* Comm thread: moves the packed parts and adds this rank's (touch: the
 * tensors' memory is the host's; else nothing moves). */
fsdp_status comm_compress_run(fsdp_work *w, bool touch);

/* ---- agreement (comm_debug.c) ---- */

/* On the comm thread before w's data moves: every rank's fingerprint agrees
 * with every other's, or w fails on every rank with a message naming both
 * sides (w->status, w->msg set). */
fsdp_status comm_agree(fsdp_work *w);

/* ---- the watchdog (comm_watchdog.c) ---- */

/* A caller waited longer than the watchdog allows on w: report, end the job. */
void comm_watchdog_fire(fsdp_work *w, double waited);
/* The comm thread waited longer than the watchdog allows for the ranks of
 * c to arrive at fp: asks every rank what it is doing, names the ones that
 * have not arrived, ends the job. */
void comm_watchdog_arrival(const fsdp_comm *c, const fingerprint *fp, double waited);
/* Finalize waited that long for the ranks not in has_left: ends the job
 * unless all of them answer (busy, but alive: then it returns). */
void comm_watchdog_leaving(double waited, const bool *has_left, int n);
/* The grace for answers to the watchdog's question. */
double comm_watchdog_grace(void);
/* A CUDA collective ran on the GPU too long (waited > 0) or failed (what). */
void comm_gpu_fatal(fsdp_work *w, const char *what, double waited);

#endif
