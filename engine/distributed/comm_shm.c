/* comm_shm.c: the mpi backend's all-gather and reduce-scatter between
 * ranks of one host, through memory they share instead of MPI's transport
 * (FSDP_COMM_SHM=1, the default; 0 sends everything through MPI). MPI
 * provides the memory and the ordering; this file only reads and writes it.
 *
 * The memory: at the world's first collective, the ranks of each host
 * (MPI_Comm_split_type, MPI_COMM_TYPE_SHARED) make one shared window
 * (MPI_Win_allocate_shared), each rank's segment its host heap
 * (host_heap.c): from then on its CPU blocks come from there, and the
 * host's other ranks reach them at the addresses MPI_Win_shared_query gives.
 * Open MPI removes the window's backing file as soon as every rank has
 * mapped it, so no exit, crash included, leaves one behind. The window is
 * locked (MPI_Win_lock_all) for its whole life; MPI_Win_sync orders the
 * flags against the data.
 *
 * A collective reads the peers' buffers where they lie:
 *   - all-gather: rank r copies each peer's block from the peer's source
 *     into its own buffer (one copy per byte, no pinning, no system call,
 *     no need for the peer's comm thread to drive the transfer);
 *   - reduce-scatter: rank r sums block r over the ranks in rank order
 *     0..P-1 straight from every peer's source, with the rounding of the
 *     MPI path's rs_add (sum of terms, divided, then added or written), so
 *     the two paths give the same bits.
 * The handshake is a mailbox per communicator in each rank's control area
 * (the first bytes of its heap; only the owner writes it): "posted" (the
 * collective's number, after the offset of its source) and "done" (this
 * rank has finished reading the others). A rank returns only when every
 * peer is done with its source, so the caller may free or rewrite it.
 * When any rank's buffer is not in its heap (made before the heap was on,
 * or the heap was full), every rank sees that in the mailboxes and the
 * collective goes through MPI on all of them; so does a communicator whose
 * ranks are not all on one host.
 *
 * Failures: the waits sleep after a short spin, answer the watchdog's
 * questions, check every 10 ms that the peers they wait for are alive (a
 * rank that died is named in the error at once) and give up after the
 * watchdog time. The collectives start only after the agreement
 * (comm_debug.c), so every rank is already inside the same one. */
#define _GNU_SOURCE
#include "comm_impl.h"
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/statvfs.h>
#include <time.h>
#include <unistd.h>

#define MAILBOX_AT 4096
#define MAILBOX_BYTES 128
#define N_MAILBOXES ((int)((HOST_HEAP_CONTROL - MAILBOX_AT) / MAILBOX_BYTES))

typedef struct mailbox {
    _Atomic uint64_t comm_id;   /* the communicator it belongs to (0: free) */
    _Atomic uint64_t posted;    /* the collective whose source is described */
    _Atomic int64_t off;        /* that source's offset in the owner's heap, -1: not in it */
    _Atomic uint64_t done;      /* the last collective whose peers' sources the owner has finished reading */
} mailbox;

typedef struct comm_shm comm_shm;
struct comm_shm {
    bool on;
    int P, r;
    uint64_t k;                 /* this communicator's shared-memory collectives so far */
    int slot;                   /* this rank's mailbox */
    const char **base;          /* (P) each rank's heap segment */
    int *pid;                   /* (P) */
    mailbox **box;              /* (P) each rank's mailbox for this communicator */
};

/* ---- the host's window (the world's, made once) ---- */

static struct {
    bool tried;
    MPI_Comm node;              /* the world's ranks on this host */
    MPI_Win win;
    int node_rank, node_size;
    const char **base;          /* (node_size) each node rank's heap segment, page-aligned as host_heap_adopt has it */
    int *pid;                   /* (node_size) */
    uint64_t host;              /* equal on the ranks of one host only: the world rank of its node rank 0 */
} g_node = {.node = MPI_COMM_NULL, .win = MPI_WIN_NULL};

