/* comm_mpi.c: the "mpi" backend: collectives on CPU buffers through MPI,
 * for communicators of any size whenever MPI is initialized (the world
 * under mpirun and every communicator split from it). The interface and
 * its rules are in comm_backend.h.
 *
 * Arrival. Each collective starts with a small agreement (agree_max: one
 * non-blocking all-reduce of a few words); that is where a rank waits for
 * the others, so that is where this file waits gently: MPI_Test in a loop
 * for the first 50 us (ranks that arrive together), then with sleeps that
 * grow to 1 ms, so a rank waiting for a stopped one costs no core (see
 * wait_arrival). While it waits it answers the watchdog questions of other ranks and
 * reads "leaving" notes: point-to-point messages on MPI_COMM_WORLD under
 * tags of their own (MPI keeps point-to-point traffic apart from
 * collectives on the same communicator). */
#define _POSIX_C_SOURCE 200809L   /* nanosleep */
#include "comm_impl.h"
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

enum { TAG_ASK = 0x6664, TAG_STATUS = 0x6665, TAG_LEAVE = 0x6666 };

static const char *mpi_error_string(long code) {
    static _Thread_local char buf[MPI_MAX_ERROR_STRING + 32];
    int len = 0;
    if (MPI_Error_string((int)code, buf, &len) != MPI_SUCCESS) snprintf(buf, sizeof buf, "MPI error %ld", code);
    return buf;
}

/* The one check for MPI calls: file:line, the call and MPI's message. */
#define MPI_CHECK(call) FSDP_CHECK_CALL(call, rc_ == MPI_SUCCESS, mpi_error_string)

/* ---- waiting for data ---- */

static void sleep_s(double s);
static void mpi_service(void);

/* Open MPI progresses a transfer only inside MPI calls, and its blocking
 * calls spin a core until they return. The comm thread shares the cores
 * with the compute threads (on a small host, one core per rank), so the
 * data collectives here are non-blocking, tested in a loop that spins for
 * the first 20 us (a small collective is done by then) and then sleeps 10
 * us, 20 us, ... at most 200 us between tests: a waiting comm thread costs
 * a few percent of a core, and a transfer finishes at most 200 us late
 * (it overlaps compute anyway). Other ranks' watchdog questions are
 * answered meanwhile. */
typedef struct { double t0, sleep, next_service; } poller;

static poller poller_start(void) {
    double now = comm_now();
    return (poller){now, 10e-6, now + 0.01};
}

static void poller_idle(poller *p) {
    double now = comm_now();
    if (now - p->t0 < 20e-6) return;
    if (now >= p->next_service) {
        mpi_service();
        p->next_service = now + 0.01;
    }
    sleep_s(p->sleep);
    p->sleep = p->sleep * 2 < 200e-6 ? p->sleep * 2 : 200e-6;
}

static fsdp_status wait_all(int n, MPI_Request *reqs) {
    poller p = poller_start();
    for (;;) {
        int done = 0;
        MPI_CHECK(MPI_Testall(n, reqs, &done, MPI_STATUSES_IGNORE));
        if (done) return FSDP_OK;
        poller_idle(&p);
    }
}

static fsdp_status wait_one(MPI_Request *req) { return wait_all(1, req); }

/* ---- data collectives ---- */

static MPI_Datatype mpi_unit(size_t elem) {   /* moves bytes, elem at a time */
    return elem == 8 ? MPI_UINT64_T : elem == 4 ? MPI_UINT32_T : elem == 2 ? MPI_UINT16_T : MPI_BYTE;
}

static fsdp_status mpi_all_gather(fsdp_comm *c, void *dst, const void *src, int64_t block_bytes, size_t elem) {
    /* MPI counts are ints: beyond 2 GiB per rank, count elements instead of
     * bytes (the caller bounds elements per rank to INT_MAX). */
    MPI_Datatype t = block_bytes <= INT_MAX ? MPI_BYTE : mpi_unit(elem);
    int count = (int)(block_bytes <= INT_MAX ? block_bytes : block_bytes / (int64_t)elem);
    MPI_Request req = MPI_REQUEST_NULL;
    if (src)
        MPI_CHECK(MPI_Iallgather(src, count, t, dst, count, t, c->mpi, &req));
    else
        MPI_CHECK(MPI_Iallgather(MPI_IN_PLACE, 0, MPI_DATATYPE_NULL, dst, count, t, c->mpi, &req));
    return wait_one(&req);
}

