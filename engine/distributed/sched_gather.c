/* sched_gather.c: a unit's parameters, gathered and freed again (FSDP2's
 * unshard, wait, reshard and prefetch): the all-gather of the shards into
 * the full buffer (from the master, its compute copy or, offloaded, through
 * a pinned host block), the wait for it, the reshard that frees it, and the
 * prefetch of the next unit in the recorded order. The units and their
 * state are sched.c's; the backward's gradients and reductions are
 * sched_backward.c's. */
#include "ops_util.h"
#include "trace.h"
#include "comm_internal.h"
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "sched_internal.h"

/* ---- offload through pinned host blocks ---- */

bool sched_stages_pinned(const fsdp_sched *s) {
    if (s->shard_device != FSDP_DEVICE_CPU || s->device == FSDP_DEVICE_CPU) return false;
    const fsdp_device_kernels *k = device_kernels(s->device);
    return k && k->host_alloc && k->copy_from_host_async && k->copy_to_host_async && k->fence_wait;
}

void sched_stage_retire(fsdp_sched *s, staged *b) {
    if (!b->ptr) return;
    const fsdp_device_kernels *k = device_kernels(s->device);
    if (!b->fence || k->fence_wait(b->fence, 0)) {
        fsdp_free_pinned(s->device, b->tag, b->ptr, b->nbytes);
    } else {   /* the copy may still read it: kept until its fence passes */
        if (s->n_retired == s->cap_retired) {
            int cap = s->cap_retired ? 2 * s->cap_retired : 8;
            staged *n = realloc(s->retired, (size_t)cap * sizeof *n);
            if (!n) {   /* nowhere to keep it: wait for its copy now */
                k->fence_wait(b->fence, 1);
                fsdp_free_pinned(s->device, b->tag, b->ptr, b->nbytes);
                *b = (staged){0};
                return;
            }
            s->retired = n;
            s->cap_retired = cap;
        }
        s->retired[s->n_retired++] = *b;
    }
    *b = (staged){0};
}

void sched_stage_reap(fsdp_sched *s, bool block) {
    if (!s->n_retired) return;
    const fsdp_device_kernels *k = device_kernels(s->device);
    int kept = 0;
    for (int i = 0; i < s->n_retired; i++) {
        staged *b = &s->retired[i];
        if (k->fence_wait(b->fence, block ? 1 : 0)) fsdp_free_pinned(s->device, b->tag, b->ptr, b->nbytes);
        else s->retired[kept++] = *b;
    }
    s->n_retired = kept;
}

/* *src (this rank's shard on the host: the f32 master or its compute copy)
 * <- the same elements in the compute dtype on the device, through a pinned
 * block that the unit keeps until its gather has been waited for. */
static fsdp_status stage_to_device(fsdp_sched *s, unit *u, fsdp_tensor **src) {
    fsdp_tensor *h = *src;
    int tag = fsdp_default_tag();
    size_t nbytes = (size_t)u->shard_n * fsdp_dtype_size(s->compute_dtype);
    sched_stage_reap(s, false);
    if (u->stage.ptr) sched_stage_retire(s, &u->stage);
    void *pin = NULL;
    FSDP_TRY(fsdp_alloc_pinned(s->device, tag, nbytes, &pin));
    fsdp_tensor *d = NULL;
    fsdp_status r = tensor_new(&d, s->compute_dtype, 1, &u->shard_n, s->device, tag, false);
    if (r != FSDP_OK) {
        fsdp_free_pinned(s->device, tag, pin, nbytes);
        return r;
    }
    /* cast (or copy) on the host, straight into the block the device reads */
    device_kernels(FSDP_DEVICE_CPU)->cast_any(pin, s->compute_dtype, tensor_data(h), h->dtype, u->shard_n);
    void *fence = KERNELS(d)->copy_from_host_async(tensor_data(d), pin, nbytes);
    u->stage = (staged){pin, nbytes, tag, fence};
    tensor_release(h);
    *src = d;
    return FSDP_OK;
}

/* ---- gathering ---- */

/* A gather that failed leaves nothing gathered: the next use tries again
 * instead of reading a buffer that was never filled. A wait that was given
 * up (fsdp_comm_abandon) is no failure of the collective: it may still be
 * running on the comm thread and write into the full buffer, so the unit
 * stays gathered with its work pending until a later wait sees it done
 * (after the REPL's rejoin). */
