/* comm_queue.c: the comm thread and its queue (DESIGN.md, decision 4).
 *
 * Every collective becomes a work item on a process-wide comm thread that
 * runs them in issue order: lane 0's, or for a communicator put on the
 * replica lane, that lane's (see "the lanes"). Each rank therefore enters
 * each communicator's collectives in exactly the order the caller issued
 * them, and the calling thread blocks
 * only inside fsdp_work_wait (comm_work.c, with the rest of the caller's
 * side of a work). A work holds its tensors until it completes.
 * Before a work's data moves, comm_agree (comm_debug.c) checks that every
 * rank runs the same collective.
 *
 * Host collectives run here through comm_run_host.c (bf16 widening,
 * scratch); CUDA collectives through comm_run_gpu.c (the comm stream,
 * groups, collectives in flight), on lane 0 only.
 */
#define _POSIX_C_SOURCE 200809L   /* clock_gettime, nanosleep, pthread_condattr_setclock under -std=c11 */
#include "comm_impl.h"
#include "trace.h"
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

/* ---- configuration from the environment (read once) ---- */

static pthread_once_t config_once = PTHREAD_ONCE_INIT;
/* Watchdog default: 120 s. Long enough for what one rank may do while the
 * others wait at the next collective (an evaluation, a sample, a checkpoint
 * written by one rank, a slow first step), short enough that a stuck job
 * costs two minutes instead of ten. Tests use a few seconds. */
static comm_config g_cfg = {.watchdog_s = 120};
static pthread_condattr_t g_condattr;   /* waits measured on CLOCK_MONOTONIC */

static bool env_flag(const char *name) {
    const char *v = getenv(name);
    return v && v[0] && strcmp(v, "0") != 0;
}

static void config_init(void) {
    g_cfg.debug = env_flag("FSDP_DEBUG_COLLECTIVES");
    g_cfg.blocking_wait = env_flag("FSDP_NCCL_BLOCKING_WAIT");
    g_cfg.sync = env_flag("FSDP_COMM_SYNC");
    g_cfg.lanes = COMM_LANES;
    const char *lanes = getenv("FSDP_COMM_LANES");
    if (lanes && lanes[0]) {
        if (!strcmp(lanes, "1") || !strcmp(lanes, "2")) g_cfg.lanes = lanes[0] - '0';
        else snprintf(g_cfg.error, sizeof g_cfg.error, "FSDP_COMM_LANES=%.16s: expected 1 (one comm thread) or 2 "
                      "(replica reductions on a thread of their own)", lanes);
    }
    const char *w = getenv("FSDP_WATCHDOG_SECONDS");
    if (w && w[0]) {
        char *end = NULL;
        double v = strtod(w, &end);
        while (end && (*end == ' ' || *end == '\t')) end++;
        if (end == w || *end != '\0' || !(v == 0 || v >= 1) || v > 1e9)
            /* below 1 s a healthy job's ordinary waits would end it */
            snprintf(g_cfg.error, sizeof g_cfg.error, "FSDP_WATCHDOG_SECONDS=%.60s: expected 0 (no watchdog) or a "
                     "number of seconds >= 1", w);
        else
            g_cfg.watchdog_s = v;
    }
    pthread_condattr_init(&g_condattr);
    pthread_condattr_setclock(&g_condattr, CLOCK_MONOTONIC);
}

const comm_config *comm_cfg(void) {
    pthread_once(&config_once, config_init);
    return &g_cfg;
}

void comm_cond_init(pthread_cond_t *cv) {
    comm_cfg();
    pthread_cond_init(cv, &g_condattr);
}

double comm_now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

