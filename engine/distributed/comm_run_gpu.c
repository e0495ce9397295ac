/* comm_run_gpu.c: CUDA collectives on the comm thread (lane 0 only).
 *
 * The same queue, checks, sequence numbers and fingerprints as host
 * collectives (comm_queue.c; fingerprints include the device), but the comm
 * thread only enqueues, on one comm stream (the device backend,
 * comm_nccl.c), after an event recorded on the compute stream at issue; a
 * communicator gets its NCCL side on its first CUDA collective.
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
 * the comm thread polls the events of collectives in flight on the GPU
 * (here), measuring from the moment the compute stream reached them; either
 * one names the collective and ends the job, as does an asynchronous NCCL
 * error. Collectives issued between comm_group_begin and comm_group_end are
 * launched as one NCCL group. */
#define _POSIX_C_SOURCE 200809L   /* nanosleep */
#include "comm_impl.h"
#include <time.h>

/* The device call of CUDA work w. */
static fsdp_status gpu_call_of(const fsdp_work *w, comm_gpu_call *out) {
    fsdp_comm *c = w->comm;
    comm_gpu_call call = {
        .dst = w->dst, .src = w->src, .scratch = w->t_scratch ? tensor_data(w->t_scratch) : NULL, .n = w->n,
        .dtype = w->dtype, .op = w->op, .root = w->root, .rank = c->rank, .size = c->size, .mpi = c->mpi,
        .between_ranks = c->be->carries_device && c->dev->between_ranks,
    };
    switch (w->kind) {
    case K_ALL_GATHER: call.kind = COMM_GPU_ALL_GATHER; break;
    case K_REDUCE_SCATTER: call.kind = COMM_GPU_REDUCE_SCATTER; break;
    case K_ALL_REDUCE: call.kind = COMM_GPU_ALL_REDUCE; break;
    case K_BROADCAST: call.kind = COMM_GPU_BROADCAST; break;
    default: return fsdp_set_error(FSDP_ERR_INVALID, "%s on CUDA tensors", comm_kind_names[w->kind]);
    }
    *out = call;
    return FSDP_OK;
}

/* Enqueues w on the comm stream (comm_nccl.c); the GPU runs it later. */
fsdp_status comm_gpu_run(fsdp_work *w) {
    comm_gpu_call call;
    FSDP_TRY(gpu_call_of(w, &call));
    return w->comm->dev->run(&w->comm->gpu, w->gw, &call);
}

/* CUDA collectives the GPU has not finished yet, in issue order (one comm
 * stream: they finish in this order). Comm thread only. */
static fsdp_work *g_inflight, *g_inflight_tail;   /* lane 0's thread only */

bool comm_gpu_inflight(void) { return g_inflight != NULL; }

void comm_gpu_inflight_push(fsdp_work *w) {
    if (w->launched == 0) w->launched = comm_now();
    atomic_fetch_add(&w->refs, 1);
    w->gnext = NULL;
    if (g_inflight_tail) g_inflight_tail->gnext = w;
    else g_inflight = w;
    g_inflight_tail = w;
}

/* Retires finished collectives (their tensors go back), watches the oldest
 * unfinished one. Never blocks. */
void comm_gpu_poll(void) {
    const comm_backend *dev = comm_device_backend();
    while (g_inflight) {
        fsdp_work *w = g_inflight;
        bool started = false;
        int r = dev->work_poll(w->gw, &started);
        if (r < 0) comm_gpu_fatal(w, fsdp_last_error(), 0);
        if (r > 0) {
            /* (inflight_push stamped launched before any poll) */
            if (counts_busy(w)) comm_count_busy(w->started > 0 ? w->started : w->launched, comm_now());
            g_inflight = w->gnext;
            if (!g_inflight) g_inflight_tail = NULL;
            comm_work_drop_tensors(w);
            comm_work_unref(w);
            continue;
        }
        double now = comm_now();
        if (started && w->started == 0) w->started = now;
        /* w->comm lives while w is in flight: freeing a communicator drains first */
        if (w->comm && dev->gpu_check(w->comm->gpu) != FSDP_OK) comm_gpu_fatal(w, fsdp_last_error(), 0);
        if (comm_cfg()->watchdog_s > 0 && w->started > 0 && now - w->started > comm_cfg()->watchdog_s)
            comm_gpu_fatal(w, "", now - w->started);
        break;
    }
}

void comm_gpu_drain(void) {
    while (g_inflight) {
        comm_gpu_poll();
        if (g_inflight) {
            struct timespec ts = {0, 200000};
            nanosleep(&ts, NULL);
        }
    }
}

/* ---- groups (comm_group_begin/end) ----
 * The comm thread keeps a group's CUDA members once their agreement has
 * passed (in the issue order, as every rank does) and launches them as one
 * NCCL group when the first work that is not a member arrives: the
 * group's end marker, which the caller queues right after its last
 * member, or anything else. Members complete then, as a lone collective
 * completes after its enqueue. */
enum { GROUP_MAX = 64 };
static fsdp_work *g_group[GROUP_MAX];   /* comm thread only */
static int g_group_n;