fsdp_status sched_wait_gather(fsdp_sched *s, unit *u) {
    if (!u->gather) return FSDP_OK;
    fsdp_status st = fsdp_work_wait(u->gather);
    if (st != FSDP_OK) {
        char msg[1024];
        snprintf(msg, sizeof msg, "%s", fsdp_last_error());
        int done = 0;
        fsdp_status tst = fsdp_work_test(u->gather, &done);
        if (!done) return fsdp_set_error(st, "%s", msg);
        if (tst != FSDP_OK) st = tst;   /* done and failed: the collective's own error */
        else fsdp_set_error(st, "%s", msg);
    }
    fsdp_work_free(u->gather);
    u->gather = NULL;
    sched_stage_retire(s, &u->stage);   /* the copy from it came before the gather */
    if (u->gather_reads_copy) {
        u->master->storage->copy_readers--;
        u->gather_reads_copy = false;
    }
    if (st != FSDP_OK && u->gathered) {
        fsdp_storage *fs = u->full->storage;
        fsdp_free(fs->device, fs->tag, fs->data, fs->nbytes);
        fs->data = NULL;
        u->gathered = false;
        s->n_gathered--;
    }
    return st;
}

/* *t becomes its dtype (cast) or device (copy) in a new tensor; the old
 * reference is given back either way, *t is NULL on failure. */
fsdp_status sched_convert_to(fsdp_tensor **t, int dtype, int device) {
    fsdp_tensor *n;
    fsdp_status r = device >= 0 ? fsdp_tensor_to_device(&n, *t, device) : tensor_from_f32(&n, *t, dtype);
    tensor_release(*t);
    *t = r == FSDP_OK ? n : NULL;
    return r;
}

void sched_drop_secondary(unit *u) {
    tensor_release(u->secondary);
    u->secondary = NULL;
}

bool sched_keeps_copy(const fsdp_sched *s) {
    if (s->direct || s->compute_dtype == FSDP_F32) return false;
    return s->copy_mode == FSDP_COPY_ON || (s->copy_mode == FSDP_COPY_AUTO && s->shard_device == s->device);
}

fsdp_status sched_current_copy(fsdp_sched *s, unit *u, fsdp_tensor **copy) {
    *copy = NULL;
    if (!sched_keeps_copy(s)) return FSDP_OK;
    fsdp_storage *ms = u->master->storage;
    if (!u->copy) {   /* first use: made, and owned by the master's storage too */
        fsdp_status r = tensor_new(&u->copy, s->compute_dtype, 1, &u->shard_n, s->shard_device, FSDP_TAG_PARAM, false);
        if (r != FSDP_OK) {
            char why[512];
            snprintf(why, sizeof why, "%s", fsdp_last_error());
            return fsdp_set_error(r, "unit %s: its %s compute copy (%lld bytes on %s, rank %d) could not be made: %s; "
                                  "fsdp.shard's compute_copy = false casts the master at each gather instead", u->name,
                                  fsdp_dtype_name(s->compute_dtype),
                                  (long long)(u->shard_n * (int64_t)fsdp_dtype_size(s->compute_dtype)),
                                  fsdp_device_name(s->shard_device), fsdp_current_rank(), why);
        }
        atomic_fetch_add(&u->copy->storage->refcount, 1);
        ms->copy = u->copy->storage;
        ms->copy_dtype = s->compute_dtype;
        ms->copy_version = 0;   /* stale */
        ms->copy_readers = 0;
    }
    if (!storage_copy_current(ms)) {
        if (ms->copy_readers > 0) return FSDP_OK;   /* still read: the caller casts into its own buffer */
        FSDP_TRY(fsdp_copy(u->copy, u->master));    /* one cast kernel */
        ms->copy_version = ms->version;
    }
    *copy = u->copy;
    return FSDP_OK;
}

/* Allocates the full buffer and issues its all-gather (no wait). from_part:
 * this is the backward's gather (or its recomputation's), which may come
 * from the hpZ part kept at the end of this step's forward; any other
 * gather (a forward, its prefetch, an unshard on request) comes from the
 * masters, which an optimizer step may have changed since a part was kept
 * by a forward whose backward never came. */
