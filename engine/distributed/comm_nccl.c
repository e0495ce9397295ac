/* comm_nccl.c: the "nccl" device backend (comm_backend.h): collectives on
 * CUDA tensors, NCCL on a comm stream ordered against the compute stream by
 * events. comm.c checks arguments; comm_queue.c orders collectives on its
 * comm thread; comm_debug.c and comm_watchdog.c keep fingerprints and the
 * watchdog, for CUDA collectives as for any other.
 *
 * A CUDA collective has three moments (DESIGN.md, decision 4):
 *   issue    caller thread: work_begin records a "ready" event on the
 *            compute stream, behind every kernel issued so far;
 *   run      comm thread, in the one issue order of all collectives: run
 *            makes the comm stream wait for "ready", enqueues the NCCL call
 *            (creating the communicator's NCCL side on first use) and
 *            records a "done" event on the comm stream; nothing here blocks
 *            on the GPU;
 *   wait     caller thread: work_wait makes the compute stream wait for
 *            "done". Consumers of a collective's result are kernels on the
 *            compute stream, so this is enough, and the host never stalls:
 *            the prefetched all-gathers and the reduce-scatters run on the
 *            comm stream while the compute stream runs kernels.
 *
 * - One NCCL communicator per fsdp_comm, made on the comm thread and so in
 *   issue order on every rank. A split (fsdp_comm_split, split_all) of a
 *   communicator that has one derives the child's from it with
 *   ncclCommSplit (NCCL 2.18 and newer), in the split's place in the issue
 *   order, every rank of the parent taking part (the ones left out with
 *   NCCL_SPLIT_NOCOLOR). Any other communicator makes its own on its first
 *   CUDA collective: its rank 0 makes the unique id and broadcasts it over
 *   the communicator's MPI communicator, then every rank calls
 *   ncclCommInitRank.
 * - Groups (comm_group_begin/end, comm_internal.h): CUDA collectives the
 *   schedule issues back to back on independent buffers go to NCCL as one
 *   ncclGroupStart/ncclGroupEnd once the last of them is agreed on (so
 *   every rank groups the same ones): a unit's forward gather with its
 *   forward prefetch, the two gathers of a frozen unit and its owner, an
 *   explicit prefetch list, a unit's reduce-scatter with the backward_post
 *   prefetch. Not grouped: a reduce-scatter and the replica all-reduce of
 *   its output that hybrid_shard issues right behind it (the second reads
 *   the first, and a group's operations may run concurrently), and
 *   anything a caller waits for before the group ends (a wait inside a
 *   group launches its members so far). A group that fails on a rank
 *   fails every member there with the same error and aborts the
 *   communicators it reached (ncclCommAbort), so nothing of it stays in
 *   flight; the caller's wait raises the error, which ends the job, and
 *   the other ranks' watchdog covers a rank that fails without ending it.
 * - One comm stream per process (non-blocking, highest priority, so NCCL
 *   kernels get SMs as soon as they are ready). Collectives of every
 *   communicator go onto it in issue order, which is the same on all ranks.
 * - f32 and bf16 are reduced natively by NCCL (ncclFloat32, ncclBfloat16);
 *   the average is ncclAvg. Unlike the MPI path, bf16 sums are therefore
 *   rounded to bf16 along NCCL's reduction (ring or tree) rather than once.
 * - A communicator of one rank without MPI (the "single" backend), or any
 *   one-rank communicator when NCCL is not built, runs device copies on the
 *   same comm stream instead.
 *
 * This is the only file that asks whether the engine was built with CUDA
 * (FSDP_HAVE_CUDA) or NCCL (FSDP_HAVE_NCCL): without CUDA there is no
 * device backend (comm_device_backend() is NULL) and the generic layer
 * refuses device tensors. */
#ifdef FSDP_HAVE_CUDA

#include "comm_impl.h"
#include <cuda_runtime.h>
#ifdef FSDP_HAVE_NCCL
#include <nccl.h>
#endif
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cuda_internal.h"   /* cuda_compute_stream(): the stream every kernel of this GPU runs on */

