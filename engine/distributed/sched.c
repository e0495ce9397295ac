/* sched.c: sharded units and the FSDP schedule around them.
 *
 * Each unit flattens its parameters into one buffer of `padded` elements
 * (a multiple of the shard group size N); this rank owns elements
 * [shard_offset, shard_offset + shard_numel): the f32 master and its
 * gradient. The full buffer lives in a storage object that outlives its
 * data: gathering allocates the data and all-gathers into it, resharding
 * frees it, and the parameter views made once over that storage stay valid
 * handles throughout (an op on them while resharded is refused).
 *
 * Forward: pre_forward gathers the unit (waiting), prefetches the next unit
 * in last forward's order and records a "begin" marker; post_forward records
 * an "end" marker and frees the full buffer unless the unit is kept.
 * Backward walks the tape down, so it meets a unit's end marker first:
 * gather again (and prefetch the next unit), and point each parameter
 * view's .grad at its slice of a flat gradient buffer, so that the ops'
 * backward accumulates straight into it. The buffer is not zeroed: each
 * slice is marked unwritten, its first gradient is written instead of
 * added (a weight's GEMM with beta = 0), and what no gradient reached is
 * zeroed when the unit's backward ends. At the begin marker every gradient
 * of the unit is complete: reduce-scatter (averaged) the flat gradient,
 * asynchronously, and free the full buffers. On the host in f32 the
 * reduce-scatter adds its average straight into the gradient shard as it
 * sums the terms; otherwise it fills a shard-sized buffer, and after the
 * walk the root's finish hook waits for the pending reductions in issue
 * order, averages them across replicas (hybrid), and adds them into the
 * gradient shards. Every rank records the same markers in the same order,
 * so collectives match across ranks. (The schedule's files, each calling
 * only those below it: sched_gather.c gathering, resharding and prefetch;
 * sched_state.c the schedule's life and its units' state; sched_backward.c
 * the backward's markers, gradients and reductions; this file the units'
 * creation, settings and forward hooks; sched_control.c FSDP2's controls.)
 *
 * Direct mode (a shard group of one, f32): parameters are views of the
 * masters and gradients accumulate in the gradient shards; with replicas
 * (no_shard) each unit's gradient shard is all-reduced in place when its
 * backward ends, in flight like a reduce-scatter.
 *
 * Offload (fsdp_sched_set_shard_device with the CPU): the master and
 * gradient shards, and so the optimizer state and its step, stay in host
 * memory; each gather copies this rank's shard (cast to the compute dtype
 * first) to the device, and each reduced gradient shard comes back. Where
 * the device has pinned host memory (CUDA), both go through pinned blocks
 * of the host (counted as host memory of their tag): the shard is cast
 * into one on the host and copied asynchronously (no staging through a
 * driver buffer, no host wait), the block kept until the gather has been
 * waited for and the copy's fence has passed, so that nothing writes or
 * reuses it while the copy may still read it; a reduced gradient comes
 * back into one by DMA, and the host adds it once its fence has passed.
 *
 * Compute copies (fsdp_sched_set_compute_copy): a unit's master shard in
 * the compute dtype, kept beside it and owned by the master's storage, so
 * that AdamW, which reads and writes every master once a step anyway,
 * writes it too (optim.c). A gather sends it instead of casting; it is cast
 * again only when the master's storage version moved past the copy's
 * (a write other than AdamW's). Readers (a gather in flight, a full buffer
 * that is the copy) are counted on the master's storage, and while there
 * are any nothing writes the copy: AdamW leaves it stale, a gather that
 * finds it stale casts into a buffer of its own as before. A shard group of
 * one on the compute device gathers by pointing the full buffer at the
 * copy; writes into the parameters then (the storage's version) make the
 * copy stale when the unit reshards, as they would be lost otherwise. */
#include "ops_util.h"
#include "trace.h"
#include "comm_internal.h"
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "sched_internal.h"

/* ---- public ---- */

