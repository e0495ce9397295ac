/* comm_work.c: work handles, the caller's side of a collective (DESIGN.md,
 * decision 4): making and freeing them, waiting for and testing them, the
 * error a work carries from the comm thread to the waiting thread, the
 * process-wide traffic statistics, and the REPL's hook that makes waits
 * give up (fsdp_comm_abandon). The queue and the comm thread that run the
 * works are in comm_queue.c. */
#define _POSIX_C_SOURCE 200809L   /* clock_gettime, nanosleep under -std=c11 */
#include "comm_impl.h"
#include "trace.h"
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

static struct timespec abs_time(double t) {
    struct timespec ts;
    ts.tv_sec = (time_t)t;
    ts.tv_nsec = (long)((t - (double)ts.tv_sec) * 1e9);
    if (ts.tv_nsec >= 1000000000L) { ts.tv_sec++; ts.tv_nsec -= 1000000000L; }
    return ts;
}

/* ---- statistics (fsdp_comm_stats: process-wide; fsdp_comm_counts: per family) ---- */

static pthread_mutex_t stats_mu = PTHREAD_MUTEX_INITIALIZER;
static int64_t g_gathered, g_reduced;
static int64_t g_wire_gathered, g_wire_reduced;   /* as they moved: compressed ones smaller */
static double g_wait_s;
static double g_busy_s, g_busy_end;   /* the union of the collectives' runs; where the last one ended */
static int g_active;                  /* host runs going on now, on all lanes */
static double g_active_since;         /* since when at least one has been (not before g_busy_end) */
static double g_window_end;           /* the last end of a counted one since then (0: none) */
static double g_lane_busy[COMM_LANES], g_lane_end[COMM_LANES], g_lane_wait[COMM_LANES];

fsdp_status fsdp_comm_stats(int64_t *gathered_bytes, int64_t *reduced_bytes, double *wait_seconds) {
    pthread_mutex_lock(&stats_mu);
    if (gathered_bytes) *gathered_bytes = g_gathered;
    if (reduced_bytes) *reduced_bytes = g_reduced;
    if (wait_seconds) *wait_seconds = g_wait_s;
    pthread_mutex_unlock(&stats_mu);
    return FSDP_OK;
}

fsdp_status fsdp_comm_busy(double *busy_seconds) {
    pthread_mutex_lock(&stats_mu);
    if (busy_seconds) *busy_seconds = g_busy_s;
    pthread_mutex_unlock(&stats_mu);
    return FSDP_OK;
}

fsdp_status fsdp_comm_lane_stats(int lane, double *busy_seconds, double *wait_seconds) {
    if (lane < 0 || lane >= COMM_LANES)
        return fsdp_set_error(FSDP_ERR_INVALID, "fsdp_comm_lane_stats: lane %d (expected 0 to %d)", lane,
                              COMM_LANES - 1);
    pthread_mutex_lock(&stats_mu);
    if (busy_seconds) *busy_seconds = g_lane_busy[lane];
    if (wait_seconds) *wait_seconds = g_lane_wait[lane];
    pthread_mutex_unlock(&stats_mu);
    return FSDP_OK;
}

/* The part of [t0, t1] on a lane that no earlier run of it covered
 * (collectives in flight together on the GPU overlap; a lane's host runs
 * follow each other). stats_mu held. */
static void lane_add(int lane, double t0, double t1) {
    if (t0 < g_lane_end[lane]) t0 = g_lane_end[lane];
    if (t1 > t0) g_lane_busy[lane] += t1 - t0;
    if (t1 > g_lane_end[lane]) g_lane_end[lane] = t1;
}

/* A CUDA collective (lane 0) ran from t0 to t1 (comm_now seconds): the part
 * no earlier run covered counts, up to where a host run going on now took
 * over (that one counts itself when it ends). */
void comm_count_busy(double t0, double t1) {
    pthread_mutex_lock(&stats_mu);
    lane_add(COMM_LANE_MAIN, t0, t1);
    double upto = g_active > 0 && g_active_since < t1 ? g_active_since : t1;
    if (t0 < g_busy_end) t0 = g_busy_end;
    if (upto > t0) g_busy_s += upto - t0;
    if (upto > g_busy_end) g_busy_end = upto;
    pthread_mutex_unlock(&stats_mu);
}

/* Host runs on several lanes overlap: the union counts, from the first
 * run that begins while none is going on to the last that ends. */
void comm_busy_begin(double t0) {
    pthread_mutex_lock(&stats_mu);
    if (g_active++ == 0) g_active_since = t0 > g_busy_end ? t0 : g_busy_end, g_window_end = 0;
    pthread_mutex_unlock(&stats_mu);
}

