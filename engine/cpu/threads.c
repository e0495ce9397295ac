/* threads.c: a small fork-join pool for CPU kernels.
 * The caller takes chunk 0 and workers the rest, so a pool of n threads
 * starts n-1. The thread count is settable so that several ranks on one host
 * do not oversubscribe its cores; OpenBLAS gets the same count. */
#include "cpu_kernels.h"
#include "fsdp.h"
#include <pthread.h>
#include <stdlib.h>
#include <unistd.h>

void openblas_set_num_threads(int num_threads);

#define MAX_THREADS 256

static struct {
    pthread_mutex_t lock;
    pthread_cond_t wake, done;
    pthread_t workers[MAX_THREADS];
    int nthreads;          /* including the caller */
    int started;           /* workers running */
    /* the job in flight */
    cpu_range_fn fn;
    void *ctx;
    int64_t n, chunk;
    int nchunks;
    int next_chunk;        /* next chunk index to hand out */
    int pending;           /* chunks not finished */
    unsigned generation;
    int stop;
} pool = {.lock = PTHREAD_MUTEX_INITIALIZER, .wake = PTHREAD_COND_INITIALIZER, .done = PTHREAD_COND_INITIALIZER};

/* One job at a time: a second thread submitting while the pool is busy runs inline. */
static pthread_mutex_t submit_lock = PTHREAD_MUTEX_INITIALIZER;

static _Thread_local int in_parallel;
static pthread_once_t init_once = PTHREAD_ONCE_INIT;

static void run_chunks(void) {
    for (;;) {
        pthread_mutex_lock(&pool.lock);
        int c = pool.next_chunk < pool.nchunks ? pool.next_chunk++ : -1;
        pthread_mutex_unlock(&pool.lock);
        if (c < 0) return;
        int64_t begin = c * pool.chunk, end = begin + pool.chunk;
        if (end > pool.n) end = pool.n;
        pool.fn(pool.ctx, begin, end);
        pthread_mutex_lock(&pool.lock);
        if (--pool.pending == 0) pthread_cond_broadcast(&pool.done);
        pthread_mutex_unlock(&pool.lock);
    }
}

static void *worker_main(void *arg) {
    (void)arg;
    in_parallel = 1;
    unsigned seen = 0;
    for (;;) {
        pthread_mutex_lock(&pool.lock);
        while (pool.generation == seen && !pool.stop) pthread_cond_wait(&pool.wake, &pool.lock);
        if (pool.stop) { pthread_mutex_unlock(&pool.lock); return NULL; }
        seen = pool.generation;
        pthread_mutex_unlock(&pool.lock);
        run_chunks();
    }
}

static void start_workers(int n) {
    while (pool.started < n - 1) {
        if (pthread_create(&pool.workers[pool.started], NULL, worker_main, NULL) != 0) break;
        pool.started++;
    }
}

static void stop_workers(void) {
    pthread_mutex_lock(&pool.lock);
    pool.stop = 1;
    pthread_cond_broadcast(&pool.wake);
    pthread_mutex_unlock(&pool.lock);
    for (int i = 0; i < pool.started; i++) pthread_join(pool.workers[i], NULL);
    pool.started = 0;
    pool.stop = 0;
}

static int default_threads(void) {
    const char *names[] = {"FSDP_NUM_THREADS", "OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS"};
    for (int i = 0; i < 3; i++) {
        const char *s = getenv(names[i]);
        if (s && atoi(s) > 0) return atoi(s);
    }
    long n = sysconf(_SC_NPROCESSORS_ONLN);
    if (n < 1) n = 1;
    /* ranks sharing a host share its cores: their count from MPI's split
     * once the runtime is up, else (a pool started before it) the launcher's */
    int ranks_here = 1;
    fsdp_runtime_local(NULL, &ranks_here);
    if (ranks_here <= 1) {
        const char *local = getenv("OMPI_COMM_WORLD_LOCAL_SIZE");
        if (!local) local = getenv("MPI_LOCALNRANKS");
        if (local && atoi(local) > 1) ranks_here = atoi(local);
    }
    if (ranks_here > 1) n = n / ranks_here > 0 ? n / ranks_here : 1;
    return (int)n;
}

static void pool_init(void) {
    int n = default_threads();
    if (n > MAX_THREADS) n = MAX_THREADS;
    pool.nthreads = n;
    openblas_set_num_threads(n);
}

int cpu_threads_get(void) {
    pthread_once(&init_once, pool_init);
    return pool.nthreads;
}

void cpu_threads_set(int n) {
    pthread_once(&init_once, pool_init);
    if (n < 1) n = 1;
    if (n > MAX_THREADS) n = MAX_THREADS;
    pthread_mutex_lock(&submit_lock);
    if (pool.started > n - 1) stop_workers();
    pool.nthreads = n;
    openblas_set_num_threads(n);
    pthread_mutex_unlock(&submit_lock);
}

void cpu_parallel_for(int64_t n, int64_t grain, cpu_range_fn fn, void *ctx) {
    if (n <= 0) return;
    pthread_once(&init_once, pool_init);
    if (grain < 1) grain = 1;
    int nt = pool.nthreads;
    if (in_parallel || nt <= 1 || n <= grain || pthread_mutex_trylock(&submit_lock) != 0) {
        fn(ctx, 0, n);
        return;
    }
    int64_t nchunks = (n + grain - 1) / grain;
    if (nchunks > nt) nchunks = nt;
    start_workers(nt);
    in_parallel = 1;
    pthread_mutex_lock(&pool.lock);
    pool.fn = fn;
    pool.ctx = ctx;
    pool.n = n;
    pool.chunk = (n + nchunks - 1) / nchunks;
    pool.nchunks = (int)((n + pool.chunk - 1) / pool.chunk);
    pool.next_chunk = 0;
    pool.pending = pool.nchunks;
    pool.generation++;
    pthread_cond_broadcast(&pool.wake);
    pthread_mutex_unlock(&pool.lock);
    run_chunks();
    pthread_mutex_lock(&pool.lock);
    while (pool.pending > 0) pthread_cond_wait(&pool.done, &pool.lock);
    pthread_mutex_unlock(&pool.lock);
    in_parallel = 0;
    pthread_mutex_unlock(&submit_lock);
}