/* Part bytes are multiples of 4 (comm_compress.c): beyond 2 GiB per part,
 * count 4-byte words. */
static fsdp_status mpi_all_to_all(fsdp_comm *c, void *dst, const void *src, int64_t block_bytes) {
    MPI_Datatype t = block_bytes <= INT_MAX ? MPI_BYTE : MPI_UINT32_T;
    int count = (int)(block_bytes <= INT_MAX ? block_bytes : block_bytes / 4);
    MPI_Request req = MPI_REQUEST_NULL;
    MPI_CHECK(MPI_Ialltoall(src, count, t, dst, count, t, c->mpi, &req));
    return wait_one(&req);
}

/* Reduce-scatter by pairwise exchange: rank r receives block r's terms
 * from every other rank and adds the P terms in rank order 0, 1, ..., P-1,
 * so every element's sum is rounded the same way whichever block holds it:
 * results do not depend on how parameters fall into blocks (the wrap
 * policy, the padding). A ring would start each block's sum at a
 * different rank. Each rank sends and receives P - 1 blocks, as in a ring
 * (MPI's non-blocking reduce-scatter reduces everything at rank 0 and
 * scatters from there). Blocks travel in chunks; while one chunk's terms
 * are added, in cache, the next chunk's are arriving into the other half
 * of a small scratch. Every rank posts its messages to a peer in the same
 * order under one tag, and MPI matches messages between two ranks in order. */
enum { TAG_RS = 0x6667 };
#define RS_SCRATCH_FLOATS ((int64_t)1 << 21)   /* 8 MiB in all */
#define RS_MIN_CHUNK ((int64_t)1 << 12)
#define RS_ADD_TILE 2048                       /* floats added per pass over the terms */

typedef struct {
    fsdp_comm *c;
    float *dst;
    const float *src;
    int64_t block, chunk;
    int divide;          /* 1, or the group's size for an average */
    bool accumulate;     /* dst += the result */
    float *scratch;      /* 2 sets x (P - 1) peers x chunk */
    MPI_Request *reqs;   /* 2 sets x (P - 1) receives, then 2 sets x (P - 1) sends */
} rs_exchange;

static int peer_slot(int q, int r) { return q < r ? q : q - 1; }

static float *rs_terms(const rs_exchange *x, int set, int q) {
    return x->scratch + ((int64_t)set * (x->c->size - 1) + peer_slot(q, x->c->rank)) * x->chunk;
}

static int64_t rs_len(const rs_exchange *x, int64_t off) {
    return x->block - off < x->chunk ? x->block - off : x->chunk;
}

static fsdp_status rs_post(rs_exchange *x, int set, int64_t off) {
    int P = x->c->size, r = x->c->rank, len = (int)rs_len(x, off);
    MPI_Request *recv = x->reqs + set * (P - 1), *send = x->reqs + 2 * (P - 1) + set * (P - 1);
    for (int q = 0; q < P; q++) {
        if (q == r) continue;
        int k = peer_slot(q, r);
        MPI_CHECK(MPI_Irecv(rs_terms(x, set, q), len, MPI_FLOAT, q, TAG_RS, x->c->mpi, &recv[k]));
        MPI_CHECK(MPI_Isend(x->src + (int64_t)q * x->block + off, len, MPI_FLOAT, q, TAG_RS, x->c->mpi, &send[k]));
    }
    return FSDP_OK;
}

/* dst[off + i] (=, or += with accumulate) (t_0[i] + t_1[i] + ... + t_{P-1}[i]) / divide,
 * summed in rank order. A tile's sum stays in a small buffer in cache, so
 * dst is written once and the terms are read once (P >= 2 here). */