void comm_busy_end(int lane, double t0, double t1, bool counted) {
    pthread_mutex_lock(&stats_mu);
    if (counted) {
        lane_add(lane, t0, t1);
        if (t1 > g_window_end) g_window_end = t1;
    }
    if (--g_active == 0 && g_window_end > g_active_since) {
        g_busy_s += g_window_end - g_active_since;
        if (g_window_end > g_busy_end) g_busy_end = g_window_end;
    }
    pthread_mutex_unlock(&stats_mu);
}

fsdp_status fsdp_comm_wire_stats(int64_t *wire_gathered_bytes, int64_t *wire_reduced_bytes) {
    pthread_mutex_lock(&stats_mu);
    if (wire_gathered_bytes) *wire_gathered_bytes = g_wire_gathered;
    if (wire_reduced_bytes) *wire_reduced_bytes = g_wire_reduced;
    pthread_mutex_unlock(&stats_mu);
    return FSDP_OK;
}

fsdp_status fsdp_comm_reset_stats(void) {
    pthread_mutex_lock(&stats_mu);
    g_gathered = g_reduced = 0;
    g_wire_gathered = g_wire_reduced = 0;
    g_wait_s = 0;
    g_busy_s = 0;
    for (int i = 0; i < COMM_LANES; i++) g_lane_busy[i] = g_lane_wait[i] = 0;
    pthread_mutex_unlock(&stats_mu);
    return FSDP_OK;
}

/* A collective that ran: the process-wide traffic and the family's counts. */
void comm_count_traffic(fsdp_work *w, fsdp_comm *c) {
    int64_t bytes = w->n * (int64_t)fsdp_dtype_size(w->dtype);
    int64_t gathered = 0, reduced = 0;
    if (w->kind == K_ALL_GATHER) gathered = bytes * w->comm_size;
    if (w->kind == K_REDUCE_SCATTER) reduced = bytes * w->comm_size;
    if (w->kind == K_ALL_REDUCE) reduced = bytes;
    int64_t wire = w->wire_bytes ? w->wire_bytes : gathered + reduced;
    if (gathered || reduced) {
        pthread_mutex_lock(&stats_mu);
        g_gathered += gathered;
        g_reduced += reduced;
        g_wire_gathered += gathered ? wire : 0;
        g_wire_reduced += reduced ? wire : 0;
        pthread_mutex_unlock(&stats_mu);
    }
    if (c && c->counts && w->kind < K_COUNTED) {
        /* a compressed reduction's fingerprint holds its wire bytes */
        long long logical = w->wire_bytes ? (long long)(bytes * w->comm_size) : (long long)w->fp.bytes;
        atomic_fetch_add(&c->counts->calls[w->kind], 1);
        atomic_fetch_add(&c->counts->bytes[w->kind], logical);
        atomic_fetch_add(&c->counts->wire[w->kind], w->wire_bytes ? (long long)w->wire_bytes : logical);
    }
}

/* ---- works ---- */

void comm_work_unref(fsdp_work *w) {
    if (atomic_fetch_sub(&w->refs, 1) != 1) return;
    tensor_release(w->t_dst);
    tensor_release(w->t_src);
    tensor_release(w->t_scratch);
    tensor_release(w->t_recv);
    free(w->doubles);
    if (w->gw) comm_device_backend()->work_free(w->gw);
    pthread_mutex_destroy(&w->mu);
    pthread_cond_destroy(&w->cv);
    free(w);
}

