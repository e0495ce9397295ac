/* sched_compress.c: compressed gradient reduction in the schedule: the
 * settings, each unit's error-feedback residual (training state that
 * checkpoints save), and the reduce-scatter of a unit's flat gradient
 * through fsdp_reduce_scatter_compressed. A shard group of one reduces
 * nothing (decision 10): no residual, no copy. */
#include "sched_internal.h"
#include <stdio.h>
#include <string.h>

fsdp_status fsdp_sched_set_compress(fsdp_sched *s, fsdp_compress mode, int64_t block, double density,
                                    int error_feedback) {
    static const char *name = "fsdp_sched_set_compress";
    if (!s) return fsdp_set_error(FSDP_ERR_INVALID, "%s: schedule is NULL", name);
    if (mode != FSDP_COMPRESS_NONE && mode != FSDP_COMPRESS_INT8 && mode != FSDP_COMPRESS_TOPK)
        return fsdp_set_error(FSDP_ERR_INVALID, "%s: mode %d, expected none (0), int8 (1) or topk (2)", name,
                              (int)mode);
    if (block < 1 || (block & (block - 1)))
        return fsdp_set_error(FSDP_ERR_INVALID, "%s: block %lld, expected a power of two >= 1", name,
                              (long long)block);
    if (!(density > 0 && density <= 1))
        return fsdp_set_error(FSDP_ERR_INVALID, "%s: density %g, expected in (0, 1]", name, density);
    if (s->n_units > 0)
        return fsdp_set_error(FSDP_ERR_INVALID, "%s: the schedule has %d units already; choose before adding units",
                              name, s->n_units);
    if (mode != FSDP_COMPRESS_NONE && s->direct)
        return fsdp_set_error(FSDP_ERR_UNSUPPORTED, "%s: direct mode (no_shard, a world of one) all-reduces the "
                              "gradient shards in place; compression takes a reduce-scatter", name);
    if (mode != FSDP_COMPRESS_NONE && (!device_is_host_like(s->device) || s->shard_device != s->device))
        return fsdp_set_error(FSDP_ERR_UNSUPPORTED, "%s: compressed reductions run on the host; here gradients are "
                              "on %s and shards on %s", name, fsdp_device_name(s->device),
                              fsdp_device_name(s->shard_device));
    s->compress = mode;
    s->compress_block = block;
    s->compress_density = density;
    s->error_feedback = error_feedback != 0;
    return FSDP_OK;
}

bool sched_compresses(const fsdp_sched *s, const unit *u) {
    return s->compress != FSDP_COMPRESS_NONE && !s->local_one && !u->slicer;
}

static fsdp_status ensure_residual(fsdp_sched *s, unit *u) {
    if (u->residual) return FSDP_OK;
    return tensor_new(&u->residual, FSDP_F32, 1, &u->padded, s->device, FSDP_TAG_GRAD, true);
}

fsdp_status sched_reduce_compressed(fsdp_sched *s, unit *u, fsdp_tensor *src, fsdp_tensor **dst, fsdp_work **w) {
    *dst = NULL;
    if (s->error_feedback) FSDP_TRY(ensure_residual(s, u));
    FSDP_TRY(tensor_new(dst, FSDP_F32, 1, &u->shard_n, s->device, FSDP_TAG_COMM, false));
    fsdp_status r = fsdp_reduce_scatter_compressed(w, s->shard_comm, *dst, src, s->error_feedback ? u->residual : NULL,
                                                   s->compress, s->compress_block, s->compress_density,
                                                   FSDP_REDUCE_AVG, u->name);
    if (r != FSDP_OK) {
        tensor_release(*dst);
        *dst = NULL;
    }
    return r;
}

fsdp_status fsdp_unit_residual(fsdp_sched *s, int k, fsdp_tensor **residual) {
    FSDP_TRY(sched_check_unit("fsdp_unit_residual", s, k));
    if (!residual) return fsdp_set_error(FSDP_ERR_INVALID, "fsdp_unit_residual: residual is NULL");
    unit *u = &s->units[k];
    if (u->residual) tensor_retain(u->residual);
    *residual = u->residual;
    return FSDP_OK;
}

fsdp_status fsdp_unit_set_residual(fsdp_sched *s, int k, fsdp_tensor *values) {
    FSDP_TRY(sched_check_unit("fsdp_unit_set_residual", s, k));
    unit *u = &s->units[k];
    if (values && tensor_numel(values) != u->padded) {
        char d[200];
        return fsdp_set_error(FSDP_ERR_SHAPE, "fsdp_unit_set_residual: unit %s: values %s, expected %lld elements "
                              "(the padded unit)", u->name, tensor_desc(values, d, sizeof d), (long long)u->padded);
    }
    FSDP_TRY(ensure_residual(s, u));
    return values ? fsdp_copy(u->residual, values) : fsdp_fill(u->residual, 0.0);
}
