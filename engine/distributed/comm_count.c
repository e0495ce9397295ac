/* comm_count.c: the "count" backend: a communicator of world N in which
 * this process plays rank r, alone. Nothing moves and nobody waits; the
 * generic layer counts every collective's bytes per kind as it does for
 * every communicator (fsdp_comm_counts), so the real fsdp.shard and real
 * training steps run unchanged and say what they would send (DESIGN.md,
 * decision 11: the planner runs the real schedule).
 *
 * Results are those of a world whose ranks all hold what this rank holds:
 *   all-gather      every block is a copy of this rank's src;
 *   reduce-scatter  N times this rank's block of src (a sum of N equal
 *                   parts; the average is the block itself);
 *   all-reduce      sum: N times the value; max: the value;
 *   broadcast       unchanged (root held the same);
 *   all-to-all      every block is this rank's own block of src (what each
 *                   equal rank sends it).
 * So results are well-defined (no uninitialized memory, finite where the
 * input is), and a step on N counting ranks computes what one rank would.
 * Tensors on devices without host-readable memory (a device that only
 * counts) are not touched at all.
 *
 * Splits: one process cannot see the colors other ranks pass, so a
 * counting communicator splits only through fsdp_comm_split_all (every
 * rank's color and key given) or as a copy of itself. */
#include "comm_impl.h"
#include <stdlib.h>
#include <string.h>

static fsdp_status count_all_gather(fsdp_comm *c, void *dst, const void *src, int64_t block_bytes, size_t elem) {
    (void)elem;
    char *d = dst;
    char *mine = d + (int64_t)c->rank * block_bytes;   /* src never overlaps dst here (comm_backend.h) */
    if (src) memcpy(mine, src, (size_t)block_bytes);
    for (int r = 0; r < c->size; r++)
        if (r != c->rank) memcpy(d + (int64_t)r * block_bytes, mine, (size_t)block_bytes);
    return FSDP_OK;
}

static fsdp_status count_reduce_scatter_f32(fsdp_comm *c, float *dst, const float *src, int64_t block, int divide,
                                            bool accumulate) {
    const float *mine = src + (int64_t)c->rank * block;   // (block,)
    for (int64_t i = 0; i < block; i++) {
        float v = mine[i] * (float)c->size / (float)divide;
        dst[i] = accumulate ? dst[i] + v : v;
    }
    return FSDP_OK;
}

static fsdp_status count_all_to_all(fsdp_comm *c, void *dst, const void *src, int64_t block_bytes) {
    const char *mine = (const char *)src + (int64_t)c->rank * block_bytes;
    for (int r = 0; r < c->size; r++) memcpy((char *)dst + (int64_t)r * block_bytes, mine, (size_t)block_bytes);
    return FSDP_OK;
}

static fsdp_status count_all_reduce(fsdp_comm *c, void *buf, int64_t n, comm_reduce_type rt, int op) {
    if (op == FSDP_REDUCE_MAX || c->size == 1) return FSDP_OK;
    switch (rt) {
    case COMM_RT_F32:
        for (int64_t i = 0; i < n; i++) ((float *)buf)[i] *= (float)c->size;
        break;
    case COMM_RT_F64:
        for (int64_t i = 0; i < n; i++) ((double *)buf)[i] *= (double)c->size;
        break;
    case COMM_RT_I32:   /* wraps as a sum over ranks would: unsigned arithmetic */
        for (int64_t i = 0; i < n; i++) ((int32_t *)buf)[i] = (int32_t)((uint32_t)((int32_t *)buf)[i] * (uint32_t)c->size);
        break;
    case COMM_RT_I64:
        for (int64_t i = 0; i < n; i++) ((int64_t *)buf)[i] = (int64_t)((uint64_t)((int64_t *)buf)[i] * (uint64_t)c->size);
        break;
    }
    return FSDP_OK;
}

static fsdp_status count_broadcast(fsdp_comm *c, void *buf, int64_t bytes, int root) {
    (void)c, (void)buf, (void)bytes, (void)root;
    return FSDP_OK;
}

static fsdp_status count_barrier(fsdp_comm *c) {
    (void)c;
    return FSDP_OK;
}

/* The generic layer fills child->rank and child->size when it knows them
 * (fsdp_comm_split_all, copies); otherwise they are -1. */
static fsdp_status count_split(fsdp_comm *parent, int color, int key, fsdp_comm *child) {
    (void)key;
    if (color < 0)
        return fsdp_set_error(FSDP_ERR_INVALID, "fsdp_comm_split on comm %s(%d): color %d, expected >= 0",
                              parent->name, parent->size, color);
    if (child->size < 1)
        return fsdp_set_error(FSDP_ERR_UNSUPPORTED, "fsdp_comm_split on counting comm %s(%d): this process plays "
                              "rank %d alone and cannot see the colors of the other ranks; use "
                              "fsdp_comm_split_all with every rank's color and key",
                              parent->name, parent->size, parent->rank);
    child->mpi = MPI_COMM_NULL;
    return FSDP_OK;
}

static fsdp_status count_destroy(fsdp_comm *c) {
    free(c->members);   /* (fsdp_comm_split_all's, for the planner) */
    c->members = NULL;
    return FSDP_OK;
}

const comm_backend comm_count_backend = {
    .name = "count",
    .all_gather = count_all_gather,
    .reduce_scatter_f32 = count_reduce_scatter_f32,
    .all_to_all = count_all_to_all,
    .all_reduce = count_all_reduce,
    .broadcast = count_broadcast,
    .barrier = count_barrier,
    .split = count_split,
    .destroy = count_destroy,
    .local = true,
};
