/* nccl_emu.cpp: the NCCL of include/nccl.h on the host. Every collective is
 * one work item of the stream it is given, so it reads its input and writes
 * its output in stream order, after the events the stream waits on; with
 * several ranks the item runs the matching MPI collective (the stream's own
 * thread calls MPI, so MPI must give MPI_THREAD_MULTIPLE, as the engine asks).
 *
 * Bootstrap: the unique id names the world rank that made it and a number;
 * in ncclCommInitRank every member sends its world rank to that one, which
 * answers with the member list; the members then make an MPI communicator of
 * just themselves (MPI_Comm_create_group), in NCCL rank order. */
#include "nccl.h"
#include "convert.h"
#include "cuda_runtime.h"
#define OMPI_SKIP_MPICXX 1   /* the C API only */
#define MPICH_SKIP_MPICXX 1
#include <mpi.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <atomic>
#include <vector>

struct emu_nccl_comm_s {
    int nranks, rank;
    MPI_Comm mpi;   /* the collectives' (the stream's thread); MPI_COMM_NULL for one rank */
    MPI_Comm ctl;   /* host calls that are collective (ncclCommSplit), apart from the stream's traffic */
    bool aborted;   /* ncclCommAbort: no call takes it any more */
};

static int g_comms_made, g_comms_split;
static int g_next_id;
static thread_local char t_last[256];

extern "C" int emu_nccl_comms_made(void) { return g_comms_made; }
extern "C" int emu_nccl_comms_split(void) { return g_comms_split; }
static std::atomic<int> g_comms_live;   /* made or split, not yet destroyed (read from any thread) */
extern "C" int emu_nccl_comms_live(void) { return g_comms_live; }

/* An MPI failure, or a bootstrap that cannot go on, would leave the other
 * ranks waiting: end the process (mpirun then ends the job). */
[[noreturn]] static void fatal(const char *what) {
    fprintf(stderr, "nccl_emu: %s\n", what);
    fflush(stderr);
    abort();
}
static void mpi_ok(int rc, const char *call) {
    if (rc == MPI_SUCCESS) return;
    char e[MPI_MAX_ERROR_STRING] = "", buf[MPI_MAX_ERROR_STRING + 128];
    int len = 0;
    MPI_Error_string(rc, e, &len);
    snprintf(buf, sizeof buf, "%s failed: %s", call, e);
    fatal(buf);
}

static ncclResult_t fail(ncclResult_t r, const char *why) {
    snprintf(t_last, sizeof t_last, "%s", why);
    return r;
}

const char *ncclGetErrorString(ncclResult_t r) {
    switch (r) {
    case ncclSuccess: return "no error";
    case ncclUnhandledCudaError: return "unhandled cuda error";
    case ncclSystemError: return "unhandled system error";
    case ncclInternalError: return "internal error";
    case ncclInvalidArgument: return "invalid argument";
    case ncclInvalidUsage: return "invalid usage";
    case ncclRemoteError: return "remote process exited or there was a network error";
    case ncclInProgress: return "NCCL operation in progress";
    }
    return "unknown result code";
}
const char *ncclGetLastError(ncclComm_t) { return t_last; }

struct id_body {
    char magic[8];
    int root_world_rank;
    int number;
};

static bool mpi_up(void) {
    int up = 0, down = 0;
    MPI_Initialized(&up);
    if (up) MPI_Finalized(&down);
    return up && !down;
}

ncclResult_t ncclGetUniqueId(ncclUniqueId *id) {
    if (!id) return fail(ncclInvalidArgument, "ncclGetUniqueId: id is NULL");
    memset(id, 0, sizeof *id);
    id_body b;
    memcpy(b.magic, "fsdpemu", 8);
    b.root_world_rank = 0;
    if (mpi_up()) MPI_Comm_rank(MPI_COMM_WORLD, &b.root_world_rank);
    b.number = g_next_id++;
    memcpy(id->internal, &b, sizeof b);
    return ncclSuccess;
}

/* Bootstrap messages on MPI_COMM_WORLD (the engine sends none there), tagged
 * by the id's number: the tags repeat after 256 ids from one root, which is
 * safe because the engine's comm thread makes one communicator at a time. */
enum { TAG_BASE = 0x3e00 };