static void rs_add(const rs_exchange *x, int set, int64_t off) {
    int P = x->c->size, r = x->c->rank;
    int64_t len = rs_len(x, off);
    const float *mine = x->src + (int64_t)r * x->block + off;
    float *acc = x->dst + off;
    const float d = (float)x->divide;
    float sum[RS_ADD_TILE];
    for (int64_t i0 = 0; i0 < len; i0 += RS_ADD_TILE) {
        int64_t n = len - i0 < RS_ADD_TILE ? len - i0 : RS_ADD_TILE;
        const float *restrict t0 = (r == 0 ? mine : rs_terms(x, set, 0)) + i0;
        const float *restrict t1 = (r == 1 ? mine : rs_terms(x, set, 1)) + i0;
        for (int64_t i = 0; i < n; i++) sum[i] = t0[i] + t1[i];
        for (int q = 2; q < P; q++) {
            const float *restrict t = (q == r ? mine : rs_terms(x, set, q)) + i0;
            for (int64_t i = 0; i < n; i++) sum[i] += t[i];
        }
        float *restrict a = acc + i0;
        if (x->divide != 1)
            for (int64_t i = 0; i < n; i++) sum[i] /= d;
        if (x->accumulate)
            for (int64_t i = 0; i < n; i++) a[i] += sum[i];
        else
            memcpy(a, sum, (size_t)n * sizeof(float));
    }
}

static fsdp_status mpi_reduce_scatter_f32(fsdp_comm *c, float *dst, const float *src, int64_t block, int divide,
                                          bool accumulate) {
    int P = c->size;
    if (P == 1 || block == 0) {   /* (a group of one: divide is 1) */
        if (accumulate)
            for (int64_t i = 0; i < block; i++) dst[i] += src[i];
        else if (block > 0)
            memcpy(dst, src, (size_t)block * sizeof(float));
        return FSDP_OK;
    }
    int64_t chunk = RS_SCRATCH_FLOATS / (2 * (P - 1));
    if (chunk < RS_MIN_CHUNK) chunk = RS_MIN_CHUNK;
    if (chunk > block) chunk = block;
    /* not counted under the comm tag, like MPI's own buffers */
    rs_exchange x = {c, dst, src, block, chunk, divide, accumulate,
                     malloc((size_t)(2 * (P - 1) * chunk) * sizeof(float)),
                     malloc((size_t)(4 * (P - 1)) * sizeof(MPI_Request))};
    if (!x.scratch || !x.reqs) {
        free(x.scratch), free(x.reqs);
        return fsdp_set_error(FSDP_ERR_OOM, "reduce_scatter on comm %s(%d): out of host memory for %lld floats",
                              c->name, c->size, (long long)(2 * (P - 1) * chunk));
    }
    fsdp_status st = rs_post(&x, 0, 0);
    for (int64_t off = 0, k = 0; off < block && st == FSDP_OK; off += chunk, k++) {
        int set = (int)(k % 2);
        if (off + chunk < block) st = rs_post(&x, 1 - set, off + chunk);
        if (st == FSDP_OK) st = wait_all(P - 1, x.reqs + set * (P - 1));   /* this chunk's terms */
        if (st != FSDP_OK) break;
        rs_add(&x, set, off);
        st = wait_all(P - 1, x.reqs + 2 * (P - 1) + set * (P - 1));     /* its sends, before the set is reused */
    }
    /* after an MPI error a transfer may still be pending into scratch: the
     * job is failing anyway, so scratch is left to it */
    if (st == FSDP_OK) free(x.scratch), free(x.reqs);
    return st;
}

static fsdp_status mpi_all_reduce(fsdp_comm *c, void *buf, int64_t n, comm_reduce_type rt, int op) {
    MPI_Datatype t = rt == COMM_RT_F32 ? MPI_FLOAT : rt == COMM_RT_F64 ? MPI_DOUBLE
                   : rt == COMM_RT_I32 ? MPI_INT32_T : MPI_INT64_T;
    size_t esz = rt == COMM_RT_F32 || rt == COMM_RT_I32 ? 4 : 8;
    MPI_Op mop = op == FSDP_REDUCE_MAX ? MPI_MAX : MPI_SUM;
    const int64_t chunk = (int64_t)1 << 30;   /* int counts; every rank cuts the same chunks */
    for (int64_t at = 0; at < n; at += chunk) {
        int64_t len = n - at < chunk ? n - at : chunk;
        MPI_Request req = MPI_REQUEST_NULL;
        MPI_CHECK(MPI_Iallreduce(MPI_IN_PLACE, (char *)buf + at * (int64_t)esz, (int)len, t, mop, c->mpi, &req));
        FSDP_TRY(wait_one(&req));
    }
    return FSDP_OK;
}