/* ---- checks: file:line, the call and the library's message ---- */

static const char *cuda_error_string(long rc) { return cudaGetErrorString((cudaError_t)rc); }
#define CUDA_CHECK(call) FSDP_CHECK_CALL(call, rc_ == (long)cudaSuccess, cuda_error_string)

#ifdef FSDP_HAVE_NCCL
static const char *nccl_error_string(long rc) {
    static _Thread_local char buf[600];
    const char *last = "";
#if NCCL_VERSION_CODE >= NCCL_VERSION(2, 13, 0)
    last = ncclGetLastError(NULL);   /* NCCL's detail on the last failure, if any */
    if (!last) last = "";
#endif
    snprintf(buf, sizeof buf, "%s%s%s", ncclGetErrorString((ncclResult_t)rc), last[0] ? ": " : "", last);
    return buf;
}
#define NCCL_CHECK(call) FSDP_CHECK_CALL(call, rc_ == (long)ncclSuccess, nccl_error_string)
#endif

/* ---- works ---- */

struct comm_gpu_work {
    cudaEvent_t ready;   /* compute stream, at issue */
    cudaEvent_t done;    /* comm stream, after the collective */
    int device;
    bool recorded;       /* done was recorded: the comm stream got work */
};

static void gpu_work_free(comm_gpu_work *w);

static fsdp_status work_begin(comm_gpu_work *w) {
    CUDA_CHECK(cudaGetDevice(&w->device));
    CUDA_CHECK(cudaEventCreateWithFlags(&w->ready, cudaEventDisableTiming));
    CUDA_CHECK(cudaEventCreateWithFlags(&w->done, cudaEventDisableTiming));
    CUDA_CHECK(cudaEventRecord(w->ready, cuda_compute_stream()));
    return FSDP_OK;
}

static fsdp_status gpu_work_begin(comm_gpu_work **out) {
    *out = NULL;
    comm_gpu_work *w = calloc(1, sizeof *w);
    if (!w) return fsdp_set_error(FSDP_ERR_OOM, "out of host memory for a collective's CUDA events");
    fsdp_status st = work_begin(w);
    if (st != FSDP_OK) {
        gpu_work_free(w);
        return st;
    }
    *out = w;
    return FSDP_OK;
}

static void gpu_work_free(comm_gpu_work *w) {
    if (!w) return;
    /* Pending events are released by CUDA once they complete. */
    if (w->ready) cudaEventDestroy(w->ready);
    if (w->done) cudaEventDestroy(w->done);
    free(w);
}

static bool gpu_work_recorded(const comm_gpu_work *w) { return w && w->recorded; }

static fsdp_status gpu_work_wait(comm_gpu_work *w) {
    if (!w || !w->recorded) return FSDP_OK;
    CUDA_CHECK(cudaStreamWaitEvent(cuda_compute_stream(), w->done, 0));
    return FSDP_OK;
}

static int gpu_work_poll(comm_gpu_work *w, bool *started) {
    if (!w || !w->recorded) return 1;
    cudaError_t e = cudaEventQuery(w->done);
    if (e == cudaSuccess) return 1;
    if (e != cudaErrorNotReady) {
        fsdp_set_error(FSDP_ERR_COMM, "%s:%d: cudaEventQuery(done) failed: %s", __FILE__, __LINE__,
                       cudaGetErrorString(e));
        return -1;
    }
    if (started) *started = cudaEventQuery(w->ready) == cudaSuccess;
    return 0;
}

/* ---- the comm stream (comm thread only) ---- */

static cudaStream_t g_stream;
static int g_stream_device = -1;

static fsdp_status comm_stream(int device, cudaStream_t *out) {
    if (g_stream_device < 0) {
        int least = 0, greatest = 0;   /* numerically lower is higher priority */
        CUDA_CHECK(cudaDeviceGetStreamPriorityRange(&least, &greatest));
        CUDA_CHECK(cudaStreamCreateWithPriority(&g_stream, cudaStreamNonBlocking, greatest));
        g_stream_device = device;
    } else if (device != g_stream_device) {
        return fsdp_set_error(FSDP_ERR_DEVICE, "a collective on GPU %d, but this process's comm stream is on GPU %d "
                              "(one GPU per rank)", device, g_stream_device);
    }
    *out = g_stream;
    return FSDP_OK;
}