ncclResult_t ncclCommInitRank(ncclComm_t *out, int nranks, ncclUniqueId id, int rank) {
    if (!out) return fail(ncclInvalidArgument, "ncclCommInitRank: comm is NULL");
    *out = NULL;
    id_body b;
    memcpy(&b, id.internal, sizeof b);
    if (memcmp(b.magic, "fsdpemu", 8) != 0) return fail(ncclInvalidArgument, "ncclCommInitRank: not a unique id");
    if (nranks < 1 || rank < 0 || rank >= nranks) return fail(ncclInvalidArgument, "ncclCommInitRank: bad rank");
    emu_nccl_comm_s *c = new emu_nccl_comm_s{nranks, rank, MPI_COMM_NULL, MPI_COMM_NULL, false};
    if (nranks > 1) {
        if (!mpi_up()) {
            delete c;
            return fail(ncclSystemError, "ncclCommInitRank: several ranks need MPI in the emulation");
        }
        int tag = TAG_BASE + (b.number & 0xff);
        int me = 0, level = 0;
        MPI_Comm_rank(MPI_COMM_WORLD, &me);
        MPI_Query_thread(&level);
        if (level < MPI_THREAD_MULTIPLE)   /* the comm stream's thread calls MPI beside the engine's threads */
            fatal("ncclCommInitRank: the emulation needs MPI_THREAD_MULTIPLE, which this MPI did not provide");
        std::vector<int> members(nranks, -1);   /* world rank of each NCCL rank */
        if (rank == 0) {
            if (me != b.root_world_rank) fatal("ncclCommInitRank: rank 0 is not the rank that made the id");
            members[0] = me;
            for (int i = 1; i < nranks; i++) {
                int msg[2];
                mpi_ok(MPI_Recv(msg, 2, MPI_INT, MPI_ANY_SOURCE, tag, MPI_COMM_WORLD, MPI_STATUS_IGNORE), "MPI_Recv");
                if (msg[0] <= 0 || msg[0] >= nranks || members[msg[0]] >= 0)
                    fatal("ncclCommInitRank: two ranks claim one NCCL rank");
                members[msg[0]] = msg[1];
            }
            for (int i = 1; i < nranks; i++)
                mpi_ok(MPI_Send(members.data(), nranks, MPI_INT, members[i], tag, MPI_COMM_WORLD), "MPI_Send");
        } else {
            int msg[2] = {rank, me};
            mpi_ok(MPI_Send(msg, 2, MPI_INT, b.root_world_rank, tag, MPI_COMM_WORLD), "MPI_Send");
            mpi_ok(MPI_Recv(members.data(), nranks, MPI_INT, b.root_world_rank, tag, MPI_COMM_WORLD, MPI_STATUS_IGNORE),
                   "MPI_Recv");
        }
        MPI_Group world, group;
        MPI_Comm_group(MPI_COMM_WORLD, &world);
        MPI_Group_incl(world, nranks, members.data(), &group);
        mpi_ok(MPI_Comm_create_group(MPI_COMM_WORLD, group, tag, &c->mpi), "MPI_Comm_create_group");
        MPI_Group_free(&group);
        MPI_Group_free(&world);
        MPI_Comm_set_errhandler(c->mpi, MPI_ERRORS_RETURN);   /* checked by mpi_ok */
        mpi_ok(MPI_Comm_dup(c->mpi, &c->ctl), "MPI_Comm_dup");
    }
    g_comms_made++;
    g_comms_live++;
    static bool told;   /* as NCCL does with NCCL_DEBUG=VERSION (or more): its version, once */
    const char *dbg = getenv("NCCL_DEBUG");
    if (dbg && *dbg && !told && rank == 0) {
        told = true;
        printf("NCCL version 2.21.5+emulated\n");
        fflush(stdout);
    }
    *out = c;
    return ncclSuccess;
}

ncclResult_t ncclCommDestroy(ncclComm_t c) {
    if (!c) return ncclSuccess;
    if (c->aborted) return fail(ncclInvalidUsage, "ncclCommDestroy: the communicator was aborted");
    g_comms_live--;
    if (mpi_up()) {
        if (c->mpi != MPI_COMM_NULL) MPI_Comm_free(&c->mpi);
        if (c->ctl != MPI_COMM_NULL) MPI_Comm_free(&c->ctl);
    }
    delete c;
    return ncclSuccess;
}

/* The emulated collectives block in MPI, where nothing can interrupt them,
 * so collectives already on a stream stay there and the handle's memory is
 * kept for them; the handle itself is dead: every later call on it is
 * refused, as on a communicator NCCL freed. */
ncclResult_t ncclCommAbort(ncclComm_t c) {
    if (!c) return ncclSuccess;
    if (!c->aborted) g_comms_live--;
    c->aborted = true;
    return ncclSuccess;
}