/* ---- the lanes ----
 * A lane is one comm thread with its own queue. Every communicator's
 * collectives run on lane 0 unless it was put on another (comm_set_lane:
 * hybrid_shard's replica reductions on the CPU, so that an all-reduce
 * across a slow inter-node link does not hold up the intra-node gathers
 * queued behind it). The works of one communicator stay on its lane, in
 * issue order, so every rank still enters each communicator's collectives
 * in one order; a work that touches bytes an unfinished work of another
 * lane touches (one of them writing) waits for that work before it runs.
 * Such waits point back in the issue order, which is the same on every
 * rank, so they cannot close a cycle. CUDA collectives run on lane 0 only
 * (one comm stream: two threads would order it differently on each rank). */

typedef struct lane {
    pthread_cond_t cv;            /* work arrived, or stop */
    fsdp_work *head, *tail;
    bool running, stop, busy;
    pthread_t thread;
    fsdp_work *run;               /* the work the thread runs now, or NULL */
    fingerprint current;          /* what the thread runs now, for the watchdog */
    char current_comm[COMM_NAME];
    int current_size;
    rank_state state;
    double state_since;
} lane;

static pthread_mutex_t q_mu = PTHREAD_MUTEX_INITIALIZER;      /* every lane's queue and state */
static pthread_cond_t q_idle = PTHREAD_COND_INITIALIZER;      /* a lane drained */
static lane g_lanes[COMM_LANES] = {{.cv = PTHREAD_COND_INITIALIZER}, {.cv = PTHREAD_COND_INITIALIZER}};
static _Thread_local lane *t_lane;    /* the comm thread's own lane */
static uint64_t q_order;              /* issue order across lanes (comm_queue_pending's oldest) */
static fingerprint q_last = {.seq = UINT64_MAX};   /* the last collective finished */
static char q_last_comm[COMM_NAME];
static int q_last_size;
static int q_failed;
#define HISTORY 8
static struct { fingerprint fp; char comm[40]; int size; } q_history[HISTORY];   /* debug mode */
static uint64_t q_history_n;

static void set_state(rank_state st) {
    pthread_mutex_lock(&q_mu);
    t_lane->state = st;
    t_lane->state_since = comm_now();
    pthread_mutex_unlock(&q_mu);
}

/* The lane a report names (q_mu held): the one that has waited longest in
 * a collective, or lane 0 when none is in one. */
static lane *reported_lane(void) {
    lane *pick = &g_lanes[0];
    for (int i = 0; i < COMM_LANES; i++) {
        lane *l = &g_lanes[i];
        bool in = l->state == RS_ARRIVING || l->state == RS_MOVING;
        bool pick_in = pick->state == RS_ARRIVING || pick->state == RS_MOVING;
        if (in && (!pick_in || l->state_since < pick->state_since)) pick = l;
    }
    return pick;
}

void comm_status_fill(comm_status *s) {
    memset(s, 0, sizeof *s);
    s->rank = fsdp_current_rank();
    pthread_mutex_lock(&q_mu);
    const lane *l = reported_lane();
    s->state = l->state;
    s->seconds = l->state_since > 0 ? comm_now() - l->state_since : 0;
    if (l->state == RS_ARRIVING || l->state == RS_MOVING) {
        s->current = l->current;
        snprintf(s->current_comm, sizeof s->current_comm, "%.39s", l->current_comm);
        s->current_size = l->current_size;
    }
    s->last = q_last;
    snprintf(s->last_comm, sizeof s->last_comm, "%.39s", q_last_comm);
    s->last_size = q_last_size;
    s->failed = q_failed;
    pthread_mutex_unlock(&q_mu);
}

void comm_history(char *buf, size_t size) {
    buf[0] = '\0';
    pthread_mutex_lock(&q_mu);
    size_t at = 0;
    uint64_t first = q_history_n > HISTORY ? q_history_n - HISTORY : 0;
    for (uint64_t i = first; i < q_history_n && at + 1 < size; i++) {
        char d[160];
        comm_fp_describe(&q_history[i % HISTORY].fp, true, d, sizeof d);
        int k = snprintf(buf + at, size - at, "\n  %s on comm %s(%d)", d, q_history[i % HISTORY].comm,
                         q_history[i % HISTORY].size);
        if (k < 0) break;
        at += (size_t)k;
    }
    pthread_mutex_unlock(&q_mu);
}