/* ---- one rank without NCCL: device copies ---- */

static fsdp_status run_copy(const comm_gpu_call *c, cudaStream_t s) {
    if (c->size != 1)
        return fsdp_set_error(FSDP_ERR_UNSUPPORTED, "CUDA collectives on %d ranks need NCCL, which is not built into "
                              "this engine", c->size);
    size_t bytes = (size_t)c->n * fsdp_dtype_size(c->dtype);
    if (c->kind == COMM_GPU_ALL_REDUCE || c->kind == COMM_GPU_BROADCAST) return FSDP_OK;   /* one rank: as it is */
    if (bytes == 0 || c->src == c->dst) return FSDP_OK;
    if (c->scratch) {   /* src and dst overlap: cudaMemcpy wants distinct buffers */
        CUDA_CHECK(cudaMemcpyAsync(c->scratch, c->src, bytes, cudaMemcpyDeviceToDevice, s));
        CUDA_CHECK(cudaMemcpyAsync(c->dst, c->scratch, bytes, cudaMemcpyDeviceToDevice, s));
    } else {
        CUDA_CHECK(cudaMemcpyAsync(c->dst, c->src, bytes, cudaMemcpyDeviceToDevice, s));
    }
    return FSDP_OK;
}

/* ---- NCCL ---- */

#ifdef FSDP_HAVE_NCCL

struct comm_gpu {
    ncclComm_t nccl;
    int device;     /* the GPU it was made on: the comm thread selects it for host calls */
    bool aborted;   /* ncclCommAbort after a failed group: nccl is gone */
    char why[512];  /* that group's error, for what still used it */
};

/* What rank 0 broadcasts: the id, or why there is none (so that no rank
 * waits in ncclCommInitRank for an id that never comes). */
typedef struct {
    int32_t ok;
    char msg[256];
    ncclUniqueId id;
} id_message;

static fsdp_status nccl_comm_create(comm_gpu **out, const comm_gpu_call *c) {
    id_message m;
    memset(&m, 0, sizeof m);
    if (c->rank == 0) {
        ncclResult_t r = ncclGetUniqueId(&m.id);
        m.ok = r == ncclSuccess;
        if (!m.ok) snprintf(m.msg, sizeof m.msg, "%.200s", nccl_error_string(r));
    }
    if (c->mpi != MPI_COMM_NULL) {
        int rc = MPI_Bcast(&m, (int)sizeof m, MPI_BYTE, 0, c->mpi);
        if (rc != MPI_SUCCESS) {
            char e[MPI_MAX_ERROR_STRING] = "";
            int len = 0;
            MPI_Error_string(rc, e, &len);
            return fsdp_set_error(FSDP_ERR_COMM, "%s:%d: MPI_Bcast of the NCCL unique id failed: %s", __FILE__,
                                  __LINE__, e);
        }
    } else if (c->size != 1) {
        return fsdp_set_error(FSDP_ERR_COMM, "no MPI communicator to carry the NCCL unique id to %d ranks", c->size);
    }
    if (!m.ok)
        return fsdp_set_error(FSDP_ERR_COMM, "ncclGetUniqueId failed on rank 0 of the communicator: %.*s",
                              (int)sizeof m.msg, m.msg);
    comm_gpu *g = calloc(1, sizeof *g);
    if (!g) return fsdp_set_error(FSDP_ERR_OOM, "out of host memory for an NCCL communicator");
    CUDA_CHECK(cudaGetDevice(&g->device));
    ncclResult_t r = ncclCommInitRank(&g->nccl, c->size, m.id, c->rank);
    if (r != ncclSuccess) {
        free(g);
        return fsdp_set_error(FSDP_ERR_COMM, "%s:%d: ncclCommInitRank(&comm, %d, id, %d) failed: %s", __FILE__,
                              __LINE__, c->size, c->rank, nccl_error_string(r));
    }
    *out = g;
    return FSDP_OK;
}

