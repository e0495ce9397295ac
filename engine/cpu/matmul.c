/* matmul.c: batched C = alpha * op(A) @ op(B) + beta * C on OpenBLAS sgemm.
 * Row-major throughout. OpenBLAS threads each gemm itself, so batches run
 * one after another; where the batch can be folded into one bigger gemm
 * (shared B, contiguous A and C) it is, since one (batch*M, K) @ (K, N) gemm
 * runs much closer to peak than many small ones. */
#include "cpu_kernels.h"
#include <cblas.h>
#include <string.h>

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

void cpu_matmul_f32(float *c, const float *a, const float *b, int64_t batch, int64_t M, int64_t N, int64_t K,
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