/* w finished (comm thread): the last one, for the watchdog. */
static void note_finished(fsdp_work *w) {
    if (!w->counted) return;
    if (w->comm) w->comm->last_done = w->fp;
    pthread_mutex_lock(&q_mu);
    q_last = w->fp;
    snprintf(q_last_comm, sizeof q_last_comm, "%s", w->comm_name);
    q_last_size = w->comm_size;
    if (g_cfg.debug) {
        q_history[q_history_n % HISTORY].fp = w->fp;
        snprintf(q_history[q_history_n % HISTORY].comm, sizeof q_history[0].comm, "%.39s", w->comm_name);
        q_history[q_history_n % HISTORY].size = w->comm_size;
        q_history_n++;
    }
    pthread_mutex_unlock(&q_mu);
}

void comm_queue_current(bool *busy, fingerprint *fp, char *comm_name, size_t name_size, int *comm_size) {
    pthread_mutex_lock(&q_mu);
    const lane *l = reported_lane();
    *busy = false;
    for (int i = 0; i < COMM_LANES; i++) *busy = *busy || g_lanes[i].busy;
    *fp = l->current;
    snprintf(comm_name, name_size, "%s", l->current_comm);
    *comm_size = l->current_size;
    pthread_mutex_unlock(&q_mu);
}

/* A parent with an NCCL side gives the child its own by ncclCommSplit, in
 * the split's place in the issue order; every rank of the parent takes
 * part, also one the host split refused or left out (as color -1), so that
 * none waits in NCCL for it. Without one (no CUDA collective on the parent
 * yet, or an NCCL before 2.18) the child makes its NCCL side on its first
 * CUDA collective, from a unique id of its own (comm_nccl.c). */
static fsdp_status split_gpu(fsdp_comm *p, fsdp_work *w, fsdp_comm *child, bool joined) {
    if (!p->dev || !p->gpu || !p->dev->gpu_split) return FSDP_OK;
    comm_gpu *g = NULL;
    fsdp_status st = p->dev->gpu_split(p->gpu, joined ? w->color : -1, w->key, child->rank, child->size, &g);
    if (st == FSDP_OK) child->gpu = g;
    return st;
}

static fsdp_status run_split(fsdp_work *w) {
    fsdp_comm *p = w->comm;
    fsdp_comm *child = w->split_out;   /* made by the caller: rank and size -1 unless known */
    fsdp_status st = p->be->split(p, w->color, w->key, child);
    if (st != FSDP_OK) {
        char msg[1024];
        snprintf(msg, sizeof msg, "%s", fsdp_last_error());
        (void)split_gpu(p, w, child, false);   /* (its own failure would hide the first one) */
        fsdp_set_error(st, "%s", msg);
        w->split_out = NULL;
        comm_counts_unref(child->counts);
        free(child);
        return st;
    }
    st = split_gpu(p, w, child, true);
    if (st != FSDP_OK) {
        char msg[1024];
        snprintf(msg, sizeof msg, "%s", fsdp_last_error());
        (void)child->be->destroy(child);
        fsdp_set_error(st, "%s", msg);
        w->split_out = NULL;
        comm_counts_unref(child->counts);
        free(child);
        return st;
    }
    child->magic = COMM_MAGIC;
    child->be = p->be;
    child->dev = p->dev;
    /* Same on every member: same parent, same split (sequence), same color. */
    child->id = comm_hash_mix(comm_hash_mix(p->id, w->fp.seq), (uint64_t)(uint32_t)w->color);
    snprintf(child->name, sizeof child->name, "%.48s.split%llu.color%d", p->name, (unsigned long long)w->fp.seq,
             w->color);
    if (!child->be->local) comm_live_add(child);
    return FSDP_OK;
}

/* A work whose caller gave up waiting for it (fsdp_comm_abandon), once it
 * is done: a split's child nobody will receive goes. */