static fsdp_status mpi_broadcast(fsdp_comm *c, void *buf, int64_t bytes, int root) {
    const int64_t chunk = (int64_t)1 << 30;
    for (int64_t at = 0; at < bytes; at += chunk) {
        int64_t len = bytes - at < chunk ? bytes - at : chunk;
        MPI_Request req = MPI_REQUEST_NULL;
        MPI_CHECK(MPI_Ibcast((char *)buf + at, (int)len, MPI_BYTE, root, c->mpi, &req));
        FSDP_TRY(wait_one(&req));
    }
    return FSDP_OK;
}

static fsdp_status mpi_barrier(fsdp_comm *c) {
    MPI_Request req = MPI_REQUEST_NULL;
    MPI_CHECK(MPI_Ibarrier(c->mpi, &req));
    return wait_one(&req);
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
    /* Which world ranks are in it, for the watchdog's report. */
    child->members = malloc((size_t)child->size * sizeof(int));
    int *mine = malloc((size_t)child->size * sizeof(int));
    if (!child->members || !mine) {
        free(mine);
        free(child->members);
        child->members = NULL;
        MPI_Comm_free(&child->mpi);
        return fsdp_set_error(FSDP_ERR_OOM, "fsdp_comm_split: out of host memory for %d ranks", child->size);
    }
    for (int r = 0; r < child->size; r++) mine[r] = r;
    MPI_Group g = MPI_GROUP_NULL, wg = MPI_GROUP_NULL;
    int rc = MPI_Comm_group(nc, &g);
    if (rc == MPI_SUCCESS) rc = MPI_Comm_group(MPI_COMM_WORLD, &wg);
    if (rc == MPI_SUCCESS) rc = MPI_Group_translate_ranks(g, child->size, mine, wg, child->members);
    if (g != MPI_GROUP_NULL) MPI_Group_free(&g);
    if (wg != MPI_GROUP_NULL) MPI_Group_free(&wg);
    free(mine);
    if (rc != MPI_SUCCESS) {   /* only the report would lack it */
        free(child->members);
        child->members = NULL;
    }
    return FSDP_OK;
}

static fsdp_status mpi_destroy(fsdp_comm *c) {
    free(c->members);
    c->members = NULL;
    if (c->mpi != MPI_COMM_NULL && c->mpi != MPI_COMM_WORLD) MPI_CHECK(MPI_Comm_free(&c->mpi));
    return FSDP_OK;
}

/* ---- arrival ---- */

static int world_rank(void) {
    int r = 0;
    MPI_Comm_rank(MPI_COMM_WORLD, &r);
    return r;
}

static int world_size(void) {
    int n = 1;
    MPI_Comm_size(MPI_COMM_WORLD, &n);
    return n;
}

/* Ranks that said they leave, with what they said (comm thread, or the
 * main thread once the comm thread has stopped: never both). */
static comm_status *g_left;
static bool *g_has_left;
static int g_left_n;

static bool note_leaving(const comm_status *s, int from) {
    if (!g_left) {
        int n = world_size();
        g_left = calloc((size_t)n, sizeof *g_left);
        g_has_left = calloc((size_t)n, sizeof *g_has_left);
        if (!g_left || !g_has_left) return false;
        g_left_n = n;
    }
    if (from < 0 || from >= g_left_n) return false;
    g_left[from] = *s;
    g_has_left[from] = true;
    return true;
}

static void sleep_s(double s) {
    struct timespec ts = {(time_t)s, (long)((s - (double)(time_t)s) * 1e9)};
    nanosleep(&ts, NULL);
}

