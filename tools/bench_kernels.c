/* bench_kernels.c: engine CPU kernels next to their baselines, in one run.
 *   matmul: OpenBLAS sgemm, oneDNN f32, oneDNN bf16 and the engine's f32
 *   choice, at the GPT-2 small shapes (forward and both gradients) and small ones
 *   elementwise: cpu_binary_f32 ADD and cpu_scale_f32 vs memcpy, GB/s of
 *   bytes read + written (memcpy on one thread and split over the pool)
 * Usage: bench_kernels [--threads=N] (default 2). Medians of several reps. */
#define _POSIX_C_SOURCE 200809L   /* clock_gettime */
#include "cpu_kernels.h"
#include "fsdp.h"
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
#define MM_REPS 9
#define MM_KINDS 4

static uint16_t *to_bf16(const float *x, int64_t n) {
    uint16_t *p = aligned_alloc(64, (size_t)n * sizeof(uint16_t));
    if (!p) { fprintf(stderr, "out of memory\n"); exit(1); }
    cpu_cast_f32_to_bf16(p, x, n);
    return p;
}

/* One shape, four ways, interleaved with a rotating order: OpenBLAS sgemm,
 * oneDNN f32, oneDNN bf16 (bf16 in and out, f32 accumulation) and the
 * engine's cpu_matmul_f32 (which picks one of the first two). */
static void bench_matmul(const char *what, int M, int K, int N, int ta, int tb) {
    float *a = alloc_filled((int64_t)M * K, 0.1f);   // (M, K) or (K, M)
    float *b = alloc_filled((int64_t)K * N, 0.2f);   // (K, N) or (N, K)
    float *c = alloc_filled((int64_t)M * N, 0.0f);   // (M, N)
    uint16_t *a16 = to_bf16(a, (int64_t)M * K), *b16 = to_bf16(b, (int64_t)K * N), *c16 = to_bf16(c, (int64_t)M * N);
    double flops = 2.0 * M * N * K, t[MM_KINDS][MM_REPS];
    int ok[MM_KINDS] = {1, 1, 1, 1};
    for (int r = -2; r < MM_REPS; r++) {   /* two warm-up rounds: threads, caches, primitive creation */
        for (int w = 0; w < MM_KINDS; w++) {
            int kind = (w + (r < 0 ? 0 : r)) % MM_KINDS;
            double t0 = now();
            switch (kind) {
            case 0: cpu_matmul_f32_blas(c, a, b, 1, M, N, K, ta, tb, 1.0f, 0.0f, 0, 0, 0); break;
            case 1: ok[1] &= cpu_matmul_dnnl(0, c, a, b, 1, M, N, K, ta, tb, 1.0f, 0.0f, 0, 0, 0) == 0; break;
            case 2: ok[2] &= cpu_matmul_dnnl(1, c16, a16, b16, 1, M, N, K, ta, tb, 1.0f, 0.0f, 0, 0, 0) == 0; break;
            default: cpu_matmul_f32(c, a, b, 1, M, N, K, ta, tb, 1.0f, 0.0f, 0, 0, 0); break;
            }
            if (r >= 0) t[kind][r] = now() - t0;
        }
    }
    double g[MM_KINDS];
    for (int k = 0; k < MM_KINDS; k++) g[k] = ok[k] ? flops / median(t[k], MM_REPS) * 1e-9 : 0.0;
    printf("| %s | %dx%dx%d%s%s | %6.1f | %6.1f | %6.1f | %6.1f (%s) | %4.2fx |\n", what, M, K, N, ta ? " A^T" : "",
           tb ? " B^T" : "", g[0], g[1], g[2], g[3], g[1] > g[0] ? "dnnl" : "blas", g[2] / (g[0] > g[1] ? g[0] : g[1]));
    free(a); free(b); free(c); free(a16); free(b16); free(c16);
}

static void bench_matmuls(void) {
    printf("oneDNN at 256x768x2304: f32 %s; ", cpu_matmul_dnnl_impl(0, 256, 2304, 768));
    printf("bf16 %s\n\n", cpu_matmul_dnnl_impl(1, 256, 2304, 768));   /* (one static buffer) */
    printf("| use | M x K x N | OpenBLAS f32 | oneDNN f32 | oneDNN bf16 | engine f32 (faster of the two) | bf16 / best f32 |\n"
           "|---|---|---|---|---|---|---|\n");
    /* GPT-2 small, B*T = 256 rows: forward C = X @ W, dX = dC @ W^T, dW = X^T @ dC */
    bench_matmul("qkv forward", 256, 768, 2304, 0, 0);
    bench_matmul("qkv dX", 256, 2304, 768, 0, 1);
    bench_matmul("qkv dW", 768, 256, 2304, 1, 0);
    bench_matmul("fc forward", 256, 768, 3072, 0, 0);
    bench_matmul("proj forward", 256, 3072, 768, 0, 0);
    bench_matmul("attn proj forward", 256, 768, 768, 0, 0);
    bench_matmul("LM head forward", 256, 768, 50304, 0, 1);
    bench_matmul("LM head dX", 256, 50304, 768, 0, 0);
    bench_matmul("LM head dW", 50304, 256, 768, 1, 0);
    /* small: the tiny preset (width 32) and per-head sizes */
    bench_matmul("tiny qkv forward", 64, 32, 96, 0, 0);
    bench_matmul("tiny LM head", 64, 32, 304, 0, 1);
    bench_matmul("head-sized", 64, 64, 64, 0, 1);
    bench_matmul("mid", 128, 256, 256, 0, 0);
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
    printf("matmul, GFLOP/s, median of %d interleaved reps\n", MM_REPS);
    bench_matmuls();
    printf("\n| elementwise (bytes read + written) | bandwidth | of best memcpy |\n|---|---|---|\n");
    bench_elementwise();
    return 0;
}