static const char *page_up(const char *p) {
    uintptr_t pg = (uintptr_t)sysconf(_SC_PAGESIZE), a = (uintptr_t)p;
    return (const char *)((a + pg - 1) / pg * pg);
}

/* Bytes each of n ranks may reserve: Open MPI backs the window with a file
 * in its backing directory (/dev/shm unless osc_sm_backing_directory says
 * otherwise) and wants the whole size free there, though pages are taken
 * only as they are touched. Half the free space, shared by the host's
 * ranks, at most 64 GiB each and the physical memory. The pages are the
 * file system's: should other jobs fill /dev/shm during the run, touching
 * a new page of the heap fails (SIGBUS), as it would for MPI's own shared
 * segments. */
static uint64_t heap_reserve(int n) {
    const char *dir = getenv("OMPI_MCA_osc_sm_backing_directory");
    struct statvfs vs;
    if (statvfs(dir && dir[0] ? dir : "/dev/shm", &vs) != 0) return 0;
    uint64_t free_bytes = (uint64_t)vs.f_bavail * (uint64_t)vs.f_frsize, r = free_bytes / 2 / (uint64_t)n;
    long pages = sysconf(_SC_PHYS_PAGES), page = sysconf(_SC_PAGESIZE);
    uint64_t phys = pages > 0 && page > 0 ? (uint64_t)pages * (uint64_t)page : 0;
    if (phys > 0 && r > phys) r = phys;
    if (r > ((uint64_t)64 << 30)) r = (uint64_t)64 << 30;
    return r;
}

#define NODE_CHECK(call) FSDP_CHECK_CALL(call, rc_ == MPI_SUCCESS, node_error)
static const char *node_error(long code) {
    static _Thread_local char buf[MPI_MAX_ERROR_STRING + 32];
    int len = 0;
    if (MPI_Error_string((int)code, buf, &len) != MPI_SUCCESS) snprintf(buf, sizeof buf, "MPI error %ld", code);
    return buf;
}

fsdp_status comm_shm_world_setup(fsdp_comm *world) {
    if (g_node.tried) return FSDP_OK;
    g_node.tried = true;
    if (!comm_cfg()->shm || world->size < 2) return FSDP_OK;
    NODE_CHECK(MPI_Comm_split_type(world->mpi, MPI_COMM_TYPE_SHARED, world->rank, MPI_INFO_NULL, &g_node.node));
    NODE_CHECK(MPI_Comm_set_errhandler(g_node.node, MPI_ERRORS_RETURN));
    NODE_CHECK(MPI_Comm_rank(g_node.node, &g_node.node_rank));
    NODE_CHECK(MPI_Comm_size(g_node.node, &g_node.node_size));
    int n = g_node.node_size;
    int64_t host = world->rank;   /* node rank 0's world rank names the host */
    NODE_CHECK(MPI_Bcast(&host, 1, MPI_INT64_T, 0, g_node.node));
    g_node.host = (uint64_t)host;
    if (n < 2) return FSDP_OK;   /* alone on this host: nothing to share */
    /* every rank of the host reserves, or none (a refusal would otherwise
     * leave some ranks waiting in the window's creation) */
    int64_t want = (int64_t)heap_reserve(n), least = want;
    NODE_CHECK(MPI_Allreduce(&want, &least, 1, MPI_INT64_T, MPI_MIN, g_node.node));
    if (least <= (int64_t)(2 * HOST_HEAP_CONTROL)) return FSDP_OK;
    MPI_Info info;
    NODE_CHECK(MPI_Info_create(&info));
    MPI_Info_set(info, "alloc_shared_noncontig", "true");
    char *mine = NULL;
    int rc = MPI_Win_allocate_shared((MPI_Aint)least, 1, info, g_node.node, &mine, &g_node.win);
    MPI_Info_free(&info);
    NODE_CHECK(rc);
    NODE_CHECK(MPI_Win_set_errhandler(g_node.win, MPI_ERRORS_RETURN));
    NODE_CHECK(MPI_Win_lock_all(MPI_MODE_NOCHECK, g_node.win));
    g_node.base = calloc((size_t)n, sizeof *g_node.base);
    g_node.pid = calloc((size_t)n, sizeof *g_node.pid);
    if (!g_node.base || !g_node.pid) return fsdp_set_error(FSDP_ERR_OOM, "shared window: out of host memory");
    for (int q = 0; q < n; q++) {
        MPI_Aint size = 0;
        int unit = 0;
        char *p = NULL;
        NODE_CHECK(MPI_Win_shared_query(g_node.win, q, &size, &unit, &p));
        g_node.base[q] = page_up(p);
    }
    int pid = (int)getpid();
    NODE_CHECK(MPI_Allgather(&pid, 1, MPI_INT, g_node.pid, 1, MPI_INT, g_node.node));
    FSDP_TRY(host_heap_adopt(mine, (uint64_t)least));
    MPI_Win_sync(g_node.win);   /* the header host_heap_adopt wrote */
    return FSDP_OK;
}

