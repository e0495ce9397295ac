/* test_cuda_kernels_bench.c: test_cuda_kernels --bench (time per call of
 * the main kernels at GPT-2 small sizes on a GPU, toy sizes in the
 * emulation) and --flash B H T D (the flash attention once at one shape,
 * for a profiler). */
#include "cuda_kernels_check.h"
#include <time.h>

/* ---- --bench: time per call at GPT-2 small sizes (B 8, T 1024, C 768, H 12) ---- */

static double now_s(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + (double)t.tv_nsec * 1e-9;
}

#define BENCH(label, work, unit, CALL)                                                                  \
    do {                                                                                                \
        CALL;                                                                                           \
        G->synchronize();                                                                               \
        double t0_ = now_s();                                                                           \
        for (int r_ = 0; r_ < 10; r_++) CALL;                                                           \
        G->synchronize();                                                                               \
        double ms_ = (now_s() - t0_) * 100.0;                                                           \
        printf("  %-44s %9.3f ms  %8.1f %s\n", label, ms_, (work) / (ms_ * 1e-3) * 1e-9, unit);         \
    } while (0)

static float *dev_uniform(int64_t n) {
    float *d = dalloc((size_t)n * sizeof(float));
    G->init_uniform_f32(d, n, -1.0f, 1.0f, 1, 1, 0);
    return d;
}