/* Answers every question waiting, reads every leaving note. */
static void mpi_service(void) {
    for (;;) {
        int flag = 0;
        MPI_Status ms;
        if (MPI_Iprobe(MPI_ANY_SOURCE, TAG_ASK, MPI_COMM_WORLD, &flag, &ms) != MPI_SUCCESS || !flag) break;
        int32_t q = 0;
        MPI_Recv(&q, 1, MPI_INT32_T, ms.MPI_SOURCE, TAG_ASK, MPI_COMM_WORLD, MPI_STATUS_IGNORE);
        comm_status st;
        comm_status_fill(&st);
        MPI_Send(&st, (int)sizeof st, MPI_BYTE, ms.MPI_SOURCE, TAG_STATUS, MPI_COMM_WORLD);   /* small: eager */
    }
    for (;;) {
        int flag = 0;
        MPI_Status ms;
        if (MPI_Iprobe(MPI_ANY_SOURCE, TAG_LEAVE, MPI_COMM_WORLD, &flag, &ms) != MPI_SUCCESS || !flag) break;
        comm_status st;
        MPI_Recv(&st, (int)sizeof st, MPI_BYTE, ms.MPI_SOURCE, TAG_LEAVE, MPI_COMM_WORLD, MPI_STATUS_IGNORE);
        note_leaving(&st, ms.MPI_SOURCE);
    }
}

/* A member of c that has left the job, or -1; one that left of its own
 * accord before one that left after a failed collective (most likely
 * because of the first). */
static int left_member(const fsdp_comm *c) {
    if (!g_left) return -1;
    int found = -1;
    for (int r = 0; r < c->size; r++) {
        int w = c->members ? c->members[r] : r;
        if (w < 0 || w >= g_left_n || !g_has_left[w]) continue;
        if (found < 0 || (g_left[found].failed > 0 && g_left[w].failed == 0)) found = w;
    }
    return found;
}

static fsdp_status left_error(const fsdp_comm *c, const fingerprint *fp, int who) {
    (void)fp;   /* the queue names the collective */
    char last[160] = "none";
    const comm_status *s = &g_left[who];
    if (s->last.seq != UINT64_MAX) comm_fp_describe(&s->last, true, last, sizeof last);
    return fsdp_set_error(FSDP_ERR_COMM, "rank %d has left the job (it returned from the program or called os.exit) "
                          "and will never join this collective of comm %s(%d); the last collective it finished was "
                          "%s on comm %s(%d)", who, c->name, c->size, last,
                          s->last.seq != UINT64_MAX ? s->last_comm : "-", s->last.seq != UINT64_MAX ? s->last_size : 0);
}

/* Waits for req without spinning a core: spins on MPI_Test for the first
 * 50 us (ranks that arrive together are done by then; longer, a comm
 * thread waiting for a peer's prefetch would take the core from this
 * rank's compute when they share one), then sleeps 10 us, 20 us, ...
 * between tests, at most 100 us for the first 50 ms (a collective starts
 * at most that late after the last rank arrives) and 1 ms after that (a
 * long wait: a straggler, and a waiting rank costs about 1% of a core);
 * meanwhile serves questions and, after the watchdog time, fires it. */
static fsdp_status wait_arrival(MPI_Request *req, const fsdp_comm *c, const fingerprint *fp) {
    const comm_config *cfg = comm_cfg();
    double t0 = comm_now(), next_service = t0, sleep = 10e-6, left_seen = 0;
    for (;;) {
        int done = 0;
        MPI_CHECK(MPI_Test(req, &done, MPI_STATUS_IGNORE));
        if (done) return FSDP_OK;
        double now = comm_now();
        if (now - t0 < 50e-6) continue;
        if (now >= next_service) {
            mpi_service();
            next_service = now + 0.01;
            int who = left_member(c);
            if (who >= 0) {
                /* Its part may have arrived already: give MPI a moment. */
                if (left_seen == 0) left_seen = now;
                else if (now - left_seen > 0.2) return left_error(c, fp, who);
            }
        }
        if (cfg->watchdog_s > 0 && now - t0 > cfg->watchdog_s) comm_watchdog_arrival(c, fp, now - t0);
        sleep_s(sleep);
        /* at most 100 us late while the wait is short, 1 ms once it is long */
        double cap = now - t0 < 0.05 ? 100e-6 : 1e-3;
        sleep = sleep * 2 < cap ? sleep * 2 : cap;
    }
}

static fsdp_status mpi_agree_max(fsdp_comm *c, int64_t *words, int n, const fingerprint *fp) {
    int who = left_member(c);
    if (who >= 0) return left_error(c, fp, who);
    MPI_Request req = MPI_REQUEST_NULL;
    MPI_CHECK(MPI_Iallreduce(MPI_IN_PLACE, words, n, MPI_INT64_T, MPI_MAX, c->mpi, &req));
    return wait_arrival(&req, c, fp);
}

