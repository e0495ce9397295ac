/* comm_nccl.h: the CUDA side of the communicators (comm_nccl.c), used only
 * by comm.c. Everything here exists only when the engine is built with
 * FSDP_HAVE_CUDA; NCCL itself additionally needs FSDP_HAVE_NCCL (without
 * it, CUDA collectives work on communicators of one rank, as device
 * copies).
 *
 * A CUDA collective has three moments (DESIGN.md, decision 4):
 *   issue    caller thread: gpu_work_begin() records a "ready" event on the
 *            compute stream, behind every kernel issued so far;
 *   run      comm thread, in the one issue order of all collectives:
 *            gpu_run() makes the comm stream wait for "ready", enqueues the
 *            NCCL call (creating the communicator's NCCL side on first use)
 *            and records a "done" event on the comm stream; nothing here
 *            blocks on the GPU;
 *   wait     caller thread: gpu_work_wait() makes the compute stream wait
 *            for "done". Consumers of a collective's result are kernels on
 *            the compute stream, so this is enough, and the host never
 *            stalls: the prefetched all-gathers and the reduce-scatters run
 *            on the comm stream while the compute stream runs kernels.
 */
#ifndef FSDP_COMM_NCCL_H
#define FSDP_COMM_NCCL_H

#include "internal.h"
#include <mpi.h>

#ifdef FSDP_HAVE_CUDA

typedef struct gpu_comm gpu_comm;   /* a communicator's NCCL side */
typedef struct gpu_work gpu_work;   /* a collective's events */

typedef enum { GPU_ALL_GATHER, GPU_REDUCE_SCATTER, GPU_ALL_REDUCE, GPU_BROADCAST } gpu_kind;

/* One collective, checked by comm.c: contiguous device buffers. */
typedef struct gpu_call {
    gpu_kind kind;
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
    bool nccl;           /* through NCCL; false: device copies (size 1 only) */
} gpu_call;

/* Whether NCCL is built in. */
bool gpu_nccl_built(void);
/* Caller thread, at issue: new events, "ready" recorded on the compute stream. */
fsdp_status gpu_work_begin(gpu_work **out);
/* Comm thread: runs call after w's ready event, on the comm stream; makes
 * *gc (the communicator's NCCL side) first when needed. Whenever the comm
 * stream got any work, "done" is recorded, even on failure: then
 * gpu_work_recorded() is true and the buffers must live until "done". */
fsdp_status gpu_run(gpu_comm **gc, gpu_work *w, const gpu_call *call);
bool gpu_work_recorded(const gpu_work *w);
/* Caller thread: the compute stream waits for "done" (no host stall). */
fsdp_status gpu_work_wait(gpu_work *w);
/* 1: "done" passed; 0: not yet (*started: "ready" passed, the collective
 * may be running); -1: CUDA reported an error (message set). */
int gpu_work_poll(gpu_work *w, bool *started);
void gpu_work_free(gpu_work *w);
/* FSDP_OK, or the communicator's asynchronous NCCL error (message set). */
fsdp_status gpu_comm_check(gpu_comm *gc);
/* Comm thread, once nothing of gc is in flight. */
fsdp_status gpu_comm_destroy(gpu_comm *gc);

#endif /* FSDP_HAVE_CUDA */
#endif
