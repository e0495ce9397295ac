/* matmul_lt.cu: matmul_epilogue_bf16 on cuBLASLt, a bf16 GEMM with
 * what follows it done in the GEMM's epilogue (after llm.c): the bias add,
 * bias + GELU keeping the GELU input, the GELU backward with its bias
 * gradient, and a weight-gradient GEMM's bias gradient.
 *
 * Row-major to column-major as in matmul.cu: row-major D (M, N) is
 * column-major D^T (N, M) = op(B)^T op(A)^T, so cuBLASLt's A is our B, its
 * B our A, m = N, n = M, and each operand keeps its own transpose flag.
 * Then our epilogues are cuBLASLt's, on the swapped problem:
 *   BIAS          D = P + bias[n]          CUBLASLT_EPILOGUE_BIAS (bias of D's rows m = N)
 *   GELU_AUX_BIAS aux = P + bias, gelu     CUBLASLT_EPILOGUE_GELU_AUX_BIAS (aux N x M, ld N)
 *   DGELU_BGRAD   D = P gelu'(aux), dbias  CUBLASLT_EPILOGUE_DGELU_BGRAD (dbias of D's rows m = N,
 *                                          our row-major D's columns)
 *   BGRAD_A       dbias[m] = sum_k op(A)   CUBLASLT_EPILOGUE_BGRADB (cuBLASLt's B is our A:
 *                                          its bias gradient has D's columns count n = M)
 *   GELU_BIAS     D = gelu(P + bias)       CUBLASLT_EPILOGUE_GELU_BIAS (no GELU input: a forward
 *                                          that records nothing)
 * GELU is the tanh form in both (device.h).
 *
 * The cuBLASLt rules relied on (its header): the GELU input's leading
 * dimension divisible by 8 and no less than D's rows (N); bias and bias
 * gradient vectors packed, of D's element type; an algorithm needs its
 * buffers as aligned as the preference's MIN_ALIGNMENT_*_BYTES said (the
 * heuristic picks from those), and bias and aux as aligned as the pointers
 * it saw. So every plan asks for 16-byte buffers, the entry takes only
 * 16-byte aligned ones (matmul_epilogue_covers) and keys its plans on the
 * alignment of bias and aux too. A query that finds no algorithm
 * (CUBLAS_STATUS_NOT_SUPPORTED or INVALID_VALUE, or none returned) makes the entry return 0
 * for that plan from then on, and the op layer composes the unfused ops.
 *
 * One handle for the process, made at start-up (cuda_lt_init) unless
 * FSDP_CUDA_EPILOGUES=0, and one workspace, taken from the engine's
 * allocator at the first call that runs (device.h: FSDP_EPILOGUE_WORKSPACE_BYTES);
 * a plan (descriptor, layouts,
 * algorithm) per shape, epilogue, transposes and those alignments, made at
 * its first call and kept, so a training step after the first creates
 * nothing: a call sets the descriptor's bias and aux pointers (host-side
 * attributes) and enqueues the GEMM on the compute stream. The plans are
 * bounded (LT_MAX_PLANS, the least recently used one destroyed for a new
 * one): a workload whose row count changes every call (sampling a growing
 * sequence) would otherwise add a heuristic query and four descriptors a
 * call, never freed. */
#include "cuda_internal.h"
#include FSDP_CUBLASLT_H
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static cublasLtHandle_t g_lt;
/* From the engine's allocator (tag other), so fsdp.memory counts it (cuBLAS's
 * own workspace and the CUDA context it does not): made under g_plans_mu at
 * the first call that runs, held for the process. */
static void *g_workspace;
static const size_t LT_WORKSPACE = FSDP_EPILOGUE_WORKSPACE_BYTES;
static const uint32_t LT_ALIGN = 16;
/* plans kept: a model's GEMMs are a few dozen shapes, far fewer */
static const int LT_MAX_PLANS = 256;

size_t cuda_lt_workspace_bytes(void) { return g_workspace ? LT_WORKSPACE : 0; }

const char *cuda_lt_init(void) {
    if (g_lt) return NULL;
    if (cublasLtCreate(&g_lt) != CUBLAS_STATUS_SUCCESS) {
        g_lt = NULL;
        return "cublasLtCreate failed";
    }
    return NULL;
}

/* The workspace, made now if it is not yet (under g_plans_mu); NULL when it
 * does not fit (a cap, or the device is full): the caller runs unfused. */
static void *lt_workspace(void) {
    if (!g_workspace && fsdp_alloc(FSDP_DEVICE_CUDA, FSDP_TAG_OTHER, LT_WORKSPACE, &g_workspace) != FSDP_OK)
        g_workspace = NULL;
    return g_workspace;
}

