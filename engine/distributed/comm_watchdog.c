/* comm_watchdog.c: what happens when a rank waits too long on a collective
 * (DESIGN.md, decisions 8 and 12: a job never hangs on a failure, and the
 * watchdog names the ranks that did not arrive).
 *
 * Where a rank waits. Every collective starts with the agreement exchange
 * (comm_debug.c); a rank waits for the others there, on the comm thread,
 * without spinning (comm_mpi.c). After FSDP_WATCHDOG_SECONDS (default 120,
 * values below 1 s refused, 0 off) that wait asks every rank of the job
 * what it is doing (a point-to-point question that the others' comm threads
 * answer while they wait or idle), waits a short grace for the answers, and
 * prints on this rank:
 *   - the collective it waits on (sequence number, kind, unit, bytes, comm),
 *   - the ranks of that communicator that have not arrived at it,
 *   - for every rank: the collective it is in, or the last one it finished,
 *     or that it gave no answer (stopped, or stuck outside the agreement),
 *     or that it is leaving the job;
 * then ends the job. Every waiting rank does the same on its own clock, so
 * every surviving rank that waits prints its report.
 *
 * A caller blocked in fsdp_work_wait has a second, later limit (the
 * watchdog plus the grace plus a second): it covers a comm thread stuck
 * elsewhere (inside a data transfer, or enqueueing a CUDA collective) and
 * names the collective it waits on and the one the comm thread is in. */
#include "comm_impl.h"
#include <stdio.h>
#include <stdlib.h>

double comm_watchdog_grace(void) {
    double g = comm_cfg()->watchdog_s / 4;
    return g < 1 ? 1 : g > 5 ? 5 : g;
}

static void describe_status(const comm_status *s, bool answered, const fsdp_comm *c, char *buf, size_t size) {
    char cur[160], last[260];
    if (!answered) {
        if (c && c->last_done.seq != UINT64_MAX) {
            comm_fp_describe(&c->last_done, true, last, sizeof last);
        } else {
            snprintf(last, sizeof last, "none");
        }
        snprintf(buf, size, "no answer within %.0f s (stopped, killed, or stuck outside collectives); the last "
                 "collective on comm %s(%d) that it took part in: %s", comm_watchdog_grace(), c ? c->name : "?",
                 c ? c->size : 0, last);
        return;
    }
    if (s->last.seq != UINT64_MAX) {
        char d[160];
        comm_fp_describe(&s->last, true, d, sizeof d);
        snprintf(last, sizeof last, "%s on comm %.39s(%d)", d, s->last_comm, s->last_size);
    } else {
        snprintf(last, sizeof last, "none");
    }
    switch (s->state) {
    case RS_ARRIVING:
    case RS_MOVING:
        comm_fp_describe(&s->current, true, cur, sizeof cur);
        snprintf(buf, size, "%s collective %s on comm %s(%d) for %.0f s", s->state == RS_ARRIVING ? "waiting at" :
                 "moving data of", cur, s->current_comm, s->current_size, s->seconds);
        return;
    case RS_LEAVING:
        snprintf(buf, size, "leaving the job (returned from the program or called os.exit); last finished %s", last);
        return;
    default:
        snprintf(buf, size, "in no collective for %.0f s (computing, or stuck outside collectives); last finished %s",
                 s->seconds, last);
        return;
    }
}

void comm_watchdog_arrival(const fsdp_comm *c, const fingerprint *fp, double waited) {
    int me = fsdp_current_rank();
    fprintf(stderr,
            "fsdp watchdog: rank %d waited %.0f s on collective #%llu %s '%s' (%llu bytes) on comm %s(%d); "
            "aborting the job\n",
            me, waited, (unsigned long long)fp->seq, comm_kind_names[fp->kind], fp->label,
            (unsigned long long)fp->bytes, c->name, c->size);
    fflush(stderr);
    int n = 1;
    MPI_Comm_size(MPI_COMM_WORLD, &n);
    comm_status *all = calloc((size_t)n, sizeof *all);
    bool *answered = calloc((size_t)n, sizeof *answered);
    if (all && answered && c->be->ask_all) {
        comm_status mine;
        comm_status_fill(&mine);
        c->be->ask_all(&mine, all, answered, comm_watchdog_grace());
        /* the members of c that are not at this collective */
        char missing[512] = "";
        size_t at = 0;
        int count = 0;
        for (int r = 0; r < c->size; r++) {
            int w = c->members ? c->members[r] : r;
            if (w < 0 || w >= n) continue;
            const comm_status *s = &all[w];
            bool here = answered[w] && (s->state == RS_ARRIVING || s->state == RS_MOVING) &&
                        s->current.comm_id == fp->comm_id && s->current.seq == fp->seq;
            if (here) continue;
            count++;
            if (at + 16 < sizeof missing) at += (size_t)snprintf(missing + at, sizeof missing - at, "%s%d",
                                                                 count > 1 ? ", " : "", w);
        }
        fprintf(stderr, "fsdp watchdog: rank %d: %s at collective #%llu on comm %s(%d): %s %s\n", me,
                count ? "not arrived" : "every rank arrived", (unsigned long long)fp->seq, c->name, c->size,
                count == 1 ? "rank" : "ranks", count ? missing : "(the data transfer itself is stuck)");
        int shown = 0;
        for (int w = 0; w < n && shown < 64; w++, shown++) {
            char d[600];
            describe_status(&all[w], answered[w], c, d, sizeof d);
            fprintf(stderr, "fsdp watchdog: rank %d:   rank %d: %s\n", me, w, d);
        }
        if (n > shown) fprintf(stderr, "fsdp watchdog: rank %d:   (%d more ranks)\n", me, n - shown);
    }
    free(all);
    free(answered);
    fsdp_runtime_abort(NULL, 1);   /* MPI_Abort under mpirun, else exit */
}

void comm_watchdog_leaving(double waited, const bool *has_left, int n) {
    int me = fsdp_current_rank();
    comm_status *all = calloc((size_t)n, sizeof *all);
    bool *answered = calloc((size_t)n, sizeof *answered);
    if (!all || !answered) fsdp_runtime_abort("fsdp watchdog: out of host memory at finalize", 1);
    comm_status mine;
    comm_status_fill(&mine);
    mine.state = RS_LEAVING;
    comm_mpi_backend.ask_all(&mine, all, answered, comm_watchdog_grace());
    bool silent = false;
    for (int r = 0; r < n; r++) silent |= !has_left[r] && !answered[r];
    if (!silent) {   /* all alive, some still busy: not a hang */
        free(all);
        free(answered);
        return;
    }
    fprintf(stderr, "fsdp watchdog: rank %d has finished and waited %.0f s at finalize for ranks that neither "
            "finished nor answer; aborting the job\n", me, waited);
    for (int r = 0; r < n && r < 64; r++) {
        if (has_left[r] && r != me) continue;
        char d[600];
        describe_status(&all[r], answered[r] || r == me, NULL, d, sizeof d);
        fprintf(stderr, "fsdp watchdog: rank %d:   rank %d: %s\n", me, r, d);
    }
    fsdp_runtime_abort(NULL, 1);
}

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
