/* bench_kernels.c: engine CPU kernels next to their baselines, in one run.
 *   matmul: the f32 FMA ceiling; OpenBLAS sgemm, oneDNN f32, the engine's f32
 *   choice, oneDNN bf16 and the engine's bf16 at the GPT-2 small shapes as
 *   the step stores them (forward and both gradients of each Linear and of
 *   the tied LM head), a large square, and small ones
 *   elementwise: cpu_binary_f32 ADD and cpu_scale_f32 vs memcpy, GB/s of
 *   bytes read + written (memcpy on one thread and split over the pool)
 *   optimizer: the clipped step's passes (sum of squares, scale, AdamW, AdamW
 *   with the clip's scale in its pass); --optim runs only these
 * Usage: bench_kernels [--threads=N] (default 2) [--matmul] (matmuls only)
 *        [--optim] (optimizer passes only).
 * Medians of several reps. */
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

/* CPU seconds of the whole process (every thread): what a shared host's
 * load moves far less than the wall time */
static double cpu_now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts);
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
#define MM_KINDS 5

static uint16_t *to_bf16(const float *x, int64_t n) {
    uint16_t *p = aligned_alloc(64, (size_t)n * sizeof(uint16_t));
    if (!p) { fprintf(stderr, "out of memory\n"); exit(1); }
    cpu_cast_f32_to_bf16(p, x, n);
    return p;
}

/* The f32 arithmetic ceiling: every pool thread runs 12 independent chains of
 * 16-float fused multiply-adds (enough to hide the FMA latency on two ports),
 * from registers, no memory. GFLOP/s over the pool. */
typedef float v16 __attribute__((vector_size(64)));
#define PEAK_ITERS 20000000L
static void fma_chains(void *ctx, int64_t begin, int64_t end) {
    float *sink = ctx;
    for (int64_t t = begin; t < end; t++) {
        v16 acc[12], m, c;
        for (int j = 0; j < 16; j++) m[j] = 0.999999f, c[j] = 1e-7f;
        for (int i = 0; i < 12; i++)
            for (int j = 0; j < 16; j++) acc[i][j] = (float)(i + j);
        for (long n = 0; n < PEAK_ITERS; n++)
            for (int i = 0; i < 12; i++) acc[i] = acc[i] * m + c;   /* contracted to FMA (-O3 -march=native) */
        float s = 0;
        for (int i = 0; i < 12; i++)
            for (int j = 0; j < 16; j++) s += acc[i][j];
        sink[t] = s;
    }
}

/* best of 5: GFLOP/s of the pool in wall time, and per CPU second */
static void fma_peak(int threads, double *wall, double *per_cpu_s) {
    float sink[64];
    *wall = *per_cpu_s = 0;
    for (int r = 0; r < 5; r++) {
        double t0 = now(), u0 = cpu_now();
        cpu_parallel_for(threads, 1, fma_chains, sink);
        double flop = threads * (double)PEAK_ITERS * 12 * 16 * 2;
        double g = flop / (now() - t0) * 1e-9, gc = flop / (cpu_now() - u0) * 1e-9;
        if (g > *wall) *wall = g;
        if (gc > *per_cpu_s) *per_cpu_s = gc;
    }
}

/* One shape, five ways, interleaved with a rotating order: OpenBLAS sgemm,
 * oneDNN f32, the engine's cpu_matmul_f32 (which picks one of the two),
 * oneDNN bf16 (bf16 in and out, f32 accumulation) and the engine's
 * cpu_matmul_bf16. Operands are stored as the engine's products store them
 * (a Linear's weight is (out, in), so its forward reads it transposed). */