ncclResult_t ncclCommGetAsyncError(ncclComm_t c, ncclResult_t *async) {
    if (!c || !async) return fail(ncclInvalidArgument, "ncclCommGetAsyncError: NULL argument");
    if (c->aborted) return fail(ncclInvalidUsage, "ncclCommGetAsyncError: the communicator was aborted");
    *async = ncclSuccess;
    return ncclSuccess;
}

ncclResult_t ncclCommCount(const ncclComm_t c, int *count) {
    if (!c || !count) return fail(ncclInvalidArgument, "ncclCommCount: NULL argument");
    *count = c->nranks;
    return ncclSuccess;
}

ncclResult_t ncclCommUserRank(const ncclComm_t c, int *rank) {
    if (!c || !rank) return fail(ncclInvalidArgument, "ncclCommUserRank: NULL argument");
    *rank = c->rank;
    return ncclSuccess;
}

/* Collective over every rank of parent, as NCCL's: each rank's new
 * communicator holds the ranks of its color, ranked by key, ties broken by
 * the parent rank; NCCL_SPLIT_NOCOLOR takes part and gets NULL. A negative
 * color other than that is refused on that rank only after it took part
 * (the others would wait for it otherwise). The child's traffic goes over
 * MPI communicators of its own, split from the parent's control one, so
 * collectives still queued on the parent's stream do not interleave. */
ncclResult_t ncclCommSplit(ncclComm_t parent, int color, int key, ncclComm_t *out, ncclConfig_t *config) {
    (void)config;   /* (the emulation has no settings a config could carry) */
    if (!out) return fail(ncclInvalidArgument, "ncclCommSplit: newcomm is NULL");
    *out = NULL;
    if (!parent) return fail(ncclInvalidArgument, "ncclCommSplit: comm is NULL");
    if (parent->aborted) return fail(ncclInvalidUsage, "ncclCommSplit: the communicator was aborted");
    bool bad = color < 0 && color != NCCL_SPLIT_NOCOLOR;
    bool in = color >= 0;
    if (parent->nranks == 1) {
        if (bad) return fail(ncclInvalidArgument, "ncclCommSplit: color must be >= 0 or NCCL_SPLIT_NOCOLOR");
        if (!in) return ncclSuccess;
        *out = new emu_nccl_comm_s{1, 0, MPI_COMM_NULL, MPI_COMM_NULL, false};
        g_comms_split++;
        g_comms_live++;
        return ncclSuccess;
    }
    MPI_Comm ctl = MPI_COMM_NULL;
    mpi_ok(MPI_Comm_split(parent->ctl, in ? color : MPI_UNDEFINED, key, &ctl), "MPI_Comm_split");
    if (bad) return fail(ncclInvalidArgument, "ncclCommSplit: color must be >= 0 or NCCL_SPLIT_NOCOLOR");
    if (!in) return ncclSuccess;
    emu_nccl_comm_s *c = new emu_nccl_comm_s{0, 0, MPI_COMM_NULL, ctl, false};
    MPI_Comm_set_errhandler(ctl, MPI_ERRORS_RETURN);
    MPI_Comm_size(ctl, &c->nranks);
    MPI_Comm_rank(ctl, &c->rank);
    if (c->nranks > 1) {
        mpi_ok(MPI_Comm_dup(ctl, &c->mpi), "MPI_Comm_dup");
    } else {   /* one rank: copies, no MPI */
        MPI_Comm_free(&c->ctl);
    }
    g_comms_split++;
    g_comms_live++;
    *out = c;
    return ncclSuccess;
}

/* ---- groups ----
 * Between ncclGroupStart and the outermost ncclGroupEnd, collectives are
 * only checked and kept; ncclGroupEnd enqueues them all, in call order, on
 * their streams. The real NCCL launches a group's operations as one and
 * lets them progress together; here they run one after another, which is
 * the same results for what may be grouped (independent buffers). An
 * argument error inside a group fails that call, and ncclGroupEnd then
 * reports the group as failed and enqueues nothing of it. */
struct coll;
static thread_local int t_group_depth;
static thread_local std::vector<std::pair<coll *, cudaStream_t>> *t_group;
static thread_local bool t_group_failed;
static long long g_groups_run;

extern "C" long long emu_nccl_groups(void) { return g_groups_run; }

/* ---- collectives ---- */

static size_t type_size(ncclDataType_t t) {
    switch (t) {
    case ncclInt8: case ncclUint8: return 1;
    case ncclFloat16: case ncclBfloat16: return 2;
    case ncclInt32: case ncclUint32: case ncclFloat32: return 4;
    case ncclInt64: case ncclUint64: case ncclFloat64: return 8;
    }
    return 0;
}