fsdp_status fsdp_sched_new(fsdp_sched **out, fsdp_comm *shard_comm, fsdp_comm *replica_comm, fsdp_dtype compute_dtype,
                           fsdp_dtype reduce_dtype, fsdp_prefetch backward_prefetch, int forward_prefetch, int limit) {
    if (!out || !shard_comm) return fsdp_set_error(FSDP_ERR_INVALID, "fsdp_sched_new: NULL argument");
    if (!fsdp_dtype_is_float(compute_dtype) || !fsdp_dtype_is_float(reduce_dtype))
        return fsdp_set_error(FSDP_ERR_DTYPE, "fsdp_sched_new: compute dtype %s and reduce dtype %s must be f32 or bf16",
                              fsdp_dtype_name(compute_dtype), fsdp_dtype_name(reduce_dtype));
    if (backward_prefetch < 0 || backward_prefetch > 2)
        return fsdp_set_error(FSDP_ERR_INVALID, "fsdp_sched_new: backward prefetch %d (expected 0, 1 or 2)",
                              backward_prefetch);
    if (limit < 1) return fsdp_set_error(FSDP_ERR_INVALID, "fsdp_sched_new: limit %d (expected >= 1)", limit);
    fsdp_sched *s = calloc(1, sizeof *s);
    if (!s) return fsdp_set_error(FSDP_ERR_OOM, "fsdp_sched_new: out of host memory");
    atomic_init(&s->refcount, 1);
    /* the schedule keeps its own communicator handles */
    fsdp_status st = comm_dup(&s->shard_comm, shard_comm);
    if (st == FSDP_OK && replica_comm) st = comm_dup(&s->replica_comm, replica_comm);
    if (st != FSDP_OK) {
        if (s->shard_comm) fsdp_comm_free(s->shard_comm);
        free(s);
        return st;
    }
    fsdp_comm_info(s->shard_comm, &s->shard_rank, &s->shard_size);
    s->local_one = s->shard_size == 1 && !sched_force_collectives();
    s->replica_size = 1;
    if (s->replica_comm) fsdp_comm_info(s->replica_comm, NULL, &s->replica_size);
    fsdp_default_device(&s->device);
    s->shard_device = s->device;
    /* host replica reductions on a comm thread of their own (comm_internal.h, lanes) */
    if (s->replica_comm && s->device == FSDP_DEVICE_CPU) comm_set_lane(s->replica_comm, COMM_LANE_REPLICA);
    s->compute_dtype = compute_dtype;
    s->reduce_dtype = reduce_dtype;
    s->backward_prefetch = backward_prefetch;
    s->forward_prefetch = forward_prefetch != 0;
    s->limit = limit;
    s->sync = true;
    s->copy_mode = FSDP_COPY_AUTO;
    sched_live_add(s);
    *out = s;
    return FSDP_OK;
}

fsdp_status fsdp_sched_set_shard_device(fsdp_sched *s, fsdp_device device) {
    if (!s) return fsdp_set_error(FSDP_ERR_INVALID, "fsdp_sched_set_shard_device: schedule is NULL");
    if ((int)device != s->device && device != FSDP_DEVICE_CPU)
        return fsdp_set_error(FSDP_ERR_DEVICE, "fsdp_sched_set_shard_device: shards go on the compute device (%s) or "
                              "the cpu, not %s", fsdp_device_name(s->device), fsdp_device_name(device));
    if (s->n_units > 0)
        return fsdp_set_error(FSDP_ERR_INVALID, "fsdp_sched_set_shard_device: the schedule has %d units already; "
                              "choose where shards live before adding units", s->n_units);
    s->shard_device = device;
    return FSDP_OK;
}

