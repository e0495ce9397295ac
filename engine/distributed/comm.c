/* comm.c: communicators and the public collectives (DESIGN.md, decisions 4
 * and 8). What each collective means is in fsdp.h; how the files of the
 * communicator divide the work is in comm_backend.h.
 *
 * Here: the world, splits, counting communicators, and every collective's
 * argument checks. The checks are purely local and happen before anything
 * is queued, so a bad call fails on every rank that makes it without any
 * rank hanging; what ranks must agree on (counts, dtypes, ops, roots) is
 * checked across ranks on the comm thread (comm_debug.c). A collective
 * whose tensors sit on different devices is refused. */
#include "comm_impl.h"
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* ---- traffic counts of a family of communicators ---- */

comm_counts *comm_counts_new(void) {
    comm_counts *k = calloc(1, sizeof *k);
    if (k) atomic_init(&k->refs, 1);
    return k;
}

void comm_counts_unref(comm_counts *k) {
    if (k && atomic_fetch_sub(&k->refs, 1) == 1) free(k);
}

static comm_counts *counts_ref(comm_counts *k) {
    if (k) atomic_fetch_add(&k->refs, 1);
    return k;
}

/* ---- live communicators, by id ---- */

static pthread_mutex_t live_mu = PTHREAD_MUTEX_INITIALIZER;
static fsdp_comm *live_head;

void comm_live_add(fsdp_comm *c) {
    pthread_mutex_lock(&live_mu);
    c->next_live = live_head;
    live_head = c;
    pthread_mutex_unlock(&live_mu);
}

void comm_live_remove(fsdp_comm *c) {
    pthread_mutex_lock(&live_mu);
    for (fsdp_comm **p = &live_head; *p; p = &(*p)->next_live) {
        if (*p == c) {
            *p = c->next_live;
            break;
        }
    }
    c->next_live = NULL;
    pthread_mutex_unlock(&live_mu);
}

void comm_live_lock(bool lock) {
    if (lock) pthread_mutex_lock(&live_mu);
    else pthread_mutex_unlock(&live_mu);
}

fsdp_comm *comm_live_find(uint64_t id) {
    for (fsdp_comm *c = live_head; c; c = c->next_live)
        if (c->id == id && c->magic == COMM_MAGIC) return c;
    return NULL;
}

/* ---- communicators ---- */

static fsdp_comm g_world_comm;
static pthread_mutex_t world_mu = PTHREAD_MUTEX_INITIALIZER;

static fsdp_status comm_check(fsdp_comm *c, const char *opname) {
    if (!c) return fsdp_set_error(FSDP_ERR_INVALID, "%s: communicator is NULL", opname);
    if (c->magic != COMM_MAGIC)
        return fsdp_set_error(FSDP_ERR_INVALID, "%s: not a live communicator (freed already?)", opname);
    if (c->be->usable) return c->be->usable(c, opname);
    return FSDP_OK;
}

fsdp_status fsdp_comm_world(fsdp_comm **out) {
    if (!out) return fsdp_set_error(FSDP_ERR_INVALID, "fsdp_comm_world: out is NULL");
    *out = NULL;
    pthread_mutex_lock(&world_mu);
    fsdp_comm *c = &g_world_comm;
    if (c->magic != COMM_MAGIC) {
        /* MPI under mpirun, else a world of one. Only here, before any
         * collective: later the comm thread alone talks to MPI. */
        fsdp_status st = fsdp_runtime_init(NULL, NULL);
        if (st != FSDP_OK) {
            pthread_mutex_unlock(&world_mu);
            return st;
        }
        int inited = 0, fin = 0;
        MPI_Initialized(&inited);
        MPI_Finalized(&fin);
        if (fin) {
            pthread_mutex_unlock(&world_mu);
            return fsdp_set_error(FSDP_ERR_STATE, "fsdp_comm_world: MPI is finalized already");
        }
        if (inited) {
            /* The comm thread makes every MPI call, but never at the same time
             * as another thread: SERIALIZED is the least it needs. */
            int level = MPI_THREAD_SINGLE;
            MPI_Query_thread(&level);
            if (level < MPI_THREAD_SERIALIZED) {
                pthread_mutex_unlock(&world_mu);
                return fsdp_set_error(FSDP_ERR_COMM,
                                      "fsdp_comm_world: MPI was initialized with thread level %d; the comm "
                                      "thread needs MPI_THREAD_SERIALIZED (%d) or more",
                                      level, MPI_THREAD_SERIALIZED);
            }
            int rank = 0, size = 1;
            MPI_Comm_rank(MPI_COMM_WORLD, &rank);
            MPI_Comm_size(MPI_COMM_WORLD, &size);
            c->be = &comm_mpi_backend;
            c->mpi = MPI_COMM_WORLD;   /* used as is: nobody else sends on it */
            c->rank = rank;
            c->size = size;
        } else {
            c->be = &comm_single_backend;
            c->mpi = MPI_COMM_NULL;
            c->rank = 0;
            c->size = 1;
        }
        if (!c->counts) c->counts = comm_counts_new();
        if (!c->counts) {
            pthread_mutex_unlock(&world_mu);
            return fsdp_set_error(FSDP_ERR_OOM, "fsdp_comm_world: out of host memory");
        }
        if (comm_cfg()->error[0]) {
            pthread_mutex_unlock(&world_mu);
            return fsdp_set_error(FSDP_ERR_INVALID, "fsdp_comm_world: %s", comm_cfg()->error);
        }
        c->dev = comm_device_backend();
        c->last_done.seq = UINT64_MAX;
        if (c->size > 1 && c->be->service) comm_set_service(c->be->service);
        c->id = comm_hash_str("world");
        c->is_world = true;
        snprintf(c->name, sizeof c->name, "world");
        atomic_init(&c->world_refs, 0);
        c->magic = COMM_MAGIC;
        if (c->size > 1) comm_live_add(c);
    }
    atomic_fetch_add(&c->world_refs, 1);
    pthread_mutex_unlock(&world_mu);
    *out = c;
    return FSDP_OK;
}

