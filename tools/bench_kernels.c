/* bench_kernels.c: engine CPU kernels next to their baselines, in one run.
 *   matmul: cpu_matmul_f32 vs cblas_sgemm called directly, GPT-2 small shapes
 *   elementwise: cpu_binary_f32 ADD and cpu_scale_f32 vs memcpy, GB/s of
 *   bytes read + written (memcpy on one thread and split over the pool)
 * Usage: bench_kernels [--threads=N] (default 2). Medians of several reps. */
#define _POSIX_C_SOURCE 200809L   /* clock_gettime */
#include "cpu_kernels.h"
#include "fsdp.h"
#include <cblas.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

static double now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + ts.tv_nsec * 1e-9;
}

static int cmp_double(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}
static double median(double *t, int n) {
    qsort(t, n, sizeof *t, cmp_double);
    return n % 2 ? t[n / 2] : 0.5 * (t[n / 2 - 1] + t[n / 2]);
}

static float *alloc_filled(int64_t n, float v) {
    float *p = aligned_alloc(64, (size_t)n * sizeof(float));
    if (!p) { fprintf(stderr, "out of memory\n"); exit(1); }
    for (int64_t i = 0; i < n; i++) p[i] = v + (float)(i % 17) * 0.01f;   /* touches every page */
    return p;
}

/* ---- matmul ---- */
#define MM_REPS 15

static void bench_matmul(int M, int K, int N) {
    float *a = alloc_filled((int64_t)M * K, 0.1f);   // (M, K)
    float *b = alloc_filled((int64_t)K * N, 0.2f);   // (K, N)
    float *c = alloc_filled((int64_t)M * N, 0.0f);   // (M, N)
    double flops = 2.0 * M * N * K, te[MM_REPS], td[MM_REPS];
    for (int w = 0; w < 2; w++) {   /* warm up both: threads, caches, page faults */
        cpu_matmul_f32(c, a, b, 1, M, N, K, 0, 0, 1.0f, 0.0f, 0, 0, 0);
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, M, N, K, 1.0f, a, K, b, N, 0.0f, c, N);
    }
    /* interleaved, alternating which goes first, so drift and cache state hit both alike */
    for (int r = 0; r < MM_REPS; r++) {
        for (int which = 0; which < 2; which++) {
            int engine = (which + r) % 2 == 0;
            double t0 = now();
            if (engine) cpu_matmul_f32(c, a, b, 1, M, N, K, 0, 0, 1.0f, 0.0f, 0, 0, 0);
            else cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, M, N, K, 1.0f, a, K, b, N, 0.0f, c, N);
            double t = now() - t0;
            if (engine) te[r] = t; else td[r] = t;
        }
    }
    double ge = flops / median(te, MM_REPS) * 1e-9, gd = flops / median(td, MM_REPS) * 1e-9;
    printf("| matmul %dx%dx%d | %8.1f GFLOP/s | %8.1f GFLOP/s | %5.1f%% |\n", M, K, N, ge, gd, 100.0 * ge / gd);
    free(a); free(b); free(c);
}

/* ---- elementwise ---- */
#define EW_REPS 11

typedef struct { char *dst; const char *src; } memcpy_ctx;
static void memcpy_range(void *p, int64_t begin, int64_t end) {
    memcpy_ctx *c = p;
    memcpy(c->dst + begin, c->src + begin, (size_t)(end - begin));
}

static void bench_elementwise(void) {
    const int64_t n = 16 * 1024 * 1024;
    float *a = alloc_filled(n, 1.0f), *b = alloc_filled(n, 2.0f), *out = alloc_filled(n, 0.0f);
    int64_t shape[1] = {n}, st[1] = {1};
    double t_add[EW_REPS], t_scale[EW_REPS], t_cpy1[EW_REPS], t_cpyn[EW_REPS];
    memcpy_ctx mc = {(char *)out, (const char *)a};
    for (int r = -2; r < EW_REPS; r++) {   /* two warm-up rounds */
        double t0 = now();
        cpu_binary_f32(FSDP_ADD, out, a, st, b, st, 1, shape);
        double t1 = now();
        cpu_scale_f32(out, a, 0.5f, n);
        double t2 = now();
        memcpy(out, a, (size_t)n * sizeof(float));
        double t3 = now();
        cpu_parallel_for(n * (int64_t)sizeof(float), 1 << 20, memcpy_range, &mc);
        double t4 = now();
        if (r < 0) continue;
        t_add[r] = t1 - t0;
        t_scale[r] = t2 - t1;
        t_cpy1[r] = t3 - t2;
        t_cpyn[r] = t4 - t3;
    }
    double bytes = (double)n * sizeof(float);
    double add = 3 * bytes / median(t_add, EW_REPS) * 1e-9, scale = 2 * bytes / median(t_scale, EW_REPS) * 1e-9;
    double cpy1 = 2 * bytes / median(t_cpy1, EW_REPS) * 1e-9, cpyn = 2 * bytes / median(t_cpyn, EW_REPS) * 1e-9;
    double best = cpy1 > cpyn ? cpy1 : cpyn;
    printf("| memcpy 64 MiB, 1 thread | %6.1f GB/s | |\n", cpy1);
    printf("| memcpy 64 MiB, split over the pool | %6.1f GB/s | |\n", cpyn);
    printf("| cpu_binary_f32 ADD, 16M floats | %6.1f GB/s | %5.1f%% |\n", add, 100.0 * add / best);
    printf("| cpu_scale_f32, 16M floats | %6.1f GB/s | %5.1f%% |\n", scale, 100.0 * scale / best);
    free(a); free(b); free(out);
}

int main(int argc, char **argv) {
    int threads = 2;
    for (int i = 1; i < argc; i++) {
        if (strncmp(argv[i], "--threads=", 10) == 0) threads = atoi(argv[i] + 10);
        else { fprintf(stderr, "usage: %s [--threads=N]\n", argv[0]); return 2; }
    }
    cpu_threads_set(threads);   /* OpenBLAS too */
    printf("threads: %d\n\n", cpu_threads_get());
    printf("| matmul M x K x N (f32) | cpu_matmul_f32 | cblas_sgemm direct | engine/direct |\n|---|---|---|---|\n");
    bench_matmul(256, 768, 2304);
    bench_matmul(256, 768, 50304);
    bench_matmul(256, 3072, 768);
    printf("\n| elementwise (bytes read + written) | bandwidth | of best memcpy |\n|---|---|---|\n");
    bench_elementwise();
    return 0;
}
