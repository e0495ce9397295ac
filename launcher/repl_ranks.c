/* repl_ranks.c: the REPL across ranks (lua/fsdp/repl.lua): rank 0's input
 * to every rank, each chunk's outcome from every rank, the notices that
 * make a rank give up waiting for ranks that failed a chunk, and bringing
 * the ranks' collectives back in step afterwards. */
#include <mpi.h>
#include <pthread.h>
#include <signal.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "fsdp.h"
#include "fsdp_repl.h"
#include "repl_launcher.h"

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

/* ---- the REPL across ranks ----
 * Rank 0 reads; every rank evaluates. The REPL talks on a communicator of
 * its own (a duplicate of MPI_COMM_WORLD), so its messages never mix with
 * the collectives the chunks run. A rank whose chunk fails tells the others
 * at once (TAG_FAILED); a listener thread on each rank that is still running
 * that chunk then makes its collective waits give up (fsdp_comm_abandon):
 * they wait on collectives the failed rank will never join. After each
 * chunk all ranks exchange their outcome; after one that failed somewhere,
 * the ranks cancel the collectives some rank waits in and others never
 * issued (fsdp_repl_rejoin), so that their communicators are in step again.
 * Only when that cannot finish does the REPL end the job, with a message. */
/* TAG_FAILED: "my chunk failed: <message>"; TAG_RELAYED: "my waits were
 * given up because <reason>" (the reason it was told, passed on as is, so
 * that every rank names the rank that failed first). */
enum { TAG_FAILED = 7001, TAG_QUIT = 7002, TAG_RELAYED = 7003, TAG_INTERRUPT = 7004, TAG_DONE = 7005,
       NOTICE_MAX = 512 };
static MPI_Comm g_ctl = MPI_COMM_NULL;
static int g_ctl_rank, g_ctl_size;
static pthread_t g_listener;
static long long g_chunk = -1;           /* the chunk being run, or -1 between chunks */
static long long g_begun = -1;           /* the last chunk begun */
/* A notice for a chunk this rank has not begun yet: rank 0's broadcast of
 * the chunk returns before the others receive it, so rank 0 (or a rank
 * quicker than this one) may run it and fail before this rank begins it. */
static long long g_early_chunk = -1;
static char g_early_reason[NOTICE_MAX + 64];
static char g_reason[NOTICE_MAX + 64];    /* why this chunk's waits were given up, if they were */
static pthread_mutex_t g_chunk_mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_t g_main_thread;
/* The watchdog on a chunk's end: the last chunk each rank said it finished
 * (TAG_DONE), and how long a rank that finished waits for the others before
 * it interrupts them (as Ctrl-C would) or, when g_watch_interrupt is off or
 * that did not stop them, ends the job. */
static long long *g_done;
static double g_watch_s = 10;
static bool g_watch_interrupt = true;

void fsdp_repl_set_watchdog(double seconds) {
    g_watch_interrupt = seconds > 0;
    g_watch_s = seconds > 0 ? seconds : 10;
}