fsdp_status fsdp_comm_new_counting(fsdp_comm **out, int world, int rank) {
    if (!out) return fsdp_set_error(FSDP_ERR_INVALID, "fsdp_comm_new_counting: out is NULL");
    *out = NULL;
    if (world < 1 || rank < 0 || rank >= world)
        return fsdp_set_error(FSDP_ERR_INVALID, "fsdp_comm_new_counting: world %d, rank %d: expected world >= 1 and "
                              "0 <= rank < world", world, rank);
    fsdp_comm *c = calloc(1, sizeof *c);
    comm_counts *k = comm_counts_new();
    if (!c || !k) {
        free(c);
        free(k);
        return fsdp_set_error(FSDP_ERR_OOM, "fsdp_comm_new_counting: out of host memory");
    }
    c->be = &comm_count_backend;
    c->dev = NULL;   /* CUDA tensors are refused: nothing would be moved, nor well-defined */
    c->mpi = MPI_COMM_NULL;
    c->rank = rank;
    c->size = world;
    c->counts = k;
    c->last_done.seq = UINT64_MAX;
    char name[64];
    snprintf(name, sizeof name, "counting.world%d", world);
    c->id = comm_hash_str(name);
    snprintf(c->name, sizeof c->name, "%s", name);
    c->magic = COMM_MAGIC;
    *out = c;
    return FSDP_OK;
}

/* Queues a split of parent; child_rank and child_size are this rank's
 * place in the child when the caller knows it (else -1). */
static fsdp_status split(fsdp_comm **out, fsdp_comm *parent, int color, int key, int child_rank, int child_size,
                         uint64_t table_hash, const char *opname) {
    /* A negative color is refused only after the split ran: the other ranks
     * are in it too, and must not wait for this one forever. */
    fsdp_comm *child = calloc(1, sizeof *child);
    if (!child) return fsdp_set_error(FSDP_ERR_OOM, "%s: out of host memory for a communicator", opname);
    child->rank = child_rank;
    child->size = child_size;
    child->counts = counts_ref(parent->counts);
    child->last_done.seq = UINT64_MAX;
    fsdp_work *w;
    fsdp_status st = comm_work_new(&w, K_SPLIT, parent, "", 0, DT_NONE, 0, opname);
    if (st != FSDP_OK) {
        comm_counts_unref(child->counts);
        free(child);
        return st;
    }
    if (table_hash) {   /* split_all: every rank must pass the same tables, checked as the "arg" */
        w->fp.label_hash = table_hash;
        w->fp.arg = (int32_t)(uint32_t)(table_hash ^ (table_hash >> 32));
    }
    w->color = color;
    w->key = key;
    w->split_out = child;            /* the comm thread completes it, or frees it on failure */
    atomic_fetch_add(&w->refs, 1);   /* keep it past comm_issue() to read the result */
    st = comm_issue(NULL, w, opname);
    pthread_mutex_lock(&w->mu);
    /* A wait given up (fsdp_comm_abandon) leaves the split to the queue,
     * which disposes of the child when it is done with it. */
    if (!w->done) w->orphaned = true;
    bool mine = w->done;
    pthread_mutex_unlock(&w->mu);
    if (st == FSDP_OK) {
        *out = w->split_out;
    } else if (mine && w->split_out) {   /* failed before the split ran (e.g. the ranks disagree) */
        comm_counts_unref(w->split_out->counts);
        free(w->split_out);
    }
    comm_work_unref(w);
    return st;
}

fsdp_status fsdp_comm_split(fsdp_comm **out, fsdp_comm *parent, int color, int key) {
    if (!out) return fsdp_set_error(FSDP_ERR_INVALID, "fsdp_comm_split: out is NULL");
    *out = NULL;
    FSDP_TRY(comm_check(parent, "fsdp_comm_split"));
    return split(out, parent, color, key, -1, -1, 0, "fsdp_comm_split");
}