void comm_shm_world_free(void) {
    if (g_node.win != MPI_WIN_NULL) {
        host_heap_disown();
        MPI_Win_unlock_all(g_node.win);
        MPI_Win_free(&g_node.win);   /* collective over the host: every rank has left the job by now */
    }
    if (g_node.node != MPI_COMM_NULL) MPI_Comm_free(&g_node.node);
    free(g_node.base), free(g_node.pid);
    g_node.base = NULL, g_node.pid = NULL;
}

/* ---- mailboxes of this process ---- */

static pthread_mutex_t g_slots_mu = PTHREAD_MUTEX_INITIALIZER;
static unsigned char g_slot_used[N_MAILBOXES];

static int slot_take(void) {
    pthread_mutex_lock(&g_slots_mu);
    int s = -1;
    for (int i = 0; i < N_MAILBOXES && s < 0; i++)
        if (!g_slot_used[i]) g_slot_used[i] = 1, s = i;
    pthread_mutex_unlock(&g_slots_mu);
    return s;
}

static void slot_give(int s) {
    pthread_mutex_lock(&g_slots_mu);
    if (s >= 0 && s < N_MAILBOXES) g_slot_used[s] = 0;
    pthread_mutex_unlock(&g_slots_mu);
}

static mailbox *mailbox_at(const char *base, int slot) {
    return (mailbox *)(uintptr_t)(base + MAILBOX_AT + (uint64_t)slot * MAILBOX_BYTES);
}

/* ---- waiting ---- */

static void nap(double s) {
    struct timespec ts = {0, (long)(s * 1e9)};
    nanosleep(&ts, NULL);
}

/* Whether process pid still runs (not gone, not a zombie). */
static bool alive(int pid) {
    char path[64], buf[256];
    snprintf(path, sizeof path, "/proc/%d/stat", pid);
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) return false;
    ssize_t n = read(fd, buf, sizeof buf - 1);
    close(fd);
    if (n <= 0) return false;
    buf[n] = 0;
    const char *p = strrchr(buf, ')');   /* "pid (comm) S ..." */
    return !(p && p[1] == ' ' && (p[2] == 'Z' || p[2] == 'X'));
}

static fsdp_status wait_error(fsdp_comm *c, const char *op, int q, const char *what, bool dead, double waited) {
    if (dead)
        return fsdp_set_error(FSDP_ERR_COMM, "%s on comm %s(%d) through shared memory: rank %d (pid %d) ended while "
                              "this rank waited for it to %s", op, c->name, c->size, q, c->shm->pid[q], what);
    return fsdp_set_error(FSDP_ERR_COMM, "%s on comm %s(%d) through shared memory: rank %d did not %s within %.0f s "
                          "(FSDP_WATCHDOG_SECONDS)", op, c->name, c->size, q, what, waited);
}