fsdp_status fsdp_sched_set_direct(fsdp_sched *s, int on) {
    if (!s) return fsdp_set_error(FSDP_ERR_INVALID, "fsdp_sched_set_direct: schedule is NULL");
    if (s->n_units > 0)
        return fsdp_set_error(FSDP_ERR_INVALID, "fsdp_sched_set_direct: the schedule has %d units already; choose "
                              "before adding units", s->n_units);
    if (on && (s->shard_size != 1 || s->compute_dtype != FSDP_F32 || s->reduce_dtype != FSDP_F32 ||
               s->shard_device != s->device))
        return fsdp_set_error(FSDP_ERR_INVALID, "fsdp_sched_set_direct: needs a shard group of one (here %d ranks), "
                              "f32 compute and reduction (here %s, %s) and shards on the compute device (here %s, "
                              "compute %s)", s->shard_size, fsdp_dtype_name(s->compute_dtype),
                              fsdp_dtype_name(s->reduce_dtype), fsdp_device_name(s->shard_device),
                              fsdp_device_name(s->device));
    s->direct = on != 0;
    return FSDP_OK;
}

fsdp_status fsdp_sched_set_compute_copy(fsdp_sched *s, fsdp_copy_mode mode) {
    if (!s) return fsdp_set_error(FSDP_ERR_INVALID, "fsdp_sched_set_compute_copy: schedule is NULL");
    if (mode != FSDP_COPY_OFF && mode != FSDP_COPY_ON && mode != FSDP_COPY_AUTO)
        return fsdp_set_error(FSDP_ERR_INVALID, "fsdp_sched_set_compute_copy: mode %d (expected FSDP_COPY_OFF 0, "
                              "FSDP_COPY_ON 1 or FSDP_COPY_AUTO 2)", (int)mode);
    if (s->n_units > 0)
        return fsdp_set_error(FSDP_ERR_INVALID, "fsdp_sched_set_compute_copy: the schedule has %d units already; "
                              "choose before adding units", s->n_units);
    if (mode == FSDP_COPY_ON && s->compute_dtype == FSDP_F32)
        return fsdp_set_error(FSDP_ERR_INVALID, "fsdp_sched_set_compute_copy: the compute dtype is f32, so the "
                              "masters are gathered as they are: there is no compute copy to keep");
    s->copy_mode = mode;
    return FSDP_OK;
}

fsdp_status fsdp_unit_compute_copy(fsdp_sched *s, int k, fsdp_tensor **copy, int *current) {
    FSDP_TRY(sched_check_unit("fsdp_unit_compute_copy", s, k));
    unit *u = &s->units[k];
    if (copy) {
        if (u->copy) tensor_retain(u->copy);
        *copy = u->copy;
    }
    if (current) *current = u->copy && storage_copy_current(u->master->storage);
    return FSDP_OK;
}

fsdp_status fsdp_sched_free(fsdp_sched *s) {
    sched_release(s);
    return FSDP_OK;
}