/* out[i] = op over ranks of in[r][i], done in double and in rank order (the
 * real NCCL's order differs by ring or tree; tests bound the difference). */
static void reduce_rows(const std::vector<char> &all, int nranks, size_t count, size_t stride_elems, size_t offset,
                        ncclDataType_t t, ncclRedOp_t op, void *out) {
    size_t es = type_size(t);
    for (size_t i = 0; i < count; i++) {
        double acc = 0;
        for (int r = 0; r < nranks; r++) {
            const char *p = all.data() + ((size_t)r * stride_elems + offset + i) * es;
            double v = 0;
            switch (t) {
            case ncclFloat32: { float f; memcpy(&f, p, 4); v = f; break; }
            case ncclBfloat16: { uint16_t h; memcpy(&h, p, 2); v = bf16_to_f32(h); break; }
            case ncclInt32: { int32_t x; memcpy(&x, p, 4); v = x; break; }
            case ncclInt64: { int64_t x; memcpy(&x, p, 8); v = (double)x; break; }
            case ncclFloat64: memcpy(&v, p, 8); break;
            default: abort();
            }
            if (r == 0) acc = v;
            else if (op == ncclMax) acc = v > acc ? v : acc;
            else if (op == ncclMin) acc = v < acc ? v : acc;
            else if (op == ncclProd) acc *= v;
            else acc += v;
        }
        if (op == ncclAvg) acc /= nranks;
        char *q = (char *)out + i * es;
        switch (t) {
        case ncclFloat32: { float f = (float)acc; memcpy(q, &f, 4); break; }
        case ncclBfloat16: { uint16_t h = f32_to_bf16((float)acc); memcpy(q, &h, 2); break; }
        case ncclInt32: { int32_t x = (int32_t)acc; memcpy(q, &x, 4); break; }
        case ncclInt64: { int64_t x = (int64_t)acc; memcpy(q, &x, 8); break; }
        case ncclFloat64: memcpy(q, &acc, 8); break;
        default: abort();
        }
    }
}

enum kind { K_GATHER, K_REDUCE_SCATTER, K_ALL_REDUCE, K_BROADCAST };
struct coll {
    kind k;
    const void *send;
    void *recv;
    size_t count;   /* per rank for gather and reduce-scatter */
    ncclDataType_t t;
    ncclRedOp_t op;
    int root;
    ncclComm_t c;
};

/* Gathers every rank's `bytes` of src into all (rank-major). */
static void gather_bytes(ncclComm_t c, const void *src, size_t bytes, std::vector<char> &all) {
    all.resize(bytes * (size_t)c->nranks);
    if (c->nranks == 1) {
        memcpy(all.data(), src, bytes);
        return;
    }
    std::vector<char> mine((const char *)src, (const char *)src + bytes);
    if (bytes > (size_t)INT_MAX) fatal("a collective of more than 2 GiB per rank is not emulated");
    mpi_ok(MPI_Allgather(mine.data(), (int)bytes, MPI_BYTE, all.data(), (int)bytes, MPI_BYTE, c->mpi), "MPI_Allgather");
}

static const char *const kind_names[] = {"ncclAllGather", "ncclReduceScatter", "ncclAllReduce", "ncclBroadcast"};

static void run_coll(void *arg) {
    coll *x = (coll *)arg;
    ncclComm_t c = x->c;
    size_t es = type_size(x->t), bytes = x->count * es;
    std::vector<char> all;
    const void *bufs[2] = {x->send, x->recv};
    int op = emu_op_begin("NCCL", kind_names[x->k], bufs, 2);   /* the host guard opens its buffers */
    switch (x->k) {
    case K_GATHER:
        gather_bytes(c, x->send, bytes, all);
        memcpy(x->recv, all.data(), all.size());
        break;
    case K_REDUCE_SCATTER:   /* everything to everyone, then each reduces its block */
        gather_bytes(c, x->send, bytes * (size_t)c->nranks, all);
        reduce_rows(all, c->nranks, x->count, x->count * (size_t)c->nranks, x->count * (size_t)c->rank, x->t, x->op,
                    x->recv);
        break;
    case K_ALL_REDUCE:
        gather_bytes(c, x->send, bytes, all);
        reduce_rows(all, c->nranks, x->count, x->count, 0, x->t, x->op, x->recv);
        break;
    case K_BROADCAST:
        gather_bytes(c, x->send, bytes, all);
        memcpy(x->recv, all.data() + (size_t)x->root * bytes, bytes);
        break;
    }
    emu_op_end(op);
    delete x;
}

