/* comm_backend.h: the one interface behind every communicator (DESIGN.md,
 * decision 4). A backend is a table of functions that move bytes; nothing
 * else in the engine knows how.
 *
 *   comm.c            public collectives: argument checks, then a work item
 *   comm_queue.c      the comm thread that runs work items in issue order,
 *                     bf16 widening, overlap scratch, CUDA works in flight
 *   comm_work.c       work handles: wait, test, free, traffic statistics,
 *                     the REPL's hooks (abandoned waits)
 *   comm_debug.c      fingerprints: the agreement check before data moves
 *   comm_watchdog.c   a wait that lasts too long: the report, the end
 *   comm_mpi.c        backend "mpi": MPI for CPU tensors, any world size
 *   comm_single.c     backend "single": a world of one without MPI
 *   comm_count.c      backend "count": world N, rank r in one process, moves
 *                     nothing, counts bytes per kind (the planner's)
 *   comm_nccl.c       backend "nccl": CUDA tensors, NCCL on a comm stream;
 *                     the only file that knows whether CUDA or NCCL is built
 *
 * A communicator has a host backend (mpi, single or count) for CPU tensors
 * and, when the engine has CUDA, the device backend (nccl) for CUDA tensors.
 * Both are this struct: a host backend fills the "host" entries and leaves
 * the "device" entries NULL; the device backend does the opposite.
 *
 * Rules every backend keeps:
 *   - Host entries run on the comm thread only, one at a time, in the same
 *     order on every rank; they block until the transfer is done.
 *   - The generic layer has checked the arguments (same element counts on
 *     every rank when agreement is on, contiguous buffers, counts that fit
 *     the backend), widened bf16 to f32 for reductions, and resolved
 *     overlapping buffers: dst and src never alias unless stated.
 *   - Errors come back as a status with fsdp_set_error's message (file:line,
 *     the failing call, the library's words); the generic layer adds which
 *     collective it was.
 *   - Results are well-defined on every backend: a backend that moves no
 *     data (count) still writes what a world of equal ranks would produce.
 */
#ifndef FSDP_COMM_BACKEND_H
#define FSDP_COMM_BACKEND_H

#include "internal.h"
#include <mpi.h>

typedef struct fingerprint fingerprint;   /* comm_impl.h */
typedef struct comm_status comm_status;

/* Element types a host backend reduces (bf16 arrives widened to f32). */
typedef enum { COMM_RT_F32, COMM_RT_F64, COMM_RT_I32, COMM_RT_I64 } comm_reduce_type;

/* The device side's opaque state: per communicator, per collective. */
typedef struct comm_gpu comm_gpu;
typedef struct comm_gpu_work comm_gpu_work;

typedef enum { COMM_GPU_ALL_GATHER, COMM_GPU_REDUCE_SCATTER, COMM_GPU_ALL_REDUCE, COMM_GPU_BROADCAST } comm_gpu_kind;

/* One collective on device buffers, checked by the generic layer. */
typedef struct comm_gpu_call {
    comm_gpu_kind kind;
    void *dst;
    const void *src;     /* all-gather, reduce-scatter */
    void *scratch;       /* n elements (gather: the block; scatter: the result) when src and dst overlap in a
                          * way NCCL does not take in place; else NULL */
    int64_t n;           /* elements: the per-rank block (gather, scatter) or the whole tensor */
    int dtype;
    int op;              /* FSDP_REDUCE_SUM, AVG, MAX */
    int root;            /* broadcast */
    int rank, size;      /* in the communicator */
    MPI_Comm mpi;        /* carries the NCCL unique id; MPI_COMM_NULL without MPI */
    bool between_ranks;  /* through NCCL; false: device copies (size 1 only) */
} comm_gpu_call;