static void bench_matmul(const char *what, int M, int K, int N, int ta, int tb) {
    float *a = alloc_filled((int64_t)M * K, 0.1f);   // (M, K) or (K, M)
    float *b = alloc_filled((int64_t)K * N, 0.2f);   // (K, N) or (N, K)
    float *c = alloc_filled((int64_t)M * N, 0.0f);   // (M, N)
    uint16_t *a16 = to_bf16(a, (int64_t)M * K), *b16 = to_bf16(b, (int64_t)K * N), *c16 = to_bf16(c, (int64_t)M * N);
    double flops = 2.0 * M * N * K, t[MM_KINDS][MM_REPS], u[MM_KINDS][MM_REPS];
    int ok[MM_KINDS] = {1, 1, 1, 1, 1};
    for (int r = -2; r < MM_REPS; r++) {   /* two warm-up rounds: threads, caches, primitive creation */
        for (int w = 0; w < MM_KINDS; w++) {
            int kind = (w + (r < 0 ? 0 : r)) % MM_KINDS;
            double t0 = now(), u0 = cpu_now();
            switch (kind) {
            case 0: cpu_matmul_f32_blas(c, a, b, 1, M, N, K, ta, tb, 1.0f, 0.0f, 0, 0, 0); break;
            case 1: ok[1] &= cpu_matmul_dnnl(0, c, a, b, 1, M, N, K, ta, tb, 1.0f, 0.0f, 0, 0, 0) == 0; break;
            case 2: cpu_matmul_f32(c, a, b, 1, M, N, K, ta, tb, 1.0f, 0.0f, 0, 0, 0); break;
            case 3: ok[3] &= cpu_matmul_dnnl(1, c16, a16, b16, 1, M, N, K, ta, tb, 1.0f, 0.0f, 0, 0, 0) == 0; break;
            default: cpu_matmul_bf16(c16, a16, b16, 1, M, N, K, ta, tb, 1.0f, 0.0f, 0, 0, 0); break;
            }
            if (r >= 0) {
                t[kind][r] = now() - t0;
                u[kind][r] = cpu_now() - u0;
            }
        }
    }
    double g[MM_KINDS], gc[MM_KINDS];
    for (int k = 0; k < MM_KINDS; k++) {
        g[k] = ok[k] ? flops / median(t[k], MM_REPS) * 1e-9 : 0.0;
        gc[k] = ok[k] ? flops / median(u[k], MM_REPS) * 1e-9 : 0.0;
    }
    printf("| %s | %dx%dx%d%s%s | %6.1f (%5.1f) | %6.1f (%5.1f) | %6.1f (%5.1f) %s | %6.1f (%5.1f) | %6.1f (%5.1f) |\n",
           what, M, K, N, ta ? " A^T" : "", tb ? " B^T" : "", g[0], gc[0], g[1], gc[1], g[2], gc[2],
           cpu_matmul_f32_route(1, M, N, K, ta, tb) ? "dnnl" : "blas", g[3], gc[3], g[4], gc[4]);
    free(a); free(b); free(c); free(a16); free(b16); free(c16);
}

/* A Linear of `in` -> `out` features on R = B*T rows: y = x @ W^T, dx = dy @ W,
 * dW = dy^T @ x, with W stored (out, in). */
static void bench_linear(const char *what, int R, int in, int out) {
    char name[96];
    snprintf(name, sizeof name, "%s forward", what);
    bench_matmul(name, R, in, out, 0, 1);
    snprintf(name, sizeof name, "%s dX", what);
    bench_matmul(name, R, out, in, 0, 0);
    snprintf(name, sizeof name, "%s dW", what);
    bench_matmul(name, out, R, in, 1, 0);
}