/* Until every peer's posted (done_field false) or done (true) is at least k. */
static fsdp_status wait_peers(fsdp_comm *c, const char *op, bool done_field, uint64_t k) {
    comm_shm *s = c->shm;
    const comm_config *cfg = comm_cfg();
    double t0 = 0, next_check = 0, sleep = 10e-6;
    for (int spin = 0;; spin++) {
        int missing = -1;
        for (int q = 0; q < s->P && missing < 0; q++) {
            if (q == s->r) continue;
            uint64_t v = atomic_load_explicit(done_field ? &s->box[q]->done : &s->box[q]->posted,
                                              memory_order_relaxed);
            if (v < k) missing = q;
        }
        if (missing < 0) {
            MPI_Win_sync(g_node.win);   /* what the peers wrote before their flags */
            return FSDP_OK;
        }
        if (spin < 256) continue;   /* ranks that arrive together */
        double now = comm_now();
        if (t0 == 0) t0 = next_check = now;
        if (now >= next_check) {
            if (c->be->service) c->be->service();   /* the watchdog questions of other ranks */
            if (!alive(s->pid[missing]))
                return wait_error(c, op, missing, done_field ? "finish reading" : "arrive", true, now - t0);
            next_check = now + 0.01;
        }
        if (cfg->watchdog_s > 0 && now - t0 > cfg->watchdog_s)
            return wait_error(c, op, missing, done_field ? "finish reading" : "arrive", false, now - t0);
        nap(sleep);
        sleep = sleep * 2 < 200e-6 ? sleep * 2 : 200e-6;
    }
}

/* ---- setup: the first collective that moves data on c ---- */

static comm_shm g_shm_off = {.on = false, .slot = -1};   /* c stays on MPI */

typedef struct {
    int32_t ok, node_rank, slot, pad;
    uint64_t host;
} shm_info;

static fsdp_status mpi_wait(fsdp_comm *c, MPI_Request *req) {
    for (int spin = 0;; spin++) {
        int done = 0;
        if (MPI_Test(req, &done, MPI_STATUS_IGNORE) != MPI_SUCCESS)
            return fsdp_set_error(FSDP_ERR_COMM, "shared-memory setup on comm %s(%d): MPI_Test failed", c->name, c->size);
        if (done) return FSDP_OK;
        if (spin > 256) nap(50e-6);
    }
}

static void shm_free(comm_shm *s) {
    if (!s) return;
    if (s->slot >= 0 && s->box && s->box[s->r]) atomic_store(&s->box[s->r]->comm_id, 0);
    slot_give(s->slot);
    free(s->base), free(s->pid), free(s->box);
    free(s);
}


/* Collective over c (every rank reaches it in the same collective): c uses
 * shared memory when all its ranks share this host's window, else MPI.
 * Only an MPI failure is an error. */