typedef struct comm_backend {
    const char *name;

    /* ---- host: CPU buffers, comm thread, blocking ---- */

    /* dst (size blocks of block_bytes) <- every rank's block in rank order;
     * src NULL: this rank's block is in place in dst already. elem: the
     * element size, for counts beyond 2 GiB. */
    fsdp_status (*all_gather)(fsdp_comm *c, void *dst, const void *src, int64_t block_bytes, size_t elem);
    /* dst (block floats) <- this rank's block of the elementwise sum of
     * every rank's src (size blocks), divided by divide (1: a sum; the
     * group's size: an average), in one pass: dst = sum / divide, or with
     * accumulate dst = dst + sum / divide (each rounded as those two steps
     * would be: a fused pass gives the same bits as reduce, divide, add). */
    fsdp_status (*reduce_scatter_f32)(fsdp_comm *c, float *dst, const float *src, int64_t block, int divide,
                                      bool accumulate);
    /* buf (n elements) <- elementwise sum or max over ranks, in place
     * (op FSDP_REDUCE_SUM or FSDP_REDUCE_MAX; averages divide after). */
    fsdp_status (*all_reduce)(fsdp_comm *c, void *buf, int64_t n, comm_reduce_type rt, int op);
    /* dst (size blocks of block_bytes) <- block r of rank r's src, for
     * every rank r, in rank order (src's block q goes to rank q). */
    fsdp_status (*all_to_all)(fsdp_comm *c, void *dst, const void *src, int64_t block_bytes);
    /* buf (bytes) <- root's buf. */
    fsdp_status (*broadcast)(fsdp_comm *c, void *buf, int64_t bytes, int root);
    fsdp_status (*barrier)(fsdp_comm *c);
    /* Collective over parent: fills child's rank, size and backend fields.
     * A negative color leaves this rank out (after taking part). */
    fsdp_status (*split)(fsdp_comm *parent, int color, int key, fsdp_comm *child);
    /* Releases the backend's part of c (the struct itself is the caller's). */
    fsdp_status (*destroy)(fsdp_comm *c);
    /* Caller thread, before anything is queued: FSDP_OK, or why c cannot
     * take collectives any more (e.g. MPI finalized). NULL: always usable. */
    fsdp_status (*usable)(fsdp_comm *c, const char *opname);

    /* ---- arrival: agreement, the watchdog, leaving (NULL when local) ----
     * These are the only waits for other ranks that can last: once every
     * rank has arrived at a collective's agreement, its data moves at once.
     * They block without spinning a core, and meanwhile answer the other
     * ranks' watchdog questions and notice ranks that leave the job. */

    /* words (n) <- elementwise max over c's ranks, once every member has
     * arrived. After the watchdog time it names who has not arrived and
     * ends the job (comm_watchdog.c); a member that has left the job fails
     * it with a message naming that rank. */
    fsdp_status (*agree_max)(fsdp_comm *c, int64_t *words, int n, const fingerprint *fp);
    /* Answers waiting questions (the comm thread calls it when idle). */
    void (*service)(void);
    /* Every rank's status (all[world], answered[world]; this rank's own
     * given), asked of every rank of the job, waiting at most grace_s. */
    void (*ask_all)(const comm_status *mine, comm_status *all, bool *answered, double grace_s);
    /* At finalize: tells every rank this one leaves, then waits until all
     * have left. timeout_s 0: no limit. Not a communicator's: the job's. */
    fsdp_status (*leave)(double timeout_s);

    /* Whether the device backend may carry this communicator's CUDA
     * tensors between ranks (NCCL's unique id travels over it). */
    bool carries_device;
    /* Whether every result is computed locally (count): the agreement check
     * and the watchdog have nobody to wait for. */
    bool local;

    /* ---- device: CUDA buffers (comm_nccl.c) ---- */

    /* Whether collectives between ranks are built in (NCCL); without, only
     * communicators of one rank, as device copies. */
    bool between_ranks;
    /* Caller thread, at issue: the collective's events, "ready" recorded on
     * the compute stream behind every kernel issued so far. */
    fsdp_status (*work_begin)(comm_gpu_work **out);
    /* Comm thread: enqueues call on the comm stream after w's "ready";
     * makes *gpu (the communicator's NCCL side) first when needed. Whenever
     * the comm stream got any work, "done" is recorded, even on failure. */
    fsdp_status (*run)(comm_gpu **gpu, comm_gpu_work *w, const comm_gpu_call *call);
    /* Comm thread: the n calls (n >= 1, all between ranks, on one GPU) as
     * one NCCL group after each one's "ready", recording each "done" as
     * run does (even on failure). One status for the group: a failure
     * fails every call of it, and the communicators it reached are
     * aborted (ncclCommAbort), so nothing of the group stays in flight on
     * this rank; later collectives on them fail at once. */
    fsdp_status (*run_group)(comm_gpu **gpus[], comm_gpu_work *ws[], const comm_gpu_call calls[], int n);
    /* Whether "done" was recorded: then the buffers live until it passes. */
    bool (*work_recorded)(const comm_gpu_work *w);
    /* Caller thread: the compute stream waits for "done" (no host stall). */
    fsdp_status (*work_wait)(comm_gpu_work *w);
    /* 1: "done" passed; 0: not yet (*started: "ready" passed); -1: CUDA
     * reported an error (message set). started may be NULL. */
    int (*work_poll)(comm_gpu_work *w, bool *started);
    void (*work_free)(comm_gpu_work *w);
    /* FSDP_OK, or the communicator's asynchronous NCCL error. */
    fsdp_status (*gpu_check)(comm_gpu *gpu);
    /* Comm thread, collective over every rank of parent's NCCL side (run in
     * the split's place in the issue order): *child <- the NCCL side of the
     * ranks of color (ranked by key, as the host split ranks them), or NULL
     * for a negative color, which still takes part. rank and size: this
     * rank's place in the host split's child, which the NCCL one must equal.
     * NULL entry (NCCL older than 2.18, or none): children make their NCCL
     * side on their first CUDA collective, as any communicator. */
    fsdp_status (*gpu_split)(comm_gpu *parent, int color, int key, int rank, int size, comm_gpu **child);
    /* Comm thread, once nothing of gpu is in flight. */
    fsdp_status (*gpu_destroy)(comm_gpu *gpu);
} comm_backend;

extern const comm_backend comm_mpi_backend;      /* comm_mpi.c */
extern const comm_backend comm_single_backend;   /* comm_single.c */
extern const comm_backend comm_count_backend;    /* comm_count.c */
/* comm_nccl.c: the device backend, or NULL when the engine has no CUDA. */
const comm_backend *comm_device_backend(void);

#endif
