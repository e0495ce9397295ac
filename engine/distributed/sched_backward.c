/* sched_backward.c: the FSDP schedule's backward, driven by the markers
 * forward records on the tape (see sched.c's header): at a unit's end
 * marker gather it again and point its parameters' .grad at the flat
 * gradient, marked unwritten; at its begin marker zero what no gradient
 * reached and reduce-scatter the flat gradient; at the root's finish wait
 * for the pending reductions in issue order and add them into the
 * gradient shards. */
#include "ops_util.h"
#include "trace.h"
#include "comm_internal.h"
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "sched_internal.h"

/* what a marker on the tape knows: its schedule and unit */
typedef struct {
    fsdp_sched *s;
    int unit;
} marker_ctx;

/* ---- backward markers ---- */

static void marker_release(void *p) {
    marker_ctx *m = p;
    sched_release(m->s);
    free(m);
}

/* Points each parameter view's .grad at its slice of the flat gradient;
 * unwritten: the flat gradient was not zeroed, so each slice takes its
 * first gradient as a write (tape.c) and zeros_where_unwritten fills what
 * no gradient reached. */
static fsdp_status link_grads(unit *u, bool unwritten) {
    for (int i = 0; i < u->n_params; i++) {
        fsdp_tensor *v = u->views ? u->views[i] : NULL;
        if (!v) continue;
        int64_t strides[FSDP_MAX_DIMS];
        contiguous_strides(v->ndim, v->shape, strides);
        fsdp_tensor *g = tensor_view(u->flat_grad, v->ndim, v->shape, strides, u->offsets[i]);
        if (!g) return fsdp_set_error(FSDP_ERR_OOM, "unit %s: out of host memory", u->name);
        g->unwritten = unwritten;
        tensor_release(v->grad);
        v->grad = g;
    }
    return FSDP_OK;
}

/* Zeroes flat[at, at + n). */
static fsdp_status zero_range(unit *u, int64_t at, int64_t n) {
    if (n <= 0) return FSDP_OK;
    int64_t one = 1;
    fsdp_tensor *part = tensor_view(u->flat_grad, 1, &n, &one, u->flat_grad->offset + at);
    if (!part) return fsdp_set_error(FSDP_ERR_OOM, "unit %s: out of host memory", u->name);
    fsdp_status st = fsdp_fill(part, 0.0);
    tensor_release(part);
    return st;
}

/* At the end of a unit's backward: the slices of an unzeroed flat gradient
 * that no gradient was written into (a parameter the loss does not reach,
 * one without a view, the padding) become zeros, so that the flat gradient
 * reads as the sum of the gradients everywhere. */
static fsdp_status zeros_where_unwritten(unit *u) {
    int64_t at = 0;   /* parameters lie in order: [offsets[i], offsets[i] + numels[i]) */
    for (int i = 0; i < u->n_params; i++) {
        fsdp_tensor *v = u->views ? u->views[i] : NULL, *g = v ? v->grad : NULL;
        bool written = g && g->storage == u->flat_grad->storage && !g->unwritten;
        if (g && g->storage == u->flat_grad->storage) g->unwritten = false;
        if (written) {
            FSDP_TRY(zero_range(u, at, u->offsets[i] - at));
            at = u->offsets[i] + u->numels[i];
        }
    }
    return zero_range(u, at, u->padded - at);
}

void sched_unlink_grads(unit *u) {
    for (int i = 0; u->views && i < u->n_params; i++) {
        if (!u->views[i]) continue;
        tensor_release(u->views[i]->grad);
        u->views[i]->grad = NULL;
    }
}

int sched_order_index(const int *order, int n, int k) {
    for (int i = n - 1; i >= 0; i--)
        if (order[i] == k) return i;
    return -1;
}

/* Offload with pinned host blocks: whether reduced (on the device) comes
 * back through one, which the host's kernels then read as they add it. */
static bool pinned_back(const fsdp_sched *s, const fsdp_tensor *reduced) {
    if (!sched_stages_pinned(s)) return false;
    const fsdp_device_kernels *h = device_kernels(FSDP_DEVICE_CPU);
    return reduced->dtype == FSDP_F32 ? h->axpy_f32 != NULL
                                      : reduced->dtype == FSDP_BF16 && h->axpy_f32_bf16 && h->cast_any;
}

/* u's gradient shard (f32, on the host) += reduced (shard_n, on the
 * device), by DMA into a pinned block of the host and, once its fence has
 * passed, the host's add from there: widened as it is added (bf16), or as
 * it is written into the schedule's zeros. */
