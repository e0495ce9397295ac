/* matmul.cu: batched C = alpha * op(A) @ op(B) + beta * C on cuBLAS.
 *
 * Everything is row-major; cuBLAS is column-major. A row-major (r, c)
 * matrix is, read column-major, its transpose (c, r) with the same leading
 * dimension. So row-major C = op(A) op(B) is column-major
 * C^T = op(B)^T op(A)^T: call cuBLAS with the operands swapped (B first),
 * m = N, n = M, and each operand's own transpose flag. TF32 is off unless
 * FSDP_CUDA_TF32=1 (cuda_device.cu), so products are plain f32. bf16
 * operands go to the tensor cores through cublasGemmStridedBatchedEx with
 * f32 accumulation (CUBLAS_COMPUTE_32F) and a bf16 result. */
#include "cuda_internal.h"
#include <limits.h>

/* K == 0: the product is empty, so C = beta * C (0 when beta is 0, even over NaN). */
__global__ void scale_c_kernel(float *c, int64_t batch, int64_t mn, int64_t stride_c, float beta) {
    GRID_STRIDE(i, batch * mn) {
        float *ci = c + (i / mn) * stride_c + i % mn;
        *ci = beta == 0.0f ? 0.0f : beta * *ci;
    }
}

/* K == 0 for bf16: C = beta * C, through f32 (rare: an empty product). */
__global__ void scale_c_bf16_kernel(uint16_t *c, int64_t batch, int64_t mn, int64_t stride_c, float beta) {
    GRID_STRIDE(i, batch * mn) {
        uint16_t *ci = c + (i / mn) * stride_c + i % mn;
        *ci = beta == 0.0f ? (uint16_t)0 : f32_to_bf16(beta * bf16_to_f32(*ci));
    }
}

void cuda_matmul_bf16(uint16_t *c, const uint16_t *a, const uint16_t *b, int64_t batch, int64_t M, int64_t N,
                      int64_t K, int trans_a, int trans_b, float alpha, float beta, int64_t stride_a,
                      int64_t stride_b, int64_t stride_c) {
    CUDA_ENTER();
    if (batch <= 0 || M <= 0 || N <= 0) return;
    if (K <= 0) {
        LAUNCH(scale_c_bf16_kernel, cuda_blocks(batch * M * N, CUDA_THREADS), CUDA_THREADS, 0)(c, batch, M * N,
                                                                                               stride_c, beta);
        CUDA_CHECK_LAUNCH();
        return;
    }
    if (M > INT_MAX || N > INT_MAX || K > INT_MAX)
        cuda_fail(__func__, __FILE__, __LINE__, "cublasGemmStridedBatchedEx", "a dimension beyond 2^31 - 1");
    int lda = (int)(trans_b ? K : N), ldb = (int)(trans_a ? M : K), ldc = (int)N;   /* as in cuda_matmul_f32 */
    cublasOperation_t op_b = trans_b ? CUBLAS_OP_T : CUBLAS_OP_N, op_a = trans_a ? CUBLAS_OP_T : CUBLAS_OP_N;
    for (int64_t b0 = 0; b0 < batch; b0 += INT_MAX) {
        int count = (int)cuda_min64(batch - b0, INT_MAX);
        CUBLAS_CHECK(cublasGemmStridedBatchedEx(cuda_cublas(), op_b, op_a, (int)N, (int)M, (int)K, &alpha,
                                                b + b0 * stride_b, CUDA_R_16BF, lda, (long long)stride_b,
                                                a + b0 * stride_a, CUDA_R_16BF, ldb, (long long)stride_a, &beta,
                                                c + b0 * stride_c, CUDA_R_16BF, ldc, (long long)stride_c, count,
                                                CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
    }
}

void cuda_matmul_f32(float *c, const float *a, const float *b, int64_t batch, int64_t M, int64_t N, int64_t K,
                     int trans_a, int trans_b, float alpha, float beta, int64_t stride_a, int64_t stride_b,
                     int64_t stride_c) {
    CUDA_ENTER();
    if (batch <= 0 || M <= 0 || N <= 0) return;
    if (K <= 0) {
        LAUNCH(scale_c_kernel, cuda_blocks(batch * M * N, CUDA_THREADS), CUDA_THREADS, 0)(c, batch, M * N, stride_c,
                                                                                          beta);
        CUDA_CHECK_LAUNCH();
        return;
    }
    if (M > INT_MAX || N > INT_MAX || K > INT_MAX)
        cuda_fail(__func__, __FILE__, __LINE__, "cublasSgemmStridedBatched", "a dimension beyond 2^31 - 1");
    int lda = (int)(trans_b ? K : N);   /* cuBLAS's A is our B: stored (N, K) or (K, N) row-major */
    int ldb = (int)(trans_a ? M : K);   /* cuBLAS's B is our A: stored (K, M) or (M, K) row-major */
    int ldc = (int)N;
    cublasOperation_t op_b = trans_b ? CUBLAS_OP_T : CUBLAS_OP_N, op_a = trans_a ? CUBLAS_OP_T : CUBLAS_OP_N;
    for (int64_t b0 = 0; b0 < batch; b0 += INT_MAX) {   /* batchCount is an int */
        int count = (int)cuda_min64(batch - b0, INT_MAX);
        CUBLAS_CHECK(cublasSgemmStridedBatched(cuda_cublas(), op_b, op_a, (int)N, (int)M, (int)K, &alpha,
                                               b + b0 * stride_b, lda, (long long)stride_b, a + b0 * stride_a, ldb,
                                               (long long)stride_a, &beta, c + b0 * stride_c, ldc,
                                               (long long)stride_c, count));
    }
}
