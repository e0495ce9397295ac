/* sched_state.c: a schedule's life and its units' state: the list of live
 * schedules, the reference count that the backward's marker nodes hold
 * (a schedule is freed when the last one lets go), clearing a unit, and
 * the checks and the gradient buffer the forward and backward share. */
#include "ops_util.h"
#include "comm_internal.h"
#include <pthread.h>
#include <stdlib.h>

#include "sched_internal.h"

/* Every schedule not yet freed, for fsdp_sched_reshard_all. */
pthread_mutex_t sched_live_mu = PTHREAD_MUTEX_INITIALIZER;
struct fsdp_sched *sched_live;

void sched_live_add(struct fsdp_sched *s) {
    pthread_mutex_lock(&sched_live_mu);
    s->live_next = sched_live;
    if (sched_live) sched_live->live_prev = s;
    sched_live = s;
    pthread_mutex_unlock(&sched_live_mu);
}

static void live_remove(struct fsdp_sched *s) {
    pthread_mutex_lock(&sched_live_mu);
    if (s->live_prev) s->live_prev->live_next = s->live_next;
    else if (sched_live == s) sched_live = s->live_next;
    if (s->live_next) s->live_next->live_prev = s->live_prev;
    s->live_prev = s->live_next = NULL;
    pthread_mutex_unlock(&sched_live_mu);
}

void sched_retain(fsdp_sched *s) { atomic_fetch_add(&s->refcount, 1); }


void sched_release(fsdp_sched *s) {
    if (!s || atomic_fetch_sub(&s->refcount, 1) != 1) return;
    live_remove(s);
    for (int k = 0; k < s->n_pend; k++) {
        if (s->pend[k].work) fsdp_work_free(s->pend[k].work);
        if (s->pend[k].replica) fsdp_work_free(s->pend[k].replica);
        tensor_release(s->pend[k].reduced);
    }
    for (int k = 0; k < s->n_units; k++) {
        sched_unit_clear(&s->units[k]);   /* (a gather in flight is waited for) */
        sched_stage_retire(s, &s->units[k].stage);
    }
    sched_stage_reap(s, true);
    free(s->retired);
    free(s->units);
    free(s->order);
    free(s->fwd_order);
    free(s->pend);
    fsdp_comm_free(s->shard_comm);
    if (s->replica_comm) fsdp_comm_free(s->replica_comm);
    if (s->reshard_comm) fsdp_comm_free(s->reshard_comm);
    free(s);
}

void sched_unit_clear(unit *u) {
    if (u->full_is_copy) {   /* the data is the copy's, which the master's storage owns */
        u->full->storage->data = NULL;
        u->master->storage->copy_readers--;
        u->full_is_copy = false;
    }
    if (u->slicer) {   /* views may outlive the schedule: they lose the slicer with it */
        if (u->full) u->full->storage->slicer = NULL;
        free(u->slicer);
        u->slicer = NULL;
    }
    if (u->gather) fsdp_work_free(u->gather);
    if (u->views)
        for (int i = 0; i < u->n_params; i++) tensor_release(u->views[i]);
    free(u->views);
    tensor_release(u->master);
    tensor_release(u->grad);
    tensor_release(u->full);
    tensor_release(u->flat_grad);
    tensor_release(u->secondary);
    tensor_release(u->copy);
    tensor_release(u->residual);
    free(u->numels);
    free(u->offsets);
    free(u->prefetch_list[0]);
    free(u->prefetch_list[1]);
}

fsdp_status sched_check_unit(const char *op, fsdp_sched *s, int k) {
    if (!s) return fsdp_set_error(FSDP_ERR_INVALID, "%s: schedule is NULL", op);
    if (k < 0 || k >= s->n_units)
        return fsdp_set_error(FSDP_ERR_INVALID, "%s: unit %d out of range (the schedule has %d)", op, k, s->n_units);
    return FSDP_OK;
}

/* The gradient shard of a trainable unit, made zeroed on first use. */
fsdp_status sched_ensure_grad(fsdp_sched *s, unit *u) {
    if (u->grad || u->frozen) return FSDP_OK;
    FSDP_TRY(tensor_new(&u->grad, FSDP_F32, 1, &u->shard_n, s->shard_device, FSDP_TAG_GRAD, true));
    unit_mark_grad_zero(u);
    return FSDP_OK;
}
