/* sched_slice.c: sliced units (the vocabulary-chunked tied embedding): a
 * unit read and reduced a slice of rows at a time through its row slicer,
 * never gathered whole (engine/ops/classifier.c reads them). */
#include "sched_internal.h"
#include <stdlib.h>
#include <string.h>

/* ---- sliced units: gathered and reduced a slice at a time ---- */

static fsdp_status slice_range(const fsdp_row_slicer *sl, int64_t lo, int64_t n, const char *op, unit **out) {
    fsdp_sched *s = sl->sched;
    unit *u = &s->units[sl->unit];
    if (lo < 0 || n < 1 || lo + n > u->shard_n)
        return fsdp_set_error(FSDP_ERR_INVALID, "%s(%s): slice [%lld, %lld) outside the shard of %lld elements", op,
                              u->name, (long long)lo, (long long)(lo + n), (long long)u->shard_n);
    *out = u;
    return FSDP_OK;
}

/* Elements [lo, lo + n) of every rank's master shard, in the compute dtype,
 * rank after rank: one all-gather of n elements each. */
static fsdp_status slice_gather(const fsdp_row_slicer *sl, int64_t lo, int64_t n, fsdp_tensor **out) {
    fsdp_sched *s = sl->sched;
    unit *u = NULL;
    FSDP_TRY(slice_range(sl, lo, n, "slice gather", &u));
    int64_t one = 1, total = n * s->shard_size;
    /* from the master's compute copy when it keeps one (cast whole, once, when stale) */
    fsdp_tensor *copy = NULL;
    if (!s->direct) FSDP_TRY(sched_current_copy(s, u, &copy));
    fsdp_tensor *from = copy ? copy : u->master;
    fsdp_tensor *src = tensor_view(from, 1, &n, &one, from->offset + lo), *dst = NULL;
    if (!src) return fsdp_set_error(FSDP_ERR_OOM, "unit %s: out of host memory", u->name);
    if (s->direct || (copy && s->local_one)) {   /* a world of one: the slice is a view, nothing copied */
        *out = src;
        return FSDP_OK;
    }
    fsdp_status r = FSDP_OK;
    if (s->compute_dtype != FSDP_F32 && !copy) r = sched_convert_to(&src, s->compute_dtype, -1);
    if (r == FSDP_OK && s->shard_device != s->device) r = sched_convert_to(&src, -1, s->device);
    if (r == FSDP_OK) r = tensor_new(&dst, s->compute_dtype, 1, &total, s->device, FSDP_TAG_PARAM, false);
    if (r == FSDP_OK) r = s->local_one ? fsdp_copy(dst, src) : fsdp_all_gather(NULL, s->shard_comm, dst, src, u->name);
    tensor_release(src);
    if (r != FSDP_OK) {
        tensor_release(dst);
        return r;
    }
    *out = dst;
    return FSDP_OK;
}

/* g (shard_size * n, f32) reduce-scattered (averaged) at once; this rank's
 * n elements are added into its gradient shard at lo. */