static fsdp_status shm_setup(fsdp_comm *c) {
    int P = c->size, r = c->rank;
    comm_shm *s = calloc(1, sizeof *s);
    shm_info *all = calloc((size_t)P, sizeof *all);
    if (s) {
        s->P = P, s->r = r, s->slot = -1, s->on = true;
        s->base = calloc((size_t)P, sizeof *s->base);
        s->pid = calloc((size_t)P, sizeof *s->pid);
        s->box = calloc((size_t)P, sizeof *s->box);
    }
    shm_info mine = {0};
    bool ready = s && all && s->base && s->pid && s->box && g_node.win != MPI_WIN_NULL && host_heap_on();
    if (ready) s->slot = slot_take();
    if (ready && s->slot >= 0) {
        mailbox *m = mailbox_at(g_node.base[g_node.node_rank], s->slot);
        atomic_store_explicit(&m->posted, 0, memory_order_relaxed);
        atomic_store_explicit(&m->done, 0, memory_order_relaxed);
        atomic_store_explicit(&m->off, -1, memory_order_relaxed);
        atomic_store_explicit(&m->comm_id, c->id, memory_order_relaxed);
        MPI_Win_sync(g_node.win);
        mine = (shm_info){1, g_node.node_rank, s->slot, 0, g_node.host};
    }
    fsdp_status st = FSDP_OK;
    MPI_Request req = MPI_REQUEST_NULL;
    if (MPI_Iallgather(&mine, (int)sizeof mine, MPI_BYTE, all ? (void *)all : (void *)&mine, (int)sizeof mine, MPI_BYTE,
                       c->mpi, &req) != MPI_SUCCESS)
        st = fsdp_set_error(FSDP_ERR_COMM, "shared-memory setup on comm %s(%d): MPI_Iallgather failed", c->name, P);
    if (st == FSDP_OK) st = mpi_wait(c, &req);
    /* every answer comes from the same allgather: the same verdict on every rank */
    bool ok = st == FSDP_OK && all;
    for (int q = 0; q < P && ok; q++) ok = all[q].ok && all[q].host == all[0].host;
    if (ok) {
        for (int q = 0; q < P; q++) {
            s->base[q] = g_node.base[all[q].node_rank];
            s->pid[q] = g_node.pid[all[q].node_rank];
            s->box[q] = mailbox_at(s->base[q], all[q].slot);
        }
        MPI_Win_sync(g_node.win);
    }
    free(all);
    if (s && (st != FSDP_OK || !ok)) {
        shm_free(s);
        s = NULL;
    }
    c->shm = s ? s : &g_shm_off;   /* the setup is done either way */
    return st;
}

static bool shm_ready(fsdp_comm *c, fsdp_status *st) {
    *st = FSDP_OK;
    if (c->size < 2 || !comm_cfg()->shm || g_node.win == MPI_WIN_NULL) return false;
    if (!c->shm) *st = shm_setup(c);
    return *st == FSDP_OK && c->shm->on;
}

/* Posts this rank's source (off, -1 when outside its heap) for the next
 * collective on c and waits for every peer's; *all_in: every source lies
 * in its owner's heap (the same answer on every rank). */
static fsdp_status post(fsdp_comm *c, const char *op, int64_t off, bool *all_in) {
    comm_shm *s = c->shm;
    uint64_t k = ++s->k;
    mailbox *m = s->box[s->r];
    atomic_store_explicit(&m->off, off, memory_order_relaxed);
    MPI_Win_sync(g_node.win);   /* the offset, and the source's data, before the flag */
    atomic_store_explicit(&m->posted, k, memory_order_relaxed);
    FSDP_TRY(wait_peers(c, op, false, k));
    *all_in = true;
    for (int q = 0; q < s->P; q++)
        if (atomic_load_explicit(&s->box[q]->off, memory_order_relaxed) < 0) *all_in = false;
    return FSDP_OK;
}

/* This rank has read the peers' sources; waits until they have read its own. */
static fsdp_status finish(fsdp_comm *c, const char *op, bool wait) {
    comm_shm *s = c->shm;
    MPI_Win_sync(g_node.win);   /* every read of the peers' sources before the flag */
    atomic_store_explicit(&s->box[s->r]->done, s->k, memory_order_relaxed);
    return wait ? wait_peers(c, op, true, s->k) : FSDP_OK;
}

static const char *peer_at(const comm_shm *s, int q, uint64_t at) {
    return s->base[q] + atomic_load_explicit(&s->box[q]->off, memory_order_relaxed) + at;
}

/* ---- the collectives ---- */

static atomic_llong g_shared, g_fallback;

fsdp_status fsdp_comm_shm_stats(int64_t *shared, int64_t *fallback) {
    if (shared) *shared = atomic_load(&g_shared);
    if (fallback) *fallback = atomic_load(&g_fallback);
    return FSDP_OK;
}