static void *listen_for_failures(void *arg) {
    (void)arg;
    char buf[NOTICE_MAX + 16];
    for (;;) {
        MPI_Status st;
        if (MPI_Recv(buf, (int)sizeof buf, MPI_BYTE, MPI_ANY_SOURCE, MPI_ANY_TAG, g_ctl, &st) != MPI_SUCCESS) break;
        if (st.MPI_TAG == TAG_QUIT) break;
        long long chunk;
        memcpy(&chunk, buf, sizeof chunk);
        if (st.MPI_TAG == TAG_DONE) {
            pthread_mutex_lock(&g_chunk_mu);
            g_done[st.MPI_SOURCE] = chunk;
            pthread_mutex_unlock(&g_chunk_mu);
            continue;
        }
        if (st.MPI_TAG == TAG_INTERRUPT) {   /* Ctrl-C at rank 0's terminal: as a SIGINT here */
            pthread_mutex_lock(&g_chunk_mu);
            if (chunk == g_chunk) pthread_kill(g_main_thread, SIGINT);
            pthread_mutex_unlock(&g_chunk_mu);
            continue;
        }
        int n = 0;
        MPI_Get_count(&st, MPI_BYTE, &n);
        char reason[NOTICE_MAX + 64];
        if (st.MPI_TAG == TAG_RELAYED)
            snprintf(reason, sizeof reason, "%.*s", n - (int)sizeof chunk, buf + sizeof chunk);
        else
            snprintf(reason, sizeof reason, "rank %d failed this chunk and will not join it: %.*s", st.MPI_SOURCE,
                     n - (int)sizeof chunk, buf + sizeof chunk);
        pthread_mutex_lock(&g_chunk_mu);
        if (chunk == g_chunk) {
            if (!g_reason[0]) snprintf(g_reason, sizeof g_reason, "%s", reason);
            fsdp_comm_abandon(g_reason, NULL);
        } else if (chunk > g_begun) {
            g_early_chunk = chunk;
            snprintf(g_early_reason, sizeof g_early_reason, "%s", reason);
        }
        pthread_mutex_unlock(&g_chunk_mu);
    }
    return NULL;
}

/* Starts the control channel; returns the world size (1: nothing to do). */
int fsdp_repl_ctl_start(void) {
    int inited = 0, size = 1;
    MPI_Initialized(&inited);
    if (inited) MPI_Comm_size(MPI_COMM_WORLD, &size);
    if (size <= 1 || g_ctl != MPI_COMM_NULL) return size;
    if (MPI_Comm_dup(MPI_COMM_WORLD, &g_ctl) != MPI_SUCCESS) return -1;
    MPI_Comm_rank(g_ctl, &g_ctl_rank);
    MPI_Comm_size(g_ctl, &g_ctl_size);
    g_chunk = -1;
    g_done = calloc((size_t)g_ctl_size, sizeof *g_done);
    if (!g_done) return -1;
    for (int r = 0; r < g_ctl_size; r++) g_done[r] = -1;
    g_main_thread = pthread_self();
    if (pthread_create(&g_listener, NULL, listen_for_failures, NULL) != 0) return -1;
    return size;
}

void fsdp_repl_ctl_stop(void) {
    if (g_ctl == MPI_COMM_NULL) return;
    char none = 0;
    MPI_Send(&none, 1, MPI_BYTE, g_ctl_rank, TAG_QUIT, g_ctl);
    pthread_join(g_listener, NULL);
    MPI_Comm_free(&g_ctl);
    g_ctl = MPI_COMM_NULL;
}

void fsdp_repl_ctl_barrier(void) {
    if (g_ctl != MPI_COMM_NULL) MPI_Barrier(g_ctl);
}

/* Rank 0's input to every rank: n bytes (n < 0: end of input). *out is a
 * malloc'd copy (fsdp_repl_free), *out_n its length (-1 at the end). */
int fsdp_repl_bcast(const char *in, int64_t n, char **out, int64_t *out_n) {
    long long len = n;
    if (MPI_Bcast(&len, 1, MPI_LONG_LONG, 0, g_ctl) != MPI_SUCCESS) return -1;
    *out_n = len;
    *out = malloc(len > 0 ? (size_t)len + 1 : 1);
    if (!*out) return -1;
    if (len > 0) {
        if (g_ctl_rank == 0) memcpy(*out, in, (size_t)len);
        if (MPI_Bcast(*out, (int)len, MPI_BYTE, 0, g_ctl) != MPI_SUCCESS) return -1;
    }
    (*out)[len > 0 ? len : 0] = '\0';
    return 0;
}

void fsdp_repl_chunk_begin(long long chunk) {
    pthread_mutex_lock(&g_chunk_mu);
    fsdp_comm_abandon(NULL, NULL);
    g_chunk = g_begun = chunk;
    g_reason[0] = '\0';
    if (g_early_chunk == chunk) {
        snprintf(g_reason, sizeof g_reason, "%s", g_early_reason);
        fsdp_comm_abandon(g_reason, NULL);
    }
    pthread_mutex_unlock(&g_chunk_mu);
}

