/* test_sched_abandon.c: a unit's gather whose wait was given up (the REPL's
 * fsdp_comm_abandon, when a peer failed a chunk) keeps its full buffer
 * alive: the collective is still running on the comm thread and will write
 * into it. Rank 0 gathers alone with waits abandoned; the others join the
 * gather only afterwards. Meanwhile rank 0 allocates a buffer of the same
 * size (the caching allocator hands back a freed block first): it must be
 * untouched by the gather, and once the gather is done the unit holds the
 * right values. Then both ranks gather again, in step. */
#include "fsdp.h"
#include <mpi.h>
#include <stdio.h>
#include <string.h>
#include <time.h>

#include "mpi_testutil.h"

static float *data_of(fsdp_tensor *t) {
    void *p = NULL;
    fsdp_tensor_data_ptr(t, &p);
    return p;
}

/* the gathered unit: element i is i + 0.5 (each rank filled its shard so) */
static int full_is_right(fsdp_sched *s, int64_t n) {
    fsdp_tensor *p = NULL;
    if (fsdp_unit_param(s, 0, 0, 1, &n, &p) != FSDP_OK) return 0;
    const float *d = data_of(p);
    int ok = d != NULL;
    for (int64_t i = 0; ok && i < n; i++) ok = d[i] == (float)i + 0.5f;
    fsdp_tensor_release(p);
    return ok;
}

int main(void) {
    int rank = 0, world = 1;
    if (fsdp_runtime_init(&rank, &world) != FSDP_OK || world < 2) {
        fprintf(stderr, "test_sched_abandon needs 2 or more ranks under mpirun (%s)\n", fsdp_last_error());
        return 1;
    }
    MPI_Comm side;
    MPI_Comm_dup(MPI_COMM_WORLD, &side);
    fsdp_comm *c = NULL;
    fsdp_sched *s = NULL;
    int64_t n = 1001;   /* odd: padded, the last shard partly padding */
    int k = -1;
    check(fsdp_comm_world(&c) == FSDP_OK, "world", rank);
    check(fsdp_sched_new(&s, c, NULL, FSDP_F32, FSDP_F32, FSDP_PREFETCH_NONE, 0, 1) == FSDP_OK, "schedule", rank);
    check(fsdp_sched_add_unit(s, "u0", 1, &n, 0, &k) == FSDP_OK && k == 0, "unit", rank);
    int64_t padded = 0, shard_n = 0, off = 0;
    fsdp_unit_info(s, 0, NULL, &padded, &shard_n, &off);
    fsdp_tensor *master = NULL, *grad = NULL;
    check(fsdp_unit_shard(s, 0, &master, &grad) == FSDP_OK, "shard", rank);
    float *m = data_of(master);
    for (int64_t i = 0; i < shard_n; i++) m[i] = (float)(off + i) + 0.5f;
    check(fsdp_unit_unshard(s, 0) == FSDP_OK && full_is_right(s, n), "a gather on every rank", rank);
    check(fsdp_unit_reshard(s, 0) == FSDP_OK, "reshard", rank);
    check(settle() == 0, "idle", rank);
    MPI_Barrier(side);

    int gathered = -1, peak = -1, token = 0;
    fsdp_tensor *other = NULL;
    if (rank == 0) {
        check(fsdp_comm_abandon("a peer failed its chunk (test)", NULL) == FSDP_OK, "abandon on", rank);
        fsdp_status st = fsdp_unit_unshard(s, 0);
        check(st == FSDP_ERR_COMM && strstr(fsdp_last_error(), "abandoned"), "rank 0's wait is given up", rank);
        fsdp_sched_stats(s, &gathered, &peak, 0);
        check(gathered == 1, "the unit stays gathered while its collective runs", rank);
        /* a block of the full buffer's size class: a freed full buffer would come back here */
        check(fsdp_tensor_zeros(&other, FSDP_F32, 1, &padded, FSDP_DEVICE_CPU, FSDP_TAG_PARAM) == FSDP_OK, "other",
              rank);
        fsdp_fill(other, -7.0f);
        for (int r = 1; r < world; r++) MPI_Send(&token, 1, MPI_INT, r, 1, side);
        for (int r = 1; r < world; r++) MPI_Recv(&token, 1, MPI_INT, r, 2, side, MPI_STATUS_IGNORE);
        check(settle() == 0, "rank 0's gather done", rank);
        const float *o = data_of(other);
        int untouched = 1;
        for (int64_t i = 0; i < padded; i++) untouched &= o[i] == -7.0f;
        check(untouched, "the late gather wrote nothing into another buffer", rank);
        check(fsdp_comm_abandon(NULL, NULL) == FSDP_OK, "abandon off", rank);
        check(fsdp_unit_wait(s, 0) == FSDP_OK && full_is_right(s, n), "the unit then holds the gathered values",
              rank);
        fsdp_tensor_release(other);
    } else {
        MPI_Recv(&token, 1, MPI_INT, 0, 1, side, MPI_STATUS_IGNORE);
        check(fsdp_unit_unshard(s, 0) == FSDP_OK && full_is_right(s, n), "the others' late gather", rank);
        MPI_Send(&token, 1, MPI_INT, 0, 2, side);
    }
    check(fsdp_unit_reshard(s, 0) == FSDP_OK, "reshard after", rank);
    fsdp_sched_stats(s, &gathered, &peak, 0);
    check(gathered == 0, "nothing gathered after the reshard", rank);
    MPI_Barrier(side);
    check(fsdp_unit_unshard(s, 0) == FSDP_OK && full_is_right(s, n), "in step again", rank);
    check(fsdp_unit_reshard(s, 0) == FSDP_OK, "reshard at the end", rank);

    fsdp_tensor_release(master);
    if (grad) fsdp_tensor_release(grad);
    fsdp_sched_free(s);
    fsdp_comm_free(c);
    MPI_Comm_free(&side);
    fsdp_runtime_finalize();
    if (rank == 0) printf("test_sched_abandon: %d checks, %d failed\n", checks, failures);
    return failures ? 1 : 0;
}
