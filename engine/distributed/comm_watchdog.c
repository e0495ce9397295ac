/* comm_watchdog.c: what happens when a rank waits too long on a collective
 * (DESIGN.md, decision 8: a job never hangs on a failure). A wait longer
 * than FSDP_WATCHDOG_SECONDS names the collective, and the one the comm
 * thread is stuck in when that is another, then ends the job. */
#include "comm_impl.h"
#include <stdio.h>

void comm_watchdog_fire(fsdp_work *w, double waited) {
    fprintf(stderr,
            "fsdp watchdog: rank %d waited %.0f s on collective #%llu %s '%s' (%llu bytes) on comm %s(%d); "
            "aborting the job\n",
            fsdp_current_rank(), waited, (unsigned long long)w->fp.seq, comm_kind_names[w->kind], w->fp.label,
            (unsigned long long)w->fp.bytes, w->comm_name, w->comm_size);
    /* The waited collective may sit behind another one that is stuck. */
    bool busy = false;
    fingerprint cur;
    char comm[COMM_NAME];
    int size = 0;
    comm_queue_current(&busy, &cur, comm, sizeof comm, &size);
    if (busy && (cur.seq != w->fp.seq || cur.comm_id != w->fp.comm_id)) {
        char what[160];
        comm_fp_describe(&cur, true, what, sizeof what);
        fprintf(stderr, "fsdp watchdog: rank %d's comm thread is still in collective %s on comm %s(%d)\n",
                fsdp_current_rank(), what, comm, size);
    }
    fsdp_runtime_abort(NULL, 1);   /* MPI_Abort under mpirun, else exit */
}

void comm_gpu_fatal(fsdp_work *w, const char *what, double waited) {
    char desc[160];
    comm_fp_describe(&w->fp, true, desc, sizeof desc);
    if (waited > 0)
        fprintf(stderr, "fsdp watchdog: rank %d: collective %s on comm %s(%d) has run on the GPU for %.0f s "
                "without completing (the comm stream waits for the other ranks); aborting the job\n",
                fsdp_current_rank(), desc, w->comm_name, w->comm_size, waited);
    else
        fprintf(stderr, "fsdp: rank %d: collective %s on comm %s(%d) failed on the GPU: %s; aborting the job\n",
                fsdp_current_rank(), desc, w->comm_name, w->comm_size, what);
    fsdp_runtime_abort(NULL, 1);
}