/* The ranks that have not said they finished chunk, as "1,2" in out;
 * returns how many, and in *lowest_done the lowest rank that has. */
static int missing_ranks(long long chunk, char *out, size_t cap, int *lowest_done) {
    int n = 0;
    size_t at = 0;
    out[0] = '\0';
    *lowest_done = -1;
    pthread_mutex_lock(&g_chunk_mu);
    for (int r = 0; r < g_ctl_size; r++) {
        if (r == g_ctl_rank || g_done[r] == chunk) {
            if (*lowest_done < 0) *lowest_done = r;
            continue;
        }
        if (at < cap) at += (size_t)snprintf(out + at, cap - at, "%s%d", n ? "," : "", r);
        n++;
    }
    pthread_mutex_unlock(&g_chunk_mu);
    return n;
}

/* The first gather of a chunk's end, watched: this rank tells every other
 * that it finished the chunk, then waits for theirs. A rank that never
 * comes (an endless loop) is reported after g_watch_s by the lowest rank
 * that finished, naming it, and interrupted as Ctrl-C would: its chunk
 * fails there and every rank goes on. One that does not stop within as long
 * again (or with interrupting off) ends the job with that message. */
static int watched_allgather(long long chunk, int *len, int *lens) {
    MPI_Request *done = calloc((size_t)g_ctl_size, sizeof *done), gather;
    if (!done) return -1;
    for (int r = 0; r < g_ctl_size; r++) {
        done[r] = MPI_REQUEST_NULL;
        if (r != g_ctl_rank) MPI_Isend(&chunk, (int)sizeof chunk, MPI_BYTE, r, TAG_DONE, g_ctl, &done[r]);
    }
    if (MPI_Iallgather(len, 1, MPI_INT, lens, 1, MPI_INT, g_ctl, &gather) != MPI_SUCCESS) {
        free(done);
        return -1;
    }
    double start = now_s();
    bool interrupted = false;
    int flag = 0;
    for (;;) {
        if (MPI_Test(&gather, &flag, MPI_STATUS_IGNORE) != MPI_SUCCESS || flag) break;
        struct timespec pause = { 0, 2000000 };
        nanosleep(&pause, NULL);
        if (now_s() - start < g_watch_s) continue;
        start = now_s();
        char who[256];
        int lowest = -1, n = missing_ranks(chunk, who, sizeof who, &lowest);
        if (n == 0 || lowest != g_ctl_rank) continue;   /* the lowest rank that finished acts */
        if (g_watch_interrupt && !interrupted) {
            printf("fsdp-lua: rank%s %s did not finish chunk %lld within %g s (FSDP_REPL_REJOIN_SECONDS; an endless "
                   "loop?): interrupting %s\n", n > 1 ? "s" : "", who, chunk, g_watch_s, n > 1 ? "them" : "it");
            fflush(stdout);
            for (int r = 0; r < g_ctl_size; r++) {
                pthread_mutex_lock(&g_chunk_mu);
                bool missing = r != g_ctl_rank && g_done[r] != chunk;
                pthread_mutex_unlock(&g_chunk_mu);
                if (missing) MPI_Send(&chunk, (int)sizeof chunk, MPI_BYTE, r, TAG_INTERRUPT, g_ctl);
            }
            interrupted = true;
            continue;
        }
        printf("fsdp-lua: rank%s %s did not finish chunk %lld within %g s (FSDP_REPL_REJOIN_SECONDS)%s: ending the "
               "job\n", n > 1 ? "s" : "", who, chunk, g_watch_s, interrupted ? " after being interrupted" : "");
        fflush(stdout);
        fflush(stderr);
        struct timespec drain = { 1, 0 };   /* mpirun forwards the line before the job is torn down */
        nanosleep(&drain, NULL);
        MPI_Abort(MPI_COMM_WORLD, 1);
    }
    MPI_Waitall(g_ctl_size, done, MPI_STATUSES_IGNORE);
    free(done);
    return flag ? 0 : -1;
}

