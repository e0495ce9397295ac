/* cublasLt.h (emulation): the cuBLASLt calls of the engine
 * (engine/cuda/matmul_lt.cu), on the host (tests/gpu/emu/cublaslt_emu.cpp);
 * emu_ symbols behind macros, as in cuda_runtime.h. The names, enum values,
 * attribute types and status codes are the real header's (CUDA 12/13).
 *
 * What it models, and checks, as the real library does (its header's rules):
 * - Column-major D = epilogue(alpha op(A) op(B) + beta C), f32 compute,
 *   accumulated in double here, bf16 operands and result rounded once;
 *   C read only when beta != 0 (it may then be D, with D's layout).
 * - The epilogues DEFAULT, BIAS, GELU_AUX_BIAS, DGELU_BGRAD and BGRADB:
 *   bias (BIAS_POINTER) of D's rows count; the GELU input (AUX_POINTER) of
 *   D's shape with AUX_LD divisible by 8 and no less than D's rows; bias and
 *   aux in D's type (bf16); GELU is the tanh form; bias gradients are sums
 *   of the f32 values before rounding, written (not added).
 * - Descriptor attributes checked for size (CUBLAS_STATUS_INVALID_VALUE);
 *   layouts checked against m, n, k and the transposes; an epilogue without
 *   its pointers, or an AUX_LD against the rules, is INVALID_VALUE.
 * - Alignment: an algorithm from cublasLtMatmulAlgoGetHeuristic needs A, B,
 *   C and D aligned to the preference's MIN_ALIGNMENT_*_BYTES (default 256,
 *   as the real one) and bias and aux aligned as the pointers set in the
 *   descriptor were at the query (at most 16 bytes); cublasLtMatmul refuses
 *   (CUBLAS_STATUS_INVALID_VALUE) what it could not run, as does a workspace
 *   smaller than the algorithm's.
 * - Every buffer must be device memory; the host guard opens A, B, C, D,
 *   bias, aux and the workspace while the product runs.
 * Test control: emu_cublaslt_set_no_algo makes the heuristic find nothing,
 * so that a caller's fallback is exercised. */
#ifndef FSDP_EMU_CUBLASLT_H
#define FSDP_EMU_CUBLASLT_H

#include "cublas_v2.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct emu_cublaslt_s *cublasLtHandle_t;
typedef struct emu_lt_desc_s *cublasLtMatmulDesc_t;
typedef struct emu_lt_layout_s *cublasLtMatrixLayout_t;
typedef struct emu_lt_pref_s *cublasLtMatmulPreference_t;
typedef struct {
    uint64_t data[8];
} cublasLtMatmulAlgo_t;
typedef struct {
    cublasLtMatmulAlgo_t algo;
    size_t workspaceSize;
    cublasStatus_t state;
    float wavesCount;
    int reserved[4];
} cublasLtMatmulHeuristicResult_t;

typedef enum {
    CUBLASLT_MATMUL_DESC_COMPUTE_TYPE = 0,        /* int32_t */
    CUBLASLT_MATMUL_DESC_SCALE_TYPE = 1,          /* int32_t */
    CUBLASLT_MATMUL_DESC_TRANSA = 3,              /* int32_t */
    CUBLASLT_MATMUL_DESC_TRANSB = 4,              /* int32_t */
    CUBLASLT_MATMUL_DESC_EPILOGUE = 7,            /* uint32_t */
    CUBLASLT_MATMUL_DESC_BIAS_POINTER = 8,        /* void * */
    CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER = 11, /* void * */
    CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_LD = 12,    /* int64_t */
    CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_DATA_TYPE = 22, /* int32_t */
    CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE = 26      /* int32_t */
} cublasLtMatmulDescAttributes_t;

typedef enum {
    CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES = 1,     /* uint64_t */
    CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES = 5,   /* uint32_t */
    CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES = 6,
    CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES = 7,
    CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES = 8
} cublasLtMatmulPreferenceAttributes_t;

typedef enum {
    CUBLASLT_EPILOGUE_DEFAULT = 1,
    CUBLASLT_EPILOGUE_BIAS = 4,
    CUBLASLT_EPILOGUE_GELU_BIAS = 32 | 4,
    CUBLASLT_EPILOGUE_GELU_AUX_BIAS = 32 | 128 | 4,
    CUBLASLT_EPILOGUE_DGELU_BGRAD = 64 | 128 | 16,
    CUBLASLT_EPILOGUE_BGRADA = 256,
    CUBLASLT_EPILOGUE_BGRADB = 512
} cublasLtEpilogue_t;

