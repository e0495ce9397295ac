/* sched_control.c: what a caller asks of a schedule beyond forward and
 * backward: unshard and reshard on request (also asynchronously), every
 * schedule back to its shards after the REPL's rejoin, hpZ reshard groups,
 * explicit prefetch lists, and the settings (recompute, sync, zero_grad,
 * statistics). */
#include "sched_internal.h"
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

fsdp_status fsdp_unit_unshard(fsdp_sched *s, int k) {
    FSDP_TRY(sched_check_unit("fsdp_unit_unshard", s, k));
    return sched_gather_now(s, &s->units[k], false);
}

fsdp_status fsdp_unit_reshard(fsdp_sched *s, int k) {
    FSDP_TRY(sched_check_unit("fsdp_unit_reshard", s, k));
    sched_drop_secondary(&s->units[k]);
    return sched_reshard_unit(s, &s->units[k]);
}

/* After ranks were brought back in step (the REPL's rejoin) every
 * schedule starts from its shards on every rank: a chunk that failed on
 * some ranks may have left units gathered, gathers issued or hpZ parts kept
 * there only. A gather that the rejoin cancelled is done (failed) and just
 * freed; one that is still running keeps its unit gathered and is named. */
fsdp_status fsdp_sched_reshard_all(void) {
    fsdp_status first = FSDP_OK;
    char msg[512] = "";
    pthread_mutex_lock(&sched_live_mu);
    for (fsdp_sched *s = sched_live; s; s = s->live_next)
        for (int k = 0; k < s->n_units; k++) {
            unit *u = &s->units[k];
            sched_drop_secondary(u);
            (void)sched_reshard_unit(s, u);   /* a cancelled gather's error is expected */
            if (u->gathered && first == FSDP_OK) {
                first = FSDP_ERR_STATE;
                snprintf(msg, sizeof msg, "unit %s: its gather is still running (%s)", u->name, fsdp_last_error());
            }
        }
    pthread_mutex_unlock(&sched_live_mu);
    if (first != FSDP_OK) return fsdp_set_error(first, "fsdp_sched_reshard_all: %s", msg);
    return FSDP_OK;
}

fsdp_status fsdp_sched_set_reshard_group(fsdp_sched *s, fsdp_comm *group) {
    if (!s) return fsdp_set_error(FSDP_ERR_INVALID, "fsdp_sched_set_reshard_group: schedule is NULL");
    int rank = 0, size = 0;
    if (group) FSDP_TRY(fsdp_comm_info(group, &rank, &size));
    if (group && (size < 1 || s->shard_size % size != 0))
        return fsdp_set_error(FSDP_ERR_INVALID, "fsdp_sched_set_reshard_group: a group of %d ranks does not divide "
                              "the shard group of %d (rank %d of it)", size, s->shard_size, s->shard_rank);
    for (int k = 0; k < s->n_units; k++)
        if (s->units[k].secondary || s->units[k].gathered)
            return fsdp_set_error(FSDP_ERR_STATE, "fsdp_sched_set_reshard_group: unit %s is gathered or keeps a part "
                                  "for its backward; change the group between steps", s->units[k].name);
    fsdp_comm *dup = NULL;
    if (group) FSDP_TRY(comm_dup(&dup, group));
    if (s->reshard_comm) fsdp_comm_free(s->reshard_comm);
    s->reshard_comm = dup;
    s->reshard_rank = rank;
    s->reshard_size = size;
    return FSDP_OK;
}

fsdp_status fsdp_unit_unshard_async(fsdp_sched *s, int k) {
    FSDP_TRY(sched_check_unit("fsdp_unit_unshard_async", s, k));
    return sched_issue_gather(s, &s->units[k], false);
}

fsdp_status fsdp_unit_wait(fsdp_sched *s, int k) {
    FSDP_TRY(sched_check_unit("fsdp_unit_wait", s, k));
    return sched_wait_gather(s, &s->units[k]);
}

