/* sched_internal.h: the schedule's state, shared by sched.c (units, the
 * FSDP schedule) and sched_slice.c (sliced units). */
#ifndef FSDP_SCHED_INTERNAL_H
#define FSDP_SCHED_INTERNAL_H

#include "ops_util.h"
#include "comm_internal.h"
#include <pthread.h>
#include <stdatomic.h>
#include <stdbool.h>

/* A pinned host block carrying an offloaded shard to the device: the
 * host's until its copy's fence has passed (sched.c). */
typedef struct staged {
    void *ptr;                     /* NULL: none */
    size_t nbytes;
    int tag;
    void *fence;
} staged;

typedef struct unit {
    char name[128];
    int n_params;
    int64_t *numels, *offsets;     /* (n_params) */
    int64_t total, padded, shard_n, shard_off;
    bool keep;                     /* stays gathered from forward to backward */
    bool frozen;                   /* no gradient: no grad shard, no flat gradient, no reduce-scatter */
    int partner;                   /* the other unit of the same module (trainable <-> frozen), or -1 */
    bool used;                     /* has run a forward (then it can no longer be frozen) */
    fsdp_tensor *master;           /* (shard_n) f32, tag param */
    fsdp_tensor *grad;             /* (shard_n) f32, tag grad; NULL when frozen */
    bool grad_zero;                /* grad holds the zeros the schedule wrote (made, or fsdp_sched_zero_grad) and
                                      no gradient has been added since: an abandoned backward may restore them;
                                      read through unit_grad_zero */
    uint64_t grad_zero_version;    /* grad's storage version when those zeros were written */
    bool restore_zeros;            /* this backward wrote into grad while it held those zeros (set by
                                      unit_grad_written, for every mode: a reduction added after the walk or
                                      during it, a world of one accumulating into it, a slice's add): until the
                                      backward finishes, an abandoned one zeroes grad again */
    bool flat_new;                 /* flat_grad was made by this backward (kept without sync, it holds no
                                      earlier micro-batch's gradients): an abandoned backward drops it */
    fsdp_tensor *full;             /* (padded) compute dtype; data NULL while resharded */
    fsdp_tensor **views;           /* (n_params) parameter views of full, or NULL */
    bool gathered;                 /* data allocated and its gather issued */
    uint64_t gathered_in;          /* the forward (fsdp_sched's forward_serial) that issued that gather */
    fsdp_work *gather;             /* in flight, or NULL */
    fsdp_tensor *flat_grad;        /* (padded) compute dtype, tag grad; during backward */
    bool flat_unwritten;           /* flat_grad was not zeroed: its .grad views take their first gradient as a
                                      write, and what none reached is zeroed when the unit's backward ends */
    fsdp_tensor *secondary;        /* (padded / G) compute dtype, tag param: this rank's part of the unit kept
                                      from forward to backward for a gather within a group of G (hpZ), or NULL */
    int *prefetch_list[2];         /* explicit prefetch when forward [0] / backward [1] starts, or NULL */
    int n_prefetch[2];             /* their lengths; -1: the default (the last forward's order) */
    fsdp_row_slicer *slicer;       /* a sliced unit: read and reduced by slices (set on full's storage), or NULL */
    fsdp_tensor *copy;             /* (shard_n) compute dtype: the master's compute copy (master->storage->copy),
                                      made on first use when the schedule keeps copies, or NULL */
    bool gather_reads_copy;        /* the gather in flight sends the copy (it counts among its readers) */
    bool full_is_copy;             /* a shard group of one: full's data is the copy's, nothing allocated */
    uint64_t full_version;         /* full's storage version when it became the copy */
    staged stage;                  /* offload: the pinned block the gather in flight was copied from */
    fsdp_tensor *residual;         /* (padded) f32, tag grad: what compressed reductions did not send (error
                                      feedback, sched_compress.c), or NULL */
} unit;

/* The schedule wrote zeros into u's gradient shard. */
static inline void unit_mark_grad_zero(unit *u) {
    u->grad_zero = true;
    u->grad_zero_version = u->grad->storage->version;
}
/* Does u's gradient shard still hold them? Not after any other write to it
 * (a user's axpy into the shard between zero_grad and backward): then the
 * backward adds, and an abandoned one leaves the shard alone. The schedule's
 * own writes (add_reduced, a reduce-scatter adding into the shard, a world
 * of one accumulating into it during the walk, sched_slice.c's adds) do not
 * bump the storage version: each goes through unit_grad_written instead, so
 * a shard that holds sums (a second backward without zero_grad, one after
 * no_sync) is never taken for zeros; only unit_mark_grad_zero sets it again,
 * where the schedule wrote the zeros. (distributed.grad_write.* checks both.) */
static inline bool unit_grad_zero(const unit *u) {
    return u->grad_zero && u->grad && u->grad->storage->version == u->grad_zero_version;
}
/* The schedule writes (or has issued a write of) gradients into u's shard:
 * called at every such write, before the backward finishes. A shard that
 * held the schedule's zeros is remembered, so that an abandoned backward
 * restores them (sched_backward.c's finish_release): the one record of
 * which shards held zeros when the backward began, whatever the mode. */
static inline void unit_grad_written(unit *u) {
    if (unit_grad_zero(u)) u->restore_zeros = true;
    u->grad_zero = false;
}

/* Offload through pinned host blocks (sched.c): whether the device has
 * them; a block handed back once its copy is done (else kept until it is);
 * every kept block whose copy is done handed back (block: waiting for each). */
bool sched_stages_pinned(const fsdp_sched *s);
void sched_stage_retire(fsdp_sched *s, staged *b);
void sched_stage_reap(fsdp_sched *s, bool block);