#define cublasLtCreate emu_cublasLtCreate
#define cublasLtDestroy emu_cublasLtDestroy
#define cublasLtMatmulDescCreate emu_cublasLtMatmulDescCreate
#define cublasLtMatmulDescDestroy emu_cublasLtMatmulDescDestroy
#define cublasLtMatmulDescSetAttribute emu_cublasLtMatmulDescSetAttribute
#define cublasLtMatrixLayoutCreate emu_cublasLtMatrixLayoutCreate
#define cublasLtMatrixLayoutDestroy emu_cublasLtMatrixLayoutDestroy
#define cublasLtMatmulPreferenceCreate emu_cublasLtMatmulPreferenceCreate
#define cublasLtMatmulPreferenceDestroy emu_cublasLtMatmulPreferenceDestroy
#define cublasLtMatmulPreferenceSetAttribute emu_cublasLtMatmulPreferenceSetAttribute
#define cublasLtMatmulAlgoGetHeuristic emu_cublasLtMatmulAlgoGetHeuristic
#define cublasLtMatmul emu_cublasLtMatmul

cublasStatus_t cublasLtCreate(cublasLtHandle_t *handle);
cublasStatus_t cublasLtDestroy(cublasLtHandle_t handle);
cublasStatus_t cublasLtMatmulDescCreate(cublasLtMatmulDesc_t *desc, cublasComputeType_t compute,
                                        cudaDataType_t scale);
cublasStatus_t cublasLtMatmulDescDestroy(cublasLtMatmulDesc_t desc);
cublasStatus_t cublasLtMatmulDescSetAttribute(cublasLtMatmulDesc_t desc, cublasLtMatmulDescAttributes_t attr,
                                              const void *buf, size_t size);
cublasStatus_t cublasLtMatrixLayoutCreate(cublasLtMatrixLayout_t *layout, cudaDataType_t type, uint64_t rows,
                                          uint64_t cols, int64_t ld);
cublasStatus_t cublasLtMatrixLayoutDestroy(cublasLtMatrixLayout_t layout);
cublasStatus_t cublasLtMatmulPreferenceCreate(cublasLtMatmulPreference_t *pref);
cublasStatus_t cublasLtMatmulPreferenceDestroy(cublasLtMatmulPreference_t pref);
cublasStatus_t cublasLtMatmulPreferenceSetAttribute(cublasLtMatmulPreference_t pref,
                                                    cublasLtMatmulPreferenceAttributes_t attr, const void *buf,
                                                    size_t size);
cublasStatus_t cublasLtMatmulAlgoGetHeuristic(cublasLtHandle_t handle, cublasLtMatmulDesc_t desc,
                                              cublasLtMatrixLayout_t Adesc, cublasLtMatrixLayout_t Bdesc,
                                              cublasLtMatrixLayout_t Cdesc, cublasLtMatrixLayout_t Ddesc,
                                              cublasLtMatmulPreference_t pref, int requested,
                                              cublasLtMatmulHeuristicResult_t results[], int *returned);
cublasStatus_t cublasLtMatmul(cublasLtHandle_t handle, cublasLtMatmulDesc_t desc, const void *alpha, const void *A,
                              cublasLtMatrixLayout_t Adesc, const void *B, cublasLtMatrixLayout_t Bdesc,
                              const void *beta, const void *C, cublasLtMatrixLayout_t Cdesc, void *D,
                              cublasLtMatrixLayout_t Ddesc, const cublasLtMatmulAlgo_t *algo, void *workspace,
                              size_t workspace_bytes, cudaStream_t stream);

/* ---- test controls ----
 * 0: the heuristic answers as it does; 1: it finds no heuristic for any
 * configuration (CUBLAS_STATUS_NOT_SUPPORTED); 2: it succeeds with no
 * algorithm (returned count 0); 3: it refuses the shape
 * (CUBLAS_STATUS_INVALID_VALUE). Each is an answer the real library gives. */
void emu_cublaslt_set_no_algo(int mode);
long long emu_cublaslt_heuristic_queries(void);   /* cublasLtMatmulAlgoGetHeuristic calls so far */
long long emu_cublaslt_matmuls(void);             /* cublasLtMatmul calls that ran */
long long emu_cublaslt_live_objects(void);        /* matmul descriptors and layouts not destroyed */

#ifdef __cplusplus
}
#endif

#endif
