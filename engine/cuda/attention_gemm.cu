/* attention_gemm.cu: attention on the tensor cores, straight from the
 * packed qkv buffer of a fused projection.
 *
 * qkv (B, T, 3C) holds, per token, the heads of q, then of k, then of v:
 * head h of q at column h D, of k at C + h D, of v at 2C + h D (C = H D).
 * So the (T, D) matrix of q for (b, h) starts at qkv + b T 3C + h D with
 * rows 3C apart: a GEMM operand with leading dimension 3C, no copy. The
 * output (B, T, C) takes head h at column h D (leading dimension C), which
 * is the layout the output projection reads, and dqkv is written the same
 * way as qkv. The batch of a GEMM is the B x H heads; their bases are not
 * one stride apart (b strides T 3C, h strides D), so the GEMMs take arrays
 * of pointers (cublasGemmBatchedEx), made by one small kernel per call.
 *
 * Forward, per head (s = scale):
 *   S = Q K^T                      (T, T) f32, bf16 operands, f32 accumulation
 *   P = softmax(s S), causal mask   (T, T) bf16, saved for the backward
 *   O = P V                        (T, D) bf16, into out
 * Backward, with dO the gradient of O:
 *   dV = P^T dO,  dP = dO V^T      (dP f32)
 *   dS = s P (dP - rowsum(P dP))   (T, T) bf16: the gradient of S
 *   dQ = dS K,    dK = dS^T Q
 * Scores and their gradient are f32 (an error in a score becomes a relative
 * error in its probability); probabilities and dS are bf16, the operands of
 * the tensor cores, as in a bf16 PyTorch or llm.c model. The CPU reference
 * is engine/cpu/attention.c (f32, flash-style) on the unpacked q, k, v.
 * The (T, T) buffers are the op layer's (engine/ops/attention.c), so the engine's
 * allocator counts them. */
#include "cuda_internal.h"
#include <limits.h>

/* ---- arrays of pointers for the batched GEMMs ---- */

#define ATTG_MAX_ARRAYS 10

/* Array g holds, for head i = b H + h, base[g] + b sb[g] + h sh[g] (bytes). */
struct attg_ptr_specs {
    const char *base[ATTG_MAX_ARRAYS];
    int64_t sb[ATTG_MAX_ARRAYS], sh[ATTG_MAX_ARRAYS];
    int n;
};

__global__ void attg_pointers_kernel(const void **arrays, attg_ptr_specs s, int64_t BH, int64_t H) {
    GRID_STRIDE(i, BH * s.n) {
        int64_t g = i / BH, bh = i % BH;
        arrays[i] = s.base[g] + (bh / H) * s.sb[g] + (bh % H) * s.sh[g];
    }
}

/* One device buffer for the arrays, grown when a call needs more; the old one
 * is freed in stream order, after the GEMMs that read it. */
static const void **g_arrays;
static size_t g_arrays_cap;

static const void **attg_arrays(const attg_ptr_specs &s, int64_t BH, int64_t H) {
    size_t need = (size_t)(BH * s.n);
    if (need > g_arrays_cap) {
        cuda_tmp_free((void *)g_arrays);
        g_arrays = (const void **)cuda_tmp_alloc(need * sizeof(void *));
        g_arrays_cap = need;
    }
    LAUNCH(attg_pointers_kernel, cuda_blocks(BH * s.n, CUDA_THREADS), CUDA_THREADS, 0)(g_arrays, s, BH, H);
    CUDA_CHECK_LAUNCH();
    return g_arrays;
}

static void attg_add(attg_ptr_specs &s, const void *base, int64_t sb, int64_t sh) {
    s.base[s.n] = (const char *)base;
    s.sb[s.n] = sb;
    s.sh[s.n] = sh;
    s.n++;
}

/* Row-major C (M, N) = alpha op(A) op(B) + beta C for every head, A, B, C
 * from the pointer arrays; lda, ldb, ldc are the row strides as stored.
 * Column-major cuBLAS sees the transposes, so B goes first (as in
 * matmul.cu). */
