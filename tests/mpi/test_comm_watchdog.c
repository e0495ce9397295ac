/* test_comm_watchdog.c: rank 1 skips a collective the others wait on. With
 * FSDP_WATCHDOG_SECONDS=2 the waiting ranks report which collective they
 * wait on and end the job, which must exit non-zero within seconds instead
 * of hanging (the ctest entry checks the exit, the time and the message). */
#include "fsdp.h"
#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>

int main(void) {
    setenv("FSDP_WATCHDOG_SECONDS", "2", 0);
    int rank = 0, world = 1;
    if (fsdp_runtime_init(&rank, &world) != FSDP_OK) {
        fprintf(stderr, "runtime init: %s\n", fsdp_last_error());
        return 1;
    }
    if (world < 2) {
        fprintf(stderr, "test_comm_watchdog needs 2 or more ranks\n");
        return 1;
    }
    fsdp_comm *c = NULL;
    if (fsdp_comm_world(&c) != FSDP_OK) {
        fprintf(stderr, "%s\n", fsdp_last_error());
        return 1;
    }
    int64_t n = 1024;
    fsdp_tensor *t = NULL;
    fsdp_tensor_zeros(&t, FSDP_F32, 1, &n, FSDP_DEVICE_CPU, FSDP_TAG_OTHER);
    fsdp_all_reduce(NULL, c, t, FSDP_REDUCE_SUM, "warmup");   /* #0, everyone */
    if (rank == 1) {
        sleep(60);   /* skips #1; the job must end long before this returns */
        fprintf(stderr, "rank 1 woke up: the watchdog did not end the job\n");
        return 0;
    }
    fsdp_status st = fsdp_all_reduce(NULL, c, t, FSDP_REDUCE_SUM, "grad.sync");
    fprintf(stderr, "rank %d: collective returned %d (%s) instead of the watchdog ending the job\n", rank, (int)st,
            fsdp_last_error());
    return 0;
}