fsdp_status comm_work_new(fsdp_work **out, work_kind kind, fsdp_comm *c, const char *label, int64_t bytes, int dtype,
                          int arg, const char *opname) {
    if (comm_cfg()->error[0]) return fsdp_set_error(FSDP_ERR_INVALID, "%s: %s", opname, comm_cfg()->error);
    fsdp_work *w = calloc(1, sizeof *w);
    if (!w) return fsdp_set_error(FSDP_ERR_OOM, "%s: out of host memory for a work handle", opname);
    atomic_init(&w->refs, 1);
    pthread_mutex_init(&w->mu, NULL);
    comm_cond_init(&w->cv);
    w->kind = kind;
    w->comm = c;
    w->counted = kind != K_FREE && kind != K_GROUP_END;
    snprintf(w->comm_name, sizeof w->comm_name, "%s", c->name);
    w->comm_size = c->size;
    if (!label) label = "";
    w->fp.comm_id = c->id;
    w->fp.bytes = (uint64_t)bytes;
    w->fp.label_hash = comm_hash_str(label);
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
void comm_work_drop_tensors(fsdp_work *w) {
    pthread_mutex_lock(&w->mu);
    fsdp_tensor *a = w->t_dst, *b = w->t_src, *c = w->t_scratch, *r = w->t_recv;
    w->t_dst = w->t_src = w->t_scratch = w->t_recv = NULL;
    pthread_mutex_unlock(&w->mu);
    tensor_release(r);
    tensor_release(a);
    tensor_release(b);
    tensor_release(c);
}

/* Whether a CUDA collective reached the comm stream, so that its tensors
 * must live until the GPU is done with it. */
bool comm_work_on_gpu(const fsdp_work *w) {
    return w->gw && comm_device_backend()->work_recorded(w->gw);
}

int comm_last_error_len(const char **e) {
    char suffix[32];
    snprintf(suffix, sizeof suffix, " [rank %d]", fsdp_current_rank());
    *e = fsdp_last_error();
    size_t n = strlen(*e), k = strlen(suffix);
    if (n >= k && strcmp(*e + n - k, suffix) == 0) n -= k;
    return (int)n;
}

/* The comm thread's error, kept in the work for the waiting thread (whose
 * fsdp_set_error adds " [rank N]" back). */
void comm_work_take_error(fsdp_work *w, fsdp_status st) {
    const char *e;
    int n = comm_last_error_len(&e);
    char what[160];
    comm_fp_describe(&w->fp, false, what, sizeof what);
    snprintf(w->msg, sizeof w->msg, "%s (collective #%llu on comm %s(%d)): %.*s", what,
             (unsigned long long)w->fp.seq, w->comm_name, w->comm_size, n, e);
    w->status = st;
}

/* ---- public: works ---- */

/* A CUDA collective the comm thread has enqueued: order the compute stream
 * after it (or, with FSDP_NCCL_BLOCKING_WAIT, wait for the GPU here, under
 * the watchdog); then its tensors may go back. */
static fsdp_status gpu_wait(fsdp_work *w, double t0) {
    const comm_backend *dev = comm_device_backend();
    const comm_config *cfg = comm_cfg();
    fsdp_status st = FSDP_OK;
    if (cfg->blocking_wait) {
        for (;;) {
            int r = dev->work_poll(w->gw, NULL);
            if (r > 0) break;
            if (r < 0) {
                st = FSDP_ERR_COMM;
                break;
            }
            if (cfg->watchdog_s > 0 && comm_now() - t0 > cfg->watchdog_s) comm_watchdog_fire(w, comm_now() - t0);
            struct timespec ts = {0, 20000};
            nanosleep(&ts, NULL);
        }
    } else {
        st = dev->work_wait(w->gw);
    }
    if (st != FSDP_OK) {
        /* the buffers stay held (until the handle goes): the GPU may still use them */
        const char *e;
        int n = comm_last_error_len(&e);
        char what[160];
        comm_fp_describe(&w->fp, false, what, sizeof what);
        return fsdp_set_error(st, "%s (collective #%llu on comm %s(%d)): %.*s", what, (unsigned long long)w->fp.seq,
                              w->comm_name, w->comm_size, n, e);
    }
    comm_work_drop_tensors(w);
    return FSDP_OK;
}

/* fsdp_comm_abandon: waits give up (the REPL, when a peer failed a chunk). */
static _Atomic int g_abandon_on;
static long long g_abandoned;
static char g_abandon_reason[512];
static pthread_mutex_t g_abandon_mu = PTHREAD_MUTEX_INITIALIZER;

fsdp_status fsdp_comm_abandon(const char *reason, int64_t *abandoned) {
    pthread_mutex_lock(&g_abandon_mu);
    if (abandoned) *abandoned = g_abandoned;
    if (reason) {
        snprintf(g_abandon_reason, sizeof g_abandon_reason, "%s", reason);
        g_abandon_on = 1;
    } else {
        g_abandon_on = 0;
        g_abandoned = 0;
    }
    pthread_mutex_unlock(&g_abandon_mu);
    return FSDP_OK;
}

static fsdp_status abandon_wait(fsdp_work *w) {
    pthread_mutex_lock(&g_abandon_mu);
    g_abandoned++;
    char what[160];
    comm_fp_describe(&w->fp, false, what, sizeof what);
    fsdp_status st = fsdp_set_error(FSDP_ERR_COMM, "%s (collective #%llu on comm %s(%d)) abandoned: %s", what,
                                    (unsigned long long)w->fp.seq, w->comm_name, w->comm_size, g_abandon_reason);
    pthread_mutex_unlock(&g_abandon_mu);
    return st;
}

fsdp_status fsdp_comm_pending(int64_t *works, uint64_t *comm_id, uint64_t *seq, int *moving) {
    if (!works || !comm_id || !seq)
        return fsdp_set_error(FSDP_ERR_INVALID, "fsdp_comm_pending: %s is NULL",
                              !works ? "works" : !comm_id ? "comm_id" : "seq");
    bool m = false;
    comm_queue_pending(works, comm_id, seq, &m);
    if (moving) *moving = m;
    return FSDP_OK;
}

fsdp_status fsdp_comm_cancel(uint64_t comm_id, uint64_t seq, int *joined) {
    static const char *name = "fsdp_comm_cancel";
    if (joined) *joined = 0;
    if (seq == UINT64_MAX) return FSDP_OK;
    /* held while the communicator is used: a queued free cannot take it away */
    fsdp_comm *world = NULL;
    if (comm_id == comm_hash_str("world")) {
        /* the world may not be made yet on a rank that has not used it */
        FSDP_TRY(fsdp_comm_world(&world));
    }
    comm_live_lock(true);
    fsdp_comm *c = comm_live_find(comm_id);
    fsdp_status st = FSDP_OK;
    if (c) {
        fsdp_work *w;
        st = comm_work_new(&w, K_CANCEL, c, "", 0, DT_NONE, 0, name);
        bool issued = false;
        if (st == FSDP_OK) st = comm_issue_if_next(w, seq, &issued, name);
        if (joined) *joined = issued;
    }
    comm_live_lock(false);
    if (world) (void)fsdp_comm_free(world);   /* the world stays; only the handle goes */
    return st;
}

fsdp_status fsdp_work_wait(fsdp_work *w) {
    if (!w) return fsdp_set_error(FSDP_ERR_INVALID, "fsdp_work_wait: work is NULL");
    const comm_config *cfg = comm_cfg();
    double t0 = comm_now();
    comm_group_before_wait(w);
    pthread_mutex_lock(&w->mu);
    /* Later than the comm thread's own watchdog, which reports more. */
    double limit = cfg->watchdog_s + comm_watchdog_grace() + 1;
    while (!w->done) {
        if (g_abandon_on) {
            pthread_mutex_unlock(&w->mu);
            return abandon_wait(w);   /* the work keeps its tensors: the comm thread may still use them */
        }
        /* wake up now and then to see fsdp_comm_abandon */
        double until = t0 + (cfg->watchdog_s > 0 ? limit : 1e18), tick = comm_now() + 0.1;
        struct timespec dl = abs_time(tick < until ? tick : until);
        int rc = pthread_cond_timedwait(&w->cv, &w->mu, &dl);
        if (rc == ETIMEDOUT && !w->done && cfg->watchdog_s > 0 && comm_now() - t0 > limit) {
            pthread_mutex_unlock(&w->mu);
            comm_watchdog_fire(w, comm_now() - t0);
            pthread_mutex_lock(&w->mu);
        }
    }
    w->observed = true;
    fsdp_status st = w->status;
    pthread_mutex_unlock(&w->mu);
    if (fsdp_timeline_on && w->counted && !comm_waiting_at_issue()) timeline_wait(w->fp.comm_id, w->fp.seq);
    if (fsdp_trace_on)
        trace_event_add(TRACE_COMPUTE, "wait", w->fp.label, (int64_t)w->fp.bytes, (int64_t)w->fp.seq, t0 * 1e6,
                        trace_now());
    fsdp_status gst = comm_work_on_gpu(w) ? gpu_wait(w, t0) : FSDP_OK;
    double dt = comm_now() - t0;
    pthread_mutex_lock(&stats_mu);
    g_wait_s += dt;
    g_lane_wait[w->lane] += dt;
    pthread_mutex_unlock(&stats_mu);
    /* The comm thread's message, re-set on this thread. */
    if (st != FSDP_OK) return fsdp_set_error(st, "%s", w->msg);
    return gst;
}

/* *done = 1 once complete; a completed work that failed returns its error. */
fsdp_status fsdp_work_test(fsdp_work *w, int *done) {
    if (!w || !done) return fsdp_set_error(FSDP_ERR_INVALID, "fsdp_work_test: %s is NULL", w ? "done" : "work");
    comm_group_before_wait(w);   /* (a member tested inside its open group would never be done) */
    pthread_mutex_lock(&w->mu);
    bool is_done = w->done;
    fsdp_status st = w->done ? w->status : FSDP_OK;
    pthread_mutex_unlock(&w->mu);
    if (is_done && comm_work_on_gpu(w)) {   /* enqueued: done once the GPU is */
        int r = comm_device_backend()->work_poll(w->gw, NULL);
        if (r == 0) is_done = false;
        if (r < 0 && st == FSDP_OK) {
            const char *e;
            int n = comm_last_error_len(&e);
            snprintf(w->msg, sizeof w->msg, "%.*s", n, e);
            st = FSDP_ERR_COMM;
        }
        if (r > 0) comm_work_drop_tensors(w);
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
    comm_work_unref(w);
    return seen ? FSDP_OK : st;
}