void comm_gpu_flush_group(void) {
    int n = g_group_n;
    if (n == 0) return;
    g_group_n = 0;
    fsdp_status st = FSDP_OK;
    const comm_backend *dev = g_group[0]->comm->dev;
    bool together = n > 1 && dev->run_group;
    for (int i = 0; i < n && together; i++) {
        fsdp_comm *c = g_group[i]->comm;
        together = c->be->carries_device && c->dev->between_ranks;
    }
    if (together) {
        comm_gpu **gpus[GROUP_MAX];
        comm_gpu_work *ws[GROUP_MAX];
        comm_gpu_call calls[GROUP_MAX];
        for (int i = 0; i < n && st == FSDP_OK; i++) {
            gpus[i] = &g_group[i]->comm->gpu;
            ws[i] = g_group[i]->gw;
            st = gpu_call_of(g_group[i], &calls[i]);
        }
        if (st == FSDP_OK) st = dev->run_group(gpus, ws, calls, n);
        for (int i = 0; i < n; i++) {
            fsdp_work *w = g_group[i];
            if (st != FSDP_OK) comm_work_take_error(w, st);
            else comm_count_traffic(w, w->comm);
        }
    } else {   /* one member, or copies of a rank without NCCL: each as it would run alone */
        for (int i = 0; i < n; i++) {
            fsdp_work *w = g_group[i];
            st = comm_gpu_run(w);
            if (st != FSDP_OK) comm_work_take_error(w, st);
            else comm_count_traffic(w, w->comm);
        }
    }
    for (int i = 0; i < n; i++) {
        g_group[i]->deferred = false;
        comm_queue_complete(g_group[i]);
    }
}

/* The bytes a CUDA work reads (src) and writes (dst). */
void comm_work_ranges(const fsdp_work *w, const void **rd, int64_t *rn, const void **wr, int64_t *wn) {
    int64_t b = w->n * (int64_t)fsdp_dtype_size(w->dtype), size = w->comm_size;
    *rd = w->src;
    *wr = w->dst;
    switch (w->kind) {
    case K_ALL_GATHER: *rn = b, *wn = b * size; break;
    case K_REDUCE_SCATTER: *rn = b * size, *wn = b; break;
    default: *rd = w->dst, *rn = b, *wn = b; break;   /* in place */
    }
}

/* Whether a and b touch the same bytes with at least one writing them:
 * then b depends on a, and a group (whose operations may run together)
 * must not hold both. */
static bool works_conflict(const fsdp_work *a, const fsdp_work *b) {
    const void *ar, *aw, *br, *bw;
    int64_t arn, awn, brn, bwn;
    comm_work_ranges(a, &ar, &arn, &aw, &awn);
    comm_work_ranges(b, &br, &brn, &bw, &bwn);
    return comm_overlaps(aw, awn, bw, bwn) || comm_overlaps(aw, awn, br, brn) || comm_overlaps(ar, arn, bw, bwn);
}

/* Keeps agreed member w for its group's launch; false when it must run now.
 * A member that depends on an earlier one (their buffers overlap, one
 * writing: the same tensors on every rank, so every rank decides alike)
 * starts a new group after the earlier members' launch, in stream order. */
bool comm_gpu_group_add(fsdp_work *w) {
    if (g_group_n == GROUP_MAX) comm_gpu_flush_group();   /* a long group: launched in parts */
    if (g_group_n > 0 && g_group[0]->device != w->device) comm_gpu_flush_group();
    for (int i = 0; i < g_group_n; i++) {
        if (works_conflict(g_group[i], w)) {
            comm_gpu_flush_group();
            break;
        }
    }
    g_group[g_group_n++] = w;
    w->deferred = true;
    return true;
}

static _Thread_local int t_group_depth;
static _Thread_local fsdp_comm *t_group_comm;   /* where the last member went: the end marker follows it */
static _Thread_local uint64_t t_group_serial;   /* the open group's number on this thread */

void comm_group_begin(void) {
    if (t_group_depth++ == 0) t_group_comm = NULL;
}

/* Queues the end marker of the members issued so far on this thread. */
static void group_close(void) {
    fsdp_comm *c = t_group_comm;
    t_group_comm = NULL;
    t_group_serial++;
    if (!c) return;   /* no CUDA member was issued */
    fsdp_work *w;
    /* If even the marker cannot be made, the comm thread launches the
     * members at the next work it meets; nothing here can wait for them. */
    if (comm_work_new(&w, K_GROUP_END, c, "", 0, DT_NONE, 0, "comm_group_end") != FSDP_OK) return;
    if (comm_enqueue(w, "comm_group_end") != FSDP_OK) {
        comm_work_unref(w);
        return;
    }
    comm_work_unref(w);   /* the queue holds its own reference */
}

void comm_group_end(void) {
    if (t_group_depth <= 0 || --t_group_depth > 0) return;
    group_close();
}

/* A wait inside an open group for one of its members: the members so far
 * are launched now (the group ends here, on every rank alike, since every
 * rank waits at the same point), and the group goes on with later ones. */
void comm_group_before_wait(const fsdp_work *w) {
    if (t_group_depth > 0 && w->grouped && w->group_serial == t_group_serial && t_group_comm) group_close();
}

/* At issue: whether w joins the caller's open group. Only CUDA collectives
 * with a handle the caller waits on later, and none that complete at issue
 * (FSDP_COMM_SYNC, a counting communicator). */
void comm_gpu_group_mark(fsdp_work *w, bool has_handle) {
    if (t_group_depth <= 0 || !has_handle || w->device != FSDP_DEVICE_CUDA || !w->gw || !w->comm) return;
    if (comm_cfg()->sync || w->comm->be->local) return;
    if (w->kind != K_ALL_GATHER && w->kind != K_REDUCE_SCATTER && w->kind != K_ALL_REDUCE && w->kind != K_BROADCAST)
        return;
    w->grouped = true;
    w->group_serial = t_group_serial;
    t_group_comm = w->comm;
}