/* A counting child's world ranks, as an MPI split knows them: the ranks of
 * its color ordered by (key, rank), through the parent's own members (the
 * planner's time model tells a node's links from the others by them). */
static void count_members(fsdp_comm *child, const fsdp_comm *parent, const int *colors, const int *keys, int n) {
    int color = colors[parent->rank], k = 0;
    if (color < 0 || child->size < 1 || child->members) return;
    child->members = malloc((size_t)child->size * sizeof(int));
    if (!child->members) return;   /* (only the time model's levels are lost) */
    for (int r = 0; r < n && k < child->size; r++) {
        if (colors[r] != color) continue;
        int j = k++;
        while (j > 0) {   /* insertion by (key, rank): ranks arrive in order */
            int q = child->members[j - 1];
            if (keys[q] <= keys[r]) break;
            child->members[j] = q;
            j--;
        }
        child->members[j] = r;
    }
    for (int j = 0; j < k; j++)
        if (parent->members) child->members[j] = parent->members[child->members[j]];
}

fsdp_status fsdp_comm_split_all(fsdp_comm **out, fsdp_comm *parent, const int *colors, const int *keys, int n) {
    static const char *name = "fsdp_comm_split_all";
    if (!out) return fsdp_set_error(FSDP_ERR_INVALID, "%s: out is NULL", name);
    *out = NULL;
    FSDP_TRY(comm_check(parent, name));
    if (!colors || !keys || n != parent->size)
        return fsdp_set_error(FSDP_ERR_INVALID, "%s on comm %s(%d): %d colors at %p, keys at %p: expected one color "
                              "and one key per rank (%d)", name, parent->name, parent->size, n, (const void *)colors,
                              (const void *)keys, parent->size);
    int me = parent->rank, color = colors[me], key = keys[me];
    /* This rank's place in the child: ranks of its color ordered by (key, rank). */
    int rank = 0, size = 0;
    uint64_t h = comm_hash_str(name);
    for (int r = 0; r < n; r++) {
        h = comm_hash_mix(h, ((uint64_t)(uint32_t)colors[r] << 32) | (uint32_t)keys[r]);
        if (colors[r] != color || color < 0) continue;
        size++;
        if (keys[r] < key || (keys[r] == key && r < me)) rank++;
    }
    if (color < 0) rank = size = -1;
    fsdp_status st = split(out, parent, color, key, rank, size, h, name);
    if (st == FSDP_OK && *out && parent->be == &comm_count_backend) count_members(*out, parent, colors, keys, n);
    return st;
}

fsdp_status comm_dup(fsdp_comm **out, fsdp_comm *parent) {
    if (!out) return fsdp_set_error(FSDP_ERR_INVALID, "comm_dup: out is NULL");
    *out = NULL;
    FSDP_TRY(comm_check(parent, "comm_dup"));
    fsdp_status st = split(out, parent, 0, parent->rank, parent->rank, parent->size, 0, "comm_dup");
    if (st == FSDP_OK && *out && parent->be == &comm_count_backend && parent->members && !(*out)->members) {
        (*out)->members = malloc((size_t)parent->size * sizeof(int));
        if ((*out)->members) memcpy((*out)->members, parent->members, (size_t)parent->size * sizeof(int));
    }
    return st;
}

fsdp_status fsdp_comm_info(fsdp_comm *c, int *rank, int *size) {
    FSDP_TRY(comm_check(c, "fsdp_comm_info"));
    if (rank) *rank = c->rank;
    if (size) *size = c->size;
    return FSDP_OK;
}

fsdp_status fsdp_comm_counts(fsdp_comm *c, fsdp_collective kind, int64_t *calls, int64_t *bytes) {
    FSDP_TRY(comm_check(c, "fsdp_comm_counts"));
    if (kind < 0 || kind >= K_COUNTED)
        return fsdp_set_error(FSDP_ERR_INVALID, "fsdp_comm_counts on comm %s(%d): kind %d, expected 0..%d", c->name,
                              c->size, kind, K_COUNTED - 1);
    if (calls) *calls = atomic_load(&c->counts->calls[kind]);
    if (bytes) *bytes = atomic_load(&c->counts->bytes[kind]);
    return FSDP_OK;
}

fsdp_status fsdp_comm_wire_counts(fsdp_comm *c, fsdp_collective kind, int64_t *bytes) {
    FSDP_TRY(comm_check(c, "fsdp_comm_wire_counts"));
    if (kind < 0 || kind >= K_COUNTED)
        return fsdp_set_error(FSDP_ERR_INVALID, "fsdp_comm_wire_counts on comm %s(%d): kind %d, expected 0..%d",
                              c->name, c->size, kind, K_COUNTED - 1);
    if (bytes) *bytes = atomic_load(&c->counts->wire[kind]);
    return FSDP_OK;
}

fsdp_status fsdp_comm_reset_counts(fsdp_comm *c) {
    FSDP_TRY(comm_check(c, "fsdp_comm_reset_counts"));
    for (int k = 0; k < K_COUNTED; k++) {
        atomic_store(&c->counts->calls[k], 0);
        atomic_store(&c->counts->bytes[k], 0);
        atomic_store(&c->counts->wire[k], 0);
    }
    return FSDP_OK;
}