bool comm_shm_all_gather(fsdp_comm *c, void *dst, const void *src, int64_t block_bytes, fsdp_status *st) {
    *st = FSDP_OK;
    if (block_bytes <= 0 || !shm_ready(c, st)) return *st != FSDP_OK;
    comm_shm *s = c->shm;
    char *out = dst;
    const void *mine = src ? src : out + (int64_t)s->r * block_bytes;
    int64_t off = -1;
    if (!host_heap_locate(mine, (uint64_t)block_bytes, &off)) off = -1;
    bool all_in = false;
    *st = post(c, "all_gather", off, &all_in);
    if (*st != FSDP_OK) return true;
    atomic_fetch_add(all_in ? &g_shared : &g_fallback, 1);
    if (!all_in) {
        *st = finish(c, "all_gather", false);
        return *st != FSDP_OK;   /* MPI moves it, on every rank */
    }
    if (src) memcpy(out + (int64_t)s->r * block_bytes, src, (size_t)block_bytes);
    for (int q = 0; q < s->P; q++)
        if (q != s->r) memcpy(out + (int64_t)q * block_bytes, peer_at(s, q, 0), (size_t)block_bytes);
    *st = finish(c, "all_gather", true);
    return true;
}

#define RS_TILE 2048   /* floats summed per pass over the terms, as comm_mpi.c's rs_add */

bool comm_shm_reduce_scatter_f32(fsdp_comm *c, float *dst, const float *src, int64_t block, int divide,
                                 bool accumulate, fsdp_status *st) {
    *st = FSDP_OK;
    if (block <= 0 || !shm_ready(c, st)) return *st != FSDP_OK;
    comm_shm *s = c->shm;
    int P = s->P, r = s->r;
    int64_t off = -1;
    if (!host_heap_locate(src, (uint64_t)(block * P) * sizeof(float), &off)) off = -1;
    bool all_in = false;
    *st = post(c, "reduce_scatter", off, &all_in);
    if (*st != FSDP_OK) return true;
    atomic_fetch_add(all_in ? &g_shared : &g_fallback, 1);
    if (!all_in) {
        *st = finish(c, "reduce_scatter", false);
        return *st != FSDP_OK;
    }
    /* term q of element i: rank q's src[r * block + i], read where it lies */
    const float **term = malloc((size_t)P * sizeof *term);
    if (!term) {
        *st = fsdp_set_error(FSDP_ERR_OOM, "reduce_scatter on comm %s(%d): out of host memory", c->name, c->size);
        (void)finish(c, "reduce_scatter", true);
        return true;
    }
    uint64_t at = (uint64_t)r * (uint64_t)block * sizeof(float);
    for (int q = 0; q < P; q++) term[q] = q == r ? src + (int64_t)r * block : (const float *)(uintptr_t)peer_at(s, q, at);
    const float d = (float)divide;
    float sum[RS_TILE];
    for (int64_t i0 = 0; i0 < block; i0 += RS_TILE) {
        int64_t n = block - i0 < RS_TILE ? block - i0 : RS_TILE;
        const float *restrict t0 = term[0] + i0, *restrict t1 = term[1] + i0;
        for (int64_t i = 0; i < n; i++) sum[i] = t0[i] + t1[i];
        for (int q = 2; q < P; q++) {
            const float *restrict t = term[q] + i0;
            for (int64_t i = 0; i < n; i++) sum[i] += t[i];
        }
        float *restrict a = dst + i0;
        if (divide != 1)
            for (int64_t i = 0; i < n; i++) sum[i] /= d;
        if (accumulate)
            for (int64_t i = 0; i < n; i++) a[i] += sum[i];
        else
            memcpy(a, sum, (size_t)n * sizeof(float));
    }
    free(term);
    *st = finish(c, "reduce_scatter", true);
    return true;
}

void comm_shm_destroy(fsdp_comm *c) {
    if (c->shm && c->shm != &g_shm_off) shm_free(c->shm);
    c->shm = NULL;
}