typedef struct {
    int64_t M, N, K;
    int trans_a, trans_b, epilogue;
    int bias_align, aux_align;   /* of the bias (or bias gradient) and aux pointers, capped at 256 */
} lt_key;

typedef struct {
    lt_key key;
    uint64_t used;   /* g_tick at its last call: the least recently used goes first */
    int ok;          /* 0: no algorithm for it (the entry returns 0) */
    cublasLtMatmulDesc_t desc;
    cublasLtMatrixLayout_t lay_a, lay_b, lay_cd;   /* cuBLASLt's A (our B), B (our A), C and D */
    cublasLtMatmulAlgo_t algo;
} lt_plan;

static pthread_mutex_t g_plans_mu = PTHREAD_MUTEX_INITIALIZER;
static lt_plan *g_plans;
static int g_n_plans, g_cap_plans, g_plan_limit = LT_MAX_PLANS;
static uint64_t g_tick;

static int align_class(const void *p) {
    uintptr_t u = (uintptr_t)p;
    int a = 256;
    while (a > 16 && u % (uintptr_t)a != 0) a /= 2;
    return u ? a : 256;
}

static bool key_eq(const lt_key *x, const lt_key *y) {
    return x->M == y->M && x->N == y->N && x->K == y->K && x->trans_a == y->trans_a && x->trans_b == y->trans_b &&
           x->epilogue == y->epilogue && x->bias_align == y->bias_align && x->aux_align == y->aux_align;
}

static cublasLtEpilogue_t lt_epilogue(int e) {
    switch (e) {
    case FSDP_EPILOGUE_BIAS: return CUBLASLT_EPILOGUE_BIAS;
    case FSDP_EPILOGUE_GELU_AUX_BIAS: return CUBLASLT_EPILOGUE_GELU_AUX_BIAS;
    case FSDP_EPILOGUE_DGELU_BGRAD: return CUBLASLT_EPILOGUE_DGELU_BGRAD;
    case FSDP_EPILOGUE_GELU_BIAS: return CUBLASLT_EPILOGUE_GELU_BIAS;
    default: return CUBLASLT_EPILOGUE_BGRADB;
    }
}

#define LT_SET(desc, attr, value)                                                                 \
    do {                                                                                          \
        auto v_ = (value);                                                                        \
        CUBLAS_CHECK(cublasLtMatmulDescSetAttribute((desc), (attr), &v_, sizeof v_));              \
    } while (0)

/* The descriptor, layouts and algorithm of k; bias_ptr and aux are the
 * first call's (the heuristic reads their alignment, not their memory). */
