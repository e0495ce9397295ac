/* test_comm_desync.c: ranks that disagree about their collectives, with the
 * agreement check in its default (always-on) form and a short watchdog.
 * One case per run (--case=NAME); rank 1 is the odd one out:
 *   size      all-reduces 2048 floats where the others all-reduce 1024
 *   dtype     i32 where the others use f32 (same bytes)
 *   op        max where the others sum
 *   kind      broadcasts where the others all-reduce (same bytes)
 *   root      broadcasts from root 1 where the others use root 0
 *   extra     issues one extra collective (a barrier) first
 *   skip      skips one collective and goes on to the next (a barrier)
 *   early     returns from the program (finalize) while the others go on
 *   exit      calls exit(0) in the middle of the run
 *   stop      stops itself (SIGSTOP) before a collective
 * Mismatches must fail on every rank with a message naming both sides, and
 * leave the ranks in step: each rank prints what it caught, then the ranks
 * count how many caught (an all-reduce that must succeed), rank 0 prints
 * "raised on N of N ranks", and every rank exits 3. A rank that left must
 * be named by the others ("rank 1 has left the job"); a stopped one by the
 * watchdog. No case may pass silently: exit 0 is a failure (expect_abort.sh). */
#include "fsdp.h"
#include <signal.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

static int g_rank;

static fsdp_tensor *floats(int64_t n, int dtype) {
    fsdp_tensor *t = NULL;
    if (fsdp_tensor_zeros(&t, dtype, 1, &n, FSDP_DEVICE_CPU, FSDP_TAG_OTHER) != FSDP_OK) {
        fprintf(stderr, "rank %d: zeros: %s\n", g_rank, fsdp_last_error());
        exit(2);
    }
    return t;
}

/* The collective the case is about: everyone's, and rank 1's variant. */
static fsdp_status odd_collective(const char *c, fsdp_comm *w, bool odd) {
    if (!strcmp(c, "size")) return fsdp_all_reduce(NULL, w, floats(odd ? 2048 : 1024, FSDP_F32), FSDP_REDUCE_SUM, "grad");
    if (!strcmp(c, "dtype")) return fsdp_all_reduce(NULL, w, floats(1024, odd ? FSDP_I32 : FSDP_F32), FSDP_REDUCE_SUM, "grad");
    if (!strcmp(c, "op")) return fsdp_all_reduce(NULL, w, floats(1024, FSDP_F32), odd ? FSDP_REDUCE_MAX : FSDP_REDUCE_SUM, "grad");
    if (!strcmp(c, "kind"))
        return odd ? fsdp_broadcast(NULL, w, floats(1024, FSDP_F32), 0, "grad")
                   : fsdp_all_reduce(NULL, w, floats(1024, FSDP_F32), FSDP_REDUCE_SUM, "grad");
    if (!strcmp(c, "root")) return fsdp_broadcast(NULL, w, floats(1024, FSDP_F32), odd ? 1 : 0, "grad");
    if (!strcmp(c, "extra")) {
        if (odd) {
            fsdp_status st = fsdp_barrier(w);   /* the extra one: meets the others' all-reduce */
            if (st != FSDP_OK) return st;
        }
        return fsdp_all_reduce(NULL, w, floats(1024, FSDP_F32), FSDP_REDUCE_SUM, "grad");
    }
    if (!strcmp(c, "skip")) {
        if (!odd) {
            fsdp_status st = fsdp_all_reduce(NULL, w, floats(1024, FSDP_F32), FSDP_REDUCE_SUM, "grad");
            if (st != FSDP_OK) return st;
        }
        return fsdp_barrier(w);
    }
    return fsdp_all_reduce(NULL, w, floats(1024, FSDP_F32), FSDP_REDUCE_SUM, "grad");
}

int main(int argc, char **argv) {
    const char *c = argc > 1 && !strncmp(argv[1], "--case=", 7) ? argv[1] + 7 : "";
    int world = 1;
    if (fsdp_runtime_init(&g_rank, &world) != FSDP_OK || world < 2) {
        fprintf(stderr, "test_comm_desync needs 2 or more ranks under mpirun: %s\n", fsdp_last_error());
        return 2;
    }
    fsdp_comm *w = NULL;
    if (fsdp_comm_world(&w) != FSDP_OK) {
        fprintf(stderr, "%s\n", fsdp_last_error());
        return 2;
    }
    bool odd = g_rank == 1;
    if (fsdp_all_reduce(NULL, w, floats(16, FSDP_F32), FSDP_REDUCE_SUM, "warmup") != FSDP_OK) {   /* #0 */
        fprintf(stderr, "rank %d: warmup: %s\n", g_rank, fsdp_last_error());
        return 2;
    }
    if (odd && !strcmp(c, "early")) {
        fprintf(stderr, "rank 1 returns early\n");
        fsdp_runtime_finalize();
        return 0;
    }
    if (odd && !strcmp(c, "exit")) {
        fprintf(stderr, "rank 1 calls exit(0)\n");
        exit(0);
    }
    if (odd && !strcmp(c, "stop")) {
        fprintf(stderr, "rank 1 stops itself\n");
        raise(SIGSTOP);
    }
    fsdp_status st = odd_collective(c, w, odd);
    if (st == FSDP_OK) {
        fprintf(stderr, "rank %d: case %s: the collective succeeded\n", g_rank, c);
        fsdp_runtime_finalize();
        return 0;
    }
    fprintf(stderr, "rank %d: case %s: caught: %s\n", g_rank, c, fsdp_last_error());
    if (!strcmp(c, "early") || !strcmp(c, "exit")) {   /* the odd rank is gone: nobody to count with */
        fsdp_runtime_finalize();
        return 3;
    }
    /* still in step: count the ranks that caught */
    double count = 1;
    st = fsdp_all_reduce_doubles(w, &count, 1, FSDP_REDUCE_SUM);
    if (st != FSDP_OK) {
        fprintf(stderr, "rank %d: counting failed: %s\n", g_rank, fsdp_last_error());
        return 4;
    }
    if (g_rank == 0) fprintf(stderr, "case %s: the error was raised on %.0f of %d ranks\n", c, count, world);
    fsdp_comm_free(w);
    fsdp_runtime_finalize();
    return 3;
}