static ncclResult_t check_coll(const coll &x) {
    if (!x.c) return fail(ncclInvalidArgument, "collective on a NULL communicator");
    if (x.c->aborted) return fail(ncclInvalidUsage, "collective on an aborted communicator");
    if (type_size(x.t) == 0) return fail(ncclInvalidArgument, "unknown data type");
    if ((x.k == K_REDUCE_SCATTER || x.k == K_ALL_REDUCE) &&
        !(x.t == ncclFloat32 || x.t == ncclBfloat16 || x.t == ncclInt32 || x.t == ncclInt64 || x.t == ncclFloat64))
        return fail(ncclInvalidArgument, "the emulation reduces f32, bf16, f64, i32 and i64 only");
    if (x.k == K_BROADCAST && (x.root < 0 || x.root >= x.c->nranks)) return fail(ncclInvalidArgument, "bad root");
    return ncclSuccess;
}

static ncclResult_t submit(coll x, cudaStream_t s) {
    ncclResult_t r = check_coll(x);
    if (r != ncclSuccess) {
        if (t_group_depth > 0) t_group_failed = true;
        return r;
    }
    if (t_group_depth > 0) {   /* deferred to ncclGroupEnd */
        t_group->push_back({new coll(x), s});
        return ncclSuccess;
    }
    emu_stream_enqueue(s, run_coll, new coll(x));
    return ncclSuccess;
}

ncclResult_t ncclGroupStart(void) {
    if (t_group_depth++ == 0) {
        t_group = new std::vector<std::pair<coll *, cudaStream_t>>();
        t_group_failed = false;
    }
    return ncclSuccess;
}

/* Test control: FSDP_EMU_NCCL_FAIL_GROUP=R:N makes the N-th group of at
 * least one collective fail at its ncclGroupEnd on world rank R, launching
 * nothing of it, as a group whose launch failed on one GPU. */
static bool injected_failure(void) {
    static int rank_to_fail = -2, nth = 0, seen = 0;
    if (rank_to_fail == -2) {
        rank_to_fail = -1;
        const char *v = getenv("FSDP_EMU_NCCL_FAIL_GROUP");
        if (v && sscanf(v, "%d:%d", &rank_to_fail, &nth) != 2) rank_to_fail = -1;
    }
    if (rank_to_fail < 0) return false;
    int me = 0;
    if (mpi_up()) MPI_Comm_rank(MPI_COMM_WORLD, &me);
    return me == rank_to_fail && ++seen == nth;
}

ncclResult_t ncclGroupEnd(void) {
    if (t_group_depth <= 0) return fail(ncclInvalidUsage, "ncclGroupEnd without ncclGroupStart");
    if (--t_group_depth > 0) return ncclSuccess;
    std::vector<std::pair<coll *, cudaStream_t>> *g = t_group;
    t_group = NULL;
    ncclResult_t r = ncclSuccess;
    if (!t_group_failed && !g->empty() && injected_failure()) {
        for (auto &e : *g) delete e.first;
        r = fail(ncclSystemError, "injected failure of this group's launch (FSDP_EMU_NCCL_FAIL_GROUP)");
    } else if (t_group_failed) {
        for (auto &e : *g) delete e.first;
        r = fail(ncclInvalidArgument, "a call of the group failed; nothing of it was launched");
    } else {
        for (auto &e : *g) emu_stream_enqueue(e.second, run_coll, e.first);
        if (!g->empty()) g_groups_run++;
    }
    delete g;
    t_group_failed = false;
    return r;
}

ncclResult_t ncclAllGather(const void *send, void *recv, size_t count, ncclDataType_t t, ncclComm_t c,
                           cudaStream_t s) {
    return submit(coll{K_GATHER, send, recv, count, t, ncclSum, 0, c}, s);
}
ncclResult_t ncclReduceScatter(const void *send, void *recv, size_t count, ncclDataType_t t, ncclRedOp_t op,
                               ncclComm_t c, cudaStream_t s) {
    return submit(coll{K_REDUCE_SCATTER, send, recv, count, t, op, 0, c}, s);
}
ncclResult_t ncclAllReduce(const void *send, void *recv, size_t count, ncclDataType_t t, ncclRedOp_t op,
                           ncclComm_t c, cudaStream_t s) {
    return submit(coll{K_ALL_REDUCE, send, recv, count, t, op, 0, c}, s);
}
ncclResult_t ncclBroadcast(const void *send, void *recv, size_t count, ncclDataType_t t, int root, ncclComm_t c,
                           cudaStream_t s) {
    return submit(coll{K_BROADCAST, send, recv, count, t, ncclSum, root, c}, s);
}