fsdp_status fsdp_comm_free(fsdp_comm *c) {
    if (!c) return FSDP_OK;
    if (c->magic != COMM_MAGIC)
        return fsdp_set_error(FSDP_ERR_INVALID, "fsdp_comm_free: not a live communicator (freed twice?)");
    if (c->is_world) {
        /* The world stays: its sequence numbers must go on counting. */
        if (atomic_fetch_sub(&c->world_refs, 1) <= 0) {
            atomic_fetch_add(&c->world_refs, 1);
            return fsdp_set_error(FSDP_ERR_INVALID, "fsdp_comm_free: the world communicator was freed more often "
                                                    "than fsdp_comm_world handed it out");
        }
        return FSDP_OK;
    }
    int finalized = 0;
    MPI_Finalized(&finalized);
    if (finalized) {   /* MPI is gone (handles freed at exit): nothing to tell it */
        comm_live_remove(c);
        comm_counts_unref(c->counts);
        c->magic = 0;
        free(c);
        return FSDP_OK;
    }
    fsdp_work *w;
    FSDP_TRY(comm_work_new(&w, K_FREE, c, "", 0, DT_NONE, 0, "fsdp_comm_free"));
    c->magic = 0;   /* no new collectives from here; queued ones still run */
    return comm_issue(NULL, w, "fsdp_comm_free");
}

fsdp_status comm_leave(void) {
    int inited = 0, fin = 0;
    MPI_Initialized(&inited);
    MPI_Finalized(&fin);
    if (!inited || fin) return FSDP_OK;
    if (comm_cfg()->error[0]) return FSDP_OK;   /* refused at the first collective already */
    return comm_mpi_backend.leave(comm_cfg()->watchdog_s);
}

int comm_rank_of(fsdp_comm *c) { return c ? c->rank : -1; }
int comm_size_of(fsdp_comm *c) { return c ? c->size : -1; }
const char *comm_name_of(fsdp_comm *c) { return c ? c->name : "?"; }

/* ---- public: collectives ---- */

static fsdp_status check_tensor(const char *opname, const char *label, const char *what, fsdp_tensor *t,
                                fsdp_comm *c) {
    char d[200];
    if (!t)
        return fsdp_set_error(FSDP_ERR_INVALID, "%s '%s' on comm %s(%d): %s is NULL", opname, label, c->name,
                              c->size, what);
    int dev = tensor_device(t);
    if (dev != FSDP_DEVICE_CPU) {
        if (c->be->local && dev != FSDP_DEVICE_CUDA) return FSDP_OK;   /* counted, never touched */
        if (!c->dev)
            return fsdp_set_error(FSDP_ERR_DEVICE, "%s '%s' on comm %s(%d): %s %s: the %s backend carries CPU tensors "
                                  "(NCCL is not built into this engine)", opname, label, c->name, c->size, what,
                                  tensor_desc(t, d, sizeof d), c->be->name);
        bool nccl = c->be->carries_device && c->dev->between_ranks;
        if (dev != FSDP_DEVICE_CUDA || (c->size > 1 && !nccl))
            return fsdp_set_error(FSDP_ERR_DEVICE, "%s '%s' on comm %s(%d): %s %s: the %s backend carries CPU "
                                  "tensors, and NCCL, which carries CUDA tensors between ranks, is not built into "
                                  "this engine", opname, label, c->name, c->size, what, tensor_desc(t, d, sizeof d),
                                  c->be->name);
    }
    if (!tensor_is_contiguous(t))
        return fsdp_set_error(FSDP_ERR_LAYOUT, "%s '%s' on comm %s(%d): %s %s is not contiguous", opname, label,
                              c->name, c->size, what, tensor_desc(t, d, sizeof d));
    if (!t->storage->data && t->storage->nbytes > 0)
        return fsdp_set_error(FSDP_ERR_STATE, "%s '%s' on comm %s(%d): %s %s belongs to a resharded unit (no data)",
                              opname, label, c->name, c->size, what, tensor_desc(t, d, sizeof d));
    return FSDP_OK;
}

static fsdp_status prepare(fsdp_work **work, fsdp_comm *c, const char *opname) {
    if (work) *work = NULL;
    return comm_check(c, opname);
}

/* One device per collective. */
static fsdp_status check_same_device(const char *opname, const char *label, fsdp_comm *c, fsdp_tensor *dst,
                                     fsdp_tensor *src) {
    if (tensor_device(dst) == tensor_device(src)) return FSDP_OK;
    char a[200], b[200];
    return fsdp_set_error(FSDP_ERR_DEVICE, "%s '%s' on comm %s(%d): dst %s is on %s but src %s is on %s: a "
                          "collective's tensors must be on one device", opname, label, c->name, c->size,
                          tensor_desc(dst, a, sizeof a), fsdp_device_name(tensor_device(dst)),
                          tensor_desc(src, b, sizeof b), fsdp_device_name(tensor_device(src)));
}