static fsdp_status slice_reduce(const fsdp_row_slicer *sl, int64_t lo, int64_t n, fsdp_tensor *g) {
    fsdp_sched *s = sl->sched;
    unit *u = NULL;
    FSDP_TRY(slice_range(sl, lo, n, "slice reduce", &u));
    if (u->frozen) return FSDP_OK;
    if (tensor_numel(g) != n * s->shard_size || g->dtype != FSDP_F32)
        return fsdp_set_error(FSDP_ERR_SHAPE, "slice reduce(%s): %lld elements of %s, expected %lld of f32", u->name,
                              (long long)tensor_numel(g), fsdp_dtype_name(g->dtype), (long long)(n * s->shard_size));
    int64_t one = 1, total = n * s->shard_size;
    fsdp_tensor *src = tensor_is_contiguous(g) ? tensor_view(g, 1, &total, &one, g->offset) : NULL, *dst = NULL;
    if (!src) return fsdp_set_error(FSDP_ERR_INVALID, "slice reduce(%s): the gradient must be contiguous", u->name);
    /* a world of one: straight into the gradient shard (with replicas, no_shard, the slice is averaged
     * across them first, below: a sliced unit has no backward end of its own to all-reduce its shard at) */
    if (s->direct && !(s->replica_comm && s->replica_size > 1)) {
        fsdp_status r = sched_ensure_grad(s, u);
        if (r == FSDP_OK) unit_grad_written(u);
        if (r == FSDP_OK) KERNELS(u->grad)->axpy_f32((float *)tensor_data(u->grad) + lo, tensor_data(src), 1.0f, n);
        tensor_release(src);
        return r;
    }
    fsdp_status r = FSDP_OK;
    if (!s->local_one && s->reduce_dtype == FSDP_F32 && device_is_host_like(s->device) &&
        !(s->replica_comm && s->replica_size > 1)) {
        /* f32 on the host: the reduce-scatter adds its average into the shard's slice as it sums */
        fsdp_tensor *part = NULL;
        r = sched_ensure_grad(s, u);
        if (r == FSDP_OK) part = tensor_view(u->grad, 1, &n, &one, u->grad->offset + lo);
        if (r == FSDP_OK && !part) r = fsdp_set_error(FSDP_ERR_OOM, "slice reduce(%s): out of host memory", u->name);
        if (r == FSDP_OK) unit_grad_written(u);
        if (r == FSDP_OK) r = comm_reduce_scatter_add(NULL, s->shard_comm, part, src, FSDP_REDUCE_AVG, u->name);
        tensor_release(part);
        tensor_release(src);
        return r;
    }
    if (s->reduce_dtype != FSDP_F32) r = sched_convert_to(&src, s->reduce_dtype, -1);
    if (r == FSDP_OK) r = tensor_new(&dst, s->reduce_dtype, 1, &n, s->device, FSDP_TAG_COMM, false);
    if (r == FSDP_OK)
        r = s->local_one ? fsdp_copy(dst, src)
                         : fsdp_reduce_scatter(NULL, s->shard_comm, dst, src, FSDP_REDUCE_AVG, u->name);
    tensor_release(src);
    if (r == FSDP_OK && s->replica_comm && s->replica_size > 1)
        r = fsdp_all_reduce(NULL, s->replica_comm, dst, FSDP_REDUCE_AVG, u->name);
    if (r == FSDP_OK && s->shard_device != s->device) r = sched_convert_to(&dst, -1, s->shard_device);
    if (r == FSDP_OK) r = sched_convert_to(&dst, FSDP_F32, -1);
    if (r == FSDP_OK) r = sched_ensure_grad(s, u);
    if (r == FSDP_OK) unit_grad_written(u);
    if (r == FSDP_OK) KERNELS(u->grad)->axpy_f32((float *)tensor_data(u->grad) + lo, tensor_data(dst), 1.0f, n);
    tensor_release(dst);
    return r;
}

fsdp_status fsdp_sched_add_sliced_unit(fsdp_sched *s, const char *name, int64_t numel, int64_t row, int *index) {
    if (!s || !index) return fsdp_set_error(FSDP_ERR_INVALID, "fsdp_sched_add_sliced_unit: NULL argument");
    if (row < 1 || numel < 1 || numel % row != 0)
        return fsdp_set_error(FSDP_ERR_SHAPE, "fsdp_sched_add_sliced_unit(%s): %lld elements are not whole rows of "
                              "%lld", name ? name : "unit", (long long)numel, (long long)row);
    if (s->shard_device != s->device)
        return fsdp_set_error(FSDP_ERR_UNSUPPORTED, "fsdp_sched_add_sliced_unit(%s): not with shards offloaded to "
                              "the %s", name ? name : "unit", fsdp_device_name(s->shard_device));
    int k;
    FSDP_TRY(sched_add_unit(s, name, 1, &numel, 0, row, &k));
    unit *u = &s->units[k];
    u->slicer = calloc(1, sizeof *u->slicer);
    if (!u->slicer) {
        sched_unit_clear(u);
        s->n_units--;
        return fsdp_set_error(FSDP_ERR_OOM, "fsdp_sched_add_sliced_unit: out of host memory");
    }
    *u->slicer = (fsdp_row_slicer){.gather = slice_gather, .reduce = slice_reduce, .sched = s, .unit = k,
                                   .blocks = s->shard_size, .shard_n = u->shard_n};
    u->full->storage->slicer = u->slicer;
    *index = k;
    return FSDP_OK;
}