static void drop_orphan(fsdp_work *w) {
    fsdp_comm *child = w->kind == K_SPLIT ? w->split_out : NULL;
    if (!child) return;
    w->split_out = NULL;
    if (w->status == FSDP_OK && child->magic == COMM_MAGIC) {
        comm_live_remove(child);
        /* its NCCL side, when ncclCommSplit gave it one (nothing of it ran) */
        if (child->gpu && child->dev) (void)child->dev->gpu_destroy(child->gpu);
        child->gpu = NULL;
        (void)child->be->destroy(child);
    }
    comm_counts_unref(child->counts);
    child->magic = 0;
    free(child);
}

static fsdp_status run_free(fsdp_work *w) {
    fsdp_comm *c = w->comm;
    fsdp_status st = FSDP_OK;
    if (c->dev && t_lane == &g_lanes[COMM_LANE_MAIN]) {   /* (CUDA collectives run on lane 0 only) */
        comm_gpu_drain();   /* nothing of it may still run on the GPU, NCCL or device copies */
        if (c->gpu) st = c->dev->gpu_destroy(c->gpu);
        c->gpu = NULL;
    }
    comm_live_remove(c);
    fsdp_status bst = c->be->destroy(c);
    if (st == FSDP_OK) st = bst;
    comm_counts_unref(c->counts);
    c->magic = 0;
    free(c);
    w->comm = NULL;
    return st;
}

static void run_work(fsdp_work *w) {
    fsdp_comm *c = w->comm;
    set_state(RS_ARRIVING);
    fsdp_status st = comm_agree(w);
    set_state(RS_MOVING);
    if (st != FSDP_OK) {
        if (w->status == FSDP_OK) comm_work_take_error(w, st);   /* the exchange itself failed */
        return;
    }
    if (w->device == FSDP_DEVICE_CUDA) {
        if (w->grouped && comm_gpu_group_add(w)) return;   /* launched with its group (flush_group) */
        st = comm_gpu_run(w);
        if (st != FSDP_OK) comm_work_take_error(w, st);
        else comm_count_traffic(w, c);
        return;
    }
    /* A counting communicator leaves tensors of other devices untouched:
     * their memory may not be readable from the host. */
    bool touch = !(c && c->be->local && w->device != FSDP_DEVICE_CPU);
    if (!touch && !w->compress && c->be == &comm_count_backend && device_is_host_like(w->device)) {
        st = comm_count_scratch(w);
        if (st != FSDP_OK) {
            comm_work_take_error(w, st);
            return;
        }
    }
    size_t esz = fsdp_dtype_size(w->dtype);
    switch (w->kind) {
    case K_ALL_GATHER: if (touch) st = comm_run_all_gather(w); break;
    case K_REDUCE_SCATTER: st = w->compress ? comm_compress_run(w, touch) : touch ? comm_run_reduce_scatter(w) : st; break;
    case K_ALL_REDUCE: if (touch) st = comm_run_all_reduce(w); break;
    case K_BROADCAST: if (touch) st = c->be->broadcast(c, w->dst, w->n * (int64_t)esz, w->root); break;
    case K_BARRIER: st = c->be->barrier(c); break;
    case K_DOUBLES: st = comm_run_doubles(w); break;
    case K_SPLIT: st = run_split(w); break;
    case K_FREE: st = run_free(w); break;
    case K_CANCEL:   /* only reached when every rank cancelled: nobody issued it */
        st = fsdp_set_error(FSDP_ERR_COMM, "cancelled on every rank");
        break;
    case K_GROUP_END: break;   /* its group was launched before it ran (comm_thread_main) */
    }
    if (st != FSDP_OK) {
        comm_work_take_error(w, st);
        return;
    }
    comm_count_traffic(w, w->comm ? c : NULL);
}

/* ---- the comm thread ---- */

/* w ran (or failed, or was launched with its group): the watchdog's
 * record, the tensors back (a CUDA collective's once the GPU is done with
 * them, not when the handle is freed), the waiter woken. */