/* align: the padded buffer is a multiple of N * align elements */
fsdp_status sched_add_unit(fsdp_sched *s, const char *name, int n_params, const int64_t *numels, int keep,
                            int64_t align, int *index) {
    if (!s || !index || n_params < 0 || (n_params > 0 && !numels))
        return fsdp_set_error(FSDP_ERR_INVALID, "fsdp_sched_add_unit: bad arguments");
    if (s->n_units == s->cap_units) {
        int cap = s->cap_units ? 2 * s->cap_units : 16;
        unit *nu = realloc(s->units, (size_t)cap * sizeof *nu);
        int *no = realloc(s->order, (size_t)cap * 4 * sizeof *no);
        int *nf = realloc(s->fwd_order, (size_t)cap * 4 * sizeof *nf);
        if (nu) s->units = nu;
        if (no) s->order = no;
        if (nf) s->fwd_order = nf;
        if (!nu || !no || !nf) return fsdp_set_error(FSDP_ERR_OOM, "fsdp_sched_add_unit: out of host memory");
        s->cap_units = cap;
    }
    unit *u = &s->units[s->n_units];
    memset(u, 0, sizeof *u);
    snprintf(u->name, sizeof u->name, "%s", name ? name : "unit");
    u->n_params = n_params;
    u->numels = calloc((size_t)(n_params ? n_params : 1), sizeof(int64_t));
    u->offsets = calloc((size_t)(n_params ? n_params : 1), sizeof(int64_t));
    if (!u->numels || !u->offsets) {
        sched_unit_clear(u);
        return fsdp_set_error(FSDP_ERR_OOM, "fsdp_sched_add_unit: out of host memory");
    }
    int64_t total = 0;
    for (int i = 0; i < n_params; i++) {
        if (numels[i] < 0) {
            sched_unit_clear(u);
            return fsdp_set_error(FSDP_ERR_SHAPE, "fsdp_sched_add_unit(%s): parameter %d has %lld elements", u->name, i,
                                  (long long)numels[i]);
        }
        if (numels[i] > INT64_MAX / 8 - total) {
            sched_unit_clear(u);
            return fsdp_set_error(FSDP_ERR_SHAPE, "fsdp_sched_add_unit(%s): %d parameters add up to more elements "
                                  "than a buffer can hold", u->name, n_params);
        }
        u->numels[i] = numels[i];
        u->offsets[i] = total;
        total += numels[i];
    }
    int64_t N = s->shard_size, M = N * align;
    u->total = total;
    u->padded = (total + M - 1) / M * M;
    if (u->padded == 0) u->padded = M;   /* every rank owns at least one element */
    u->shard_n = u->padded / N;
    u->shard_off = s->shard_rank * u->shard_n;
    u->keep = keep != 0;
    u->partner = -1;
    u->n_prefetch[0] = u->n_prefetch[1] = -1;   /* the default order */
    /* (the gradient shard comes on first use: a unit frozen next never has one) */
    fsdp_status st = tensor_new(&u->master, FSDP_F32, 1, &u->shard_n, s->shard_device, FSDP_TAG_PARAM, true);
    if (st == FSDP_OK && s->direct) {   /* the full buffer is the master shard (the whole unit) */
        int64_t one = 1;
        u->full = tensor_view(u->master, 1, &u->padded, &one, u->master->offset);
        if (!u->full) st = fsdp_set_error(FSDP_ERR_OOM, "fsdp_sched_add_unit(%s): out of host memory", u->name);
    } else if (st == FSDP_OK) {
        st = tensor_new(&u->full, s->compute_dtype, 1, &u->padded, s->device, FSDP_TAG_PARAM, false);
    }
    if (st != FSDP_OK) {
        sched_unit_clear(u);
        return st;
    }
    if (!s->direct) {   /* the full buffer starts resharded: keep the storage object, drop its data */
        fsdp_storage *fs = u->full->storage;
        fsdp_free(fs->device, fs->tag, fs->data, fs->nbytes);
        fs->data = NULL;
    }
    *index = s->n_units++;
    return FSDP_OK;
}

fsdp_status fsdp_sched_add_unit(fsdp_sched *s, const char *name, int n_params, const int64_t *numels, int keep,
                                int *index) {
    return sched_add_unit(s, name, n_params, numels, keep, 1, index);
}

fsdp_status fsdp_unit_set_frozen(fsdp_sched *s, int k, int owner) {
    FSDP_TRY(sched_check_unit("fsdp_unit_set_frozen", s, k));
    unit *u = &s->units[k];
    if (owner != -1) {
        FSDP_TRY(sched_check_unit("fsdp_unit_set_frozen (owner)", s, owner));
        unit *o = &s->units[owner];
        if (owner == k || o->frozen || o->partner >= 0)
            return fsdp_set_error(FSDP_ERR_INVALID, "fsdp_unit_set_frozen(%s): owner %s must be another unit, "
                                  "trainable and without a frozen part yet", u->name, o->name);
        if (o->keep != u->keep)
            return fsdp_set_error(FSDP_ERR_INVALID, "fsdp_unit_set_frozen(%s): owner %s is %s gathered from forward "
                                  "to backward, this unit is %s", u->name, o->name, o->keep ? "kept" : "not kept",
                                  u->keep ? "kept" : "not");
    }
    if (u->frozen) return fsdp_set_error(FSDP_ERR_INVALID, "fsdp_unit_set_frozen(%s): already frozen", u->name);
    if (u->used || u->gathered || u->flat_grad)
        return fsdp_set_error(FSDP_ERR_INVALID, "fsdp_unit_set_frozen(%s): the unit has been used; freeze it before "
                              "its first forward", u->name);
    u->frozen = true;
    tensor_release(u->grad);   /* frozen: no gradient shard at all */
    u->grad = NULL;
    for (int i = 0; u->views && i < u->n_params; i++)
        if (u->views[i]) u->views[i]->requires_grad = false;
    if (owner != -1) {
        u->partner = owner;
        s->units[owner].partner = k;
    }
    return FSDP_OK;
}