/* Last step before comm_issue() for a collective on tensors: a CUDA one
 * records its "ready" event on the compute stream now, behind every kernel
 * issued so far, and gets device scratch when its buffers overlap in a way
 * NCCL does not take in place. On failure w is gone. */
static fsdp_status work_device(fsdp_work *w, int device, bool need_scratch, const char *opname) {
    w->device = device;
    w->fp.device = device;
    if (device != FSDP_DEVICE_CUDA) return FSDP_OK;
    const comm_backend *dev = w->comm->dev;   /* check_tensor saw it */
    fsdp_status st = FSDP_OK;
    if (need_scratch) st = tensor_new(&w->t_scratch, w->dtype, 1, &w->n, device, FSDP_TAG_COMM, false);
    if (st == FSDP_OK) st = dev->work_begin(&w->gw);
    if (st != FSDP_OK) {
        const char *e;
        int n = comm_last_error_len(&e);
        char msg[1024];
        snprintf(msg, sizeof msg, "%.*s", n, e);
        st = fsdp_set_error(st, "%s '%s' on comm %s(%d): %s", opname, w->fp.label, w->comm_name, w->comm_size, msg);
        comm_work_unref(w);
    }
    return st;
}

static fsdp_status check_reduce_op(const char *opname, const char *label, fsdp_comm *c, int op, bool max_ok) {
    if (op == FSDP_REDUCE_SUM || op == FSDP_REDUCE_AVG || (max_ok && op == FSDP_REDUCE_MAX)) return FSDP_OK;
    return fsdp_set_error(FSDP_ERR_INVALID, "%s '%s' on comm %s(%d): reduce op %d, expected %s", opname, label,
                          c->name, c->size, op, max_ok ? "sum (0), avg (1) or max (2)" : "sum (0) or avg (1)");
}

/* Which dtypes a collective on tensors takes. */
typedef enum {
    SAME_DTYPE,          /* any, dst and src alike (all-gather moves bytes) */
    SAME_FLOAT_DTYPE,    /* f32 or bf16, alike, reduced with sum or avg (reduce-scatter) */
    REDUCIBLE_DTYPE,     /* f32, bf16 with sum, avg or max; i32, i64 with sum or max (all-reduce) */
} dtype_rule;

/* The local checks of a collective on tensors, in the order a caller meets
 * them: each tensor usable, one device, the reduce op and the dtypes (rule),
 * then for a gather or a scatter the element counts: the whole tensor (dst
 * when dst_whole, else src) holds size times the block's elements, and a
 * block fits MPI's int counts. src NULL: one tensor, in place. */
static fsdp_status check_collective(const char *opname, const char *label, fsdp_comm *c, fsdp_tensor *dst,
                                    fsdp_tensor *src, bool dst_whole, dtype_rule rule, int op) {
    char a[200], b[200];
    FSDP_TRY(check_tensor(opname, label, src ? "dst" : "t", dst, c));
    if (src) {
        FSDP_TRY(check_tensor(opname, label, "src", src, c));
        FSDP_TRY(check_same_device(opname, label, c, dst, src));
    }
    switch (rule) {
    case SAME_DTYPE:
        if (dst->dtype != src->dtype)
            return fsdp_set_error(FSDP_ERR_DTYPE, "%s '%s' on comm %s(%d): dst %s and src %s differ in dtype", opname,
                                  label, c->name, c->size, tensor_desc(dst, a, sizeof a),
                                  tensor_desc(src, b, sizeof b));
        break;
    case SAME_FLOAT_DTYPE:
        FSDP_TRY(check_reduce_op(opname, label, c, op, false));
        if (dst->dtype != src->dtype || (src->dtype != FSDP_F32 && src->dtype != FSDP_BF16))
            return fsdp_set_error(FSDP_ERR_DTYPE, "%s '%s' on comm %s(%d): dst %s, src %s: expected both f32 or both "
                                  "bf16", opname, label, c->name, c->size, tensor_desc(dst, a, sizeof a),
                                  tensor_desc(src, b, sizeof b));
        break;
    case REDUCIBLE_DTYPE:
        if (fsdp_dtype_is_float(dst->dtype)) {
            FSDP_TRY(check_reduce_op(opname, label, c, op, true));
        } else if (dst->dtype == FSDP_I32 || dst->dtype == FSDP_I64) {
            if (op != FSDP_REDUCE_SUM && op != FSDP_REDUCE_MAX)
                return fsdp_set_error(FSDP_ERR_INVALID, "%s '%s' on comm %s(%d): t %s: reduce op %d (%s), integers "
                                      "take sum (0) or max (2)", opname, label, c->name, c->size,
                                      tensor_desc(dst, a, sizeof a), op, comm_op_name(op));
        } else {
            return fsdp_set_error(FSDP_ERR_DTYPE, "%s '%s' on comm %s(%d): t %s: expected f32, bf16, i32 or i64",
                                  opname, label, c->name, c->size, tensor_desc(dst, a, sizeof a));
        }
        break;
    }
    if (!src) return FSDP_OK;
    fsdp_tensor *whole = dst_whole ? dst : src, *block = dst_whole ? src : dst;
    const char *whole_name = dst_whole ? "dst" : "src", *block_name = dst_whole ? "src" : "dst";
    int64_t n = tensor_numel(block);
    if (tensor_numel(whole) != n * c->size)
        return fsdp_set_error(FSDP_ERR_SHAPE,
                              "%s '%s' on comm %s(%d): %s %s has %lld elements, expected size * %s numel = "
                              "%d * %lld = %lld (%s %s)",
                              opname, label, c->name, c->size, whole_name, tensor_desc(whole, a, sizeof a),
                              (long long)tensor_numel(whole), block_name, c->size, (long long)n,
                              (long long)n * c->size, block_name, tensor_desc(block, b, sizeof b));
    if (n > INT_MAX)
        return fsdp_set_error(FSDP_ERR_UNSUPPORTED, "%s '%s' on comm %s(%d): %s %s has more than %d elements", opname,
                              label, c->name, c->size, block_name, tensor_desc(block, b, sizeof b), INT_MAX);
    return FSDP_OK;
}