void comm_queue_complete(fsdp_work *w) {
    if (w->status == FSDP_OK) {
        note_finished(w);
    } else {
        pthread_mutex_lock(&q_mu);
        q_failed++;
        pthread_mutex_unlock(&q_mu);
    }
    set_state(RS_IDLE);
    if (comm_work_on_gpu(w)) comm_gpu_inflight_push(w);
    else comm_work_drop_tensors(w);
    pthread_mutex_lock(&w->mu);
    w->done = true;
    bool orphaned = w->orphaned;
    pthread_cond_broadcast(&w->cv);
    pthread_mutex_unlock(&w->mu);
    if (orphaned) drop_orphan(w);
    comm_work_unref(w);
}

/* The world's service (answers to watchdog questions), once a world
 * between ranks exists. */
static void (*g_service)(void);

void comm_set_service(void (*fn)(void)) {
    pthread_mutex_lock(&q_mu);
    g_service = fn;
    pthread_mutex_unlock(&q_mu);
}

/* Before w runs on its lane: the works of other lanes it depends on have
 * finished (they were queued before it; see "the lanes"). */
static void wait_dependencies(fsdp_work *w) {
    for (int i = 0; i < COMM_LANES; i++) {
        fsdp_work *d = w->after[i];
        if (!d) continue;
        pthread_mutex_lock(&d->mu);
        while (!d->done) pthread_cond_wait(&d->cv, &d->mu);
        pthread_mutex_unlock(&d->mu);
        w->after[i] = NULL;
        comm_work_unref(d);
    }
}

static void *comm_thread_main(void *arg) {
    lane *L = arg;
    t_lane = L;
    bool main_lane = L == &g_lanes[0];
    pthread_mutex_lock(&q_mu);
    for (;;) {
        if (!L->head) {
            /* stop once the queue is drained and the GPU has finished */
            bool gpu_busy = main_lane && comm_gpu_inflight();
            if (L->stop && !gpu_busy) break;
            L->busy = false;
            pthread_cond_broadcast(&q_idle);
            if (gpu_busy) {
                /* poll the collectives in flight every 2 ms (the lane's cv: realtime clock) */
                struct timespec dl;
                clock_gettime(CLOCK_REALTIME, &dl);
                dl.tv_nsec += 2000000L;
                if (dl.tv_nsec >= 1000000000L) { dl.tv_sec++; dl.tv_nsec -= 1000000000L; }
                pthread_cond_timedwait(&L->cv, &q_mu, &dl);
                pthread_mutex_unlock(&q_mu);
                comm_gpu_poll();
                pthread_mutex_lock(&q_mu);
            } else if (g_service && main_lane) {
                /* answer other ranks' watchdog questions while idle, every 100 ms */
                struct timespec dl;
                clock_gettime(CLOCK_REALTIME, &dl);
                dl.tv_nsec += 100000000L;
                if (dl.tv_nsec >= 1000000000L) { dl.tv_sec++; dl.tv_nsec -= 1000000000L; }
                pthread_cond_timedwait(&L->cv, &q_mu, &dl);
                if (!L->head && !L->stop) {
                    pthread_mutex_unlock(&q_mu);
                    g_service();
                    pthread_mutex_lock(&q_mu);
                }
            } else {
                pthread_cond_wait(&L->cv, &q_mu);
            }
            continue;
        }
        fsdp_work *w = L->head;
        L->busy = true;
        pthread_mutex_unlock(&q_mu);
        wait_dependencies(w);   /* w stays at the head (pending) meanwhile */
        pthread_mutex_lock(&q_mu);
        L->head = w->next;
        if (!L->head) L->tail = NULL;
        L->run = w;
        L->current = w->fp;
        snprintf(L->current_comm, sizeof L->current_comm, "%s", w->comm_name);
        L->current_size = w->comm_size;
        pthread_mutex_unlock(&q_mu);

        double tt0 = trace_now();
        if (main_lane && !w->grouped) comm_gpu_flush_group();   /* a group ends where its members do */
        /* a host collective's run is busy time; a CUDA one's is counted when the GPU finishes it */
        bool moves = w->kind != K_FREE && w->kind != K_SPLIT && w->kind != K_GROUP_END && w->kind != K_CANCEL;
        double t_run = comm_now();
        if (moves) comm_busy_begin(t_run);
        run_work(w);
        if (moves) comm_busy_end(w->lane, t_run, comm_now(), counts_busy(w) && !comm_work_on_gpu(w));
        pthread_mutex_lock(&q_mu);
        L->run = NULL;   /* ran: no longer pending for fsdp_comm_pending */
        pthread_mutex_unlock(&q_mu);
        if (tt0 > 0)
            trace_event_add(w->lane == COMM_LANE_MAIN ? TRACE_COMM : TRACE_COMM_REPLICA, comm_kind_names[w->kind],
                            w->fp.label, (int64_t)w->fp.bytes, (int64_t)w->fp.seq, tt0, trace_now());
        if (!w->deferred) comm_queue_complete(w);
        else set_state(RS_IDLE);
        if (main_lane && comm_gpu_inflight()) comm_gpu_poll();

        pthread_mutex_lock(&q_mu);
    }
    L->busy = false;
    pthread_cond_broadcast(&q_idle);
    pthread_mutex_unlock(&q_mu);
    return NULL;
}