fsdp_status fsdp_unit_info(fsdp_sched *s, int k, int64_t *total, int64_t *padded, int64_t *shard_numel,
                           int64_t *shard_offset) {
    FSDP_TRY(sched_check_unit("fsdp_unit_info", s, k));
    unit *u = &s->units[k];
    if (total) *total = u->total;
    if (padded) *padded = u->padded;
    if (shard_numel) *shard_numel = u->shard_n;
    if (shard_offset) *shard_offset = u->shard_off;
    return FSDP_OK;
}

fsdp_status fsdp_unit_shard(fsdp_sched *s, int k, fsdp_tensor **master, fsdp_tensor **grad) {
    FSDP_TRY(sched_check_unit("fsdp_unit_shard", s, k));
    unit *u = &s->units[k];
    if (grad) FSDP_TRY(sched_ensure_grad(s, u));
    if (master) {
        tensor_retain(u->master);
        *master = u->master;
    }
    if (grad) {
        if (u->grad) tensor_retain(u->grad);
        *grad = u->grad;
    }
    return FSDP_OK;
}

fsdp_status fsdp_unit_param(fsdp_sched *s, int k, int i, int ndim, const int64_t *shape, fsdp_tensor **out) {
    FSDP_TRY(sched_check_unit("fsdp_unit_param", s, k));
    unit *u = &s->units[k];
    char sb[160];
    if (i < 0 || i >= u->n_params)
        return fsdp_set_error(FSDP_ERR_INVALID, "fsdp_unit_param(%s): parameter %d out of range (%d)", u->name, i,
                              u->n_params);
    if (ndim < 0 || ndim > FSDP_MAX_DIMS || (ndim > 0 && !shape))
        return fsdp_set_error(FSDP_ERR_SHAPE, "fsdp_unit_param(%s): %d dims for parameter %d", u->name, ndim, i);
    int64_t n = 1;
    for (int d = 0; d < ndim; d++) {
        if (shape[d] < 0)
            return fsdp_set_error(FSDP_ERR_SHAPE, "fsdp_unit_param(%s): negative size in %s for parameter %d",
                                  u->name, shape_str(ndim, shape, sb, sizeof sb), i);
        n *= shape[d];
    }
    if (n != u->numels[i])
        return fsdp_set_error(FSDP_ERR_SHAPE, "fsdp_unit_param(%s): shape %s for parameter %d of %lld elements",
                              u->name, shape_str(ndim, shape, sb, sizeof sb), i, (long long)u->numels[i]);
    if (!u->views) {
        u->views = calloc((size_t)u->n_params, sizeof *u->views);
        if (!u->views) return fsdp_set_error(FSDP_ERR_OOM, "fsdp_unit_param: out of host memory");
    }
    if (!u->views[i]) {
        int64_t strides[FSDP_MAX_DIMS];
        contiguous_strides(ndim, shape, strides);
        fsdp_tensor *v = tensor_view(u->full, ndim, shape, strides, u->offsets[i]);
        if (!v) return fsdp_set_error(FSDP_ERR_OOM, "fsdp_unit_param: out of host memory");
        v->requires_grad = !u->frozen;   /* a leaf: its .grad is pointed into the flat gradient */
        u->views[i] = v;
    }
    tensor_retain(u->views[i]);
    *out = u->views[i];
    return FSDP_OK;
}

