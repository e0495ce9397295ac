/* matmul.c: batched C = alpha * op(A) @ op(B) + beta * C. Row-major
 * throughout. f32 goes to oneDNN (matmul_dnnl.c) or OpenBLAS sgemm,
 * whichever is faster for the shape class (cpu_matmul_f32 says which); bf16
 * goes to oneDNN's bf16 matmul, or is widened to f32 for OpenBLAS where
 * oneDNN cannot run it.
 *
 * OpenBLAS path: OpenBLAS threads each gemm itself, so batches run
 * one after another; where the batch can be folded into one bigger gemm
 * (shared B, contiguous A and C) it is, since one (batch*M, K) @ (K, N) gemm
 * runs much closer to peak than many small ones. */
#ifndef _POSIX_C_SOURCE
#define _POSIX_C_SOURCE 200809L   /* clock_gettime */
#endif
#include "cpu_kernels.h"
#include <cblas.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

/* f32 products of fewer multiply-adds (M*N*K) run on OpenBLAS. */
#define DNNL_F32_MIN_MNK (1LL << 18)

/* K == 0: the product is empty, so C = beta * C (BLAS rejects lda = 0). */
static void scale_c(float *c, int64_t M, int64_t N, float beta) {
    for (int64_t i = 0; i < M * N; i++) c[i] = beta == 0.0f ? 0.0f : beta * c[i];
}

static void gemm(float *c, const float *a, const float *b, int64_t M, int64_t N, int64_t K,
                 int trans_a, int trans_b, float alpha, float beta) {
    if (K == 0) { scale_c(c, M, N, beta); return; }
    blasint lda = (blasint)(trans_a ? M : K);   /* A is (K, M) or (M, K) */
    blasint ldb = (blasint)(trans_b ? K : N);   /* B is (N, K) or (K, N) */
    blasint ldc = (blasint)N;                   /* C is (M, N) */
    cblas_sgemm(CblasRowMajor, trans_a ? CblasTrans : CblasNoTrans, trans_b ? CblasTrans : CblasNoTrans,
                (blasint)M, (blasint)N, (blasint)K, alpha, a, lda > 0 ? lda : 1, b, ldb > 0 ? ldb : 1,
                beta, c, ldc > 0 ? ldc : 1);
}

void cpu_matmul_f32_blas(float *c, const float *a, const float *b, int64_t batch, int64_t M, int64_t N, int64_t K,
                         int trans_a, int trans_b, float alpha, float beta,
                         int64_t stride_a, int64_t stride_b, int64_t stride_c) {
    if (batch <= 0 || M <= 0 || N <= 0) return;
    /* Shared B, A not transposed, A and C batches back to back: the batch is
     * just more rows, (batch*M, K) @ (K, N) -> (batch*M, N). */
    if (batch > 1 && stride_b == 0 && !trans_a && stride_a == M * K && stride_c == M * N) {
        gemm(c, a, b, batch * M, N, K, 0, trans_b, alpha, beta);
        return;
    }
    /* M == 1 with shared B, A rows back to back: same fold, batch rows of one. */
    if (batch > 1 && stride_b == 0 && M == 1 && stride_a == K && stride_c == N) {
        gemm(c, a, b, batch, N, K, 0, trans_b, alpha, beta);
        return;
    }
    for (int64_t i = 0; i < batch; i++)
        gemm(c + i * stride_c, a + i * stride_a, b + i * stride_b, M, N, K, trans_a, trans_b, alpha, beta);
}

/* Which library runs an f32 matmul, by what tools/bench_kernels and the
 * step's own statistics (FSDP_MATMUL_STATS) measured at GPT-2's products as
 * a step stores them (docs/notes/cpu-performance-log.md): oneDNN from 2^18 multiply-adds up
 * (5-15% more GFLOP per CPU second than OpenBLAS in the step, forward,
 * dX and dW alike, once a wide B read as stored is reordered first: see
 * matmul_dnnl.c), OpenBLAS below, where its single-threaded small-matrix
 * path wins. Mixing the two within a step costs more than either's margin:
 * OpenBLAS's threads spin for a while after each call, on the cores
 * oneDNN's OpenMP team needs next. FSDP_MATMUL_F32=blas or =dnnl forces one
 * (for that benchmark and for tests). */
static int f32_route = -1;   /* -1 not read yet, 0 by shape, 1 OpenBLAS, 2 oneDNN */