typedef struct pending {
    int unit;
    fsdp_work *work;
    fsdp_tensor *reduced;          /* (shard_n) reduce dtype, or a group of one's flat gradient itself (its
                                    * values in the reduce dtype's range: local_reduce_in_place); NULL for an
                                    * all-reduce in place (direct) or a reduce-scatter that adds straight into
                                    * the gradient shard */
    fsdp_work *replica;            /* hybrid: the replica average of reduced, issued behind work (or NULL) */
} pending;

struct fsdp_sched {
    atomic_int refcount;
    fsdp_comm *shard_comm, *replica_comm;
    fsdp_comm *reshard_comm;       /* hpZ: the backward regathers within this subgroup of the shard group, or NULL */
    int reshard_rank, reshard_size;
    int shard_rank, shard_size, replica_size;
    bool local_one;                /* a shard group of one copies locally (unless FSDP_FORCE_COLLECTIVES=1) */
    int device;                    /* where gathered buffers and gradients during backward live */
    int shard_device;              /* where master and gradient shards live: device, or the CPU (offload) */
    int compute_dtype, reduce_dtype;
    int backward_prefetch, forward_prefetch, limit;
    bool sync;
    int recompute;                 /* FSDP_RECOMPUTE_*: the forward hooks' context */
    bool direct;                   /* a shard group of one: views of the masters, no gathers, gradients
                                      straight into the gradient shard, all-reduced there across replicas
                                      (fsdp_sched_set_direct) */
    int copy_mode;                 /* masters' compute copies: FSDP_COPY_AUTO, _ON or _OFF
                                      (fsdp_sched_set_compute_copy) */
    int compress;                  /* fsdp_compress mode of the gradient reduce-scatters (fsdp_sched_set_compress) */
    int64_t compress_block;
    double compress_density;
    bool error_feedback;
    unit *units;
    int n_units, cap_units;
    int *order;                    /* units in the order of their last post_forward */
    int n_order;
    int *fwd_order;                /* units in the order of their last pre_forward */
    int n_fwd_order, fwd_pos;
    uint64_t forward_serial;       /* forwards begun (the root's pre_forward) */
    int n_gathered, peak_gathered;
    pending *pend;
    int n_pend, cap_pend;
    staged *retired;               /* offload: pinned blocks whose copies may still run (their fence unpassed) */
    int n_retired, cap_retired;
    bool finish_registered;
    struct fsdp_sched *live_prev, *live_next;   /* the live schedules (fsdp_sched_reshard_all) */
};

/* *t becomes its dtype (cast) or device (copy) in a new tensor. */
fsdp_status sched_convert_to(fsdp_tensor **t, int dtype, int device);
/* Whether the units of s keep their master's compute copy. */
bool sched_keeps_copy(const fsdp_sched *s);
/* *copy (borrowed): u's master in the compute dtype, current (cast now if
 * the master was written since), or NULL when u keeps no copy or its copy
 * is stale while something still reads it (then the caller casts). */
fsdp_status sched_current_copy(fsdp_sched *s, unit *u, fsdp_tensor **copy);
/* The gradient shard of a trainable unit, made zeroed on first use. */
fsdp_status sched_ensure_grad(fsdp_sched *s, unit *u);
fsdp_status sched_add_unit(fsdp_sched *s, const char *name, int n_params, const int64_t *numels, int keep,
                           int64_t row, int *index);
void sched_unit_clear(unit *u);

/* Whether unit u's reduction is compressed; then issues it (sched_compress.c):
 * src (f32, padded) -> a new f32 shard *dst, work *w. */
bool sched_compresses(const fsdp_sched *s, const unit *u);
fsdp_status sched_reduce_compressed(fsdp_sched *s, unit *u, fsdp_tensor *src, fsdp_tensor **dst, fsdp_work **w);

/* sched.c's and sched_gather.c's pieces that sched_control.c (unshard on
 * request, resharding, FSDP2 controls, settings) and sched_backward.c build on */
extern pthread_mutex_t sched_live_mu;   /* guards sched_live */
extern struct fsdp_sched *sched_live;   /* every schedule not yet freed */
fsdp_status sched_check_unit(const char *op, fsdp_sched *s, int k);
fsdp_status sched_wait_gather(fsdp_sched *s, unit *u);
fsdp_status sched_issue_gather(fsdp_sched *s, unit *u, bool from_part);
fsdp_status sched_gather_now(fsdp_sched *s, unit *u, bool from_part);
fsdp_status sched_reshard_unit(fsdp_sched *s, unit *u);
/* hpZ: keep this rank's part of the gathered unit for the backward's regather */
fsdp_status sched_keep_secondary(fsdp_sched *s, unit *u);
void sched_drop_secondary(unit *u);
void sched_unlink_grads(unit *u);

/* sched_state.c: a new schedule joins the live list; the reference count
 * (the backward's marker nodes hold one each) */
void sched_live_add(struct fsdp_sched *s);
void sched_retain(fsdp_sched *s);
void sched_release(fsdp_sched *s);
/* shared by sched.c and sched_backward.c */
fsdp_status sched_prefetch(fsdp_sched *s, int k, bool from_part);
fsdp_status sched_prefetch_listed(fsdp_sched *s, int k, int phase, bool *done);
bool sched_force_collectives(void);
/* The position of unit k in order[0..n), or -1 */
int sched_order_index(const int *order, int n, int k);
/* Records unit k's begin (end = false) or end marker on the tape */
fsdp_status sched_record_marker(fsdp_sched *s, int k, bool end);
/* Has the tape's finish wait for s's pending reductions (the root's forward) */
fsdp_status sched_on_backward_finish(fsdp_sched *s);

#endif