fsdp_status sched_issue_gather(fsdp_sched *s, unit *u, bool from_part) {
    if (u->gathered || s->direct) return FSDP_OK;   /* direct: the full buffer is the master */
    if (!from_part) sched_drop_secondary(u);
    fsdp_storage *st = u->full->storage;
    fsdp_tensor *copy = NULL;
    if (!u->secondary) FSDP_TRY(sched_current_copy(s, u, &copy));
    if (copy && s->local_one && s->shard_device == s->device) {
        /* a shard group of one: the copy is the whole unit, the full buffer points at it */
        st->data = copy->storage->data;
        u->full_is_copy = true;
        u->full_version = st->version;
        u->master->storage->copy_readers++;
        u->gathered = true;
        u->gathered_in = s->forward_serial;
        s->n_gathered++;
        if (s->n_gathered > s->peak_gathered) s->peak_gathered = s->n_gathered;
        return FSDP_OK;
    }
    FSDP_TRY(fsdp_alloc(st->device, st->tag, st->nbytes, &st->data));
    if (u->secondary) {   /* hpZ: the backward's gather comes from the group's kept parts */
        fsdp_status r = s->reshard_size == 1 ? fsdp_copy(u->full, u->secondary)
                                             : fsdp_all_gather(&u->gather, s->reshard_comm, u->full, u->secondary,
                                                               u->name);
        if (r != FSDP_OK) {
            fsdp_free(st->device, st->tag, st->data, st->nbytes);
            st->data = NULL;
            return r;
        }
        tensor_release(u->secondary);   /* the work holds it until done */
        u->secondary = NULL;
        u->gathered = true;
        u->gathered_in = s->forward_serial;
        s->n_gathered++;
        if (s->n_gathered > s->peak_gathered) s->peak_gathered = s->n_gathered;
        return FSDP_OK;
    }
    fsdp_tensor *src = copy ? copy : u->master;
    tensor_retain(src);
    fsdp_status r = FSDP_OK;
    /* cast where the master is: half the bytes to move when offloaded; a
     * shard group of one beside its master casts straight into the full
     * buffer below (fsdp_copy: one kernel, no staged copy) */
    bool cast_in_copy = s->local_one && s->shard_device == s->device;
    if (sched_stages_pinned(s)) {
        r = stage_to_device(s, u, &src);
    } else {
        if (s->compute_dtype != FSDP_F32 && !copy && !cast_in_copy) r = sched_convert_to(&src, s->compute_dtype, -1);
        if (r == FSDP_OK && s->shard_device != s->device) r = sched_convert_to(&src, -1, s->device);
    }
    if (r != FSDP_OK) {
        fsdp_free(st->device, st->tag, st->data, st->nbytes);
        st->data = NULL;
        return r;
    }
    /* a shard group of one holds the whole unit: a local copy, no collective */
    if (s->local_one)
        r = fsdp_copy(u->full, src);
    else
        r = fsdp_all_gather(&u->gather, s->shard_comm, u->full, src, u->name);
    if (r == FSDP_OK && u->gather && src == copy) {   /* sent from the copy: read until the wait */
        u->master->storage->copy_readers++;
        u->gather_reads_copy = true;
    }
    tensor_release(src);   /* the work holds it until done */
    if (!u->gather) sched_stage_retire(s, &u->stage);   /* copied locally, or failed: no gather to wait for */
    if (r != FSDP_OK) {
        fsdp_free(st->device, st->tag, st->data, st->nbytes);
        st->data = NULL;
        return r;
    }
    u->gathered = true;
    u->gathered_in = s->forward_serial;
    s->n_gathered++;
    if (s->n_gathered > s->peak_gathered) s->peak_gathered = s->n_gathered;
    return FSDP_OK;
}

fsdp_status sched_gather_now(fsdp_sched *s, unit *u, bool from_part) {
    FSDP_TRY(sched_issue_gather(s, u, from_part));
    return sched_wait_gather(s, u);
}

/* hpZ, at the end of a forward whose backward comes: keep this rank's
 * 1/G of the gathered unit (G the reshard group's size), so that the
 * backward regathers within the group instead of the whole shard group. */