static fsdp_status add_through_pinned(fsdp_sched *s, unit *u, fsdp_tensor *reduced) {
    size_t nbytes = (size_t)u->shard_n * fsdp_dtype_size(reduced->dtype);
    int tag = reduced->storage->tag;
    void *pin = NULL;
    FSDP_TRY(fsdp_alloc_pinned(s->device, tag, nbytes, &pin));
    const fsdp_device_kernels *k = KERNELS(reduced);
    k->fence_wait(k->copy_to_host_async(pin, tensor_data(reduced), nbytes), 1);   /* the host reads it next */
    fsdp_status r = sched_ensure_grad(s, u);
    if (r == FSDP_OK) {
        const fsdp_device_kernels *h = KERNELS(u->grad);
        float *g = tensor_data(u->grad);
        bool zeros = unit_grad_zero(u);
        unit_grad_written(u);
        if (reduced->dtype == FSDP_F32) h->axpy_f32(g, pin, 1.0f, u->shard_n);
        else if (zeros) h->cast_any(g, FSDP_F32, pin, FSDP_BF16, u->shard_n);
        else h->axpy_f32_bf16(g, pin, 1.0f, u->shard_n);
    }
    fsdp_free_pinned(s->device, tag, pin, nbytes);
    return r;
}

/* Hybrid: the replica average of a unit's reduced shard, issued right
 * behind its reduce-scatter (or local copy), so it runs while the walk goes
 * on instead of after it. No wait is needed between: on the CPU it runs on
 * the replica lane, which holds it until the reduce-scatter that writes its
 * bytes has finished (comm_queue.c, lanes) while lane 0 goes on with the
 * gathers; on the GPU both are on the one comm stream, in issue order (and
 * a group never holds a collective with the one whose output it reads). */
static fsdp_status issue_replica_average(fsdp_sched *s, pending *q) {
    if (!(s->replica_comm && s->replica_size > 1) || !q->reduced) return FSDP_OK;
    return fsdp_all_reduce(&q->replica, s->replica_comm, q->reduced, FSDP_REDUCE_AVG, s->units[q->unit].name);
}

/* Pending reduction k, in issue order (the same on every rank, so the
 * replica all-reduces match too): wait for it, average it across replicas
 * (hybrid), add it into the unit's gradient shard and free its output. */
static fsdp_status add_reduced(fsdp_sched *s, int k) {
    pending *q = &s->pend[k];
    if (!q->reduced) {   /* added already, or an all-reduce of the gradient shard in place (direct) */
        fsdp_status r = q->work ? fsdp_work_wait(q->work) : FSDP_OK;
        if (q->work) fsdp_work_free(q->work);
        q->work = NULL;
        return r;
    }
    unit *u = &s->units[q->unit];
    fsdp_status r = q->work ? fsdp_work_wait(q->work) : FSDP_OK;
    if (q->replica) {   /* q->work (if any) was the reduce-scatter: the replica average came behind it */
        if (q->work) fsdp_work_free(q->work);
        q->work = q->replica;
        q->replica = NULL;
        if (r == FSDP_OK) r = fsdp_work_wait(q->work);
    } else if (r == FSDP_OK && s->replica_comm && s->replica_size > 1) {   /* not issued (its issue failed) */
        r = fsdp_all_reduce(NULL, s->replica_comm, q->reduced, FSDP_REDUCE_AVG, u->name);
    }
    if (r == FSDP_OK && pinned_back(s, q->reduced)) {
        r = add_through_pinned(s, u, q->reduced);
    } else if (r == FSDP_OK) {
        fsdp_tensor *g32 = q->reduced;
        tensor_retain(g32);
        /* back to the offloaded shard in the reduce dtype (fewer bytes), then f32 */
        if (s->shard_device != s->device) r = sched_convert_to(&g32, -1, s->shard_device);
        if (r == FSDP_OK) r = sched_ensure_grad(s, u);
        /* a bf16 gradient is widened as it is added where the device can; into
         * the schedule's zeros it is widened as it is written, without reading
         * the shard (the values of the add, up to the sign of a zero: 0 + -0
         * is +0, which no later use tells apart) */
        bool widen_in_add = r == FSDP_OK && g32->dtype == FSDP_BF16 && KERNELS(u->grad)->axpy_f32_bf16;
        bool widen_as_write = widen_in_add && unit_grad_zero(u) && KERNELS(u->grad)->cast_any;
        if (r == FSDP_OK && !widen_in_add) r = sched_convert_to(&g32, FSDP_F32, -1);
        if (r == FSDP_OK) unit_grad_written(u);
        if (r == FSDP_OK && widen_as_write)
            KERNELS(u->grad)->cast_any(tensor_data(u->grad), FSDP_F32, tensor_data(g32), FSDP_BF16, u->shard_n);
        else if (r == FSDP_OK && widen_in_add)
            KERNELS(u->grad)->axpy_f32_bf16(tensor_data(u->grad), tensor_data(g32), 1.0f, u->shard_n);
        else if (r == FSDP_OK)
            KERNELS(u->grad)->axpy_f32(tensor_data(u->grad), tensor_data(g32), 1.0f, u->shard_n);
        tensor_release(g32);
    }
    if (q->work) fsdp_work_free(q->work);
    q->work = NULL;
    tensor_release(q->reduced);
    q->reduced = NULL;
    return r;
}