/* Ends a chunk: a failed rank (err != NULL) tells the others first (a
 * rank whose waits were given up passes on why instead). Then
 * every rank's record reaches every rank: *out holds, per rank, an int64
 * length n, then n bytes: an int64 count of the collective waits that rank
 * gave up, then its record (the outcome, as the REPL writes it). */
int fsdp_repl_chunk_end(const char *err, const char *record, int64_t record_n, char **out, int64_t *out_n) {
    long long chunk = g_chunk;
    MPI_Request *reqs = NULL;
    char notice[NOTICE_MAX + 16];
    /* This rank is done with the chunk: later notices are ignored, and no
     * wait of the chunk is left to give up. */
    int64_t abandoned = 0;
    char relayed[sizeof g_reason] = "";
    pthread_mutex_lock(&g_chunk_mu);
    g_chunk = -1;
    fsdp_comm_abandon(NULL, &abandoned);
    if (abandoned > 0 && err && g_reason[0]) {
        snprintf(relayed, sizeof relayed, "%s", g_reason);
        err = relayed;
    }
    pthread_mutex_unlock(&g_chunk_mu);
    if (err) {
        size_t n = strlen(err);
        if (n > NOTICE_MAX) n = NOTICE_MAX;
        memcpy(notice, &chunk, sizeof chunk);
        memcpy(notice + sizeof chunk, err, n);
        reqs = calloc((size_t)g_ctl_size, sizeof *reqs);
        if (!reqs) return -1;
        for (int r = 0; r < g_ctl_size; r++) {
            reqs[r] = MPI_REQUEST_NULL;
            if (r != g_ctl_rank)
                MPI_Isend(notice, (int)(sizeof chunk + n), MPI_BYTE, r, relayed[0] ? TAG_RELAYED : TAG_FAILED, g_ctl,
                          &reqs[r]);
        }
    }

    int len = (int)record_n + 8;
    char *mine = malloc((size_t)len);
    int *lens = calloc((size_t)g_ctl_size, sizeof *lens), *offs = calloc((size_t)g_ctl_size, sizeof *offs);
    int rc = mine && lens && offs ? 0 : -1;
    if (rc == 0) {
        memcpy(mine, &abandoned, 8);
        memcpy(mine + 8, record, (size_t)record_n);
    }
    if (rc == 0 && watched_allgather(chunk, &len, lens) != 0) rc = -1;
    long long total = 0;
    for (int r = 0; rc == 0 && r < g_ctl_size; r++) offs[r] = (int)total, total += lens[r];
    char *all = rc == 0 ? malloc((size_t)total + 1) : NULL;
    if (rc == 0 && !all) rc = -1;
    if (rc == 0 && MPI_Allgatherv(mine, len, MPI_BYTE, all, lens, offs, MPI_BYTE, g_ctl) != MPI_SUCCESS) rc = -1;
    if (reqs) {
        MPI_Waitall(g_ctl_size, reqs, MPI_STATUSES_IGNORE);
        free(reqs);
    }
    if (rc == 0) {
        *out = malloc((size_t)total + 8 * (size_t)g_ctl_size + 1);
        char *p = *out;
        for (int r = 0; p && r < g_ctl_size; r++) {
            int64_t l = lens[r];
            memcpy(p, &l, 8);
            memcpy(p + 8, all + offs[r], (size_t)l);
            p += 8 + l;
        }
        if (!p) rc = -1;
        else *out_n = (int64_t)(p - *out);
    }
    free(mine);
    free(all);
    free(lens);
    free(offs);
    return rc;
}