int cpu_matmul_f32_route(int64_t batch, int64_t M, int64_t N, int64_t K, int trans_a, int trans_b) {
    if (f32_route < 0) {
        const char *s = getenv("FSDP_MATMUL_F32");
        f32_route = s && !strcmp(s, "blas") ? 1 : s && !strcmp(s, "dnnl") ? 2 : 0;
    }
    if (f32_route) return f32_route == 2;
    (void)batch, (void)trans_a, (void)trans_b;
    return M * N * K >= DNNL_F32_MIN_MNK;
}

enum { PATH_BLAS, PATH_DNNL, PATH_BF16_VIA_F32, PATH_BF16_NAIVE, PATH_EMPTY };

static int matmul_f32_run(float *c, const float *a, const float *b, int64_t batch, int64_t M, int64_t N, int64_t K,
                          int trans_a, int trans_b, float alpha, float beta,
                          int64_t stride_a, int64_t stride_b, int64_t stride_c) {
    if (K > 0 && cpu_matmul_f32_route(batch, M, N, K, trans_a, trans_b) &&
        cpu_matmul_dnnl(0, c, a, b, batch, M, N, K, trans_a, trans_b, alpha, beta, stride_a, stride_b, stride_c) == 0)
        return PATH_DNNL;
    cpu_matmul_f32_blas(c, a, b, batch, M, N, K, trans_a, trans_b, alpha, beta, stride_a, stride_b, stride_c);
    return PATH_BLAS;
}

/* ---- per-product statistics (FSDP_MATMUL_STATS=1) ----
 * Calls and wall time of every distinct product (dtype, library, shape,
 * transposes, accumulation), printed to stderr at exit: what a training
 * step's matmuls take and the rate each reaches. Off, it costs one test. */
#define STATS_SLOTS 256

typedef struct {
    int bf16, path, ta, tb, acc;
    int64_t batch, M, N, K;
    int64_t calls;
    double seconds, cpu_seconds;   /* wall; CPU of the whole process (its other threads idle meanwhile) */
} mm_stat;

static struct {
    pthread_once_t once;
    int on;
    pthread_mutex_t lock;
    int n;
    mm_stat slot[STATS_SLOTS];
    int64_t other_calls;   /* products past the slots: counted together */
    double other_flop, other_seconds, other_cpu_seconds;
} stats = {.once = PTHREAD_ONCE_INIT, .lock = PTHREAD_MUTEX_INITIALIZER};

static double seconds_now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static double cpu_seconds_now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static const char *path_name(int path) {
    static const char *names[] = {"OpenBLAS", "oneDNN", "f32 OpenBLAS/oneDNN (widened)", "naive", "empty"};
    return names[path];
}

static void stats_print(void) {
    double total_s = 0, total_cpu = 0, total_flop = 0;
    int64_t total_calls = 0;
    /* at exit another thread may be inside a product (a fatal error): never wait for it */
    if (pthread_mutex_trylock(&stats.lock) != 0) return;
    fprintf(stderr, "matmul stats: dtype | library | batch x M x K x N | op(A) op(B) | C | calls | ms | CPU ms | GFLOP/s"
                    " | GFLOP per CPU s\n");
    for (int i = 0; i < stats.n; i++) {
        const mm_stat *e = &stats.slot[i];
        double flop = 2.0 * (double)e->batch * (double)e->M * (double)e->N * (double)e->K * (double)e->calls;
        fprintf(stderr, "matmul stats: %s | %s | %lld x %lld x %lld x %lld | %s %s | %s | %lld | %.2f | %.2f | %.1f | %.1f\n",
                e->bf16 ? "bf16" : "f32", path_name(e->path), (long long)e->batch, (long long)e->M, (long long)e->K,
                (long long)e->N, e->ta ? "A^T" : "A", e->tb ? "B^T" : "B", e->acc ? "+=" : "=",
                (long long)e->calls, e->seconds * 1e3, e->cpu_seconds * 1e3,
                e->seconds > 0 ? flop / e->seconds * 1e-9 : 0.0, e->cpu_seconds > 0 ? flop / e->cpu_seconds * 1e-9 : 0.0);
        total_s += e->seconds;
        total_cpu += e->cpu_seconds;
        total_flop += flop;
        total_calls += e->calls;
    }
    if (stats.other_calls) {
        fprintf(stderr, "matmul stats: (other products, %d distinct ones shown) | | | | | %lld | %.2f | %.2f | %.1f | %.1f\n",
                STATS_SLOTS, (long long)stats.other_calls, stats.other_seconds * 1e3, stats.other_cpu_seconds * 1e3,
                stats.other_seconds > 0 ? stats.other_flop / stats.other_seconds * 1e-9 : 0.0,
                stats.other_cpu_seconds > 0 ? stats.other_flop / stats.other_cpu_seconds * 1e-9 : 0.0);
        total_s += stats.other_seconds;
        total_cpu += stats.other_cpu_seconds;
        total_flop += stats.other_flop;
        total_calls += stats.other_calls;
    }
    fprintf(stderr, "matmul total: %.1f ms in %lld calls, %.2f GFLOP, %.1f GFLOP/s; %.1f CPU ms, %.1f GFLOP per CPU s\n",
            total_s * 1e3, (long long)total_calls, total_flop * 1e-9, total_s > 0 ? total_flop / total_s * 1e-9 : 0.0,
            total_cpu * 1e3, total_cpu > 0 ? total_flop / total_cpu * 1e-9 : 0.0);
    pthread_mutex_unlock(&stats.lock);
}

