/* cublaslt_emu.cpp: the host emulation of cuBLASLt described in
 * include/cublasLt.h: descriptors as plain structs, a heuristic that
 * returns one algorithm recording what it needs (alignments, workspace),
 * and the product with its epilogue accumulated in double. */
#include "cuda_emu.h"
#include "cublasLt.h"
#include "convert.h"
#include <atomic>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>

struct emu_cublaslt_s {
    int live;
};
struct emu_lt_desc_s {
    int32_t compute, scale, transa, transb;
    uint32_t epilogue;
    const void *bias;   /* bias, or the bias gradient written */
    const void *aux;
    int64_t aux_ld;
    int32_t bias_type, aux_type;   /* -1: D's type */
};
struct emu_lt_layout_s {
    int32_t type;
    uint64_t rows, cols;
    int64_t ld;
};
struct emu_lt_pref_s {
    uint64_t max_workspace;
    uint32_t align[4];   /* A, B, C, D */
};

static std::atomic<int> g_no_algo;
static std::atomic<long long> g_queries, g_matmuls;

extern "C" void emu_cublaslt_set_no_algo(int mode) { g_no_algo = mode; }
extern "C" long long emu_cublaslt_heuristic_queries(void) { return g_queries; }
static std::atomic<long long> g_live;   /* descriptors and layouts created and not destroyed */
extern "C" long long emu_cublaslt_live_objects(void) { return g_live; }
extern "C" long long emu_cublaslt_matmuls(void) { return g_matmuls; }

/* ---- handle, descriptors, layouts, preferences ---- */