int bench(int tiny) {   /* tiny: toy sizes, to run the code in the emulation */
    const int64_t B = tiny ? 2 : 8, T = tiny ? 32 : 1024, Cd = tiny ? 48 : 768, H = tiny ? 3 : 12, D = 16 * (H == 3) + 64 * (H == 12);
    const int64_t V = tiny ? 97 : 50257, Vp = tiny ? 128 : 50304, N = B * T, P = tiny ? 1000 : 124000000;
    printf("time per call, mean of 10 after one warm-up (GB/s counts the bytes read and written once):\n");
    float *x = dev_uniform(N * 4 * Cd), *w = dev_uniform(4 * Cd * Cd), *y = dev_uniform(N * 4 * Cd);
    BENCH("matmul (8192x768) @ (768x3072)", 2.0 * N * Cd * 4 * Cd, "GFLOP/s",
          G->matmul_f32(y, x, w, 1, N, 4 * Cd, Cd, 0, 0, 1.0f, 0.0f, 0, 0, 0));
    BENCH("matmul (8192x3072) @ (768x3072)^T", 2.0 * N * Cd * 4 * Cd, "GFLOP/s",
          G->matmul_f32(x, y, w, 1, N, Cd, 4 * Cd, 0, 1, 1.0f, 0.0f, 0, 0, 0));
    float *q = dev_uniform(N * Cd), *k = dev_uniform(N * Cd), *v = dev_uniform(N * Cd), *o = dev_uniform(N * Cd);
    float *lse = dev_uniform(B * H * T), *dq = dev_uniform(N * Cd), *dk = dev_uniform(N * Cd), *dv = dev_uniform(N * Cd);
    double att = 4.0 * B * H * T * T * D / 2;   /* causal: half the scores */
    BENCH("attention forward (8,12,1024,64) causal", att, "GFLOP/s",
          G->attention_forward_f32(o, lse, q, k, v, B, H, T, D, 1, 0.125f));
    BENCH("attention backward (8,12,1024,64) causal", 2.5 * att, "GFLOP/s",
          G->attention_backward_f32(dq, dk, dv, o, q, k, v, o, lse, B, H, T, D, 1, 0.125f));
    /* bf16 attention from a packed qkv, in the same run: the flash kernels and the GEMM path (model
     * FLOPs: the backward counts twice the forward's products, whatever it recomputes) */
    uint16_t *qkv16 = dalloc((size_t)N * 3 * Cd * 2), *o16 = dalloc((size_t)N * Cd * 2);
    uint16_t *do16 = dalloc((size_t)N * Cd * 2), *dqkv16 = dalloc((size_t)N * 3 * Cd * 2);
    G->cast_any(qkv16, FSDP_BF16, x, FSDP_F32, N * 3 * Cd);
    G->cast_any(do16, FSDP_BF16, y, FSDP_F32, N * Cd);
    float *lse16 = dev_uniform(B * H * T), *drow16 = dev_uniform(B * H * T);
    if (G->attention_flash_forward_bf16 && G->attention_flash_backward_bf16) {
        BENCH("flash attention forward bf16 (8,12,1024,64) causal", att, "GFLOP/s",
              G->attention_flash_forward_bf16(o16, lse16, qkv16, B, H, T, D, 1, 0.125f));
        BENCH("flash attention backward bf16 (8,12,1024,64) causal", 2 * att, "GFLOP/s",
              G->attention_flash_backward_bf16(dqkv16, drow16, do16, qkv16, o16, lse16, B, H, T, D, 1, 0.125f));
    }
    if (G->attention_qkv_forward_bf16 && G->attention_qkv_backward_bf16) {
        uint16_t *probs = dalloc((size_t)B * H * T * T * 2), *dscores = dalloc((size_t)B * H * T * T * 2);
        float *scores = dalloc((size_t)B * H * T * T * 4);
        BENCH("GEMM attention forward bf16 (8,12,1024,64) causal", att, "GFLOP/s",
              G->attention_qkv_forward_bf16(o16, probs, scores, qkv16, B, H, T, D, 1, 0.125f));
        BENCH("GEMM attention backward bf16 (8,12,1024,64) causal", 2 * att, "GFLOP/s",
              G->attention_qkv_backward_bf16(dqkv16, scores, dscores, do16, qkv16, probs, B, H, T, D, 1, 0.125f));
    }
    float *mean = dev_uniform(N), *rstd = dev_uniform(N), *g = dev_uniform(Cd), *bb = dev_uniform(Cd);
    BENCH("layernorm forward (8192, 768)", 8.0 * N * Cd, "GB/s",
          G->layernorm_forward_f32(y, mean, rstd, x, g, bb, N, Cd, 1e-5f));
    BENCH("layernorm backward (8192, 768)", 12.0 * N * Cd, "GB/s",
          G->layernorm_backward_f32(y, dq, dk, q, x, g, mean, rstd, N, Cd));
    BENCH("gelu forward (8192 x 3072)", 8.0 * N * 4 * Cd, "GB/s", G->gelu_forward_f32(y, x, N * 4 * Cd));
    BENCH("gelu backward (8192 x 3072)", 12.0 * N * 4 * Cd, "GB/s", G->gelu_backward_f32(y, x, y, N * 4 * Cd));
    BENCH("softmax forward (8192, 1024)", 8.0 * N * T, "GB/s", G->softmax_forward_f32(y, x, N, T));
    BENCH("sum_dim bias grad (8192, 3072) -> 3072", 4.0 * N * 4 * Cd, "GB/s",
          G->sum_dim_f32(y, x, 1, N, 4 * Cd));
    BENCH("copy_strided (8,1024,12,64) -> (8,12,1024,64)", 8.0 * N * Cd, "GB/s",
          G->copy_strided(y, (const int64_t[]){H * T * D, D, T * D, 1}, x, (const int64_t[]){T * Cd, Cd, D, 1}, 4,
                          (const int64_t[]){B, T, H, D}, sizeof(float)));
    float *logits = dev_uniform(N * Vp), *losses = dev_uniform(N);
    int64_t *ids = halloc((size_t)N * sizeof(int64_t));
    for (int64_t i = 0; i < N; i++) ids[i] = (i * 7919) % V;
    int64_t *dids = dup_bytes(ids, (size_t)N * sizeof(int64_t));
    BENCH("cross_entropy forward (8192, 50304)", 8.0 * N * Vp, "GB/s",
          G->cross_entropy_forward_f32(losses, lse, logits, dids, N, Vp, V, -100));
    float one = 1.0f, *gone = dupf(&one, 1);
    BENCH("cross_entropy backward (8192, 50304)", 8.0 * N * Vp, "GB/s",
          G->cross_entropy_backward_f32(logits, logits, lse, dids, N, Vp, V, -100, gone, N));
    float *table = dev_uniform(Vp * Cd);
    BENCH("embedding forward (8192 ids, 768)", 8.0 * N * Cd, "GB/s", G->embedding_forward_f32(y, dids, N, table, Cd));
    BENCH("embedding backward (50257 x 768, 8192 ids)", 4.0 * (V + 2 * N) * Cd, "GB/s",
          G->embedding_backward_f32(table, V, dids, N, y, Cd));
    uint16_t *table16 = dalloc((size_t)(Vp * Cd) * 2), *y16 = dalloc((size_t)(N * Cd) * 2);
    G->cast_any(table16, FSDP_BF16, table, FSDP_F32, Vp * Cd);
    G->cast_any(y16, FSDP_BF16, y, FSDP_F32, N * Cd);
    /* bytes: dout, and each row of an id read and written (the ids here are all distinct) */
    BENCH("embedding backward acc bf16 (8192 ids, 768)", 2.0 * 3 * N * Cd, "GB/s",
          G->embedding_backward_acc_bf16(table16, dids, N, y16, Cd));
    /* a frequent id: every 8th position the same token (one block sums its N / 8 rows in order) */
    int64_t *zids = halloc((size_t)N * sizeof(int64_t));
    for (int64_t i = 0; i < N; i++) zids[i] = i % 8 == 0 ? 13 : ids[i];
    int64_t *dzids = dup_bytes(zids, (size_t)N * sizeof(int64_t));
    BENCH("embedding backward acc bf16, 1/8 one id", 2.0 * (N + 2 * (N - N / 8 + 1)) * Cd, "GB/s",
          G->embedding_backward_acc_bf16(table16, dzids, N, y16, Cd));
    float *p = dev_uniform(P), *pg = dev_uniform(P), *m1 = dev_uniform(P), *m2 = dev_uniform(P);
    G->scale_f32(m2, m2, 0.0f, P);
    BENCH("adamw (124M parameters)", 28.0 * P, "GB/s",
          G->adamw_f32(p, pg, m1, m2, P, 0.9f, 0.999f, 1e-8f, 0.9999f, 1e-4f, 1.0f, 1.0f));
    BENCH("sumsq (124M)", 4.0 * P, "GB/s", (void)G->sumsq_f32(pg, P));
    BENCH("init_normal (124M)", 4.0 * P, "GB/s", G->init_normal_f32(p, P, 0.0f, 0.02f, 1, 2, 0));
    free_case();
    fsdp_status last = cuda_last_status();
    return last == FSDP_OK ? 0 : 1;
}