static int grad_is_enabled(void) {
    int on = 0;
    fsdp_grad_enabled(&on);
    return on;
}

fsdp_status fsdp_unit_pre_forward(fsdp_sched *s, int k) {
    FSDP_TRY(sched_check_unit("fsdp_unit_pre_forward", s, k));
    unit *u = &s->units[k];
    FSDP_TRY(sched_ensure_grad(s, u));
    u->used = true;
    bool replay = s->recompute == FSDP_RECOMPUTE_REPLAY;
    if (k == 0) {   /* the root starts a new forward */
        s->n_order = 0;
        s->fwd_pos = 0;
        if (!replay) s->forward_serial++;
    }
    bool grad = grad_is_enabled();
    /* a kept unit still gathered from an earlier forward that had no
     * backward may hold values from before an optimizer step: regather
     * (not when this is the recomputation of this step's forward, nor when
     * this forward's prefetch gathered it) */
    bool stale = u->gathered && u->gathered_in != s->forward_serial;
    if (u->keep && stale && !u->flat_grad && !replay) FSDP_TRY(sched_reshard_unit(s, u));
    /* a part kept by a forward whose backward never came is stale (an
     * optimizer step may have come since): a new forward drops them all */
    if (!replay && k == 0)
        for (int i = 0; i < s->n_units; i++) sched_drop_secondary(&s->units[i]);
    if (!replay) sched_drop_secondary(u);
    if (grad && k == 0 && !s->finish_registered) {
        FSDP_TRY(sched_on_backward_finish(s));
        s->finish_registered = true;
    }
    /* the unit's own gather and the forward prefetch (the units listed
     * for it, else the one that came after it last time) issued together,
     * one NCCL group, before the wait for the unit's own */
    comm_group_begin();
    fsdp_status gst = sched_issue_gather(s, u, replay);
    bool listed = false;
    if (gst == FSDP_OK) gst = sched_prefetch_listed(s, k, 0, &listed);
    /* (not in a recomputed forward during backward: the unit after this one
     * in forward order has had its backward already) */
    if (gst == FSDP_OK && !listed && s->forward_prefetch && !replay) {
        int i = sched_order_index(s->fwd_order, s->n_fwd_order, k);
        if (i >= 0 && i + 1 < s->n_fwd_order) gst = sched_prefetch(s, s->fwd_order[i + 1], replay);
    }
    comm_group_end();
    if (gst == FSDP_OK) gst = sched_wait_gather(s, u);
    FSDP_TRY(gst);
    trace_unit_push("forward", u->name);
    if (!replay && s->fwd_pos < 4 * s->cap_units) {
        s->fwd_order[s->fwd_pos++] = k;
        if (s->fwd_pos > s->n_fwd_order) s->n_fwd_order = s->fwd_pos;
    }
    if (grad) FSDP_TRY(sched_record_marker(s, k, false));
    return FSDP_OK;
}

fsdp_status fsdp_unit_post_forward(fsdp_sched *s, int k) {
    FSDP_TRY(sched_check_unit("fsdp_unit_post_forward", s, k));
    unit *u = &s->units[k];
    trace_unit_pop("forward", u->name);
    bool replay = s->recompute == FSDP_RECOMPUTE_REPLAY;
    if (!replay && s->n_order < 4 * s->cap_units) s->order[s->n_order++] = k;
    bool grad = grad_is_enabled();
    if (grad) FSDP_TRY(sched_record_marker(s, k, true));
    /* kept units stay gathered for the backward; without one coming, free
     * them; a recomputed unit's backward comes right after its replay */
    bool backward_comes = grad || s->recompute == FSDP_RECOMPUTE_FORWARD;
    if (!replay && backward_comes) FSDP_TRY(sched_keep_secondary(s, u));
    if (!replay && (!u->keep || !backward_comes)) FSDP_TRY(sched_reshard_unit(s, u));
    return FSDP_OK;
}