/* The NCCL type of dtype and how many of it one element is. Moves (gather,
 * broadcast) take any dtype; reductions only numbers NCCL adds. */
static fsdp_status nccl_type(int dtype, bool reduce, ncclDataType_t *t, size_t *per_elem) {
    *per_elem = 1;
    switch (dtype) {
    case FSDP_F32: *t = ncclFloat32; return FSDP_OK;
    /* ncclBfloat16 (9) is declared only when the CUDA bf16 types are, in older nccl.h */
    case FSDP_BF16: *t = (ncclDataType_t)9; return FSDP_OK;
    case FSDP_I32: *t = ncclInt32; return FSDP_OK;
    case FSDP_I64: *t = ncclInt64; return FSDP_OK;
    default:
        if (!reduce) {
            *t = ncclUint8;
            *per_elem = fsdp_dtype_size(dtype);
            return FSDP_OK;
        }
        return fsdp_set_error(FSDP_ERR_DTYPE, "NCCL does not reduce %s", fsdp_dtype_name(dtype));
    }
}

static fsdp_status nccl_op(int op, ncclRedOp_t *out) {
    switch (op) {
    case FSDP_REDUCE_SUM: *out = ncclSum; return FSDP_OK;
    case FSDP_REDUCE_MAX: *out = ncclMax; return FSDP_OK;
    case FSDP_REDUCE_AVG:
#if NCCL_VERSION_CODE >= NCCL_VERSION(2, 10, 0)
        *out = ncclAvg;
        return FSDP_OK;
#else
        return fsdp_set_error(FSDP_ERR_UNSUPPORTED, "averaging needs NCCL 2.10 or newer (ncclAvg); this engine "
                              "was built with NCCL %d", NCCL_VERSION_CODE);
#endif
    default: return fsdp_set_error(FSDP_ERR_INVALID, "reduce op %d", op);
    }
}

/* A collective in three parts, so that a group can put every call's NCCL
 * part between one ncclGroupStart and ncclGroupEnd: device copies that
 * must come before (an all-gather's overlapping block into the scratch)
 * and after (a reduce-scatter's result out of it) stay outside, on the
 * same stream, in that order. */
static fsdp_status nccl_before(const comm_gpu_call *c, cudaStream_t s) {
    if (c->kind == COMM_GPU_ALL_GATHER && c->scratch)
        CUDA_CHECK(cudaMemcpyAsync(c->scratch, c->src, (size_t)c->n * fsdp_dtype_size(c->dtype),
                                   cudaMemcpyDeviceToDevice, s));
    return FSDP_OK;
}

static fsdp_status nccl_call(comm_gpu *g, const comm_gpu_call *c, cudaStream_t s) {
    if (g->aborted)
        return fsdp_set_error(FSDP_ERR_COMM, "this communicator's NCCL side was aborted after a collective group "
                              "failed on it (%s)", g->why);
    ncclDataType_t t = ncclFloat32;
    size_t k = 1;
    ncclRedOp_t op = ncclSum;
    bool reduce = c->kind == COMM_GPU_REDUCE_SCATTER || c->kind == COMM_GPU_ALL_REDUCE;
    FSDP_TRY(nccl_type(c->dtype, reduce, &t, &k));
    if (reduce) FSDP_TRY(nccl_op(c->op, &op));
    size_t count = (size_t)c->n * k;
    switch (c->kind) {
    case COMM_GPU_ALL_GATHER:
        /* In place when src is this rank's block of dst (NCCL's rule);
         * any other overlap goes through the scratch block. */
        NCCL_CHECK(ncclAllGather(c->scratch ? c->scratch : c->src, c->dst, count, t, g->nccl, s));
        return FSDP_OK;
    case COMM_GPU_REDUCE_SCATTER:
        /* In place when dst is this rank's block of src. */
        NCCL_CHECK(ncclReduceScatter(c->src, c->scratch ? c->scratch : c->dst, count, t, op, g->nccl, s));
        return FSDP_OK;
    case COMM_GPU_ALL_REDUCE:
        NCCL_CHECK(ncclAllReduce(c->dst, c->dst, count, t, op, g->nccl, s));
        return FSDP_OK;
    case COMM_GPU_BROADCAST:
        NCCL_CHECK(ncclBroadcast(c->dst, c->dst, count, t, c->root, g->nccl, s));
        return FSDP_OK;
    }
    return fsdp_set_error(FSDP_ERR_INVALID, "unknown CUDA collective %d", (int)c->kind);
}

