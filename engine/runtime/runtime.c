/* runtime.c: process set-up and shutdown, above every engine part (it
 * starts MPI, the CUDA backend, the comm thread and the trace, and sets the
 * CPU threads). MPI is initialized only when the process was started by an
 * MPI launcher, so `fsdp-lua recipe.lua` needs no mpirun. */
#include "internal.h"
#include "cpu_kernels.h"
#include "comm_internal.h"
#include "trace.h"
#ifdef FSDP_HAVE_CUDA
#include "cuda_internal.h"
#endif
#include <malloc.h>
#include <mpi.h>
#include <stdio.h>
#include <stdlib.h>

static int g_rank = 0, g_world = 1, g_we_initialized_mpi = 0;
static int g_local_rank = 0, g_local_size = 1;
static volatile int g_aborting = 0;

/* A rank that calls exit() (Lua's os.exit) still leaves the job properly:
 * the others hear that it left (comm_leave) instead of waiting for it. */
static void finalize_at_exit(void) {
    if (!g_aborting) fsdp_runtime_finalize();
}

static const char *mpi_error_string(long code) {
    static _Thread_local char buf[MPI_MAX_ERROR_STRING];
    int len = 0;
    if (MPI_Error_string((int)code, buf, &len) != MPI_SUCCESS) snprintf(buf, sizeof buf, "MPI error %ld", code);
    return buf;
}

static int launched_by_mpi(void) {
    const char *vars[] = {"OMPI_COMM_WORLD_SIZE", "PMIX_RANK", "PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID"};
    for (int i = 0; i < 5; i++)
        if (getenv(vars[i])) return 1;
    return 0;
}

fsdp_status fsdp_runtime_init(int *rank, int *world) {
    /* Large temporary buffers (MPI's, inside collectives) would otherwise be
     * mmap'd and unmapped on every call, and each fresh page costs a fault
     * and a clear: keep them in the heap and let the heap keep them. */
    static int malloc_tuned = 0;
    if (!malloc_tuned) {
        mallopt(M_MMAP_THRESHOLD, 1 << 30);
        mallopt(M_TRIM_THRESHOLD, 1 << 30);
        malloc_tuned = 1;
    }
    int inited = 0;
    MPI_Initialized(&inited);
    if (!inited && launched_by_mpi()) {
        int provided = 0;
        FSDP_CHECK_CALL(MPI_Init_thread(NULL, NULL, MPI_THREAD_MULTIPLE, &provided), rc_ == MPI_SUCCESS,
                        mpi_error_string);
        g_we_initialized_mpi = 1;
        inited = 1;
        atexit(finalize_at_exit);
    }
    if (inited) {
        /* Errors come back as codes; FSDP_CHECK_CALL turns them into messages. */
        MPI_Comm_set_errhandler(MPI_COMM_WORLD, MPI_ERRORS_RETURN);
        FSDP_CHECK_CALL(MPI_Comm_rank(MPI_COMM_WORLD, &g_rank), rc_ == MPI_SUCCESS, mpi_error_string);
        FSDP_CHECK_CALL(MPI_Comm_size(MPI_COMM_WORLD, &g_world), rc_ == MPI_SUCCESS, mpi_error_string);
        fsdp_set_current_rank(g_rank);
    }
    static int local_known = 0;   /* a collective: once, in the first init, on every rank */
    if (inited && !local_known) {
        /* the node's ranks from MPI itself, not a launcher's variable
         * (srun, MPICH and PMIx name it differently or not at all) */
        MPI_Comm node;
        FSDP_CHECK_CALL(MPI_Comm_split_type(MPI_COMM_WORLD, MPI_COMM_TYPE_SHARED, g_rank, MPI_INFO_NULL, &node),
                        rc_ == MPI_SUCCESS, mpi_error_string);
        FSDP_CHECK_CALL(MPI_Comm_rank(node, &g_local_rank), rc_ == MPI_SUCCESS, mpi_error_string);
        FSDP_CHECK_CALL(MPI_Comm_size(node, &g_local_size), rc_ == MPI_SUCCESS, mpi_error_string);
        MPI_Comm_free(&node);
        local_known = 1;
    }
#ifdef FSDP_HAVE_CUDA
    /* Rank r takes GPU (local rank r) when there is one, else stays on the CPU. */
    FSDP_TRY(cuda_backend_init(g_local_rank));
#endif
    if (rank) *rank = g_rank;
    if (world) *world = g_world;
    const char *trace = getenv("FSDP_TRACE");
    if (trace && *trace && !fsdp_trace_on) FSDP_TRY(fsdp_trace_start(trace));   /* init may run again */
    return FSDP_OK;
}

fsdp_status fsdp_runtime_rank(int *rank, int *world) {
    if (rank) *rank = g_rank;
    if (world) *world = g_world;
    return FSDP_OK;
}

fsdp_status fsdp_runtime_local(int *local_rank, int *local_size) {
    if (local_rank) *local_rank = g_local_rank;
    if (local_size) *local_size = g_local_size;
    return FSDP_OK;
}

fsdp_status fsdp_runtime_finalize(void) {
    comm_shutdown();   /* drain the comm thread before MPI goes away */
    if (fsdp_trace_stop() != FSDP_OK) fprintf(stderr, "fsdp: rank %d: %s\n", g_rank, fsdp_last_error());
    int inited = 0, finalized = 0;
    MPI_Initialized(&inited);
    MPI_Finalized(&finalized);
    if (g_we_initialized_mpi && inited && !finalized) FSDP_TRY(comm_leave());
    if (g_we_initialized_mpi && inited && !finalized)
        FSDP_CHECK_CALL(MPI_Finalize(), rc_ == MPI_SUCCESS, mpi_error_string);
    return FSDP_OK;
}

fsdp_status fsdp_runtime_abort(const char *msg, int exit_code) {
    g_aborting = 1;
    if (msg) fprintf(stderr, "%s\n", msg);
    fflush(stderr);
    fflush(stdout);
    int inited = 0, finalized = 0;
    MPI_Initialized(&inited);
    MPI_Finalized(&finalized);
    if (inited && !finalized && g_world > 1) MPI_Abort(MPI_COMM_WORLD, exit_code ? exit_code : 1);
    exit(exit_code);
}

fsdp_status fsdp_version(const char **out) {
    if (!out) return fsdp_set_error(FSDP_ERR_INVALID, "fsdp_version: out is NULL");
    *out = FSDP_VERSION_STRING;
    return FSDP_OK;
}

fsdp_status fsdp_set_num_threads(int n) {
    if (n < 1 || n > 256)
        return fsdp_set_error(FSDP_ERR_INVALID, "fsdp_set_num_threads: %d threads asked, expected 1..256", n);
    cpu_threads_set(n);
    return FSDP_OK;
}

fsdp_status fsdp_get_num_threads(int *out) {
    if (!out) return fsdp_set_error(FSDP_ERR_INVALID, "fsdp_get_num_threads: out is NULL");
    *out = cpu_threads_get();
    return FSDP_OK;
}