cublasStatus_t cublasLtCreate(cublasLtHandle_t *handle) {
    if (!handle) return CUBLAS_STATUS_INVALID_VALUE;
    *handle = new emu_cublaslt_s{1};
    return CUBLAS_STATUS_SUCCESS;
}
cublasStatus_t cublasLtDestroy(cublasLtHandle_t handle) {
    if (!handle) return CUBLAS_STATUS_NOT_INITIALIZED;
    delete handle;
    return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasLtMatmulDescCreate(cublasLtMatmulDesc_t *desc, cublasComputeType_t compute,
                                        cudaDataType_t scale) {
    if (!desc) return CUBLAS_STATUS_INVALID_VALUE;
    g_live++;
    *desc = new emu_lt_desc_s{(int32_t)compute, (int32_t)scale, CUBLAS_OP_N, CUBLAS_OP_N, CUBLASLT_EPILOGUE_DEFAULT,
                              NULL, NULL, 0, -1, -1};
    return CUBLAS_STATUS_SUCCESS;
}
cublasStatus_t cublasLtMatmulDescDestroy(cublasLtMatmulDesc_t desc) {
    if (desc) g_live--;
    delete desc;
    return CUBLAS_STATUS_SUCCESS;
}

/* Copies the attribute's value when buf and size fit its type (the real
 * library's check: INVALID_VALUE otherwise). */
template <class T> static cublasStatus_t take(T *field, const void *buf, size_t size) {
    if (!buf || size != sizeof(T)) return CUBLAS_STATUS_INVALID_VALUE;
    memcpy(field, buf, sizeof(T));
    return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasLtMatmulDescSetAttribute(cublasLtMatmulDesc_t d, cublasLtMatmulDescAttributes_t attr,
                                              const void *buf, size_t size) {
    if (!d) return CUBLAS_STATUS_INVALID_VALUE;
    switch (attr) {
    case CUBLASLT_MATMUL_DESC_COMPUTE_TYPE: return take(&d->compute, buf, size);
    case CUBLASLT_MATMUL_DESC_SCALE_TYPE: return take(&d->scale, buf, size);
    case CUBLASLT_MATMUL_DESC_TRANSA: return take(&d->transa, buf, size);
    case CUBLASLT_MATMUL_DESC_TRANSB: return take(&d->transb, buf, size);
    case CUBLASLT_MATMUL_DESC_EPILOGUE: return take(&d->epilogue, buf, size);
    case CUBLASLT_MATMUL_DESC_BIAS_POINTER: return take(&d->bias, buf, size);
    case CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER: return take(&d->aux, buf, size);
    case CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_LD: return take(&d->aux_ld, buf, size);
    case CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_DATA_TYPE: return take(&d->aux_type, buf, size);
    case CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE: return take(&d->bias_type, buf, size);
    }
    return CUBLAS_STATUS_INVALID_VALUE;
}

cublasStatus_t cublasLtMatrixLayoutCreate(cublasLtMatrixLayout_t *layout, cudaDataType_t type, uint64_t rows,
                                          uint64_t cols, int64_t ld) {
    if (!layout) return CUBLAS_STATUS_INVALID_VALUE;
    g_live++;
    *layout = new emu_lt_layout_s{(int32_t)type, rows, cols, ld};
    return CUBLAS_STATUS_SUCCESS;
}
cublasStatus_t cublasLtMatrixLayoutDestroy(cublasLtMatrixLayout_t layout) {
    if (layout) g_live--;
    delete layout;
    return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasLtMatmulPreferenceCreate(cublasLtMatmulPreference_t *pref) {
    if (!pref) return CUBLAS_STATUS_INVALID_VALUE;
    *pref = new emu_lt_pref_s{0, {256, 256, 256, 256}};   /* the real defaults: no workspace, 256-byte buffers */
    return CUBLAS_STATUS_SUCCESS;
}
cublasStatus_t cublasLtMatmulPreferenceDestroy(cublasLtMatmulPreference_t pref) {
    delete pref;
    return CUBLAS_STATUS_SUCCESS;
}
cublasStatus_t cublasLtMatmulPreferenceSetAttribute(cublasLtMatmulPreference_t p,
                                                    cublasLtMatmulPreferenceAttributes_t attr, const void *buf,
                                                    size_t size) {
    if (!p) return CUBLAS_STATUS_INVALID_VALUE;
    switch (attr) {
    case CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES: return take(&p->max_workspace, buf, size);
    case CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES: return take(&p->align[0], buf, size);
    case CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES: return take(&p->align[1], buf, size);
    case CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES: return take(&p->align[2], buf, size);
    case CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES: return take(&p->align[3], buf, size);
    }
    return CUBLAS_STATUS_INVALID_VALUE;
}

/* ---- the operation's checks (the same at the query and at the product) ---- */

static bool epi_known(uint32_t e) {
    return e == CUBLASLT_EPILOGUE_DEFAULT || e == CUBLASLT_EPILOGUE_BIAS || e == CUBLASLT_EPILOGUE_GELU_AUX_BIAS ||
           e == CUBLASLT_EPILOGUE_GELU_BIAS || e == CUBLASLT_EPILOGUE_DGELU_BGRAD || e == CUBLASLT_EPILOGUE_BGRADA || e == CUBLASLT_EPILOGUE_BGRADB;
}
static bool epi_bias(uint32_t e) { return e != CUBLASLT_EPILOGUE_DEFAULT; }   /* of the modelled ones */
static bool epi_aux(uint32_t e) { return e == CUBLASLT_EPILOGUE_GELU_AUX_BIAS || e == CUBLASLT_EPILOGUE_DGELU_BGRAD; }

struct emu_lt_shape {
    uint64_t m, n, k;
};

static cublasStatus_t check_op(cublasLtHandle_t h, cublasLtMatmulDesc_t d, cublasLtMatrixLayout_t A,
                               cublasLtMatrixLayout_t B, cublasLtMatrixLayout_t C, cublasLtMatrixLayout_t D,
                               emu_lt_shape *s) {
    if (!h || !h->live) return CUBLAS_STATUS_NOT_INITIALIZED;
    if (!d || !A || !B || !C || !D) return CUBLAS_STATUS_INVALID_VALUE;
    /* the one type combination modelled: bf16 operands and result, f32 compute and scale */
    if (d->compute != CUBLAS_COMPUTE_32F || d->scale != CUDA_R_32F) return CUBLAS_STATUS_NOT_SUPPORTED;
    if (A->type != CUDA_R_16BF || B->type != CUDA_R_16BF || C->type != CUDA_R_16BF || D->type != CUDA_R_16BF)
        return CUBLAS_STATUS_NOT_SUPPORTED;
    if ((d->transa != CUBLAS_OP_N && d->transa != CUBLAS_OP_T) || (d->transb != CUBLAS_OP_N && d->transb != CUBLAS_OP_T))
        return CUBLAS_STATUS_INVALID_VALUE;
    uint64_t m = D->rows, n = D->cols;
    uint64_t k = d->transa == CUBLAS_OP_N ? A->cols : A->rows;
    uint64_t a_m = d->transa == CUBLAS_OP_N ? A->rows : A->cols;
    uint64_t b_k = d->transb == CUBLAS_OP_N ? B->rows : B->cols, b_n = d->transb == CUBLAS_OP_N ? B->cols : B->rows;
    if (a_m != m || b_k != k || b_n != n || C->rows != m || C->cols != n) return CUBLAS_STATUS_INVALID_VALUE;
    const emu_lt_layout_s *all[4] = {A, B, C, D};
    for (const emu_lt_layout_s *l : all)
        if (l->ld < 1 || (uint64_t)l->ld < l->rows) return CUBLAS_STATUS_INVALID_VALUE;
    if (!epi_known(d->epilogue)) return CUBLAS_STATUS_NOT_SUPPORTED;
    if (epi_bias(d->epilogue)) {
        if (!d->bias) return CUBLAS_STATUS_INVALID_VALUE;
        if (d->bias_type != -1 && d->bias_type != D->type) return CUBLAS_STATUS_NOT_SUPPORTED;
    }
    if (epi_aux(d->epilogue)) {
        /* the header's rule for the GELU input: AUX_LD divisible by 8, no less than D's rows */
        if (!d->aux || d->aux_ld % 8 != 0 || d->aux_ld < (int64_t)m) return CUBLAS_STATUS_INVALID_VALUE;
        if (d->aux_type != -1 && d->aux_type != D->type) return CUBLAS_STATUS_NOT_SUPPORTED;
    }
    *s = emu_lt_shape{m, n, k};
    return CUBLAS_STATUS_SUCCESS;
}

static uint64_t align_of(const void *p) {
    uintptr_t u = (uintptr_t)p;
    return u ? (u & (~u + 1)) : 256;
}

/* An algorithm: what it was found for and what it needs. */
enum { ALGO_MAGIC = 0x4c54414c, ALGO_TAG, ALGO_M, ALGO_N, ALGO_K, ALGO_ALIGN, ALGO_AUX_ALIGN, ALGO_WORKSPACE };
/* Split-K algorithms (a long k) want some workspace when the preference allows it. */
static const uint64_t SPLIT_K_WORKSPACE = 1u << 20;

cublasStatus_t cublasLtMatmulAlgoGetHeuristic(cublasLtHandle_t h, cublasLtMatmulDesc_t d,
                                              cublasLtMatrixLayout_t A, cublasLtMatrixLayout_t B,
                                              cublasLtMatrixLayout_t C, cublasLtMatrixLayout_t D,
                                              cublasLtMatmulPreference_t pref, int requested,
                                              cublasLtMatmulHeuristicResult_t results[], int *returned) {
    g_queries++;
    if (!returned || !results || !pref) return CUBLAS_STATUS_INVALID_VALUE;
    *returned = 0;
    if (requested <= 0) return CUBLAS_STATUS_INVALID_VALUE;
    emu_lt_shape s;
    cublasStatus_t st = check_op(h, d, A, B, C, D, &s);
    if (st != CUBLAS_STATUS_SUCCESS) return st;
    if (g_no_algo == 1) return CUBLAS_STATUS_NOT_SUPPORTED;
    if (g_no_algo == 2) return CUBLAS_STATUS_SUCCESS;
    if (g_no_algo == 3) return CUBLAS_STATUS_INVALID_VALUE;
    for (uint32_t a : pref->align)
        if (a == 0 || (a & (a - 1)) != 0) return CUBLAS_STATUS_INVALID_VALUE;
    cublasLtMatmulHeuristicResult_t r;
    memset(&r, 0, sizeof r);
    r.algo.data[0] = ALGO_MAGIC;
    r.algo.data[1] = d->epilogue | (uint64_t)d->transa << 16 | (uint64_t)d->transb << 24;
    r.algo.data[2] = s.m;
    r.algo.data[3] = s.n;
    r.algo.data[4] = s.k;
    r.algo.data[5] = (uint64_t)pref->align[0] | (uint64_t)pref->align[1] << 16 | (uint64_t)pref->align[2] << 32 |
                     (uint64_t)pref->align[3] << 48;
    /* bias and aux: vector loads as wide as the pointers seen here allow, up to 16 bytes */
    uint64_t ab = epi_bias(d->epilogue) ? align_of(d->bias) : 1, ax = epi_aux(d->epilogue) ? align_of(d->aux) : 1;
    r.algo.data[6] = (ab < 16 ? ab : 16) | (ax < 16 ? ax : 16) << 16;
    r.workspaceSize = s.k >= 2048 && pref->max_workspace >= SPLIT_K_WORKSPACE ? SPLIT_K_WORKSPACE : 0;
    r.algo.data[7] = r.workspaceSize;
    r.state = CUBLAS_STATUS_SUCCESS;
    r.wavesCount = 1.0f;
    results[0] = r;
    *returned = 1;
    return CUBLAS_STATUS_SUCCESS;
}

/* ---- the product ---- */

static float gelu_tanh(float x) {
    float u = 0.7978845608028654f * (x + 0.044715f * x * x * x);
    return 0.5f * x * (1.0f + tanhf(u));
}
static float gelu_tanh_grad(float x) {
    float u = 0.7978845608028654f * (x + 0.044715f * x * x * x);
    float t = tanhf(u), du = 0.7978845608028654f * (1.0f + 3.0f * 0.044715f * x * x);
    return 0.5f * (1.0f + t) + 0.5f * x * (1.0f - t * t) * du;
}

static bool aligned(const void *p, uint64_t a) { return a <= 1 || (uintptr_t)p % a == 0; }

/* The bytes a column-major layout spans (its last column ends at rows). */
static size_t span_bytes(const emu_lt_layout_s *l) {
    if (l->rows == 0 || l->cols == 0) return 0;
    return ((size_t)l->ld * (l->cols - 1) + l->rows) * 2;
}

static void check_buffer(const void *p, size_t n, const char *what) {
    emu_check_device_ptr(p, what);
    emu_check_device_range(p, n, what);
}

cublasStatus_t cublasLtMatmul(cublasLtHandle_t h, cublasLtMatmulDesc_t d, const void *alpha_p, const void *A,
                              cublasLtMatrixLayout_t Ad, const void *B, cublasLtMatrixLayout_t Bd,
                              const void *beta_p, const void *C, cublasLtMatrixLayout_t Cd, void *D,
                              cublasLtMatrixLayout_t Dd, const cublasLtMatmulAlgo_t *algo, void *workspace,
                              size_t workspace_bytes, cudaStream_t) {
    emu_lt_shape s;
    cublasStatus_t st = check_op(h, d, Ad, Bd, Cd, Dd, &s);
    if (st != CUBLAS_STATUS_SUCCESS) return st;
    if (!alpha_p || !beta_p || !algo) return CUBLAS_STATUS_INVALID_VALUE;
    const uint64_t *g = algo->data;
    if (g[0] != ALGO_MAGIC || g[1] != (d->epilogue | (uint64_t)d->transa << 16 | (uint64_t)d->transb << 24) ||
        g[2] != s.m || g[3] != s.n || g[4] != s.k)
        return CUBLAS_STATUS_INVALID_VALUE;   /* an algorithm found for another operation */
    if (workspace_bytes < g[7]) return CUBLAS_STATUS_INVALID_VALUE;
    float alpha = *(const float *)alpha_p, beta = *(const float *)beta_p;
    bool read_c = beta != 0.0f;
    if (read_c && C == D && (Cd->rows != Dd->rows || Cd->cols != Dd->cols || Cd->ld != Dd->ld))
        return CUBLAS_STATUS_INVALID_VALUE;   /* in place needs C's layout to be D's */
    /* what the algorithm needs: buffers as aligned as it was chosen for */
    if (!aligned(A, g[5] & 0xffff) || !aligned(B, g[5] >> 16 & 0xffff) ||
        (read_c && !aligned(C, g[5] >> 32 & 0xffff)) || !aligned(D, g[5] >> 48))
        return CUBLAS_STATUS_INVALID_VALUE;
    if ((epi_bias(d->epilogue) && !aligned(d->bias, g[6] & 0xffff)) ||
        (epi_aux(d->epilogue) && !aligned(d->aux, g[6] >> 16 & 0xffff)))
        return CUBLAS_STATUS_INVALID_VALUE;
    if (s.m == 0 || s.n == 0) return CUBLAS_STATUS_SUCCESS;

    check_buffer(A, span_bytes(Ad), "cublasLtMatmul A");
    check_buffer(B, span_bytes(Bd), "cublasLtMatmul B");
    if (read_c) check_buffer(C, span_bytes(Cd), "cublasLtMatmul C");
    check_buffer(D, span_bytes(Dd), "cublasLtMatmul D");
    uint32_t e = d->epilogue;
    size_t bias_n = e == CUBLASLT_EPILOGUE_BGRADB ? s.n : s.m;
    if (epi_bias(e)) check_buffer(d->bias, bias_n * 2, "cublasLtMatmul bias");
    if (epi_aux(e)) check_buffer(d->aux, ((size_t)d->aux_ld * (s.n - 1) + s.m) * 2, "cublasLtMatmul aux");
    if (g[7]) check_buffer(workspace, g[7], "cublasLtMatmul workspace");

    const void *bufs[] = {A, B, read_c ? C : NULL, D, d->bias, d->aux, g[7] ? workspace : NULL};
    int op = emu_op_begin("cuBLASLt", "cublasLtMatmul", bufs, 7);
    const uint16_t *a = (const uint16_t *)A, *b = (const uint16_t *)B, *c = (const uint16_t *)C;
    uint16_t *dd = (uint16_t *)D, *aux = (uint16_t *)d->aux, *bias_w = (uint16_t *)d->bias;
    const uint16_t *bias = (const uint16_t *)d->bias;
    bool ta = d->transa == CUBLAS_OP_T, tb = d->transb == CUBLAS_OP_T;
    auto opa = [&](uint64_t i, uint64_t l) {   // op(A) (m, k)
        return (double)bf16_to_f32(a[ta ? l + i * Ad->ld : i + l * Ad->ld]);
    };
    auto opb = [&](uint64_t l, uint64_t j) {   // op(B) (k, n)
        return (double)bf16_to_f32(b[tb ? j + l * Bd->ld : l + j * Bd->ld]);
    };
    double *grad = NULL;
    if (e == CUBLASLT_EPILOGUE_DGELU_BGRAD) grad = (double *)calloc(s.m, sizeof(double));
    for (uint64_t j = 0; j < s.n; j++)
        for (uint64_t i = 0; i < s.m; i++) {
            double acc = 0.0;
            for (uint64_t l = 0; l < s.k; l++) acc += opa(i, l) * opb(l, j);
            size_t at = i + j * (size_t)Dd->ld;
            float p = (float)(read_c ? alpha * acc + (double)beta * bf16_to_f32(c[i + j * (size_t)Cd->ld])
                                     : alpha * acc);
            size_t at_aux = i + j * (size_t)d->aux_ld;
            switch (e) {
            case CUBLASLT_EPILOGUE_BIAS: p += bf16_to_f32(bias[i]); break;
            case CUBLASLT_EPILOGUE_GELU_BIAS: p = gelu_tanh(p + bf16_to_f32(bias[i])); break;
            case CUBLASLT_EPILOGUE_GELU_AUX_BIAS:
                p += bf16_to_f32(bias[i]);
                aux[at_aux] = f32_to_bf16(p);
                p = gelu_tanh(p);
                break;
            case CUBLASLT_EPILOGUE_DGELU_BGRAD:
                p *= gelu_tanh_grad(bf16_to_f32(aux[at_aux]));
                grad[i] += p;
                break;
            default: break;
            }
            dd[at] = f32_to_bf16(p);
        }
    /* bias gradients: written, not added; one rounding of the f32 sums */
    if (e == CUBLASLT_EPILOGUE_DGELU_BGRAD)
        for (uint64_t i = 0; i < s.m; i++) bias_w[i] = f32_to_bf16((float)grad[i]);
    if (e == CUBLASLT_EPILOGUE_BGRADA)
        for (uint64_t i = 0; i < s.m; i++) {
            double sum = 0.0;
            for (uint64_t l = 0; l < s.k; l++) sum += opa(i, l);
            bias_w[i] = f32_to_bf16((float)sum);
        }
    if (e == CUBLASLT_EPILOGUE_BGRADB)
        for (uint64_t j = 0; j < s.n; j++) {
            double sum = 0.0;
            for (uint64_t l = 0; l < s.k; l++) sum += opb(l, j);
            bias_w[j] = f32_to_bf16((float)sum);
        }
    free(grad);
    emu_op_end(op);
    g_matmuls++;
    return CUBLAS_STATUS_SUCCESS;
}
