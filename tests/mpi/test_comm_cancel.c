/* test_comm_cancel.c: bringing ranks back in step after a collective that
 * only rank 0 issued (what the REPL does after a chunk that failed on some
 * ranks: fsdp_comm_pending, fsdp_comm_cancel). Rank 0 waits in an
 * all-reduce the others never issue; they see it pending, cancel it in its
 * place, and rank 0's collective fails with no data moved. Afterwards an
 * all-reduce on every rank gives the right sum: the sequence numbers agree
 * again. Also what cancel leaves alone: a collective already issued, one
 * further ahead, a communicator this rank does not know. */
#include "fsdp.h"
#include <mpi.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "mpi_testutil.h"

/* every element of t equals v */
static int all_equal(fsdp_tensor *t, int64_t n, float v) {
    float *p = NULL;
    fsdp_tensor_data_ptr(t, (void **)&p);
    for (int64_t i = 0; i < n; i++)
        if (p[i] != v) return 0;
    return 1;
}

int main(void) {
    int rank = 0, world = 1;
    if (fsdp_runtime_init(&rank, &world) != FSDP_OK || world < 2) {
        fprintf(stderr, "test_comm_cancel needs 2 or more ranks under mpirun (%s)\n", fsdp_last_error());
        return 1;
    }
    MPI_Comm side;   /* for the test's own messages, apart from the engine's */
    MPI_Comm_dup(MPI_COMM_WORLD, &side);
    fsdp_comm *c = NULL;
    check(fsdp_comm_world(&c) == FSDP_OK, "world", rank);
    int64_t n = 5;
    fsdp_tensor *t = NULL;
    check(fsdp_tensor_zeros(&t, FSDP_F32, 1, &n, FSDP_DEVICE_CPU, FSDP_TAG_OTHER) == FSDP_OK, "tensor", rank);
    float sum = (float)(world * (world + 1) / 2);
    fsdp_fill(t, rank + 1);
    check(fsdp_all_reduce(NULL, c, t, FSDP_REDUCE_SUM, "warmup") == FSDP_OK && all_equal(t, n, sum), "warmup sum",
          rank);
    check(settle() == 0, "idle after the warmup", rank);

    int64_t works = -1;
    uint64_t got[2] = {0, 0};   /* rank 0's pending collective: communicator id, sequence number */
    int moving = -1;
    fsdp_work *w = NULL;
    if (rank == 0) {
        fsdp_fill(t, 7);
        check(fsdp_all_reduce(&w, c, t, FSDP_REDUCE_SUM, "only.rank0") == FSDP_OK, "issue on rank 0 only", rank);
        for (int i = 0; i < 100 && works < 1; i++) {
            fsdp_comm_pending(&works, &got[0], &got[1], &moving);
            if (works < 1) sleep_ms(10);
        }
        check(works == 1 && got[1] == 1 && moving == 0, "rank 0 sees its all-reduce #1 pending, waiting", rank);
        int joined = -1;
        check(fsdp_comm_cancel(got[0], got[1], &joined) == FSDP_OK && joined == 0,
              "rank 0 does not cancel what it issued", rank);
    }
    MPI_Bcast(got, 2, MPI_UINT64_T, 0, side);
    if (rank != 0) {
        uint64_t id, seq;
        check(fsdp_comm_pending(&works, &id, &seq, NULL) == FSDP_OK && works == 0, "the others are idle", rank);
        int joined = -1;
        check(fsdp_comm_cancel(got[0], got[1] + 1, &joined) == FSDP_OK && joined == 0,
              "a collective further ahead is left alone", rank);
        check(fsdp_comm_cancel(got[0] ^ 1, got[1], &joined) == FSDP_OK && joined == 0,
              "an unknown communicator is left alone", rank);
        check(fsdp_comm_cancel(got[0], got[1], &joined) == FSDP_OK && joined == 1, "the others cancel #1", rank);
        check(fsdp_comm_cancel(got[0], got[1], &joined) == FSDP_OK && joined == 0, "and only once", rank);
    }
    if (rank == 0) {
        fsdp_status st = fsdp_work_wait(w);
        const char *e = fsdp_last_error();
        check(st == FSDP_ERR_COMM && strstr(e, "no data moved") && strstr(e, "cancel"),
              "rank 0's all-reduce fails, no data moved", rank);
        check(all_equal(t, n, 7), "rank 0's tensor is untouched", rank);
        fsdp_work_free(w);
    }
    check(settle() == 0, "every comm thread idle again", rank);
    MPI_Barrier(side);
    fsdp_fill(t, rank + 1);
    check(fsdp_all_reduce(NULL, c, t, FSDP_REDUCE_SUM, "after") == FSDP_OK && all_equal(t, n, sum),
          "in step again: the next all-reduce sums", rank);

    uint64_t id, seq;
    check(fsdp_comm_pending(NULL, &id, &seq, NULL) == FSDP_ERR_INVALID, "pending: NULL works refused", rank);
    int joined = -1;
    check(fsdp_comm_cancel(got[0], UINT64_MAX, &joined) == FSDP_OK && joined == 0, "cancel: no sequence, nothing",
          rank);

    fsdp_tensor_release(t);
    fsdp_comm_free(c);
    MPI_Comm_free(&side);
    fsdp_runtime_finalize();
    if (rank == 0) printf("test_comm_cancel: %d checks, %d failed\n", checks, failures);
    return failures ? 1 : 0;
}