static void attg_gemm(const void *const *A, cudaDataType_t at, int lda, const void *const *Bp, cudaDataType_t bt,
                      int ldb, void *const *Cp, cudaDataType_t ct, int ldc, int64_t BH, int64_t M, int64_t N,
                      int64_t K, int trans_a, int trans_b, float alpha, float beta) {
    cublasOperation_t op_a = trans_a ? CUBLAS_OP_T : CUBLAS_OP_N, op_b = trans_b ? CUBLAS_OP_T : CUBLAS_OP_N;
    CUBLAS_CHECK(cublasGemmBatchedEx(cuda_cublas(), op_b, op_a, (int)N, (int)M, (int)K, &alpha, Bp, bt, ldb, A, at,
                                     lda, &beta, Cp, ct, ldc, (int)BH, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
}

/* ---- row kernels over the (B H T, T) scores: a warp per row ---- */

#define ATTG_THREADS 256
#define ATTG_ROWS_PER_BLOCK (ATTG_THREADS / 32)

/* P = softmax(scale S) over the keys a query sees (j <= i under the causal
 * mask, else all T); 0 where masked. CPU reference: the softmax inside
 * engine/cpu/attention.c. */
__global__ void __launch_bounds__(ATTG_THREADS) attg_softmax_kernel(uint16_t *__restrict__ probs,
                                                                    const float *__restrict__ scores, int64_t rows,
                                                                    int64_t T, int causal, float scale) {
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    for (int64_t r = (int64_t)blockIdx.x * ATTG_ROWS_PER_BLOCK + warp; r < rows;
         r += (int64_t)gridDim.x * ATTG_ROWS_PER_BLOCK) {
        const float *s = scores + r * T;   // (T)
        uint16_t *p = probs + r * T;       // (T)
        int64_t seen = causal ? r % T + 1 : T;
        float mx = -INFINITY;
        for (int64_t j = lane; j < seen; j += 32) mx = fmaxf(mx, scale * s[j]);
        mx = warp_max_f(mx);
        float sum = 0.0f;
        for (int64_t j = lane; j < seen; j += 32) sum += expf(scale * s[j] - mx);
        float inv = 1.0f / warp_sum_f(sum);
        for (int64_t j = lane; j < T; j += 32)
            p[j] = j < seen ? f32_to_bf16(expf(scale * s[j] - mx) * inv) : (uint16_t)0;
    }
}

/* dS = scale P (dP - sum_j P dP) per row; 0 where masked. */
__global__ void __launch_bounds__(ATTG_THREADS) attg_softmax_backward_kernel(uint16_t *__restrict__ dscores,
                                                                             const float *__restrict__ dprobs,
                                                                             const uint16_t *__restrict__ probs,
                                                                             int64_t rows, int64_t T, int causal,
                                                                             float scale) {
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    for (int64_t r = (int64_t)blockIdx.x * ATTG_ROWS_PER_BLOCK + warp; r < rows;
         r += (int64_t)gridDim.x * ATTG_ROWS_PER_BLOCK) {
        const float *dp = dprobs + r * T;   // (T)
        const uint16_t *p = probs + r * T;  // (T)
        uint16_t *ds = dscores + r * T;     // (T)
        int64_t seen = causal ? r % T + 1 : T;
        float dot = 0.0f;
        for (int64_t j = lane; j < seen; j += 32) dot += bf16_to_f32(p[j]) * dp[j];
        dot = warp_sum_f(dot);
        for (int64_t j = lane; j < T; j += 32)
            ds[j] = j < seen ? f32_to_bf16(scale * bf16_to_f32(p[j]) * (dp[j] - dot)) : (uint16_t)0;
    }
}

static unsigned attg_row_blocks(int64_t rows) {
    int64_t b = cuda_ceil_div(rows, ATTG_ROWS_PER_BLOCK), cap = (int64_t)cuda_sm_count() * 16;
    return (unsigned)(b < cap ? b : cap);
}

static void attg_check_shape(const char *op, int64_t B, int64_t H, int64_t T, int64_t D) {
    /* cuBLAS takes int sizes, leading dimensions and batch counts; the op
     * layer sends larger shapes down the f32 path */
    if (B * H > INT_MAX || T > INT_MAX || 3 * H * D > INT_MAX)
        cuda_fail(op, __FILE__, __LINE__, "cublasGemmBatchedEx", "attention shape beyond int sizes");
}

/* out (B, T, C), probs (B, H, T, T) bf16; scores (B, H, T, T) f32 scratch;
 * qkv (B, T, 3C). */
void cuda_attention_qkv_forward_bf16(uint16_t *out, uint16_t *probs, float *scores, const uint16_t *qkv, int64_t B,
                                     int64_t H, int64_t T, int64_t D, int causal, float scale) {
    CUDA_ENTER();
    if (B * H <= 0 || T <= 0 || D <= 0) return;
    attg_check_shape(__func__, B, H, T, D);
    const int64_t C = H * D, BH = B * H, e = sizeof(uint16_t), TT = T * T;
    attg_ptr_specs s;
    s.n = 0;
    attg_add(s, qkv, T * 3 * C * e, D * e);            // 0: Q
    attg_add(s, qkv + C, T * 3 * C * e, D * e);        // 1: K
    attg_add(s, scores, H * TT * 4, TT * 4);           // 2: S
    attg_add(s, probs, H * TT * e, TT * e);            // 3: P
    attg_add(s, qkv + 2 * C, T * 3 * C * e, D * e);    // 4: V
    attg_add(s, out, T * C * e, D * e);                // 5: O
    const void **arr = attg_arrays(s, BH, H);
    void *const *w = (void *const *)arr;
    /* S = Q K^T */
    attg_gemm(arr, CUDA_R_16BF, (int)(3 * C), arr + BH, CUDA_R_16BF, (int)(3 * C), w + 2 * BH, CUDA_R_32F, (int)T, BH,
              T, T, D, 0, 1, 1.0f, 0.0f);
    LAUNCH(attg_softmax_kernel, attg_row_blocks(BH * T), ATTG_THREADS, 0)(probs, scores, BH * T, T, causal, scale);
    CUDA_CHECK_LAUNCH();
    /* O = P V */
    attg_gemm(arr + 3 * BH, CUDA_R_16BF, (int)T, arr + 4 * BH, CUDA_R_16BF, (int)(3 * C), w + 5 * BH, CUDA_R_16BF,
              (int)C, BH, T, D, T, 0, 0, 1.0f, 0.0f);
}

/* dqkv (B, T, 3C) every element written; dprobs (B, H, T, T) f32 and
 * dscores (B, H, T, T) bf16 scratch; dout (B, T, C); probs from the forward. */
void cuda_attention_qkv_backward_bf16(uint16_t *dqkv, float *dprobs, uint16_t *dscores, const uint16_t *dout,
                                      const uint16_t *qkv, const uint16_t *probs, int64_t B, int64_t H, int64_t T,
                                      int64_t D, int causal, float scale) {
    CUDA_ENTER();
    if (B * H <= 0 || T <= 0 || D <= 0) return;
    attg_check_shape(__func__, B, H, T, D);
    const int64_t C = H * D, BH = B * H, e = sizeof(uint16_t), TT = T * T, row3 = T * 3 * C * e;
    attg_ptr_specs s;
    s.n = 0;
    attg_add(s, probs, H * TT * e, TT * e);            // 0: P
    attg_add(s, dout, T * C * e, D * e);               // 1: dO
    attg_add(s, dqkv + 2 * C, row3, D * e);            // 2: dV
    attg_add(s, qkv + 2 * C, row3, D * e);             // 3: V
    attg_add(s, dprobs, H * TT * 4, TT * 4);           // 4: dP
    attg_add(s, dscores, H * TT * e, TT * e);          // 5: dS
    attg_add(s, qkv + C, row3, D * e);                 // 6: K
    attg_add(s, dqkv, row3, D * e);                    // 7: dQ
    attg_add(s, qkv, row3, D * e);                     // 8: Q
    attg_add(s, dqkv + C, row3, D * e);                // 9: dK
    const void **arr = attg_arrays(s, BH, H);
    void *const *w = (void *const *)arr;
    const int ld3 = (int)(3 * C);
    /* dV = P^T dO */
    attg_gemm(arr, CUDA_R_16BF, (int)T, arr + BH, CUDA_R_16BF, (int)C, w + 2 * BH, CUDA_R_16BF, ld3, BH, T, D, T, 1, 0,
              1.0f, 0.0f);
    /* dP = dO V^T */
    attg_gemm(arr + BH, CUDA_R_16BF, (int)C, arr + 3 * BH, CUDA_R_16BF, ld3, w + 4 * BH, CUDA_R_32F, (int)T, BH, T, T,
              D, 0, 1, 1.0f, 0.0f);
    LAUNCH(attg_softmax_backward_kernel, attg_row_blocks(BH * T), ATTG_THREADS, 0)(dscores, dprobs, probs, BH * T, T,
                                                                                   causal, scale);
    CUDA_CHECK_LAUNCH();
    /* dQ = dS K */
    attg_gemm(arr + 5 * BH, CUDA_R_16BF, (int)T, arr + 6 * BH, CUDA_R_16BF, ld3, w + 7 * BH, CUDA_R_16BF, ld3, BH, T,
              D, T, 0, 0, 1.0f, 0.0f);
    /* dK = dS^T Q */
    attg_gemm(arr + 5 * BH, CUDA_R_16BF, (int)T, arr + 8 * BH, CUDA_R_16BF, ld3, w + 9 * BH, CUDA_R_16BF, ld3, BH, T,
              D, T, 1, 0, 1.0f, 0.0f);
}