void cpu_matmul_stats_totals(int64_t *calls, double *flop, double *seconds) {
    *calls = 0;
    *flop = *seconds = 0;
    pthread_mutex_lock(&stats.lock);
    for (int i = 0; i < stats.n; i++) {
        const mm_stat *e = &stats.slot[i];
        *calls += e->calls;
        *flop += 2.0 * (double)e->batch * (double)e->M * (double)e->N * (double)e->K * (double)e->calls;
        *seconds += e->seconds;
    }
    *calls += stats.other_calls;
    *flop += stats.other_flop;
    *seconds += stats.other_seconds;
    pthread_mutex_unlock(&stats.lock);
}

static void stats_init(void) {
    const char *s = getenv("FSDP_MATMUL_STATS");
    stats.on = s && atoi(s) > 0;
    if (stats.on) atexit(stats_print);
}

static int stats_on(void) {
    pthread_once(&stats.once, stats_init);
    return stats.on;
}

static void stats_add(int bf16, int path, int64_t batch, int64_t M, int64_t N, int64_t K, int ta, int tb, float beta,
                      double seconds, double cpu_seconds) {
    mm_stat key = {.bf16 = bf16, .path = path, .ta = ta != 0, .tb = tb != 0, .acc = beta != 0.0f,
                   .batch = batch, .M = M, .N = N, .K = K};
    pthread_mutex_lock(&stats.lock);
    mm_stat *e = NULL;
    for (int i = 0; i < stats.n && !e; i++) {
        mm_stat *s = &stats.slot[i];
        if (s->bf16 == key.bf16 && s->path == key.path && s->ta == key.ta && s->tb == key.tb && s->acc == key.acc &&
            s->batch == key.batch && s->M == key.M && s->N == key.N && s->K == key.K)
            e = s;
    }
    if (!e && stats.n < STATS_SLOTS) {
        e = &stats.slot[stats.n++];
        *e = key;
    }
    if (e) {
        e->calls++;
        e->seconds += seconds;
        e->cpu_seconds += cpu_seconds;
    } else {
        stats.other_calls++;
        stats.other_flop += 2.0 * (double)batch * (double)M * (double)N * (double)K;
        stats.other_seconds += seconds;
        stats.other_cpu_seconds += cpu_seconds;
    }
    pthread_mutex_unlock(&stats.lock);
}

void cpu_matmul_f32(float *c, const float *a, const float *b, int64_t batch, int64_t M, int64_t N, int64_t K,
                    int trans_a, int trans_b, float alpha, float beta,
                    int64_t stride_a, int64_t stride_b, int64_t stride_c) {
    if (batch <= 0 || M <= 0 || N <= 0) return;
    if (!stats_on()) {
        matmul_f32_run(c, a, b, batch, M, N, K, trans_a, trans_b, alpha, beta, stride_a, stride_b, stride_c);
        return;
    }
    double t0 = seconds_now(), u0 = cpu_seconds_now();
    int path = matmul_f32_run(c, a, b, batch, M, N, K, trans_a, trans_b, alpha, beta, stride_a, stride_b, stride_c);
    stats_add(0, K > 0 ? path : PATH_EMPTY, batch, M, N, K, trans_a, trans_b, beta, seconds_now() - t0,
              cpu_seconds_now() - u0);
}

/* ---- bf16 ---- */