static void plan_make(lt_plan *p, const lt_key *k, const void *bias_ptr, const void *aux) {
    memset(p, 0, sizeof *p);
    p->key = *k;
    CUBLAS_CHECK(cublasLtMatmulDescCreate(&p->desc, CUBLAS_COMPUTE_32F, CUDA_R_32F));
    int32_t op_a = k->trans_b ? CUBLAS_OP_T : CUBLAS_OP_N, op_b = k->trans_a ? CUBLAS_OP_T : CUBLAS_OP_N;
    LT_SET(p->desc, CUBLASLT_MATMUL_DESC_TRANSA, op_a);
    LT_SET(p->desc, CUBLASLT_MATMUL_DESC_TRANSB, op_b);
    LT_SET(p->desc, CUBLASLT_MATMUL_DESC_EPILOGUE, (uint32_t)lt_epilogue(k->epilogue));
    LT_SET(p->desc, CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE, (int32_t)CUDA_R_16BF);
    LT_SET(p->desc, CUBLASLT_MATMUL_DESC_BIAS_POINTER, bias_ptr);
    if (k->epilogue == FSDP_EPILOGUE_GELU_AUX_BIAS || k->epilogue == FSDP_EPILOGUE_DGELU_BGRAD) {
        LT_SET(p->desc, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_DATA_TYPE, (int32_t)CUDA_R_16BF);
        LT_SET(p->desc, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_LD, (int64_t)k->N);
        LT_SET(p->desc, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER, aux);
    }
    /* our B: (K, N) row-major = column-major N x K (ld N), or (N, K) = K x N (ld K) */
    uint64_t M = (uint64_t)k->M, N = (uint64_t)k->N, K = (uint64_t)k->K;
    CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&p->lay_a, CUDA_R_16BF, k->trans_b ? K : N, k->trans_b ? N : K,
                                            (int64_t)(k->trans_b ? K : N)));
    /* our A: (M, K) row-major = column-major K x M (ld K), or (K, M) = M x K (ld M) */
    CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&p->lay_b, CUDA_R_16BF, k->trans_a ? M : K, k->trans_a ? K : M,
                                            (int64_t)(k->trans_a ? M : K)));
    CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&p->lay_cd, CUDA_R_16BF, N, M, (int64_t)N));

    cublasLtMatmulPreference_t pref;
    CUBLAS_CHECK(cublasLtMatmulPreferenceCreate(&pref));
    uint64_t ws = LT_WORKSPACE;
    CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws, sizeof ws));
    const cublasLtMatmulPreferenceAttributes_t aligns[4] = {
        CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES,
        CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES};
    for (int i = 0; i < 4; i++)
        CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(pref, aligns[i], &LT_ALIGN, sizeof LT_ALIGN));
    cublasLtMatmulHeuristicResult_t res;
    memset(&res, 0, sizeof res);
    int found = 0;
    cublasStatus_t st = cublasLtMatmulAlgoGetHeuristic(g_lt, p->desc, p->lay_a, p->lay_b, p->lay_cd, p->lay_cd, pref,
                                                       1, &res, &found);
    CUBLAS_CHECK(cublasLtMatmulPreferenceDestroy(pref));
    /* no algorithm is an answer. So is INVALID_VALUE: cuBLASLt has been seen to
     * answer so for a matrix of one row or column (PyTorch avoids it there),
     * and composing the unfused ops is right either way. Any other failure
     * is a wrong descriptor here. */
    if (st != CUBLAS_STATUS_SUCCESS && st != CUBLAS_STATUS_NOT_SUPPORTED && st != CUBLAS_STATUS_INVALID_VALUE)
        cuda_fail(__func__, __FILE__, __LINE__, "cublasLtMatmulAlgoGetHeuristic", cublasGetStatusString(st));
    p->ok = st == CUBLAS_STATUS_SUCCESS && found > 0 && res.state == CUBLAS_STATUS_SUCCESS &&
            res.workspaceSize <= LT_WORKSPACE;
    if (p->ok) {
        p->algo = res.algo;
        return;
    }
    CUBLAS_CHECK(cublasLtMatmulDescDestroy(p->desc));
    CUBLAS_CHECK(cublasLtMatrixLayoutDestroy(p->lay_a));
    CUBLAS_CHECK(cublasLtMatrixLayoutDestroy(p->lay_b));
    CUBLAS_CHECK(cublasLtMatrixLayoutDestroy(p->lay_cd));
    p->desc = NULL;
    p->lay_a = p->lay_b = p->lay_cd = NULL;
}

/* Destroys what plan_make made for p (a plan without an algorithm holds nothing). */
static void plan_destroy(lt_plan *p) {
    if (p->ok) {
        CUBLAS_CHECK(cublasLtMatmulDescDestroy(p->desc));
        CUBLAS_CHECK(cublasLtMatrixLayoutDestroy(p->lay_a));
        CUBLAS_CHECK(cublasLtMatrixLayoutDestroy(p->lay_b));
        CUBLAS_CHECK(cublasLtMatrixLayoutDestroy(p->lay_cd));
    }
    memset(p, 0, sizeof *p);
}

/* The plan of k (g_plans_mu held): a kept one, else a new one in a free
 * slot or in the least recently used one's. */
static lt_plan *plan_for(const lt_key *k, const void *bias_ptr, const void *aux) {
    g_tick++;
    for (int i = 0; i < g_n_plans; i++)
        if (key_eq(&g_plans[i].key, k)) {
            g_plans[i].used = g_tick;
            return &g_plans[i];
        }
    lt_plan *p;
    if (g_n_plans < g_plan_limit) {
        if (g_n_plans == g_cap_plans) {
            int cap = g_cap_plans ? 2 * g_cap_plans : 32;
            if (cap > g_plan_limit) cap = g_plan_limit;
            lt_plan *np = (lt_plan *)realloc(g_plans, (size_t)cap * sizeof *np);
            if (!np) cuda_fail(__func__, __FILE__, __LINE__, "realloc", "out of host memory for cuBLASLt plans");
            g_plans = np;
            g_cap_plans = cap;
        }
        p = &g_plans[g_n_plans++];
    } else {
        p = &g_plans[0];
        for (int i = 1; i < g_n_plans; i++)
            if (g_plans[i].used < p->used) p = &g_plans[i];
        plan_destroy(p);
    }
    plan_make(p, k, bias_ptr, aux);
    p->used = g_tick;
    return p;
}