/* The walk reached the end of unit k's forward: its backward starts. */
static fsdp_status before_backward(void *p) {
    marker_ctx *m = p;
    fsdp_sched *s = m->s;
    unit *u = &s->units[m->unit];
    FSDP_TRY(sched_gather_now(s, u, true));
    trace_unit_push("backward", u->name);
    /* each reduce-scatter in flight holds a full flat gradient and its
     * output: let at most one still run while this unit's backward starts;
     * the others are added into their gradient shards and freed now */
    for (int k = 0; k + 1 < s->n_pend; k++) FSDP_TRY(add_reduced(s, k));
    if (!u->flat_grad && !u->frozen) {   /* kept across micro-batches without sync */
        if (s->direct) {   /* gradients accumulate into the gradient shard itself */
            int64_t one = 1;
            FSDP_TRY(sched_ensure_grad(s, u));
            /* a shard that holds the schedule's zeros takes each parameter's first gradient as a write:
             * the values of an add into zeros, without reading them (a GEMM's beta 0) */
            bool zeros = unit_grad_zero(u);
            unit_grad_written(u);
            u->flat_grad = tensor_view(u->grad, 1, &u->padded, &one, u->grad->offset);
            if (!u->flat_grad) return fsdp_set_error(FSDP_ERR_OOM, "unit %s: out of host memory", u->name);
            FSDP_TRY(link_grads(u, zeros));
        } else {
            /* not zeroed: each parameter's first gradient is written (a sliced unit is reduced by slices,
             * and its flat gradient zeroed as before) */
            bool unwritten = !u->slicer;
            FSDP_TRY(tensor_new(&u->flat_grad, s->compute_dtype, 1, &u->padded, s->device, FSDP_TAG_GRAD,
                                !unwritten));
            u->flat_unwritten = unwritten;
            u->flat_new = true;
            FSDP_TRY(link_grads(u, unwritten));
        }
    }
    bool listed;
    FSDP_TRY(sched_prefetch_listed(s, m->unit, 1, &listed));
    if (!listed && s->backward_prefetch == FSDP_PREFETCH_BACKWARD_PRE) {
        int i = sched_order_index(s->order, s->n_order, m->unit);
        if (i > 0) FSDP_TRY(sched_prefetch(s, s->order[i - 1], true));
    }
    return FSDP_OK;
}

/* Room for one more pending reduction. */
static fsdp_status grow_pending(fsdp_sched *s, const unit *u) {
    if (s->n_pend < s->cap_pend) return FSDP_OK;
    int cap = s->cap_pend ? 2 * s->cap_pend : 16;
    pending *np = realloc(s->pend, (size_t)cap * sizeof *np);
    if (!np) return fsdp_set_error(FSDP_ERR_OOM, "unit %s: out of host memory", u->name);
    s->pend = np;
    s->cap_pend = cap;
    return FSDP_OK;
}

/* A shard group of one whose flat gradient can stand for its reduction
 * (the average over one rank is the gradient itself): the values are the
 * reduce dtype's already (the same dtype, or bf16 gradients and f32
 * reduction, exact) and no replica all-reduce reads it in the reduce dtype;
 * the gradient shard is on the compute device. */
static bool local_reduce_in_place(const fsdp_sched *s) {
    if (!s->local_one || s->shard_device != s->device) return false;
    if (s->compute_dtype == s->reduce_dtype) return true;
    bool replicas = s->replica_comm && s->replica_size > 1;
    return s->compute_dtype == FSDP_BF16 && s->reduce_dtype == FSDP_F32 && !replicas;
}

/* Whether unit u's reduce-scatter can add its average straight into the
 * gradient shard (comm_reduce_scatter_add): f32 traffic on the host between
 * ranks, no replica average to take first, the shard beside the compute
 * (not offloaded), and the shard holding the schedule's zeros, so that an
 * abandoned backward can restore them (a second backward without
 * zero_grad adds through a reduced buffer as before). The same bits either
 * way: dst + fl(sum / N). */