static fsdp_status nccl_after(const comm_gpu_call *c, cudaStream_t s) {
    if (c->kind == COMM_GPU_REDUCE_SCATTER && c->scratch)
        CUDA_CHECK(cudaMemcpyAsync(c->dst, c->scratch, (size_t)c->n * fsdp_dtype_size(c->dtype),
                                   cudaMemcpyDeviceToDevice, s));
    return FSDP_OK;
}

static fsdp_status run_nccl(comm_gpu *g, const comm_gpu_call *c, cudaStream_t s) {
    FSDP_TRY(nccl_before(c, s));
    FSDP_TRY(nccl_call(g, c, s));
    return nccl_after(c, s);
}

static fsdp_status gpu_comm_check(comm_gpu *g) {
    if (!g) return FSDP_OK;
    if (g->aborted)
        return fsdp_set_error(FSDP_ERR_COMM, "the NCCL communicator was aborted after a collective group failed on "
                              "it (%s), with collectives of it still in flight", g->why);
    ncclResult_t async = ncclSuccess;
    NCCL_CHECK(ncclCommGetAsyncError(g->nccl, &async));
#if NCCL_VERSION_CODE >= NCCL_VERSION(2, 14, 0)
    if (async == ncclInProgress) return FSDP_OK;
#endif
    if (async != ncclSuccess)
        return fsdp_set_error(FSDP_ERR_COMM, "NCCL reported an asynchronous error: %s", nccl_error_string(async));
    return FSDP_OK;
}

static fsdp_status gpu_comm_destroy(comm_gpu *g) {
    if (!g) return FSDP_OK;
    ncclComm_t nc = g->aborted ? NULL : g->nccl;
    free(g);
    if (nc) NCCL_CHECK(ncclCommDestroy(nc));
    return FSDP_OK;
}

/* ---- a group of collectives (comm thread) ----
 * Every call's "ready" first, then each call's copies before, the NCCL
 * calls between one ncclGroupStart and ncclGroupEnd (NCCL launches them
 * together, so they may run concurrently: the members' buffers are
 * independent), the copies after, and each "done". A call NCCL refuses,
 * or a failed ncclGroupEnd, fails the whole group on this rank; the
 * communicators it reached are aborted (ncclCommAbort), since what NCCL
 * launched of it can never complete without the others, and the error goes
 * to every member, so the caller's wait raises it and the job ends as for
 * any failed collective (the other ranks' watchdog otherwise). */