void cuda_lt_set_plan_limit(int n) {
    pthread_mutex_lock(&g_plans_mu);
    for (int i = 0; i < g_n_plans; i++) plan_destroy(&g_plans[i]);
    free(g_plans);
    g_plans = NULL;
    g_n_plans = g_cap_plans = 0;
    g_plan_limit = n > 0 ? n : LT_MAX_PLANS;
    pthread_mutex_unlock(&g_plans_mu);
}

int cuda_lt_plans(void) {
    pthread_mutex_lock(&g_plans_mu);
    int n = g_n_plans;
    pthread_mutex_unlock(&g_plans_mu);
    return n;
}

static const char *epilogue_name(int e) {
    switch (e) {
    case FSDP_EPILOGUE_BIAS: return "BIAS";
    case FSDP_EPILOGUE_GELU_AUX_BIAS: return "GELU_AUX_BIAS";
    case FSDP_EPILOGUE_DGELU_BGRAD: return "DGELU_BGRAD";
    case FSDP_EPILOGUE_BGRAD_A: return "BGRAD_A";
    case FSDP_EPILOGUE_GELU_BIAS: return "GELU_BIAS";
    }
    return "unknown";
}

int cuda_matmul_epilogue_bf16(uint16_t *d, const uint16_t *a, const uint16_t *b, const uint16_t *c, int64_t M,
                              int64_t N, int64_t K, int trans_a, int trans_b, float alpha, float beta, int epilogue,
                              const uint16_t *bias, uint16_t *aux, uint16_t *dbias) {
    CUDA_ENTER();
    /* a call without what its epilogue needs is the caller's bug, not a shape to fall back from */
    bool need_bias = epilogue == FSDP_EPILOGUE_BIAS || epilogue == FSDP_EPILOGUE_GELU_AUX_BIAS ||
                     epilogue == FSDP_EPILOGUE_GELU_BIAS;
    bool need_aux = epilogue == FSDP_EPILOGUE_GELU_AUX_BIAS || epilogue == FSDP_EPILOGUE_DGELU_BGRAD;
    bool need_dbias = epilogue == FSDP_EPILOGUE_DGELU_BGRAD || epilogue == FSDP_EPILOGUE_BGRAD_A;
    char why[160];
    if (epilogue < FSDP_EPILOGUE_BIAS || epilogue > FSDP_EPILOGUE_GELU_BIAS) {
        snprintf(why, sizeof why, "epilogue %d, expected 1..5 (enum fsdp_epilogue)", epilogue);
        cuda_fail(__func__, __FILE__, __LINE__, "the argument check", why);
    }
    if (!d || !a || !b || (beta != 0.0f && !c) || (need_bias && !bias) || (need_aux && !aux) ||
        (need_dbias && !dbias)) {
        snprintf(why, sizeof why, "epilogue %s (M %lld, N %lld, K %lld, beta %g) without one of its buffers",
                 epilogue_name(epilogue), (long long)M, (long long)N, (long long)K, (double)beta);
        cuda_fail(__func__, __FILE__, __LINE__, "the argument check", why);
    }
    if (!g_lt) return 0;
    if (!matmul_epilogue_covers(d, a, b, c, M, N, K, alpha, beta, epilogue, bias, aux, dbias)) return 0;
    const void *bias_ptr = need_bias ? (const void *)bias : (const void *)dbias;
    lt_key key = {M, N, K, trans_a ? 1 : 0, trans_b ? 1 : 0, epilogue, align_class(bias_ptr),
                  need_aux ? align_class(aux) : 256};
    pthread_mutex_lock(&g_plans_mu);
    if (!lt_workspace()) {
        pthread_mutex_unlock(&g_plans_mu);
        return 0;
    }
    lt_plan *p = plan_for(&key, bias_ptr, aux);
    if (!p->ok) {
        pthread_mutex_unlock(&g_plans_mu);
        return 0;
    }
    LT_SET(p->desc, CUBLASLT_MATMUL_DESC_BIAS_POINTER, bias_ptr);
    if (need_aux) LT_SET(p->desc, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER, (const void *)aux);
    /* beta 0: C is not read; D stands in for it (a valid buffer of C's layout) */
    const uint16_t *cc = beta != 0.0f ? c : d;
    CUBLAS_CHECK(cublasLtMatmul(g_lt, p->desc, &alpha, b, p->lay_a, a, p->lay_b, &beta, cc, p->lay_cd, d, p->lay_cd,
                                &p->algo, g_workspace, LT_WORKSPACE, cuda_stream()));
    pthread_mutex_unlock(&g_plans_mu);
    return 1;
}