static bool reduces_into_grad(const fsdp_sched *s, const unit *u) {
    return !s->local_one && s->reduce_dtype == FSDP_F32 && device_is_host_like(s->device) &&
           s->shard_device == s->device && !(s->replica_comm && s->replica_size > 1) && unit_grad_zero(u);
}

/* The walk reached the start of unit k's forward: its gradients are complete. */
static fsdp_status unit_backward_done(void *p) {
    marker_ctx *m = p;
    fsdp_sched *s = m->s;
    unit *u = &s->units[m->unit];
    trace_unit_pop("backward", u->name);
    if (u->flat_grad && u->flat_unwritten) {   /* (also without sync: the flat gradient is read as it is kept) */
        FSDP_TRY(zeros_where_unwritten(u));
        u->flat_unwritten = false;
    }
    if (s->sync && u->flat_grad && s->direct) {   /* already in the gradient shard */
        sched_unlink_grads(u);
        tensor_release(u->flat_grad);
        u->flat_grad = NULL;
        if (s->replica_comm && s->replica_size > 1) {
            /* replicas (no_shard): average the gradient shard in place, in flight while the walk goes on.
             * Micro-batches without sync accumulated into it too, and an earlier step's gradient that was
             * not zeroed is equal on every replica, so the average is the one of this step's gradients. */
            FSDP_TRY(grow_pending(s, u));
            fsdp_work *w = NULL;
            FSDP_TRY(fsdp_all_reduce(&w, s->replica_comm, u->grad, FSDP_REDUCE_AVG, u->name));
            s->pend[s->n_pend++] = (pending){m->unit, w, NULL, NULL};
        }
    } else if (s->sync && u->flat_grad && local_reduce_in_place(s)) {
        /* a group of one whose gradient values the reduce dtype holds as
         * they are: the flat gradient itself is the reduction, added into
         * the gradient shard later (no copy, nothing widened first) */
        FSDP_TRY(grow_pending(s, u));
        s->pend[s->n_pend++] = (pending){m->unit, NULL, u->flat_grad, NULL};
        sched_unlink_grads(u);
        u->flat_grad = NULL;   /* the pending entry holds its reference */
    } else if (s->sync && u->flat_grad) {
        fsdp_tensor *src = u->flat_grad, *dst;
        tensor_retain(src);
        /* compressed: from f32 values, whatever the reduce dtype (the wire format replaces it) */
        bool compressed = sched_compresses(s, u);
        int want = compressed ? FSDP_F32 : s->reduce_dtype;
        /* a group of one: fsdp_copy below converts as it copies */
        if (want != s->compute_dtype && !s->local_one) {
            fsdp_tensor *c;
            fsdp_status r = tensor_as_f32(&c, u->flat_grad);
            tensor_release(src);
            if (r != FSDP_OK) return r;
            src = c;
            if (want != FSDP_F32) {
                r = tensor_from_f32(&c, src, want);
                tensor_release(src);
                if (r != FSDP_OK) return r;
                src = c;
            }
        }
        fsdp_status r = grow_pending(s, u);
        if (r == FSDP_OK) r = sched_ensure_grad(s, u);
        if (r != FSDP_OK) {
            tensor_release(src);
            return r;
        }
        fsdp_work *w = NULL;
        if (compressed) {
            r = sched_reduce_compressed(s, u, src, &dst, &w);
            tensor_release(src);
            if (r != FSDP_OK) return r;
            s->pend[s->n_pend++] = (pending){m->unit, w, dst, NULL};
            FSDP_TRY(issue_replica_average(s, &s->pend[s->n_pend - 1]));
        } else if (reduces_into_grad(s, u)) {
            /* the reduce-scatter adds its average into the gradient shard as it sums the terms */
            unit_grad_written(u);
            r = comm_reduce_scatter_add(&w, s->shard_comm, u->grad, src, FSDP_REDUCE_AVG, u->name);
            tensor_release(src);
            if (r != FSDP_OK) return r;
            s->pend[s->n_pend++] = (pending){m->unit, w, NULL, NULL};
        } else {
            r = tensor_new(&dst, s->reduce_dtype, 1, &u->shard_n, s->device, FSDP_TAG_COMM, false);
            /* a group of one: the average over one rank is the gradient itself */
            if (r == FSDP_OK)
                r = s->local_one ? fsdp_copy(dst, src)
                                 : fsdp_reduce_scatter(&w, s->shard_comm, dst, src, FSDP_REDUCE_AVG, u->name);
            tensor_release(src);
            if (r != FSDP_OK) {
                tensor_release(dst);
                return r;
            }
            s->pend[s->n_pend++] = (pending){m->unit, w, dst, NULL};
            FSDP_TRY(issue_replica_average(s, &s->pend[s->n_pend - 1]));
        }
        sched_unlink_grads(u);
        tensor_release(u->flat_grad);
        u->flat_grad = NULL;
    }
    FSDP_TRY(sched_reshard_unit(s, u));
    if (s->backward_prefetch == FSDP_PREFETCH_BACKWARD_POST && u->n_prefetch[1] < 0) {
        int i = sched_order_index(s->order, s->n_order, m->unit);
        if (i > 0) FSDP_TRY(sched_prefetch(s, s->order[i - 1], true));
    }
    return FSDP_OK;
}