fsdp_status sched_keep_secondary(fsdp_sched *s, unit *u) {
    if (!s->reshard_comm || !u->gathered || u->keep || u->secondary) return FSDP_OK;
    FSDP_TRY(sched_wait_gather(s, u));
    int64_t n = u->padded / s->reshard_size, one = 1;
    fsdp_tensor *part = tensor_view(u->full, 1, &n, &one, u->full->offset + (int64_t)s->reshard_rank * n), *sec = NULL;
    if (!part) return fsdp_set_error(FSDP_ERR_OOM, "unit %s: out of host memory", u->name);
    fsdp_status r = tensor_new(&sec, s->compute_dtype, 1, &n, s->device, FSDP_TAG_PARAM, false);
    if (r == FSDP_OK) r = fsdp_copy(sec, part);
    tensor_release(part);
    if (r != FSDP_OK) {
        if (sec) tensor_release(sec);
        return r;
    }
    u->secondary = sec;
    return FSDP_OK;
}

fsdp_status sched_reshard_unit(fsdp_sched *s, unit *u) {
    if (!u->gathered) return FSDP_OK;
    FSDP_TRY(sched_wait_gather(s, u));
    fsdp_storage *st = u->full->storage;
    if (u->full_is_copy) {
        fsdp_storage *ms = u->master->storage;
        ms->copy_readers--;
        u->full_is_copy = false;
        /* the parameters were written while they were the copy: it no
         * longer holds the master's values (which those writes never reached) */
        if (st->version != u->full_version) ms->copy_version = 0;
    } else {
        fsdp_free(st->device, st->tag, st->data, st->nbytes);
    }
    st->data = NULL;
    u->gathered = false;
    s->n_gathered--;
    return FSDP_OK;
}

/* Prefetch: gather unit k early when the limit allows; the limit counts
 * the gathered units that are not kept (the root stays gathered anyway). */
/* A frozen unit with an owner goes with it: the pair is gathered together
 * and counts once. */
static bool counts_alone(const unit *u) { return !(u->frozen && u->partner >= 0); }

static fsdp_status prefetch_as(fsdp_sched *s, int k, bool limited, bool from_part) {
    if (k < 0 || k >= s->n_units) return FSDP_OK;
    unit *u = &s->units[k];
    if (!counts_alone(u)) u = &s->units[u->partner];
    unit *p = u->partner >= 0 ? &s->units[u->partner] : NULL;
    if (u->gathered && (!p || p->gathered)) return FSDP_OK;
    if (!u->gathered) {
        int transient = 0;
        for (int i = 0; i < s->n_units; i++)
            if (s->units[i].gathered && !s->units[i].keep && counts_alone(&s->units[i])) transient++;
        if (limited && transient >= s->limit) return FSDP_OK;
    }
    /* a pair's two gathers: one NCCL group */
    comm_group_begin();
    fsdp_status st = u->gathered ? FSDP_OK : sched_issue_gather(s, u, from_part);
    if (st == FSDP_OK && p) st = sched_issue_gather(s, p, from_part);
    comm_group_end();
    return st;
}

fsdp_status sched_prefetch(fsdp_sched *s, int k, bool from_part) { return prefetch_as(s, k, true, from_part); }

/* Unit k's explicit prefetch list for a phase (0 forward, 1 backward), if
 * it has one: gathered in order, beyond the limit. *done says whether
 * there was a list (then the default prefetch is skipped). */
fsdp_status sched_prefetch_listed(fsdp_sched *s, int k, int phase, bool *done) {
    unit *u = &s->units[k];
    *done = u->n_prefetch[phase] >= 0;
    /* the backward's (and a recomputation's) prefetch may use kept parts */
    bool from_part = phase == 1 || s->recompute == FSDP_RECOMPUTE_REPLAY;
    fsdp_status st = FSDP_OK;
    comm_group_begin();   /* the list's gathers: one NCCL group */
    for (int i = 0; i < u->n_prefetch[phase] && st == FSDP_OK; i++)
        st = prefetch_as(s, u->prefetch_list[phase][i], false, from_part);
    comm_group_end();
    return st;
}

/* FSDP_FORCE_COLLECTIVES=1: a shard group of one still gathers and reduces
 * through its communicator instead of copying locally (so that one
 * GPU can exercise NCCL; fsdp.shard then leaves direct mode off too). */
bool sched_force_collectives(void) {
    const char *v = getenv("FSDP_FORCE_COLLECTIVES");
    return v && strcmp(v, "1") == 0;
}