/* The reference and last resort: f32 accumulation, one rounding per output. */
static void matmul_bf16_naive(uint16_t *c, const uint16_t *a, const uint16_t *b, int64_t M, int64_t N, int64_t K,
                              int ta, int tb, float alpha, float beta) {
    for (int64_t i = 0; i < M; i++)
        for (int64_t j = 0; j < N; j++) {
            float acc = 0.0f;
            for (int64_t k = 0; k < K; k++)
                acc += bf16_to_f32(a[ta ? k * M + i : i * K + k]) * bf16_to_f32(b[tb ? j * K + k : k * N + j]);
            float old = beta == 0.0f ? 0.0f : beta * bf16_to_f32(c[i * N + j]);
            c[i * N + j] = f32_to_bf16(alpha * acc + old);
        }
}

/* Without bf16 oneDNN: each batch widened to f32, one f32 matmul (oneDNN or
 * OpenBLAS by shape), narrowed once. */
static int matmul_bf16_via_f32(uint16_t *c, const uint16_t *a, const uint16_t *b, int64_t batch, int64_t M,
                                int64_t N, int64_t K, int ta, int tb, float alpha, float beta, int64_t sa,
                                int64_t sb, int64_t sc) {
    float *wa = malloc((size_t)(M * K) * sizeof *wa), *wb = malloc((size_t)(K * N) * sizeof *wb);
    float *wc = malloc((size_t)(M * N) * sizeof *wc);
    int path = wa && wb && wc ? PATH_BF16_VIA_F32 : PATH_BF16_NAIVE;
    for (int64_t i = 0; i < batch; i++) {
        const uint16_t *ai = a + i * sa, *bi = b + i * sb;
        uint16_t *ci = c + i * sc;
        if (!wa || !wb || !wc) {
            matmul_bf16_naive(ci, ai, bi, M, N, K, ta, tb, alpha, beta);
            continue;
        }
        if (i == 0 || sa) cpu_cast_bf16_to_f32(wa, ai, M * K);
        if (i == 0 || sb) cpu_cast_bf16_to_f32(wb, bi, K * N);
        if (beta != 0.0f) cpu_cast_bf16_to_f32(wc, ci, M * N);
        matmul_f32_run(wc, wa, wb, 1, M, N, K, ta, tb, alpha, beta, 0, 0, 0);
        cpu_cast_f32_to_bf16(ci, wc, M * N);
    }
    free(wa);
    free(wb);
    free(wc);
    return path;
}

/* Does oneDNN run bf16 on bf16 hardware here (AVX512-BF16 dot products or
 * AMX tiles: "brg:avx512_core_bf16", "brg:avx512_core_amx_bf16")? On a CPU
 * without them it emulates bf16 ("gemm:jit") at a fraction of f32 speed,
 * so there bf16 is widened to the f32 path instead. */
static int bf16_native = -1;

static int dnnl_bf16_is_native(void) {
    if (bf16_native < 0) {
        const char *impl = cpu_matmul_dnnl_impl(1, 64, 64, 64);
        bf16_native = strstr(impl, "bf16") != NULL;
    }
    return bf16_native;
}

static int matmul_bf16_run(uint16_t *c, const uint16_t *a, const uint16_t *b, int64_t batch, int64_t M, int64_t N,
                           int64_t K, int trans_a, int trans_b, float alpha, float beta,
                           int64_t stride_a, int64_t stride_b, int64_t stride_c) {
    if (K > 0 && dnnl_bf16_is_native() && cpu_matmul_dnnl(1, c, a, b, batch, M, N, K, trans_a, trans_b, alpha, beta,
                                                           stride_a, stride_b, stride_c) == 0)
        return PATH_DNNL;
    return matmul_bf16_via_f32(c, a, b, batch, M, N, K, trans_a, trans_b, alpha, beta, stride_a, stride_b, stride_c);
}

void cpu_matmul_bf16(uint16_t *c, const uint16_t *a, const uint16_t *b, int64_t batch, int64_t M, int64_t N,
                     int64_t K, int trans_a, int trans_b, float alpha, float beta,
                     int64_t stride_a, int64_t stride_b, int64_t stride_c) {
    if (batch <= 0 || M <= 0 || N <= 0) return;
    if (!stats_on()) {
        matmul_bf16_run(c, a, b, batch, M, N, K, trans_a, trans_b, alpha, beta, stride_a, stride_b, stride_c);
        return;
    }
    double t0 = seconds_now(), u0 = cpu_seconds_now();
    int path = matmul_bf16_run(c, a, b, batch, M, N, K, trans_a, trans_b, alpha, beta, stride_a, stride_b, stride_c);
    stats_add(1, K > 0 ? path : PATH_EMPTY, batch, M, N, K, trans_a, trans_b, beta, seconds_now() - t0,
              cpu_seconds_now() - u0);
}