fsdp_status fsdp_all_gather(fsdp_work **work, fsdp_comm *c, fsdp_tensor *dst, fsdp_tensor *src, const char *label) {
    static const char *op = "fsdp_all_gather";
    FSDP_TRY(prepare(work, c, op));
    if (!label) label = "";
    FSDP_TRY(check_collective(op, label, c, dst, src, true, SAME_DTYPE, -1));
    storage_written(dst->storage);
    int64_t n = tensor_numel(src);
    fsdp_work *w;
    FSDP_TRY(comm_work_new(&w, K_ALL_GATHER, c, label, n * c->size * (int64_t)fsdp_dtype_size(dst->dtype),
                           dst->dtype, 0, op));
    tensor_retain(dst);
    tensor_retain(src);
    w->t_dst = dst;
    w->t_src = src;
    w->dst = tensor_data(dst);
    w->src = tensor_data(src);
    w->n = n;
    w->dtype = dst->dtype;
    int64_t block = n * (int64_t)fsdp_dtype_size(dst->dtype);
    bool in_place = (const char *)w->src == (char *)w->dst + (int64_t)c->rank * block;
    FSDP_TRY(work_device(w, tensor_device(dst), !in_place && comm_overlaps(w->src, block, w->dst, block * c->size),
                         op));
    return comm_issue(work, w, op);
}

static fsdp_status reduce_scatter(fsdp_work **work, fsdp_comm *c, fsdp_tensor *dst, fsdp_tensor *src, int op,
                                  bool accumulate, const char *label, const char *name) {
    FSDP_TRY(prepare(work, c, name));
    if (!label) label = "";
    FSDP_TRY(check_collective(name, label, c, dst, src, false, SAME_FLOAT_DTYPE, op));
    if (accumulate) {   /* the host's f32 path only: the backends add in their pass over the terms */
        char a[200], b[200];
        int64_t nb = tensor_numel(dst) * 4;
        if (dst->dtype != FSDP_F32 || !device_is_host_like(tensor_device(dst)))
            return fsdp_set_error(FSDP_ERR_UNSUPPORTED, "%s '%s' on comm %s(%d): dst %s: adding into dst takes f32 "
                                  "tensors on the host", name, label, c->name, c->size, tensor_desc(dst, a, sizeof a));
        if (comm_overlaps(tensor_data(dst), nb, tensor_data(src), nb * c->size))
            return fsdp_set_error(FSDP_ERR_INVALID, "%s '%s' on comm %s(%d): dst %s overlaps src %s", name, label,
                                  c->name, c->size, tensor_desc(dst, a, sizeof a), tensor_desc(src, b, sizeof b));
    }
    storage_written(dst->storage);
    int64_t n = tensor_numel(dst);
    fsdp_work *w;
    FSDP_TRY(comm_work_new(&w, K_REDUCE_SCATTER, c, label, n * c->size * (int64_t)fsdp_dtype_size(src->dtype),
                           src->dtype, op, name));
    tensor_retain(dst);
    tensor_retain(src);
    w->t_dst = dst;
    w->t_src = src;
    w->dst = tensor_data(dst);
    w->src = tensor_data(src);
    w->n = n;
    w->dtype = src->dtype;
    w->op = op;
    w->accumulate = accumulate;
    int64_t block = n * (int64_t)fsdp_dtype_size(src->dtype);
    bool in_place = (char *)w->dst == (const char *)w->src + (int64_t)c->rank * block;
    FSDP_TRY(work_device(w, tensor_device(src), !in_place && comm_overlaps(w->dst, block, w->src, block * c->size),
                         name));
    return comm_issue(work, w, name);
}