static fsdp_status gpu_run_group(comm_gpu **gcs[], comm_gpu_work *ws[], const comm_gpu_call calls[], int n) {
    int device = ws[0]->device;
    CUDA_CHECK(cudaSetDevice(device));
    cudaStream_t s = NULL;
    FSDP_TRY(comm_stream(device, &s));
    fsdp_status st = FSDP_OK;
    /* communicators without an NCCL side yet make it first, in member order on every rank */
    for (int i = 0; i < n && st == FSDP_OK; i++)
        if (!*gcs[i]) st = nccl_comm_create(gcs[i], &calls[i]);
    for (int i = 0; i < n && st == FSDP_OK; i++) {
        cudaError_t e = cudaStreamWaitEvent(s, ws[i]->ready, 0);
        if (e != cudaSuccess)
            st = fsdp_set_error(FSDP_ERR_COMM, "%s:%d: cudaStreamWaitEvent(ready) failed: %s", __FILE__, __LINE__,
                                cudaGetErrorString(e));
    }
    for (int i = 0; i < n && st == FSDP_OK; i++) st = nccl_before(&calls[i], s);
    bool started = false;
    if (st == FSDP_OK) {
        ncclResult_t r = ncclGroupStart();
        if (r != ncclSuccess)
            st = fsdp_set_error(FSDP_ERR_COMM, "%s:%d: ncclGroupStart() failed: %s", __FILE__, __LINE__,
                                nccl_error_string(r));
        started = r == ncclSuccess;
    }
    int reached = 0;   /* members whose NCCL call was made */
    for (int i = 0; i < n && st == FSDP_OK; i++, reached++) st = nccl_call(*gcs[i], &calls[i], s);
    if (started) {
        char first[1024] = "";
        if (st != FSDP_OK) snprintf(first, sizeof first, "%s", fsdp_last_error());
        ncclResult_t r = ncclGroupEnd();   /* (after a refused call too: it closes the group) */
        if (st == FSDP_OK && r != ncclSuccess)
            st = fsdp_set_error(FSDP_ERR_COMM, "%s:%d: ncclGroupEnd() of %d collectives failed: %s", __FILE__,
                                __LINE__, n, nccl_error_string(r));
        else if (st != FSDP_OK)
            fsdp_set_error(st, "in a group of %d collectives: %s", n, first);
        if (st != FSDP_OK) {
            char msg[1024];
            snprintf(msg, sizeof msg, "%s; its NCCL communicators were aborted", fsdp_last_error());
            for (int i = 0; i < n; i++) {   /* each communicator it reached, once */
                comm_gpu *g = *gcs[i];
                if (!g || g->aborted || i >= reached) continue;
                (void)ncclCommAbort(g->nccl);
                g->aborted = true;
                snprintf(g->why, sizeof g->why, "%.500s", msg);
            }
            fsdp_set_error(st, "%s", msg);
        }
    }
    for (int i = 0; i < n && st == FSDP_OK; i++) st = nccl_after(&calls[i], s);
    /* Even after a failure: whatever did reach the stream must finish
     * before the buffers are given back. */
    for (int i = 0; i < n; i++) {
        cudaError_t e = cudaEventRecord(ws[i]->done, s);
        if (e == cudaSuccess) {
            ws[i]->recorded = true;
            continue;
        }
        cudaStreamSynchronize(s);   /* best effort: nothing may still use the buffers */
        if (st == FSDP_OK)
            st = fsdp_set_error(FSDP_ERR_COMM, "%s:%d: cudaEventRecord(done, comm stream) failed: %s", __FILE__,
                                __LINE__, cudaGetErrorString(e));
    }
    return st;
}

#if NCCL_VERSION_CODE >= NCCL_VERSION(2, 18, 0)
/* The child's NCCL communicator from the parent's: no unique id to make
 * and broadcast, no bootstrap of its own (NCCL reuses the parent's). Every
 * rank of the parent calls it, those the split leaves out with
 * NCCL_SPLIT_NOCOLOR. NCCL ranks the child's members by key, ties by the
 * parent's rank, as MPI_Comm_split and fsdp_comm_split_all do; that the
 * two agree is checked, not assumed. */