/* After a chunk that failed on some ranks: a comm thread may still wait in
 * a collective that other ranks never issued (the caller's wait was given
 * up, the collective was not). In rounds, every rank tells every other the
 * oldest collective its comm thread has not finished; a member of that
 * communicator that has not issued it issues a cancel in its place
 * (fsdp_comm_cancel: the agreement fails on every rank, no data moves),
 * and the waiting ranks go on to their next one. Every rank cancels the
 * same collectives in the same order (by communicator id, then sequence
 * number). It ends when every comm thread is idle: the ranks' sequence
 * numbers agree again. Returns the collectives this rank cancelled, or -1
 * when nothing moved for timeout_s (as rank 0 measures it, so that every
 * rank stops in the same round) or MPI failed. */
typedef struct { int64_t works; uint64_t comm_id, seq; int64_t moving; double still_s; } rejoin_state;

static int cmp_pending(const void *a, const void *b) {
    const rejoin_state *x = a, *y = b;
    if (x->comm_id != y->comm_id) return x->comm_id < y->comm_id ? -1 : 1;
    return x->seq < y->seq ? -1 : x->seq > y->seq;
}

int64_t fsdp_repl_rejoin(double timeout_s) {
    int n = g_ctl_size;
    rejoin_state *all = calloc((size_t)n, sizeof *all), *prev = calloc((size_t)n, sizeof *prev);
    rejoin_state *order = calloc((size_t)n, sizeof *order);
    int64_t cancelled = 0;
    double still_since = now_s();
    int rc = all && prev && order ? 0 : -1;
    for (int round = 0; rc == 0; round++) {
        rejoin_state mine = {0};
        int moving = 0;
        fsdp_comm_pending(&mine.works, &mine.comm_id, &mine.seq, &moving);
        mine.moving = moving;
        mine.still_s = now_s() - still_since;
        if (MPI_Allgather(&mine, (int)sizeof mine, MPI_BYTE, all, (int)sizeof mine, MPI_BYTE, g_ctl) != MPI_SUCCESS) {
            rc = -1;
            break;
        }
        bool busy = false, changed = round == 0;
        for (int r = 0; r < n; r++) {
            busy = busy || all[r].works > 0;
            changed = changed || all[r].works != prev[r].works || all[r].comm_id != prev[r].comm_id ||
                      all[r].seq != prev[r].seq || all[r].moving;
            prev[r] = all[r];
        }
        if (!busy) break;
        if (changed) still_since = now_s();
        else if (all[0].still_s > timeout_s) rc = -1;
        if (rc != 0) break;
        memcpy(order, all, (size_t)n * sizeof *all);
        qsort(order, (size_t)n, sizeof *order, cmp_pending);
        for (int r = 0; r < n; r++) {
            if (order[r].works == 0 || order[r].seq == UINT64_MAX) continue;
            if (r > 0 && order[r].comm_id == order[r - 1].comm_id && order[r].seq == order[r - 1].seq) continue;
            int joined = 0;
            if (fsdp_comm_cancel(order[r].comm_id, order[r].seq, &joined) == FSDP_OK) cancelled += joined;
        }
        struct timespec ts = {0, 10 * 1000 * 1000};   /* the comm threads' turn */
        nanosleep(&ts, NULL);
    }
    free(all);
    free(prev);
    free(order);
    return rc == 0 ? cancelled : -1;
}

/* Ctrl-C at rank 0's terminal (repl_terminal.c): every rank's listener
 * interrupts the chunk now running, if it still is. */
void repl_interrupt_chunk(void) {
    long long chunk;
    pthread_mutex_lock(&g_chunk_mu);
    chunk = g_chunk;
    pthread_mutex_unlock(&g_chunk_mu);
    if (chunk < 0) return;
    for (int r = 0; r < g_ctl_size; r++) MPI_Send(&chunk, (int)sizeof chunk, MPI_BYTE, r, TAG_INTERRUPT, g_ctl);
}

int repl_rank(void) { return g_ctl == MPI_COMM_NULL ? -1 : g_ctl_rank; }