fsdp_status fsdp_reduce_scatter(fsdp_work **work, fsdp_comm *c, fsdp_tensor *dst, fsdp_tensor *src, fsdp_reduce_op op,
                                const char *label) {
    return reduce_scatter(work, c, dst, src, op, false, label, "fsdp_reduce_scatter");
}

fsdp_status comm_reduce_scatter_add(fsdp_work **work, fsdp_comm *c, fsdp_tensor *dst, fsdp_tensor *src,
                                    fsdp_reduce_op op, const char *label) {
    return reduce_scatter(work, c, dst, src, op, true, label, "fsdp_reduce_scatter (adding into dst)");
}

fsdp_status fsdp_reduce_scatter_compressed(fsdp_work **work, fsdp_comm *c, fsdp_tensor *dst, fsdp_tensor *src,
                                           fsdp_tensor *residual, fsdp_compress mode, int64_t block, double density,
                                           fsdp_reduce_op op, const char *label) {
    static const char *name = "fsdp_reduce_scatter_compressed";
    FSDP_TRY(prepare(work, c, name));
    if (!label) label = "";
    if (mode != FSDP_COMPRESS_INT8 && mode != FSDP_COMPRESS_TOPK)
        return fsdp_set_error(FSDP_ERR_INVALID, "%s '%s' on comm %s(%d): mode %d, expected int8 (1) or topk (2)", name,
                              label, c->name, c->size, (int)mode);
    if (mode == FSDP_COMPRESS_INT8 && (block < 1 || (block & (block - 1))))
        return fsdp_set_error(FSDP_ERR_INVALID, "%s '%s' on comm %s(%d): block %lld, expected a power of two >= 1",
                              name, label, c->name, c->size, (long long)block);
    if (mode == FSDP_COMPRESS_TOPK && !(density > 0 && density <= 1))
        return fsdp_set_error(FSDP_ERR_INVALID, "%s '%s' on comm %s(%d): density %g, expected in (0, 1]", name, label,
                              c->name, c->size, density);
    FSDP_TRY(check_collective(name, label, c, dst, src, false, SAME_FLOAT_DTYPE, op));
    char a[200], b[200];
    int64_t n = tensor_numel(dst);
    if (dst->dtype != FSDP_F32 || !device_is_host_like(tensor_device(dst)))
        return fsdp_set_error(FSDP_ERR_UNSUPPORTED, "%s '%s' on comm %s(%d): dst %s: compressed reductions take f32 "
                              "tensors on the host", name, label, c->name, c->size, tensor_desc(dst, a, sizeof a));
    if (residual) {
        FSDP_TRY(check_tensor(name, label, "residual", residual, c));
        if (residual->dtype != FSDP_F32 || tensor_numel(residual) != n * c->size ||
            tensor_device(residual) != tensor_device(src))
            return fsdp_set_error(FSDP_ERR_SHAPE, "%s '%s' on comm %s(%d): residual %s, expected f32 like src %s", name,
                                  label, c->name, c->size, tensor_desc(residual, a, sizeof a),
                                  tensor_desc(src, b, sizeof b));
    }
    void *pd = tensor_data(dst), *ps = tensor_data(src), *pr = residual ? tensor_data(residual) : NULL;
    if (comm_overlaps(pd, n * 4, ps, n * c->size * 4) || (pr && (comm_overlaps(pr, n * c->size * 4, ps, n * c->size * 4) ||
                                                                 comm_overlaps(pr, n * c->size * 4, pd, n * 4))))
        return fsdp_set_error(FSDP_ERR_INVALID, "%s '%s' on comm %s(%d): dst %s, src %s and residual overlap", name,
                              label, c->name, c->size, tensor_desc(dst, a, sizeof a), tensor_desc(src, b, sizeof b));
    storage_written(dst->storage);
    if (residual) storage_written(residual->storage);
    int64_t part = comm_compress_part_bytes(mode, n, block, density), wire = part * c->size;
    /* the parts sent and received, as 4-byte words (parts are multiples of 4 bytes) */
    int64_t words = wire / 4;
    int dev = tensor_device(src);
    fsdp_tensor *send = NULL, *recv = NULL;
    fsdp_status st = tensor_new(&send, FSDP_I32, 1, &words, dev, FSDP_TAG_COMM, false);
    if (st == FSDP_OK) st = tensor_new(&recv, FSDP_I32, 1, &words, dev, FSDP_TAG_COMM, false);
    /* a counting communicator leaves tensors of other devices untouched (comm_queue.c's run_work) */
    bool touch = !(c->be->local && dev != FSDP_DEVICE_CPU);
    if (st == FSDP_OK && touch)
        st = comm_compress_pack(tensor_data(send), ps, pr, mode, n, c->size, block, density);
    else if (st == FSDP_OK && mode == FSDP_COMPRESS_TOPK && device_is_host_like(dev)) {   /* the plan's scratch */
        void *p = NULL;
        st = fsdp_alloc(dev, FSDP_TAG_COMM, (size_t)n * 4, &p);
        if (p) fsdp_free(dev, FSDP_TAG_COMM, p, (size_t)n * 4);
    }
    fsdp_work *w = NULL;
    if (st == FSDP_OK) st = comm_work_new(&w, K_REDUCE_SCATTER, c, label, wire, DT_COMPRESSED + (int)mode, op, name);
    if (st != FSDP_OK) {
        tensor_release(send);
        tensor_release(recv);
        return st;
    }
    tensor_retain(dst);
    w->t_dst = dst;
    w->t_src = send;
    w->t_recv = recv;
    w->dst = pd;
    w->src = tensor_data(send);
    w->n = n;
    w->dtype = FSDP_F32;
    w->op = op;
    w->compress = mode;
    w->compress_block = block;
    w->density = density;
    w->wire_bytes = wire;
    FSDP_TRY(work_device(w, tensor_device(src), false, name));
    return comm_issue(work, w, name);
}

