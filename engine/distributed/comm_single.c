/* comm_single.c: the "single" backend: a world of one rank without MPI
 * (`fsdp-lua recipe.lua`). Gathers and reductions of one rank are copies or
 * nothing; the generic layer runs the same checks as for MPI, so a program
 * that works here calls collectives correctly. */
#include "comm_impl.h"
#include <string.h>

static fsdp_status single_all_gather(fsdp_comm *c, void *dst, const void *src, int64_t block_bytes, size_t elem) {
    (void)c, (void)elem;
    if (src) memmove(dst, src, (size_t)block_bytes);
    return FSDP_OK;
}

static fsdp_status single_reduce_scatter_f32(fsdp_comm *c, float *dst, const float *src, int64_t block, int divide,
                                             bool accumulate) {
    (void)c;
    if (accumulate) {
        for (int64_t i = 0; i < block; i++) dst[i] += src[i] / (float)divide;
    } else {
        memmove(dst, src, (size_t)block * sizeof(float));
        if (divide != 1)
            for (int64_t i = 0; i < block; i++) dst[i] /= (float)divide;
    }
    return FSDP_OK;
}

static fsdp_status single_all_to_all(fsdp_comm *c, void *dst, const void *src, int64_t block_bytes) {
    (void)c;
    memmove(dst, src, (size_t)block_bytes);
    return FSDP_OK;
}

static fsdp_status single_all_reduce(fsdp_comm *c, void *buf, int64_t n, comm_reduce_type rt, int op) {
    (void)c, (void)buf, (void)n, (void)rt, (void)op;
    return FSDP_OK;
}

static fsdp_status single_broadcast(fsdp_comm *c, void *buf, int64_t bytes, int root) {
    (void)c, (void)buf, (void)bytes, (void)root;
    return FSDP_OK;
}

static fsdp_status single_barrier(fsdp_comm *c) {
    (void)c;
    return FSDP_OK;
}

static fsdp_status single_split(fsdp_comm *parent, int color, int key, fsdp_comm *child) {
    (void)key;
    if (color < 0)   /* alone: nobody waits for this rank */
        return fsdp_set_error(FSDP_ERR_INVALID, "fsdp_comm_split on comm %s(%d): color %d, expected >= 0",
                              parent->name, parent->size, color);
    child->mpi = MPI_COMM_NULL;
    child->rank = 0;
    child->size = 1;
    return FSDP_OK;
}

static fsdp_status single_destroy(fsdp_comm *c) {
    (void)c;
    return FSDP_OK;
}

const comm_backend comm_single_backend = {
    .name = "single",
    .all_gather = single_all_gather,
    .reduce_scatter_f32 = single_reduce_scatter_f32,
    .all_to_all = single_all_to_all,
    .all_reduce = single_all_reduce,
    .broadcast = single_broadcast,
    .barrier = single_barrier,
    .split = single_split,
    .destroy = single_destroy,
    .local = true,
};