/* The bytes a host work reads and writes (over-estimates only add waits). */
static void host_ranges(const fsdp_work *w, const void **rd, int64_t *rn, const void **wr, int64_t *wn) {
    *rd = *wr = NULL;
    *rn = *wn = 0;
    switch (w->kind) {
    case K_ALL_GATHER: case K_REDUCE_SCATTER: case K_ALL_REDUCE: case K_BROADCAST:
        comm_work_ranges(w, rd, rn, wr, wn);
        if (w->t_recv) *rn = INT64_MAX / 4;   /* compressed: src is the packed parts; stay on the safe side */
        break;
    case K_DOUBLES: *rd = *wr = w->doubles, *rn = *wn = w->n * 8; break;
    default: break;   /* splits, frees, barriers, cancels: no bytes of the caller's */
    }
}

static bool host_works_conflict(const fsdp_work *a, const fsdp_work *b) {
    const void *ar, *aw, *br, *bw;
    int64_t arn, awn, brn, bwn;
    host_ranges(a, &ar, &arn, &aw, &awn);
    host_ranges(b, &br, &brn, &bw, &bwn);
    return comm_overlaps(aw, awn, bw, bwn) || comm_overlaps(aw, awn, br, brn) || comm_overlaps(ar, arn, bw, bwn);
}

/* q_mu held: w waits for the last unfinished work of each other lane it
 * conflicts with. Only when more than one lane has ever run. */
static void note_dependencies(fsdp_work *w) {
    for (int i = 0; i < COMM_LANES; i++) {
        lane *l = &g_lanes[i];
        if (i == w->lane || !l->running) continue;
        fsdp_work *last = NULL;
        if (l->run && host_works_conflict(l->run, w)) last = l->run;
        for (fsdp_work *x = l->head; x; x = x->next)
            if (host_works_conflict(x, w)) last = x;
        if (!last) continue;
        atomic_fetch_add(&last->refs, 1);
        w->after[i] = last;
    }
}

/* Puts w at the end of its communicator's lane, with the next sequence
 * number of its communicator; with only_seq, only when that number is
 * *only_seq (else *issued is false and w stays the caller's). */