/* The collectives that work on one tensor in place (all-reduce, broadcast);
 * arg is the reduce op or the root. */
static fsdp_status issue_in_place(fsdp_work **work, work_kind kind, fsdp_comm *c, const char *label, fsdp_tensor *t,
                                  int arg, const char *name) {
    fsdp_work *w;
    int64_t n = tensor_numel(t);
    FSDP_TRY(comm_work_new(&w, kind, c, label, n * (int64_t)fsdp_dtype_size(t->dtype), t->dtype, arg, name));
    tensor_retain(t);
    w->t_dst = t;
    w->dst = tensor_data(t);
    w->n = n;
    w->dtype = t->dtype;
    if (kind == K_BROADCAST) w->root = arg;
    else w->op = arg;
    FSDP_TRY(work_device(w, tensor_device(t), false, name));
    return comm_issue(work, w, name);
}

fsdp_status fsdp_all_reduce(fsdp_work **work, fsdp_comm *c, fsdp_tensor *t, fsdp_reduce_op op, const char *label) {
    static const char *name = "fsdp_all_reduce";
    FSDP_TRY(prepare(work, c, name));
    if (!label) label = "";
    FSDP_TRY(check_collective(name, label, c, t, NULL, false, REDUCIBLE_DTYPE, op));
    storage_written(t->storage);
    return issue_in_place(work, K_ALL_REDUCE, c, label, t, op, name);
}

fsdp_status fsdp_broadcast(fsdp_work **work, fsdp_comm *c, fsdp_tensor *t, int root, const char *label) {
    static const char *name = "fsdp_broadcast";
    FSDP_TRY(prepare(work, c, name));
    if (!label) label = "";
    FSDP_TRY(check_tensor(name, label, "t", t, c));
    char a[200];
    if (root < 0 || root >= c->size)
        return fsdp_set_error(FSDP_ERR_INVALID, "%s '%s' on comm %s(%d): t %s: root %d, expected 0..%d", name, label,
                              c->name, c->size, tensor_desc(t, a, sizeof a), root, c->size - 1);
    storage_written(t->storage);
    return issue_in_place(work, K_BROADCAST, c, label, t, root, name);
}

fsdp_status fsdp_barrier(fsdp_comm *c) {
    FSDP_TRY(comm_check(c, "fsdp_barrier"));
    fsdp_work *w;
    FSDP_TRY(comm_work_new(&w, K_BARRIER, c, "", 0, DT_NONE, 0, "fsdp_barrier"));
    return comm_issue(NULL, w, "fsdp_barrier");
}

/* On the comm thread too, so it keeps its place among queued collectives. */
fsdp_status fsdp_all_reduce_doubles(fsdp_comm *c, double *values, int n, fsdp_reduce_op op) {
    static const char *name = "fsdp_all_reduce_doubles";
    FSDP_TRY(comm_check(c, name));
    if (n < 0 || (n > 0 && !values))
        return fsdp_set_error(FSDP_ERR_INVALID, "%s on comm %s(%d): %d values at %p", name, c->name, c->size, n,
                              (void *)values);
    FSDP_TRY(check_reduce_op(name, "", c, op, true));
    fsdp_work *w;
    FSDP_TRY(comm_work_new(&w, K_DOUBLES, c, "", (int64_t)n * 8, DT_F64, op, name));
    /* The work's own copy: a wait given up (fsdp_comm_abandon) returns
     * while the comm thread may still write the result. */
    w->doubles = malloc((size_t)(n > 0 ? n : 1) * sizeof *values);
    if (!w->doubles) {
        comm_work_unref(w);
        return fsdp_set_error(FSDP_ERR_OOM, "%s on comm %s(%d): out of host memory for %d values", name, c->name,
                              c->size, n);
    }
    if (n > 0) memcpy(w->doubles, values, (size_t)n * sizeof *values);
    w->n = n;
    w->op = op;
    atomic_fetch_add(&w->refs, 1);   /* keep it past comm_issue() to read the result */
    fsdp_status st = comm_issue(NULL, w, name);
    if (st == FSDP_OK && n > 0) memcpy(values, w->doubles, (size_t)n * sizeof *values);
    comm_work_unref(w);
    return st;
}