static void bench_matmuls(int threads) {
    double peak, peak_cpu;
    fma_peak(threads, &peak, &peak_cpu);
    printf("f32 FMA peak (registers only, %d threads): %.1f GFLOP/s, %.1f per CPU second\n", threads, peak, peak_cpu);
    printf("oneDNN at 256x768x2304: f32 %s; ", cpu_matmul_dnnl_impl(0, 256, 2304, 768));
    printf("bf16 %s\n\n", cpu_matmul_dnnl_impl(1, 256, 2304, 768));   /* (one static buffer) */
    printf("GFLOP/s (in brackets: GFLOP per CPU second of the process, which a shared host's load moves less)\n\n");
    printf("| use | M x K x N | OpenBLAS f32 | oneDNN f32 | engine f32 (its choice) | oneDNN bf16 | engine bf16 |\n"
           "|---|---|---|---|---|---|---|\n");
    /* GPT-2 small at batch 4 x 64: B*T = 256 rows */
    bench_linear("qkv", 256, 768, 2304);
    bench_linear("attn proj", 256, 768, 768);
    bench_linear("fc", 256, 768, 3072);
    bench_linear("mlp proj", 256, 3072, 768);
    bench_linear("LM head (tied wte)", 256, 768, 50304);
    /* the arithmetic ceiling a large square reaches */
    bench_matmul("square", 2048, 2048, 2048, 0, 0);
    /* small: the tiny preset (width 32) and per-head sizes */
    bench_matmul("tiny qkv forward", 64, 32, 96, 0, 1);
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

/* ---- the optimizer step's passes over the gradients ----
 * As a training step with clipping makes them, over arrays past the caches:
 * the gradient norm's sum of squares, the clip's scale, AdamW, and AdamW
 * reading the gradients scaled (opt:step { grad_scale }). Milliseconds and
 * GB/s of bytes read + written, interleaved, medians. */
#define OPT_REPS 7
static void bench_optimizer(void) {
    const int64_t n = 32 * 1024 * 1024;   /* 128 MiB per array */
    float *p = alloc_filled(n, 1.0f), *g = alloc_filled(n, 0.01f), *m = alloc_filled(n, 0.0f);
    float *v = alloc_filled(n, 0.0f), *flush = alloc_filled(n, 0.5f);
    double t[4][OPT_REPS];
    volatile double sink = 0;
    for (int r = -1; r < OPT_REPS; r++) {   /* one warm-up round */
        for (int k = 0; k < 4; k++) {
            cpu_scale_f32(flush, flush, 1.0f, n);   /* the arrays out of the caches */
            double t0 = now();
            switch (k) {
            case 0: sink += cpu_sumsq_f32(g, n); break;
            case 1: cpu_scale_f32(g, g, 1.0f, n); break;
            case 2: cpu_adamw_f32(p, g, m, v, n, 0.9f, 0.95f, 1e-8f, 0.9999f, 1e-4f, 1.0f, 1.0f); break;
            default: cpu_adamw_f32(p, g, m, v, n, 0.9f, 0.95f, 1e-8f, 0.9999f, 1e-4f, 1.0f, 0.5f); break;
            }
            if (r >= 0) t[k][r] = now() - t0;
        }
    }
    const char *what[4] = {"sumsq (the gradient norm)", "scale (the clip as a pass)", "adamw",
                           "adamw with grad_scale (the clip in its pass)"};
    const double bytes[4] = {4, 8, 28, 28};
    double ms[4];
    for (int k = 0; k < 4; k++) {
        ms[k] = median(t[k], OPT_REPS) * 1e3;
        printf("| %s, 32M floats | %7.2f ms | %6.1f GB/s |\n", what[k], ms[k], bytes[k] * n / ms[k] * 1e-6);
    }
    printf("| clip + step as passes (sumsq, scale, adamw) | %7.2f ms | |\n", ms[0] + ms[1] + ms[2]);
    printf("| clip in the step (sumsq, adamw with grad_scale) | %7.2f ms | |\n", ms[0] + ms[3]);
    free(p); free(g); free(m); free(v); free(flush);
}

int main(int argc, char **argv) {
    int threads = 2, matmul_only = 0, optim_only = 0;
    for (int i = 1; i < argc; i++) {
        if (strncmp(argv[i], "--threads=", 10) == 0) threads = atoi(argv[i] + 10);
        else if (strcmp(argv[i], "--matmul") == 0) matmul_only = 1;
        else if (strcmp(argv[i], "--optim") == 0) optim_only = 1;
        else { fprintf(stderr, "usage: %s [--threads=N] [--matmul] [--optim]\n", argv[0]); return 2; }
    }
    cpu_threads_set(threads);   /* OpenBLAS too */
    printf("threads: %d\n\n", cpu_threads_get());
    if (!optim_only) {
        printf("matmul, GFLOP/s, median of %d interleaved reps\n", MM_REPS);
        bench_matmuls(threads);
        if (matmul_only) return 0;
        printf("\n| elementwise (bytes read + written) | bandwidth | of best memcpy |\n|---|---|---|\n");
        bench_elementwise();
    }
    printf("\n| optimizer passes (bytes read + written) | time | bandwidth |\n|---|---|---|\n");
    bench_optimizer();
    return 0;
}