static fsdp_status gpu_comm_split(comm_gpu *parent, int color, int key, int rank, int size, comm_gpu **out) {
    *out = NULL;
    CUDA_CHECK(cudaSetDevice(parent->device));
    ncclComm_t nc = NULL;
    ncclResult_t r = ncclCommSplit(parent->nccl, color < 0 ? NCCL_SPLIT_NOCOLOR : color, key, &nc, NULL);
    if (r != ncclSuccess)
        return fsdp_set_error(FSDP_ERR_COMM, "%s:%d: ncclCommSplit(comm, color %d, key %d) failed: %s", __FILE__,
                              __LINE__, color, key, nccl_error_string(r));
    if (color < 0) {
        if (nc) (void)ncclCommDestroy(nc);
        return FSDP_OK;
    }
    int nrank = -1, nsize = -1;
    r = ncclCommUserRank(nc, &nrank);
    if (r == ncclSuccess) r = ncclCommCount(nc, &nsize);
    if (r != ncclSuccess || nrank != rank || nsize != size) {
        (void)ncclCommDestroy(nc);
        if (r != ncclSuccess)
            return fsdp_set_error(FSDP_ERR_COMM, "%s:%d: ncclCommUserRank/ncclCommCount of a split failed: %s",
                                  __FILE__, __LINE__, nccl_error_string(r));
        return fsdp_set_error(FSDP_ERR_COMM, "ncclCommSplit (color %d, key %d) made rank %d of %d, but the host "
                              "communicator's split made rank %d of %d", color, key, nrank, nsize, rank, size);
    }
    comm_gpu *g = calloc(1, sizeof *g);
    if (!g) {
        (void)ncclCommDestroy(nc);
        return fsdp_set_error(FSDP_ERR_OOM, "out of host memory for an NCCL communicator");
    }
    g->nccl = nc;
    g->device = parent->device;
    *out = g;
    return FSDP_OK;
}
#define GPU_COMM_SPLIT gpu_comm_split
#endif

#else /* no NCCL: communicators never get an NCCL side */

struct comm_gpu {
    int unused;
};

static fsdp_status gpu_comm_check(comm_gpu *g) {
    (void)g;
    return FSDP_OK;
}

static fsdp_status gpu_comm_destroy(comm_gpu *g) {
    free(g);
    return FSDP_OK;
}

#endif /* FSDP_HAVE_NCCL */

/* ---- running one collective (comm thread) ---- */

static fsdp_status gpu_run(comm_gpu **gc, comm_gpu_work *w, const comm_gpu_call *c) {
    CUDA_CHECK(cudaSetDevice(w->device));   /* the comm thread's current device */
    cudaStream_t s = NULL;
    FSDP_TRY(comm_stream(w->device, &s));
#ifdef FSDP_HAVE_NCCL
    if (c->between_ranks && !*gc) FSDP_TRY(nccl_comm_create(gc, c));
#else
    (void)gc;
    if (c->between_ranks)
        return fsdp_set_error(FSDP_ERR_UNSUPPORTED, "CUDA collectives through NCCL: NCCL is not built into this "
                              "engine");
#endif
    CUDA_CHECK(cudaStreamWaitEvent(s, w->ready, 0));
    fsdp_status st;
#ifdef FSDP_HAVE_NCCL
    st = c->between_ranks ? run_nccl(*gc, c, s) : run_copy(c, s);
#else
    st = run_copy(c, s);
#endif
    /* Even after a failure: whatever did reach the stream must finish
     * before the buffers are given back. */
    cudaError_t e = cudaEventRecord(w->done, s);
    if (e == cudaSuccess) {
        w->recorded = true;
    } else {
        cudaStreamSynchronize(s);   /* best effort: nothing may still use the buffers */
        if (st == FSDP_OK)
            st = fsdp_set_error(FSDP_ERR_COMM, "%s:%d: cudaEventRecord(done, comm stream) failed: %s", __FILE__,
                                __LINE__, cudaGetErrorString(e));
    }
    return st;
}

static const comm_backend nccl_backend = {
    .name = "nccl",
#ifdef FSDP_HAVE_NCCL
    .between_ranks = true,
#endif
    .work_begin = gpu_work_begin,
    .run = gpu_run,
    .work_recorded = gpu_work_recorded,
    .work_wait = gpu_work_wait,
    .work_poll = gpu_work_poll,
    .work_free = gpu_work_free,
    .gpu_check = gpu_comm_check,
    .gpu_destroy = gpu_comm_destroy,
#ifdef GPU_COMM_SPLIT
    .gpu_split = GPU_COMM_SPLIT,
#endif
#ifdef FSDP_HAVE_NCCL
    .run_group = gpu_run_group,
#endif
};

const comm_backend *comm_device_backend(void) { return &nccl_backend; }

#else /* !FSDP_HAVE_CUDA */

#include "comm_impl.h"

const comm_backend *comm_device_backend(void) { return NULL; }

#endif /* FSDP_HAVE_CUDA */