fsdp_status fsdp_unit_set_prefetch(fsdp_sched *s, int k, int backward, int n, const int *units) {
    FSDP_TRY(sched_check_unit("fsdp_unit_set_prefetch", s, k));
    unit *u = &s->units[k];
    const char *phase = backward ? "backward" : "forward";
    if (backward != 0 && backward != 1)
        return fsdp_set_error(FSDP_ERR_INVALID, "fsdp_unit_set_prefetch(%s): phase %d (expected 0 forward, 1 "
                              "backward)", u->name, backward);
    if (n < -1 || (n > 0 && !units))
        return fsdp_set_error(FSDP_ERR_INVALID, "fsdp_unit_set_prefetch(%s, %s): %d units%s", u->name, phase, n,
                              n > 0 ? " but no list" : " (expected a count >= 0, or -1 for the default)");
    for (int i = 0; i < n; i++) {
        if (units[i] < 0 || units[i] >= s->n_units)
            return fsdp_set_error(FSDP_ERR_INVALID, "fsdp_unit_set_prefetch(%s, %s): unit %d is not in the "
                                  "schedule (it has %d units)", u->name, phase, units[i], s->n_units);
        if (units[i] == k)
            return fsdp_set_error(FSDP_ERR_INVALID, "fsdp_unit_set_prefetch(%s, %s): a unit cannot prefetch itself",
                                  u->name, phase);
    }
    int *list = NULL;
    if (n > 0) {
        list = malloc((size_t)n * sizeof *list);
        if (!list) return fsdp_set_error(FSDP_ERR_OOM, "fsdp_unit_set_prefetch: out of host memory");
        memcpy(list, units, (size_t)n * sizeof *list);
    }
    free(u->prefetch_list[backward]);
    u->prefetch_list[backward] = list;
    u->n_prefetch[backward] = n;
    return FSDP_OK;
}

fsdp_status fsdp_sched_set_recompute(fsdp_sched *s, fsdp_recompute_mode mode) {
    if (!s) return fsdp_set_error(FSDP_ERR_INVALID, "fsdp_sched_set_recompute: schedule is NULL");
    if (mode < FSDP_RECOMPUTE_NONE || mode > FSDP_RECOMPUTE_REPLAY)
        return fsdp_set_error(FSDP_ERR_INVALID, "fsdp_sched_set_recompute: mode %d (expected 0, 1 or 2)", mode);
    s->recompute = mode;
    return FSDP_OK;
}

fsdp_status fsdp_sched_set_sync(fsdp_sched *s, int sync) {
    if (!s) return fsdp_set_error(FSDP_ERR_INVALID, "fsdp_sched_set_sync: schedule is NULL");
    s->sync = sync != 0;
    return FSDP_OK;
}

fsdp_status fsdp_sched_zero_grad(fsdp_sched *s) {
    if (!s) return fsdp_set_error(FSDP_ERR_INVALID, "fsdp_sched_zero_grad: schedule is NULL");
    for (int k = 0; k < s->n_units; k++) {
        unit *u = &s->units[k];
        if (u->flat_grad) {
            sched_unlink_grads(u);
            tensor_release(u->flat_grad);
            u->flat_grad = NULL;
        }
        if (u->grad) {
            FSDP_TRY(fsdp_fill(u->grad, 0.0));
            unit_mark_grad_zero(u);
        }
    }
    return FSDP_OK;
}

fsdp_status fsdp_sched_stats(fsdp_sched *s, int *gathered_now, int *gathered_peak, int reset) {
    if (!s) return fsdp_set_error(FSDP_ERR_INVALID, "fsdp_sched_stats: schedule is NULL");
    if (gathered_now) *gathered_now = s->n_gathered;
    if (gathered_peak) *gathered_peak = s->peak_gathered;
    if (reset) s->peak_gathered = s->n_gathered;
    return FSDP_OK;
}
