/* trace_file.c: a trace's start and its file (DESIGN.md, decision 9). Every
 * rank starts recording after a barrier, so their clocks start together; at
 * the end every rank sends its events (engine/core/trace.c) to rank 0
 * (MPI_Gatherv on the world), which writes one JSON file for Perfetto or
 * chrome://tracing, never through a link planted at its name. */
#define _POSIX_C_SOURCE 200809L
#include "internal.h"
#include "trace.h"
#include <mpi.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* This rank and the world's size; 0 when MPI is not running (one process). */
static int mpi_world(int *rank, int *size) {
    int inited = 0, finalized = 0;
    MPI_Initialized(&inited);
    MPI_Finalized(&finalized);
    *rank = 0;
    *size = 1;
    if (!inited || finalized) return 0;
    MPI_Comm_rank(MPI_COMM_WORLD, rank);
    MPI_Comm_size(MPI_COMM_WORLD, size);
    return 1;
}

fsdp_status fsdp_trace_start(const char *path) {
    if (!path || !*path) return fsdp_set_error(FSDP_ERR_INVALID, "fsdp_trace_start: path is empty");
    if (fsdp_trace_on)
        return fsdp_set_error(FSDP_ERR_STATE, "fsdp_trace_start: a trace (to '%s') is already on", trace_path());
    int rank, size;
    if (mpi_world(&rank, &size) && size > 1) MPI_Barrier(MPI_COMM_WORLD);
    if (rank == 0) {   /* say now, not at the end, that the file cannot be written */
        fsdp_file *f;   /* never through a link planted at the name */
        if (fsdp_file_open(&f, path, FSDP_FILE_CREATE) != FSDP_OK) {
            char why[512];
            snprintf(why, sizeof why, "%s", fsdp_last_error());
            return fsdp_set_error(FSDP_ERR_IO, "fsdp_trace_start: cannot write '%s': %s", path, why);
        }
        fsdp_file_close(f);
    }
    trace_begin(path);
    return FSDP_OK;
}

fsdp_status fsdp_trace_stop(void) {
    if (!fsdp_trace_on) return FSDP_OK;
    fsdp_trace_on = 0;   /* nothing is recorded while the events are read */
    int rank, size;
    int mpi = mpi_world(&rank, &size) && size > 1;
    size_t len = 0;
    char *mine = trace_events_json(rank, &len);
    if (!mine) {
        trace_end();
        return fsdp_set_error(FSDP_ERR_OOM, "fsdp_trace_stop: no memory for the events");
    }
    char path[1024];
    snprintf(path, sizeof path, "%s", trace_path());
    fsdp_status st = FSDP_OK;
    char *all = mine;
    long long total = (long long)len;
    int *lens = NULL, *offs = NULL;
    if (mpi) {
        int l = (int)len;
        lens = calloc((size_t)size, sizeof *lens);
        offs = calloc((size_t)size, sizeof *offs);
        if (!lens || !offs) st = fsdp_set_error(FSDP_ERR_OOM, "fsdp_trace_stop: no memory");
        MPI_Gather(&l, 1, MPI_INT, lens, 1, MPI_INT, 0, MPI_COMM_WORLD);
        total = 0;
        if (rank == 0)
            for (int r = 0; r < size; r++) offs[r] = (int)total, total += lens[r];
        all = rank == 0 ? malloc((size_t)total + 1) : NULL;
        MPI_Gatherv(mine, l, MPI_CHAR, all, lens, offs, MPI_CHAR, 0, MPI_COMM_WORLD);
    }
    if (rank == 0 && st == FSDP_OK) {
        static const char head[] = "{\"displayTimeUnit\":\"ms\",\"traceEvents\":[\n";
        char tail[128];
        int nt = snprintf(tail, sizeof tail, "{\"ph\":\"M\",\"pid\":0,\"name\":\"trace_end\",\"args\":{\"ranks\":%d}}\n]}\n", size);
        size_t nh = sizeof head - 1, n = nh + (size_t)total + (size_t)nt;
        char *text = all ? malloc(n) : NULL;
        if (!text) {
            st = fsdp_set_error(FSDP_ERR_IO, "fsdp_trace_stop: cannot write '%s'", path);
        } else {
            memcpy(text, head, nh);
            memcpy(text + nh, all, (size_t)total);
            memcpy(text + nh + (size_t)total, tail, (size_t)nt);
            /* a fresh temporary renamed into place: a link at the name is replaced, not followed */
            if (fsdp_file_write_atomic(path, text, (int64_t)n) != FSDP_OK) {
                char why[512];
                snprintf(why, sizeof why, "%s", fsdp_last_error());
                st = fsdp_set_error(FSDP_ERR_IO, "fsdp_trace_stop: writing '%s' failed: %s", path, why);
            }
            free(text);
        }
    }
    if (all != mine) free(all);
    free(mine);
    free(lens);
    free(offs);
    trace_end();
    return st;
}
