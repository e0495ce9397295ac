/* cublas_v2.h (emulation): the cuBLAS calls of the engine, on the host
 * (tests/gpu/emu/cuda_emu.cpp); emu_ symbols behind macros, as in
 * cuda_runtime.h. */
#ifndef FSDP_EMU_CUBLAS_V2_H
#define FSDP_EMU_CUBLAS_V2_H

#include "cuda_runtime.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct emu_cublas_s *cublasHandle_t;
typedef enum cublasStatus_t {
    CUBLAS_STATUS_SUCCESS = 0,
    CUBLAS_STATUS_NOT_INITIALIZED = 1,
    CUBLAS_STATUS_INVALID_VALUE = 7,
    CUBLAS_STATUS_NOT_SUPPORTED = 15
} cublasStatus_t;
typedef enum cublasOperation_t { CUBLAS_OP_N = 0, CUBLAS_OP_T = 1 } cublasOperation_t;
typedef enum cublasMath_t { CUBLAS_DEFAULT_MATH = 0, CUBLAS_TF32_TENSOR_OP_MATH = 3 } cublasMath_t;

typedef enum cudaDataType_t { CUDA_R_32F = 0, CUDA_R_16BF = 14 } cudaDataType_t;
typedef enum cublasComputeType_t { CUBLAS_COMPUTE_32F = 68 } cublasComputeType_t;
typedef enum cublasGemmAlgo_t { CUBLAS_GEMM_DEFAULT = -1 } cublasGemmAlgo_t;

#define cublasCreate emu_cublasCreate
#define cublasSetStream emu_cublasSetStream
#define cublasSetMathMode emu_cublasSetMathMode
#define cublasGetStatusString emu_cublasGetStatusString
#define cublasSgemmStridedBatched emu_cublasSgemmStridedBatched
#define cublasGemmStridedBatchedEx emu_cublasGemmStridedBatchedEx
#define cublasGemmBatchedEx emu_cublasGemmBatchedEx

cublasStatus_t cublasCreate(cublasHandle_t *h);
cublasStatus_t cublasSetStream(cublasHandle_t h, cudaStream_t s);
cublasStatus_t cublasSetMathMode(cublasHandle_t h, cublasMath_t m);
const char *cublasGetStatusString(cublasStatus_t s);
cublasStatus_t cublasSgemmStridedBatched(cublasHandle_t h, cublasOperation_t ta, cublasOperation_t tb, int m, int n,
                                         int k, const float *alpha, const float *A, int lda, long long sa,
                                         const float *B, int ldb, long long sb, const float *beta, float *C, int ldc,
                                         long long sc, int batch);
/* f32 or bf16 operands and result (f32 compute only); a result of bf16 is
 * rounded once, to nearest even */
cublasStatus_t cublasGemmStridedBatchedEx(cublasHandle_t h, cublasOperation_t ta, cublasOperation_t tb, int m, int n,
                                          int k, const void *alpha, const void *A, cudaDataType_t at, int lda,
                                          long long sa, const void *B, cudaDataType_t bt, int ldb, long long sb,
                                          const void *beta, void *C, cudaDataType_t ct, int ldc, long long sc,
                                          int batch, cublasComputeType_t compute, cublasGemmAlgo_t algo);
/* The same over arrays of matrices: Aarray[i], Barray[i], Carray[i] (the
 * arrays themselves in device memory, as cuBLAS reads them on the GPU) */
cublasStatus_t cublasGemmBatchedEx(cublasHandle_t h, cublasOperation_t ta, cublasOperation_t tb, int m, int n, int k,
                                   const void *alpha, const void *const Aarray[], cudaDataType_t at, int lda,
                                   const void *const Barray[], cudaDataType_t bt, int ldb, const void *beta,
                                   void *const Carray[], cudaDataType_t ct, int ldc, int batch,
                                   cublasComputeType_t compute, cublasGemmAlgo_t algo);

#ifdef __cplusplus
}
#endif

#endif