/* The unit's gradient reduction and the backward_post prefetch of the
 * next unit: one NCCL group (independent buffers: the flat gradient and
 * the reduction's output, the next unit's shard and full buffer). */
static fsdp_status after_backward(void *p) {
    comm_group_begin();
    fsdp_status st = unit_backward_done(p);
    comm_group_end();
    return st;
}

/* After the walk: finish the reductions in issue order (the same on every
 * rank, so the replica all-reduces match too) into the gradient shards. */
static fsdp_status finish_backward(void *p) {
    fsdp_sched *s = p;
    fsdp_status st = FSDP_OK;
    for (int k = 0; k < s->n_pend; k++) {
        fsdp_status r = add_reduced(s, k);
        if (r != FSDP_OK && st == FSDP_OK) st = r;
    }
    s->n_pend = 0;
    /* complete: nothing of this backward is to be undone */
    for (int k = 0; k < s->n_units && st == FSDP_OK; k++) s->units[k].restore_zeros = s->units[k].flat_new = false;
    /* a unit prefetched but not used since (a recomputed block's backward
     * can prefetch one that already ran) would keep values from before the
     * optimizer step: nothing stays gathered past a backward */
    for (int k = 0; k < s->n_units; k++) {
        fsdp_status r = sched_reshard_unit(s, &s->units[k]);
        sched_drop_secondary(&s->units[k]);
        if (r != FSDP_OK && st == FSDP_OK) st = r;
    }
    return st;
}

/* Runs after the finish hook, and instead of it when the backward was
 * abandoned (aborted, the tape cleared, or the finish failed): then partial
 * flat gradients, pending reductions and gathered units must not leak into
 * the next step, and every gradient shard this backward wrote into while it
 * held the schedule's zeros (restore_zeros, in every mode: a world of one
 * accumulates into its shards during the walk) holds zeros again. */
static void finish_release(void *p) {
    fsdp_sched *s = p;
    for (int k = 0; k < s->n_pend; k++) {
        if (s->pend[k].work) fsdp_work_free(s->pend[k].work);   /* (waits: the comm thread is done with it) */
        if (s->pend[k].replica) fsdp_work_free(s->pend[k].replica);
        tensor_release(s->pend[k].reduced);
    }
    s->n_pend = 0;
    for (int k = 0; k < s->n_units; k++) {
        unit *u = &s->units[k];
        /* without sync a flat gradient is kept for the next micro-batch, unless this backward made it (it holds
         * only this backward's part) or it is the gradient shard itself (direct: the next backward links it
         * again, as writes into restored zeros or adds onto earlier micro-batches) */
        if (u->flat_grad && (s->sync || s->direct || u->flat_new)) {
            sched_unlink_grads(u);
            tensor_release(u->flat_grad);
            u->flat_grad = NULL;
            u->flat_unwritten = false;
        }
        if (u->restore_zeros && u->grad && fsdp_fill(u->grad, 0.0) == FSDP_OK) unit_mark_grad_zero(u);
        u->restore_zeros = u->flat_new = false;
        sched_reshard_unit(s, u);
        sched_drop_secondary(u);
    }
    s->finish_registered = false;
    sched_release(s);
}

fsdp_status sched_record_marker(fsdp_sched *s, int k, bool end) {
    marker_ctx *m = malloc(sizeof *m);
    if (!m) return fsdp_set_error(FSDP_ERR_OOM, "unit %s: out of host memory", s->units[k].name);
    m->s = s;
    m->unit = k;
    sched_retain(s);
    return tape_record_marker(end ? "fsdp unit end" : "fsdp unit begin", end ? before_backward : after_backward, m,
                              marker_release);
}

fsdp_status sched_on_backward_finish(fsdp_sched *s) {
    sched_retain(s);
    return tape_on_finish(finish_backward, s, finish_release);
}