static fsdp_status enqueue(fsdp_work *w, const uint64_t *only_seq, bool *issued, const char *opname) {
    pthread_mutex_lock(&q_mu);
    if (issued) *issued = false;
    if (only_seq && (!w->counted || w->comm->next_seq != *only_seq)) {
        pthread_mutex_unlock(&q_mu);
        return FSDP_OK;
    }
    w->lane = w->comm ? w->comm->lane : COMM_LANE_MAIN;
    if (w->lane != COMM_LANE_MAIN && w->device == FSDP_DEVICE_CUDA) {
        pthread_mutex_unlock(&q_mu);
        return fsdp_set_error(FSDP_ERR_INVALID, "%s: comm %s(%d) runs on comm lane %d, which carries host tensors "
                              "only; a CUDA collective needs a communicator on lane 0", opname, w->comm_name,
                              w->comm_size, w->lane);
    }
    lane *L = &g_lanes[w->lane];
    if (!L->running) {
        L->stop = false;
        int rc = pthread_create(&L->thread, NULL, comm_thread_main, L);
        if (rc != 0) {
            pthread_mutex_unlock(&q_mu);
            return fsdp_set_error(FSDP_ERR_COMM, "%s: cannot start the comm thread of lane %d: %s", opname, w->lane,
                                  strerror(rc));
        }
        L->running = true;
    }
    if (issued) *issued = true;
    if (w->counted) w->fp.seq = w->comm->next_seq++;
    w->order = q_order++;
    note_dependencies(w);
    atomic_fetch_add(&w->refs, 1);   /* the queue's reference */
    w->next = NULL;
    if (L->tail) L->tail->next = w;
    else L->head = w;
    L->tail = w;
    L->busy = true;
    pthread_cond_signal(&L->cv);
    pthread_mutex_unlock(&q_mu);
    return FSDP_OK;
}

/* comm_set_lane's checks: another lane only for a communicator between
 * ranks that has not queued anything yet, when MPI takes calls from two
 * threads at once and FSDP_COMM_LANES allows it. */
void comm_set_lane(fsdp_comm *c, int lane_id) {
    if (!c || lane_id < 0 || lane_id >= COMM_LANES || comm_cfg()->lanes <= lane_id) return;
    if (lane_id != COMM_LANE_MAIN) {
        if (c->be->local || c->size < 2 || c->mpi == MPI_COMM_NULL) return;
        int level = MPI_THREAD_SINGLE;
        MPI_Query_thread(&level);
        if (level < MPI_THREAD_MULTIPLE) return;
    }
    pthread_mutex_lock(&q_mu);
    if (c->next_seq == 0) c->lane = lane_id;
    pthread_mutex_unlock(&q_mu);
}

int comm_lane_of(fsdp_comm *c) { return c ? c->lane : -1; }

fsdp_status comm_enqueue(fsdp_work *w, const char *opname) { return enqueue(w, NULL, NULL, opname); }

fsdp_status comm_issue_if_next(fsdp_work *w, uint64_t seq, bool *issued, const char *opname) {
    fsdp_status st = enqueue(w, &seq, issued, opname);
    comm_work_unref(w);
    return st;
}

void comm_queue_pending(int64_t *n, uint64_t *comm_id, uint64_t *seq, bool *moving) {
    pthread_mutex_lock(&q_mu);
    int64_t count = 0;
    fsdp_work *oldest = NULL;
    const lane *at = NULL;
    for (int i = 0; i < COMM_LANES; i++) {
        const lane *l = &g_lanes[i];
        fsdp_work *first = l->run ? l->run : l->head;
        count += l->run ? 1 : 0;
        for (fsdp_work *w = l->head; w; w = w->next) count++;
        if (first && (!oldest || first->order < oldest->order)) oldest = first, at = l;
    }
    *n = count;
    *comm_id = oldest ? oldest->fp.comm_id : 0;
    *seq = oldest && oldest->counted ? oldest->fp.seq : UINT64_MAX;
    *moving = at && at->run && at->state == RS_MOVING;
    pthread_mutex_unlock(&q_mu);
}