static void mpi_ask_all(const comm_status *mine, comm_status *all, bool *answered, double grace_s) {
    int me = world_rank(), n = world_size();
    MPI_Request *reqs = calloc((size_t)(2 * n), sizeof *reqs);
    if (!reqs) return;
    int32_t q = me;
    for (int r = 0; r < n; r++) {
        answered[r] = r == me;
        if (r == me) {
            all[r] = *mine;
            reqs[2 * r] = reqs[2 * r + 1] = MPI_REQUEST_NULL;
            continue;
        }
        MPI_Irecv(&all[r], (int)sizeof all[r], MPI_BYTE, r, TAG_STATUS, MPI_COMM_WORLD, &reqs[2 * r]);
        MPI_Isend(&q, 1, MPI_INT32_T, r, TAG_ASK, MPI_COMM_WORLD, &reqs[2 * r + 1]);
    }
    double t0 = comm_now();
    int missing = n - 1;
    while (missing > 0 && comm_now() - t0 < grace_s) {
        mpi_service();   /* the others ask too */
        for (int r = 0; r < n; r++) {
            if (answered[r]) continue;
            int done = 0;
            MPI_Test(&reqs[2 * r], &done, MPI_STATUS_IGNORE);
            if (done) {
                answered[r] = true;
                missing--;
            }
        }
        sleep_s(2e-3);
    }
    /* Whoever did not answer: a leaving note counts as an answer. */
    for (int r = 0; r < n; r++)
        if (!answered[r] && g_left && r < g_left_n && g_has_left[r]) {
            all[r] = g_left[r];
            answered[r] = true;
        }
    free(reqs);   /* unfinished requests die with the job, which ends now */
}

static fsdp_status mpi_leave(double timeout_s) {
    int me = world_rank(), n = world_size();
    if (n == 1) return FSDP_OK;
    comm_status mine;
    comm_status_fill(&mine);
    mine.state = RS_LEAVING;
    MPI_Request *reqs = calloc((size_t)n, sizeof *reqs);
    if (!reqs) return fsdp_set_error(FSDP_ERR_OOM, "finalize: out of host memory");
    for (int r = 0; r < n; r++) {
        reqs[r] = MPI_REQUEST_NULL;
        if (r != me) MPI_Isend(&mine, (int)sizeof mine, MPI_BYTE, r, TAG_LEAVE, MPI_COMM_WORLD, &reqs[r]);
    }
    note_leaving(&mine, me);
    double t0 = comm_now(), sleep = 20e-6;
    for (;;) {
        mpi_service();
        int gone = 0;
        for (int r = 0; r < n; r++) gone += g_has_left && g_has_left[r];
        if (gone == n) break;
        if (timeout_s > 0 && comm_now() - t0 > timeout_s) {
            comm_watchdog_leaving(comm_now() - t0, g_has_left, n);   /* ends the job */
            t0 = comm_now();   /* the others answered: they are busy, not gone; wait on */
        }
        sleep_s(sleep);
        if (sleep < 1e-3) sleep *= 2;
    }
    MPI_Waitall(n, reqs, MPI_STATUSES_IGNORE);
    free(reqs);
    return FSDP_OK;
}

static fsdp_status mpi_usable(fsdp_comm *c, const char *opname) {
    int fin = 0;
    MPI_Finalized(&fin);
    if (fin)
        return fsdp_set_error(FSDP_ERR_STATE, "%s on comm %s(%d): MPI is finalized already", opname, c->name, c->size);
    return FSDP_OK;
}

const comm_backend comm_mpi_backend = {
    .name = "mpi",
    .all_gather = mpi_all_gather,
    .reduce_scatter_f32 = mpi_reduce_scatter_f32,
    .all_to_all = mpi_all_to_all,
    .all_reduce = mpi_all_reduce,
    .broadcast = mpi_broadcast,
    .barrier = mpi_barrier,
    .split = mpi_split,
    .destroy = mpi_destroy,
    .usable = mpi_usable,
    .agree_max = mpi_agree_max,
    .service = mpi_service,
    .ask_all = mpi_ask_all,
    .leave = mpi_leave,
    .carries_device = true,
};
