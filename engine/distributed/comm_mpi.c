/* comm_mpi.c: the "mpi" backend: collectives on CPU buffers through MPI,
 * for communicators of any size whenever MPI is initialized (the world
 * under mpirun and every communicator split from it). The interface and
 * its rules are in comm_backend.h. */
#include "comm_impl.h"
#include <limits.h>
#include <stdio.h>

static const char *mpi_error_string(long code) {
    static _Thread_local char buf[MPI_MAX_ERROR_STRING + 32];
    int len = 0;
    if (MPI_Error_string((int)code, buf, &len) != MPI_SUCCESS) snprintf(buf, sizeof buf, "MPI error %ld", code);
    return buf;
}

/* The one check for MPI calls: file:line, the call and MPI's message. */
#define MPI_CHECK(call) FSDP_CHECK_CALL(call, rc_ == MPI_SUCCESS, mpi_error_string)

static MPI_Datatype mpi_unit(size_t elem) {   /* moves bytes, elem at a time */
    return elem == 8 ? MPI_UINT64_T : elem == 4 ? MPI_UINT32_T : elem == 2 ? MPI_UINT16_T : MPI_BYTE;
}

static fsdp_status mpi_all_gather(fsdp_comm *c, void *dst, const void *src, int64_t block_bytes, size_t elem) {
    /* MPI counts are ints: beyond 2 GiB per rank, count elements instead of
     * bytes (the caller bounds elements per rank to INT_MAX). */
    MPI_Datatype t = block_bytes <= INT_MAX ? MPI_BYTE : mpi_unit(elem);
    int count = (int)(block_bytes <= INT_MAX ? block_bytes : block_bytes / (int64_t)elem);
    if (src)
        MPI_CHECK(MPI_Allgather(src, count, t, dst, count, t, c->mpi));
    else
        MPI_CHECK(MPI_Allgather(MPI_IN_PLACE, 0, MPI_DATATYPE_NULL, dst, count, t, c->mpi));
    return FSDP_OK;
}

static fsdp_status mpi_reduce_scatter_f32(fsdp_comm *c, float *dst, const float *src, int64_t block) {
    MPI_CHECK(MPI_Reduce_scatter_block(src, dst, (int)block, MPI_FLOAT, MPI_SUM, c->mpi));
    return FSDP_OK;
}

static fsdp_status mpi_all_reduce(fsdp_comm *c, void *buf, int64_t n, comm_reduce_type rt, int op) {
    MPI_Datatype t = rt == COMM_RT_F32 ? MPI_FLOAT : rt == COMM_RT_F64 ? MPI_DOUBLE
                   : rt == COMM_RT_I32 ? MPI_INT32_T : MPI_INT64_T;
    size_t esz = rt == COMM_RT_F32 || rt == COMM_RT_I32 ? 4 : 8;
    MPI_Op mop = op == FSDP_REDUCE_MAX ? MPI_MAX : MPI_SUM;
    const int64_t chunk = (int64_t)1 << 30;   /* int counts; every rank cuts the same chunks */
    for (int64_t at = 0; at < n; at += chunk) {
        int64_t len = n - at < chunk ? n - at : chunk;
        MPI_CHECK(MPI_Allreduce(MPI_IN_PLACE, (char *)buf + at * (int64_t)esz, (int)len, t, mop, c->mpi));
    }
    return FSDP_OK;
}

static fsdp_status mpi_broadcast(fsdp_comm *c, void *buf, int64_t bytes, int root) {
    const int64_t chunk = (int64_t)1 << 30;
    for (int64_t at = 0; at < bytes; at += chunk) {
        int64_t len = bytes - at < chunk ? bytes - at : chunk;
        MPI_CHECK(MPI_Bcast((char *)buf + at, (int)len, MPI_BYTE, root, c->mpi));
    }
    return FSDP_OK;
}

static fsdp_status mpi_barrier(fsdp_comm *c) {
    MPI_CHECK(MPI_Barrier(c->mpi));
    return FSDP_OK;
}

static fsdp_status mpi_split(fsdp_comm *parent, int color, int key, fsdp_comm *child) {
    MPI_Comm nc = MPI_COMM_NULL;
    MPI_CHECK(MPI_Comm_split(parent->mpi, color < 0 ? MPI_UNDEFINED : color, key, &nc));
    if (nc == MPI_COMM_NULL)
        return fsdp_set_error(FSDP_ERR_INVALID, "fsdp_comm_split on comm %s(%d): color %d, expected >= 0",
                              parent->name, parent->size, color);
    child->mpi = nc;
    /* Errors come back as codes here too, as runtime.c sets on the world. */
    MPI_CHECK(MPI_Comm_set_errhandler(nc, MPI_ERRORS_RETURN));
    MPI_CHECK(MPI_Comm_rank(nc, &child->rank));
    MPI_CHECK(MPI_Comm_size(nc, &child->size));
    return FSDP_OK;
}

static fsdp_status mpi_destroy(fsdp_comm *c) {
    if (c->mpi != MPI_COMM_NULL && c->mpi != MPI_COMM_WORLD) MPI_CHECK(MPI_Comm_free(&c->mpi));
    return FSDP_OK;
}

static fsdp_status mpi_usable(fsdp_comm *c, const char *opname) {
    int fin = 0;
    MPI_Finalized(&fin);
    if (fin)
        return fsdp_set_error(FSDP_ERR_STATE, "%s on comm %s(%d): MPI is finalized already", opname, c->name, c->size);
    return FSDP_OK;
}

const comm_backend comm_mpi_backend = {
    .name = "mpi",
    .all_gather = mpi_all_gather,
    .reduce_scatter_f32 = mpi_reduce_scatter_f32,
    .all_reduce = mpi_all_reduce,
    .broadcast = mpi_broadcast,
    .barrier = mpi_barrier,
    .split = mpi_split,
    .destroy = mpi_destroy,
    .usable = mpi_usable,
    .carries_device = true,
};
