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
#include "cpu_kernels.h"
#include <cblas.h>
#include <stdlib.h>
#include <string.h>

/* oneDNN f32 from this many multiply-adds (M*N*K) up; OpenBLAS below. */
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

/* Which library runs an f32 matmul. Measured with tools/bench_kernels (see
 * BENCHMARKS.md): FSDP_MATMUL_F32=blas or =dnnl forces one (for that
 * benchmark and for tests). */
static int f32_route = -1;   /* -1 not read yet, 0 by shape, 1 OpenBLAS, 2 oneDNN */

static int f32_use_dnnl(int64_t batch, int64_t M, int64_t N, int64_t K) {
    if (f32_route < 0) {
        const char *s = getenv("FSDP_MATMUL_F32");
        f32_route = s && !strcmp(s, "blas") ? 1 : s && !strcmp(s, "dnnl") ? 2 : 0;
    }
    if (f32_route) return f32_route == 2;
    (void)batch;
    return M * N * K >= DNNL_F32_MIN_MNK;
}

void cpu_matmul_f32(float *c, const float *a, const float *b, int64_t batch, int64_t M, int64_t N, int64_t K,
                    int trans_a, int trans_b, float alpha, float beta,
                    int64_t stride_a, int64_t stride_b, int64_t stride_c) {
    if (batch <= 0 || M <= 0 || N <= 0) return;
    if (K > 0 && f32_use_dnnl(batch, M, N, K) &&
        cpu_matmul_dnnl(0, c, a, b, batch, M, N, K, trans_a, trans_b, alpha, beta, stride_a, stride_b, stride_c) == 0)
        return;
    cpu_matmul_f32_blas(c, a, b, batch, M, N, K, trans_a, trans_b, alpha, beta, stride_a, stride_b, stride_c);
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
static void matmul_bf16_via_f32(uint16_t *c, const uint16_t *a, const uint16_t *b, int64_t batch, int64_t M,
                                int64_t N, int64_t K, int ta, int tb, float alpha, float beta, int64_t sa,
                                int64_t sb, int64_t sc) {
    float *wa = malloc((size_t)(M * K) * sizeof *wa), *wb = malloc((size_t)(K * N) * sizeof *wb);
    float *wc = malloc((size_t)(M * N) * sizeof *wc);
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
        cpu_matmul_f32(wc, wa, wb, 1, M, N, K, ta, tb, alpha, beta, 0, 0, 0);
        cpu_cast_f32_to_bf16(ci, wc, M * N);
    }
    free(wa);
    free(wb);
    free(wc);
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

void cpu_matmul_bf16(uint16_t *c, const uint16_t *a, const uint16_t *b, int64_t batch, int64_t M, int64_t N,
                     int64_t K, int trans_a, int trans_b, float alpha, float beta,
                     int64_t stride_a, int64_t stride_b, int64_t stride_c) {
    if (batch <= 0 || M <= 0 || N <= 0) return;
    if (K > 0 && dnnl_bf16_is_native() && cpu_matmul_dnnl(1, c, a, b, batch, M, N, K, trans_a, trans_b, alpha, beta, stride_a, stride_b,
                                 stride_c) == 0)
        return;
    matmul_bf16_via_f32(c, a, b, batch, M, N, K, trans_a, trans_b, alpha, beta, stride_a, stride_b, stride_c);
}
