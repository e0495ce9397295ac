/* mpi_testutil.h: what the multi-rank C tests of the comm thread share:
 * checks counted per rank, a sleep, and waiting for the comm thread to go
 * idle. Each test is its own program, so the counters are its own. */
#ifndef FSDP_MPI_TESTUTIL_H
#define FSDP_MPI_TESTUTIL_H

#include "fsdp.h"
#include <stdio.h>
#include <time.h>

static int failures, checks;

static void check(int ok, const char *what, int rank) {
    checks++;
    if (!ok) {
        failures++;
        fprintf(stderr, "FAIL (rank %d): %s (last error: %s)\n", rank, what, fsdp_last_error());
    }
}

static void sleep_ms(int ms) {
    struct timespec ts = {0, ms * 1000000L};
    nanosleep(&ts, NULL);
}

/* waits until this rank's comm thread has nothing left (at most 10 s);
 * returns what is still pending (0 when idle) */
static int64_t settle(void) {
    int64_t works = -1;
    uint64_t id, seq;
    for (int i = 0; i < 1000; i++) {
        fsdp_comm_pending(&works, &id, &seq, NULL);
        if (works == 0) break;
        sleep_ms(10);
    }
    return works;
}

#endif