/* The planner's record of a collective queued (timeline.h). */
static void timeline_issued(const fsdp_work *w) {
    const fsdp_comm *c = w->comm;
    if (!w->counted || !c) return;
    int first = c->members ? c->members[0] : 0, stride = 1;
    if (c->members && c->size > 1) {
        stride = c->members[1] - c->members[0];
        for (int r = 2; r < c->size && stride > 0; r++)
            if (c->members[r] - c->members[r - 1] != stride) stride = -1;
        if (stride <= 0) stride = -1;
    }
    timeline_issue(c->id, c->size, first, stride, w->kind, w->fp.seq, (int64_t)w->fp.bytes, w->fp.dtype,
                   w->fp.label_hash);
}

/* Set while comm_issue completes a counting collective at once: that wait
 * is not one of the caller's (timeline.h). */
static _Thread_local bool t_issue_wait;
bool comm_waiting_at_issue(void) { return t_issue_wait; }

fsdp_status comm_issue(fsdp_work **out, fsdp_work *w, const char *opname) {
    comm_gpu_group_mark(w, out != NULL);
    fsdp_status est = enqueue(w, NULL, NULL, opname);
    if (est != FSDP_OK) {
        comm_work_unref(w);
        return est;
    }
    if (fsdp_timeline_on) timeline_issued(w);
    if (out) {
        *out = w;
        /* A counting communicator's collectives complete before they
         * return (nothing overlaps, and a plan must not depend on thread
         * timing); with FSDP_COMM_SYNC=1 every collective does, so that a
         * real run holds its buffers exactly as long as a plan says. The
         * caller's wait then returns at once, with the work's status. */
        if (comm_cfg()->sync || (w->comm && w->comm->be == &comm_count_backend)) {
            t_issue_wait = true;
            (void)fsdp_work_wait(w);
            t_issue_wait = false;
        }
        return FSDP_OK;
    }
    fsdp_status st = fsdp_work_wait(w);
    comm_work_unref(w);
    return st;
}

/* ---- shutdown ---- */

static bool any_lane_busy(void) {
    for (int i = 0; i < COMM_LANES; i++)
        if (g_lanes[i].busy || g_lanes[i].head) return true;
    return false;
}

void comm_shutdown(void) {
    comm_cfg();
    pthread_mutex_lock(&q_mu);
    bool running = false;
    for (int i = 0; i < COMM_LANES; i++) running = running || g_lanes[i].running;
    if (!running) {
        pthread_mutex_unlock(&q_mu);
        return;
    }
    /* Drain first, under the watchdog: a collective some rank never joins
     * must not turn finalize into a hang. */
    double t0 = comm_now();
    while (any_lane_busy()) {
        if (g_cfg.watchdog_s > 0) {
            /* q_idle uses the default (realtime) clock: wait in short slices. */
            struct timespec rt;
            clock_gettime(CLOCK_REALTIME, &rt);
            rt.tv_sec += 1;
            pthread_cond_timedwait(&q_idle, &q_mu, &rt);
            if (any_lane_busy() && comm_now() - t0 > g_cfg.watchdog_s + comm_watchdog_grace() + 1) {
                const lane *l = reported_lane();
                char what[160];
                comm_fp_describe(&l->current, true, what, sizeof what);
                fprintf(stderr, "fsdp watchdog: rank %d waited %.0f s at shutdown for collective %s on comm %s(%d); "
                        "aborting the job\n", fsdp_current_rank(), comm_now() - t0, what, l->current_comm,
                        l->current_size);
                pthread_mutex_unlock(&q_mu);
                fsdp_runtime_abort(NULL, 1);
            }
        } else {
            pthread_cond_wait(&q_idle, &q_mu);
        }
    }
    for (int i = 0; i < COMM_LANES; i++) {
        g_lanes[i].stop = true;
        pthread_cond_signal(&g_lanes[i].cv);
    }
    pthread_mutex_unlock(&q_mu);
    for (int i = 0; i < COMM_LANES; i++)
        if (g_lanes[i].running) pthread_join(g_lanes[i].thread, NULL);
    pthread_mutex_lock(&q_mu);
    for (int i = 0; i < COMM_LANES; i++) g_lanes[i].running = g_lanes[i].stop = false;
    pthread_mutex_unlock(&q_mu);
}