/* --flash B H T D: the flash attention forward and backward (causal, bf16)
 * once each at one shape, nothing else, for a profiler to measure (ncu's
 * DRAM bytes per kernel, tools/gpu-check's flash-dram stage) */
int flash_once(int argc, char **argv) {
    int64_t s[4];
    for (int i = 0; i < 4; i++) s[i] = 2 + i < argc ? strtoll(argv[2 + i], NULL, 10) : 0;
    const int64_t B = s[0], H = s[1], T = s[2], D = s[3], C3 = 3 * H * D;
    if (!G->attention_flash_forward_bf16 || !attention_flash_covers(B, H, T, D)) {
        printf("FAILED: --flash B H T D: (%lld, %lld, %lld, %lld) is not a shape the flash kernels cover\n",
               (long long)B, (long long)H, (long long)T, (long long)D);
        return 1;
    }
    float *x = dev_uniform(B * T * C3);
    uint16_t *qkv = dalloc((size_t)(B * T * C3) * 2), *dqkv = dalloc((size_t)(B * T * C3) * 2);
    uint16_t *o = dalloc((size_t)(B * T * H * D) * 2), *dout = dalloc((size_t)(B * T * H * D) * 2);
    float *lse = dalloc((size_t)(B * H * T) * 4), *drow = dalloc((size_t)(B * H * T) * 4);
    G->cast_any(qkv, FSDP_BF16, x, FSDP_F32, B * T * C3);
    G->cast_any(dout, FSDP_BF16, x, FSDP_F32, B * T * H * D);
    const float scale = 1.0f / sqrtf((float)D);
    G->attention_flash_forward_bf16(o, lse, qkv, B, H, T, D, 1, scale);
    G->attention_flash_backward_bf16(dqkv, drow, dout, qkv, o, lse, B, H, T, D, 1, scale);
    G->synchronize();
    fsdp_status last = cuda_last_status();
    printf("flash attention forward and backward, bf16, causal, (B %lld, H %lld, T %lld, D %lld): %s\n",
           (long long)B, (long long)H, (long long)T, (long long)D, last == FSDP_OK ? "ran" : "FAILED");
    free_case();
    return last == FSDP_OK ? 0 : 1;
}
