/* test_cuda_matmul_lt.c: the CUDA table's matmul_epilogue_bf16 (cuBLASLt,
 * engine/cuda/matmul_lt.cu) against a double-precision reference, the
 * cases it must refuse (return 0, nothing written), its plan cache, the
 * counting device's line for it, and (emulated build) the rules the
 * emulated cuBLASLt enforces as the real library does.
 *
 * Built twice, as test_cuda_kernels: on the real backend (skipped, exit
 * 77, without a GPU) and over the emulation (tests/gpu/emu).
 *
 * The reference: P = alpha op(A) op(B) + beta C in double on the same bf16
 * values, then the epilogue in double (GELU in its tanh form). Tolerances,
 * |got - want| <= 2^-8 x bound per element (one bf16 rounding, 2^-9
 * relative, with room for f32 accumulation):
 *   D, aux (BIAS, GELU_AUX_BIAS): bound sum_k |a b| |alpha| + |beta c| + |bias|
 *   D = gelu(aux): |gelu| + 0.01 x that (the accumulation's error through
 *     gelu', at most 1.13)
 *   D = P gelu'(aux): |D| + 0.01 |gelu'(aux)| sum |a b| (as above)
 *   dbias of DGELU_BGRAD: the sum over the rows of D's bounds (the sum may
 *     be of D rounded or not)
 *   dbias of BGRAD_A: sum_k |op(A)|
 * bf16 output cannot tell GELU's tanh form from its erf form (they differ
 * by at most 3e-4 relative, the rounding is 2e-3): the form is the
 * emulation's and the real library's documented one (device.h).
 * Outputs start as NaN, so an element not written fails.
 *
 * Flags: --fault (a call with an unknown epilogue must end the process
 * with a message naming the device and the op), --off (under
 * FSDP_CUDA_EPILOGUES=0: the entry must be absent). */
#include "convert.h"
#include "cuda_internal.h"
#include "device.h"
#include "fsdp.h"
#include "cuda_case.h"
#include "testutil.h"
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#ifdef FSDP_CUDA_EMU
#include "cublasLt.h"
void emu_set_device_count(int n);
#define MODE "emulated CUDA"
#else
#define MODE "CUDA"
#endif

static test_rng rng;

/* n random bf16 values in [-scale, -scale/10] U [scale/10, scale], as floats */
static float *hrand16(int64_t n, float scale) {
    float *x = halloc((size_t)(n > 0 ? n : 1) * sizeof(float));
    test_fill_nonzero(&rng, x, n, scale);
    for (int64_t i = 0; i < n; i++) x[i] = bf16_to_f32(f32_to_bf16(x[i]));
    return x;
}
/* a device copy of bf16 values held as floats, with `pad` NaN elements
 * before them (pad 1: a pointer 2 bytes past a 16-byte boundary) */
static uint16_t *dev16(const float *h, int64_t n, int pad) {
    uint16_t *t = halloc((size_t)(n + pad) * 2);
    for (int i = 0; i < pad; i++) t[i] = 0x7fc0;
    for (int64_t i = 0; i < n; i++) t[pad + i] = h ? f32_to_bf16(h[i]) : 0x7fc0;   /* NULL: NaN */
    uint16_t *d = dalloc((size_t)(n + pad) * 2);
    G->copy_from_host(d, t, (size_t)(n + pad) * 2);
    return d + pad;
}
static float *back16(const uint16_t *d, int64_t n) {
    uint16_t *h = halloc((size_t)n * 2);
    float *f = halloc((size_t)n * sizeof(float));
    G->copy_to_host(h, d, (size_t)n * 2);
    for (int64_t i = 0; i < n; i++) f[i] = bf16_to_f32(h[i]);
    return f;
}
static int all_nan(const uint16_t *d, int64_t n) {
    float *f = back16(d, n);
    for (int64_t i = 0; i < n; i++)
        if (f[i] == f[i]) return 0;
    return 1;
}

/* |got - want| <= tol bound, element by element */
static void check_bound(const char *what, const float *got, const double *want, const double *bound, int64_t n,
                        double tol) {
    int64_t wrong = 0, first = -1;
    for (int64_t i = 0; i < n; i++)
        if (!(fabs((double)got[i] - want[i]) <= tol * bound[i] + 1e-30)) {
            if (first < 0) first = i;
            wrong++;
        }
    if (wrong)
        fprintf(stderr, "  %s: first wrong at %lld: got %.9g want %.9g (bound %.3g)\n", what, (long long)first,
                (double)got[first], want[first], tol * bound[first]);
    test_check(wrong == 0, "%s: %lld of %lld values beyond 2^-8 x their bound", what, (long long)wrong, (long long)n);
}

/* ---- the reference ---- */

static double gelu_d(double x) {
    double u = 0.7978845608028654 * (x + 0.044715 * x * x * x);
    return 0.5 * x * (1.0 + tanh(u));
}
static double gelu_grad_d(double x) {
    double u = 0.7978845608028654 * (x + 0.044715 * x * x * x), t = tanh(u);
    return 0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * 0.7978845608028654 * (1.0 + 3.0 * 0.044715 * x * x);
}

typedef struct {
    int64_t M, N, K;
    int ta, tb;
    float alpha, beta;
    int in_place;   /* C == D */
} lt_case;

static const char *epi_name(int e) {
    static const char *n[] = {"?", "BIAS", "GELU_AUX_BIAS", "DGELU_BGRAD", "BGRAD_A", "GELU_BIAS"};
    return e >= 1 && e <= 5 ? n[e] : "?";
}

/* One call of the entry on random inputs, checked against the reference. */
static void run_case(const lt_case *t, int epi) {
    int64_t M = t->M, N = t->N, K = t->K, MN = M * N;
    float *a = hrand16(M * K, 1), *b = hrand16(K * N, 1), *c = hrand16(MN, 1), *bias = hrand16(N, 1);
    float *aux_in = hrand16(MN, 2);
    uint16_t *da = dev16(a, M * K, 0), *db = dev16(b, K * N, 0), *dc = dev16(c, MN, 0);
    uint16_t *dd = t->in_place ? dc : dev16(NULL, MN, 0);
    uint16_t *dbias = dev16(bias, N, 0);
    uint16_t *daux = epi == FSDP_EPILOGUE_DGELU_BGRAD ? dev16(aux_in, MN, 0) : dev16(NULL, MN, 0);
    int64_t ng = epi == FSDP_EPILOGUE_BGRAD_A ? M : N;
    uint16_t *dgrad = dev16(NULL, ng, 0);
    int ran = G->matmul_epilogue_bf16(dd, da, db, dc, M, N, K, t->ta, t->tb, t->alpha, t->beta, epi, dbias, daux,
                                      dgrad);
    char name[192];
    snprintf(name, sizeof name, "%s M %lld N %lld K %lld ta %d tb %d alpha %g beta %g%s", epi_name(epi),
             (long long)M, (long long)N, (long long)K, t->ta, t->tb, t->alpha, t->beta,
             t->in_place ? " C == D" : t->beta != 0 ? " C != D" : "");
    test_check(ran == 1, "%s: ran (returned %d)", name, ran);
    if (ran != 1) {
        free_case();
        return;
    }
    double *want = halloc((size_t)MN * sizeof(double)), *bound = halloc((size_t)MN * sizeof(double));
    double *want_aux = halloc((size_t)MN * sizeof(double)), *bound_aux = halloc((size_t)MN * sizeof(double));
    double *want_g = halloc((size_t)ng * sizeof(double)), *bound_g = halloc((size_t)ng * sizeof(double));
    for (int64_t i = 0; i < ng; i++) want_g[i] = bound_g[i] = 0;
    for (int64_t i = 0; i < M; i++)
        for (int64_t j = 0; j < N; j++) {
            double s = 0, mag = 0;
            for (int64_t k = 0; k < K; k++) {
                double x = t->ta ? a[k * M + i] : a[i * K + k];   // op(A)[i, k]
                double y = t->tb ? b[j * K + k] : b[k * N + j];   // op(B)[k, j]
                s += x * y;
                mag += fabs(x * y);
            }
            int64_t at = i * N + j;
            double cv = t->beta != 0 ? c[at] : 0;
            double p = t->alpha * s + t->beta * cv, pm = fabs(t->alpha) * mag + fabs(t->beta * cv);
            switch (epi) {
            case FSDP_EPILOGUE_BIAS: want[at] = p + bias[j], bound[at] = pm + fabs(bias[j]); break;
            case FSDP_EPILOGUE_GELU_BIAS:
                want[at] = gelu_d(p + bias[j]), bound[at] = fabs(want[at]) + 0.01 * (pm + fabs(bias[j]));
                break;
            case FSDP_EPILOGUE_GELU_AUX_BIAS:
                want_aux[at] = p + bias[j], bound_aux[at] = pm + fabs(bias[j]);
                want[at] = gelu_d(want_aux[at]), bound[at] = fabs(want[at]) + 0.01 * bound_aux[at];
                break;
            case FSDP_EPILOGUE_DGELU_BGRAD: {
                double g = gelu_grad_d(aux_in[at]);
                want[at] = p * g, bound[at] = fabs(want[at]) + 0.01 * fabs(g) * pm;
                want_g[j] += want[at], bound_g[j] += bound[at];
                break;
            }
            default: want[at] = p, bound[at] = pm; break;
            }
        }
    if (epi == FSDP_EPILOGUE_BGRAD_A)
        for (int64_t i = 0; i < M; i++)
            for (int64_t k = 0; k < K; k++) {
                double x = t->ta ? a[k * M + i] : a[i * K + k];
                want_g[i] += x, bound_g[i] += fabs(x);
            }
    char what[224];
    snprintf(what, sizeof what, "%s: D", name);
    check_bound(what, back16(dd, MN), want, bound, MN, 1.0 / 256);
    if (epi == FSDP_EPILOGUE_GELU_AUX_BIAS) {
        snprintf(what, sizeof what, "%s: aux (the GELU input)", name);
        check_bound(what, back16(daux, MN), want_aux, bound_aux, MN, 1.0 / 256);
    }
    if (epi == FSDP_EPILOGUE_DGELU_BGRAD || epi == FSDP_EPILOGUE_BGRAD_A) {
        snprintf(what, sizeof what, "%s: dbias", name);
        check_bound(what, back16(dgrad, ng), want_g, bound_g, ng, 1.0 / 256);
    }
    if (epi == FSDP_EPILOGUE_BIAS || epi == FSDP_EPILOGUE_BGRAD_A || epi == FSDP_EPILOGUE_GELU_BIAS) {
        snprintf(what, sizeof what, "%s: aux untouched", name);   /* buffers it must not write */
        test_check(all_nan(daux, MN), "%s", what);
    }
    if (epi == FSDP_EPILOGUE_GELU_BIAS) {
        snprintf(what, sizeof what, "%s: dbias untouched", name);
        test_check(all_nan(dgrad, ng), "%s", what);
    }
    free_case();
}

static void test_epilogues(void) {
    /* N a multiple of 8 where the GELU input needs it (cuBLASLt's aux rule) */
    for (int ta = 0; ta < 2; ta++)
        for (int tb = 0; tb < 2; tb++) {
            lt_case cs[] = {
                {1, 8, 1, ta, tb, 1, 0, 0},      {3, 8, 5, ta, tb, 1, 0, 0},      {7, 16, 13, ta, tb, 0.5f, 0, 0},
                {5, 24, 31, ta, tb, 1, 1, 0},    {5, 24, 31, ta, tb, 1, 1, 1},    {11, 8, 2, ta, tb, -2, 0.25f, 1},
                {2, 40, 97, ta, tb, 1, 1, 0},
            };
            for (size_t i = 0; i < sizeof cs / sizeof cs[0]; i++)
                for (int e = FSDP_EPILOGUE_BIAS; e <= FSDP_EPILOGUE_GELU_BIAS; e++) {
                    if (e == FSDP_EPILOGUE_BGRAD_A && cs[i].alpha != 1.0f) continue;   /* refused: see test_refusals */
                    run_case(&cs[i], e);
                }
        }
    /* no aux (GELU_BIAS included: the aux rule is the GELU input's): any N, also 1, odd and prime */
    lt_case odd[] = {{1, 1, 1, 0, 0, 1, 0, 0}, {13, 7, 3, 1, 0, 1, 1, 0}, {3, 13, 17, 0, 1, 1, 1, 1},
                     {17, 1, 5, 1, 1, 1, 0, 0}};
    for (size_t i = 0; i < sizeof odd / sizeof odd[0]; i++) {
        run_case(&odd[i], FSDP_EPILOGUE_BIAS);
        run_case(&odd[i], FSDP_EPILOGUE_BGRAD_A);
        run_case(&odd[i], FSDP_EPILOGUE_GELU_BIAS);
    }
    /* the MLP's shapes (c_fc, c_proj, a weight gradient), rows cut so the
     * double reference stays quick: C 64 in the emulation, GPT-2's 768 on a GPU */
#ifdef FSDP_CUDA_EMU
    lt_case mlp[] = {{24, 256, 64, 0, 1, 1, 0, 0}, {24, 64, 256, 0, 1, 1, 0, 0}, {64, 256, 24, 1, 0, 1, 1, 0}};
#else
    lt_case mlp[] = {{64, 3072, 768, 0, 1, 1, 0, 0}, {64, 768, 3072, 0, 1, 1, 0, 0},
                     {768, 3072, 64, 1, 0, 1, 1, 0}, {61, 776, 769, 0, 1, 1, 0, 0}};
#endif
    for (size_t i = 0; i < sizeof mlp / sizeof mlp[0]; i++) {
        run_case(&mlp[i], FSDP_EPILOGUE_BIAS);
        run_case(&mlp[i], FSDP_EPILOGUE_GELU_AUX_BIAS);
        run_case(&mlp[i], FSDP_EPILOGUE_GELU_BIAS);
        run_case(&mlp[i], FSDP_EPILOGUE_DGELU_BGRAD);
        run_case(&mlp[i], FSDP_EPILOGUE_BGRAD_A);
    }
}

/* ---- what it refuses: 0 back and nothing written ---- */

typedef struct {
    const char *what;
    int epi;
    int64_t M, N, K;
    float alpha, beta;
    int pad_d, pad_a, pad_b, pad_c, pad_bias, pad_aux, pad_grad;   /* elements off a 16-byte boundary */
    int want;                                                       /* what it returns */
} refusal;

static void run_refusal(const refusal *r) {
    int64_t M = r->M, N = r->N, K = r->K, MN = M * N;
    int64_t ng = r->epi == FSDP_EPILOGUE_BGRAD_A ? M : N;
    uint16_t *da = dev16(hrand16(M * K, 1), M * K, r->pad_a), *db = dev16(hrand16(K * N, 1), K * N, r->pad_b);
    uint16_t *dc = dev16(hrand16(MN, 1), MN, r->pad_c), *dd = dev16(NULL, MN, r->pad_d);
    uint16_t *dbias = dev16(hrand16(N, 1), N, r->pad_bias);
    uint16_t *daux = dev16(r->epi == FSDP_EPILOGUE_DGELU_BGRAD ? hrand16(MN, 1) : NULL, MN, r->pad_aux);
    uint16_t *dgrad = dev16(NULL, ng, r->pad_grad);
    int ran = G->matmul_epilogue_bf16(dd, da, db, dc, M, N, K, 0, 1, r->alpha, r->beta, r->epi, dbias, daux, dgrad);
    test_check(ran == r->want, "%s (%s M %lld N %lld K %lld): returned %d, want %d", r->what, epi_name(r->epi),
               (long long)M, (long long)N, (long long)K, ran, r->want);
    if (ran == 0 && r->want == 0) {
        int untouched = (MN == 0 || all_nan(dd, MN)) && (ng == 0 || all_nan(dgrad, ng)) &&
                        (r->epi != FSDP_EPILOGUE_GELU_AUX_BIAS || MN == 0 || all_nan(daux, MN));
        test_check(untouched, "%s: nothing written", r->what);
    }
    if (ran == 1 && r->want == 1) test_check(!all_nan(dd, MN), "%s: D written", r->what);
    free_case();
}

static void test_refusals(void) {
    const int B = FSDP_EPILOGUE_BIAS, GL = FSDP_EPILOGUE_GELU_AUX_BIAS, DG = FSDP_EPILOGUE_DGELU_BGRAD,
              BA = FSDP_EPILOGUE_BGRAD_A, GB = FSDP_EPILOGUE_GELU_BIAS;
    refusal rs[] = {
        {"bias 2 bytes off 16", GB, 3, 8, 5, 1, 0, 0, 0, 0, 0, 1, 0, 0, 0},
        {"N 12 without aux (GELU_BIAS keeps no GELU input)", GB, 3, 12, 5, 1, 0, 0, 0, 0, 0, 0, 0, 0, 1},
        {"an unused aux and dbias off 16", GB, 3, 13, 5, 1, 0, 0, 0, 0, 0, 0, 1, 1, 1},
        {"D 2 bytes off 16", B, 3, 8, 5, 1, 0, 1, 0, 0, 0, 0, 0, 0, 0},
        {"A 2 bytes off 16", GL, 3, 8, 5, 1, 0, 0, 1, 0, 0, 0, 0, 0, 0},
        {"B 2 bytes off 16", DG, 3, 8, 5, 1, 0, 0, 0, 1, 0, 0, 0, 0, 0},
        {"C 2 bytes off 16, beta 1", B, 3, 8, 5, 1, 1, 0, 0, 0, 1, 0, 0, 0, 0},
        {"C 2 bytes off 16, beta 0 (C not read)", B, 3, 8, 5, 1, 0, 0, 0, 0, 1, 0, 0, 0, 1},
        {"bias 2 bytes off 16", GL, 3, 8, 5, 1, 0, 0, 0, 0, 0, 1, 0, 0, 0},
        {"aux 2 bytes off 16", GL, 3, 8, 5, 1, 0, 0, 0, 0, 0, 0, 1, 0, 0},
        {"aux 2 bytes off 16", DG, 3, 8, 5, 1, 0, 0, 0, 0, 0, 0, 1, 0, 0},
        {"dbias 2 bytes off 16", DG, 3, 8, 5, 1, 0, 0, 0, 0, 0, 0, 0, 1, 0},
        {"dbias 2 bytes off 16", BA, 3, 8, 5, 1, 0, 0, 0, 0, 0, 0, 0, 1, 0},
        {"an unused aux off 16", B, 3, 8, 5, 1, 0, 0, 0, 0, 0, 0, 1, 1, 1},
        {"N 12, not a multiple of 8 (the aux rule)", GL, 3, 12, 5, 1, 0, 0, 0, 0, 0, 0, 0, 0, 0},
        {"N 12, not a multiple of 8 (the aux rule)", DG, 3, 12, 5, 1, 0, 0, 0, 0, 0, 0, 0, 0, 0},
        {"N 12 without aux", B, 3, 12, 5, 1, 0, 0, 0, 0, 0, 0, 0, 0, 1},
        {"BGRAD_A with alpha 0.5", BA, 3, 8, 5, 0.5f, 0, 0, 0, 0, 0, 0, 0, 0, 0},
        {"K 0", B, 3, 8, 0, 1, 0, 0, 0, 0, 0, 0, 0, 0, 0},
    };
    for (size_t i = 0; i < sizeof rs / sizeof rs[0]; i++) run_refusal(&rs[i]);
}

#ifdef FSDP_CUDA_EMU
/* ---- plans: one query per shape, epilogue, transposes and alignment; no algorithm -> 0 ---- */

static void test_plans(void) {
    lt_case t = {9, 16, 7, 1, 0, 1, 0, 0};
    long long q0 = emu_cublaslt_heuristic_queries(), m0 = emu_cublaslt_matmuls();
    run_case(&t, FSDP_EPILOGUE_GELU_AUX_BIAS);
    run_case(&t, FSDP_EPILOGUE_GELU_AUX_BIAS);
    run_case(&t, FSDP_EPILOGUE_GELU_AUX_BIAS);
    test_check(emu_cublaslt_heuristic_queries() - q0 == 1 && emu_cublaslt_matmuls() - m0 == 3,
               "three calls of one plan: %lld heuristic queries (want 1), %lld products (want 3)",
               emu_cublaslt_heuristic_queries() - q0, emu_cublaslt_matmuls() - m0);
    q0 = emu_cublaslt_heuristic_queries();
    t.tb = 1;
    run_case(&t, FSDP_EPILOGUE_GELU_AUX_BIAS);
    test_check(emu_cublaslt_heuristic_queries() - q0 == 1, "another transpose: a new plan");

    /* the heuristic finds nothing: 0, nothing written, and the answer kept */
    const char *no_algo[3] = {"no heuristic (CUBLAS_STATUS_NOT_SUPPORTED)", "no algorithm returned",
                              "the heuristic refuses the shape (CUBLAS_STATUS_INVALID_VALUE)"};
    for (int mode = 1; mode <= 3; mode++) {
        emu_cublaslt_set_no_algo(mode);
        refusal r = {no_algo[mode - 1],
                     FSDP_EPILOGUE_DGELU_BGRAD, 5 + mode, 24, 3, 1, 0, 0, 0, 0, 0, 0, 0, 0, 0};
        q0 = emu_cublaslt_heuristic_queries();
        run_refusal(&r);
        emu_cublaslt_set_no_algo(0);
        run_refusal(&r);   /* the plan remembers there is none */
        test_check(emu_cublaslt_heuristic_queries() - q0 == 1, "%s: asked once (%lld queries)", r.what,
                   emu_cublaslt_heuristic_queries() - q0);
    }
}

/* ---- the plans are bounded: the least recently used one is destroyed for a new one ---- */

static long long queries_of(int64_t M) {   /* heuristic queries of one BIAS call with M rows */
    lt_case t = {M, 8, 3, 0, 1, 1, 0, 0};
    long long q0 = emu_cublaslt_heuristic_queries();
    run_case(&t, FSDP_EPILOGUE_BIAS);
    return emu_cublaslt_heuristic_queries() - q0;
}

static void test_plan_bound(void) {
    cuda_lt_set_plan_limit(4);   /* every plan destroyed: what is left is not theirs */
    long long live0 = emu_cublaslt_live_objects();
    test_check(cuda_lt_plans() == 0, "a new limit starts with no plans (%d)", cuda_lt_plans());
    long long q = 0;
    for (int64_t M = 1; M <= 4; M++) q += queries_of(M);
    test_check(q == 4 && cuda_lt_plans() == 4 && emu_cublaslt_live_objects() - live0 == 16,
               "4 shapes under a limit of 4: %lld queries, %d plans, %lld descriptors and layouts (want 4, 4, 16)", q,
               cuda_lt_plans(), emu_cublaslt_live_objects() - live0);
    test_check(queries_of(1) == 0, "M 1 again: kept (and now the most recently used)");
    test_check(queries_of(5) == 1, "M 5: a new plan");
    test_check(cuda_lt_plans() == 4 && emu_cublaslt_live_objects() - live0 == 16,
               "M 5 took the least recently used plan's place: %d plans, %lld objects", cuda_lt_plans(),
               emu_cublaslt_live_objects() - live0);
    test_check(queries_of(1) == 0 && queries_of(3) == 0 && queries_of(4) == 0 && queries_of(5) == 0,
               "M 1, 3, 4 and 5 kept");
    test_check(queries_of(2) == 1, "M 2, the least recently used, was the one destroyed");
    q = 0;
    for (int64_t M = 6; M <= 40; M++) q += queries_of(M);   /* a row count that changes every call */
    test_check(q == 35 && cuda_lt_plans() == 4 && emu_cublaslt_live_objects() - live0 == 16,
               "35 more shapes: %lld queries, still %d plans and %lld objects", q, cuda_lt_plans(),
               emu_cublaslt_live_objects() - live0);
    /* a plan without an algorithm holds no descriptors, and is evicted too */
    emu_cublaslt_set_no_algo(1);
    refusal none = {"no algorithm for M 41", FSDP_EPILOGUE_BIAS, 41, 8, 3, 1, 0, 0, 0, 0, 0, 0, 0, 0, 0};
    long long q0 = emu_cublaslt_heuristic_queries();
    run_refusal(&none);
    test_check(emu_cublaslt_heuristic_queries() - q0 == 1, "no algorithm for M 41: asked once");
    emu_cublaslt_set_no_algo(0);
    test_check(emu_cublaslt_live_objects() - live0 == 12, "its slot holds nothing: %lld objects (want 12)",
               emu_cublaslt_live_objects() - live0);
    cuda_lt_set_plan_limit(0);
    test_check(cuda_lt_plans() == 0 && emu_cublaslt_live_objects() == live0,
               "back to the default limit: every plan destroyed (%lld objects left over)",
               emu_cublaslt_live_objects() - live0);
    test_check(queries_of(1) == 1 && queries_of(1) == 0, "and made again as needed");
}

/* ---- the emulated cuBLASLt refuses what the real one does ---- */

static uint16_t *dev_aligned(size_t n, size_t align) {   /* n bf16 NaNs at an address a multiple of align */
    uint8_t *p = dalloc(n * 2 + align);
    uintptr_t u = ((uintptr_t)p + align - 1) & ~(uintptr_t)(align - 1);
    uint16_t *t = halloc(n * 2);
    for (size_t i = 0; i < n; i++) t[i] = 0x3f80;   /* 1.0 */
    G->copy_from_host((void *)u, t, n * 2);
    return (uint16_t *)u;
}

static void test_emulated_rules(void) {
    cublasLtHandle_t h;
    test_check(cublasLtCreate(&h) == CUBLAS_STATUS_SUCCESS, "cublasLtCreate");
    uint64_t m = 16, n = 4, k = 8;
    cublasLtMatmulDesc_t d;
    cublasLtMatrixLayout_t la, lb, lc;
    cublasLtMatmulPreference_t pref;
    cublasLtMatmulDescCreate(&d, CUBLAS_COMPUTE_32F, CUDA_R_32F);
    cublasLtMatrixLayoutCreate(&la, CUDA_R_16BF, m, k, (int64_t)m);
    cublasLtMatrixLayoutCreate(&lb, CUDA_R_16BF, k, n, (int64_t)k);
    cublasLtMatrixLayoutCreate(&lc, CUDA_R_16BF, m, n, (int64_t)m);
    cublasLtMatmulPreferenceCreate(&pref);
    cublasLtMatmulHeuristicResult_t res;
    int found = 0;
    uint32_t epi = CUBLASLT_EPILOGUE_GELU_AUX_BIAS;
    test_check(cublasLtMatmulDescSetAttribute(d, CUBLASLT_MATMUL_DESC_EPILOGUE, &epi, 2) == CUBLAS_STATUS_INVALID_VALUE,
               "an attribute of the wrong size: INVALID_VALUE");
    cublasLtMatmulDescSetAttribute(d, CUBLASLT_MATMUL_DESC_EPILOGUE, &epi, sizeof epi);
    cublasStatus_t st = cublasLtMatmulAlgoGetHeuristic(h, d, la, lb, lc, lc, pref, 1, &res, &found);
    test_check(st == CUBLAS_STATUS_INVALID_VALUE, "GELU_AUX_BIAS without bias and aux: %d, want INVALID_VALUE", st);
    uint16_t *a = dev_aligned(m * k, 256), *b = dev_aligned(k * n, 256), *dd = dev_aligned(m * n, 256);
    uint16_t *bias = dev_aligned(m, 256), *aux = dev_aligned(m * n + 8 * n, 256);
    const void *bp = bias, *ap = aux;
    cublasLtMatmulDescSetAttribute(d, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &bp, sizeof bp);
    cublasLtMatmulDescSetAttribute(d, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER, &ap, sizeof ap);
    int64_t lds[] = {20, 8, 24};   /* not divisible by 8; less than the rows (16); fine */
    cublasStatus_t want[] = {CUBLAS_STATUS_INVALID_VALUE, CUBLAS_STATUS_INVALID_VALUE, CUBLAS_STATUS_SUCCESS};
    for (int i = 0; i < 3; i++) {
        cublasLtMatmulDescSetAttribute(d, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_LD, &lds[i], sizeof lds[i]);
        st = cublasLtMatmulAlgoGetHeuristic(h, d, la, lb, lc, lc, pref, 1, &res, &found);
        test_check(st == want[i] && (st != CUBLAS_STATUS_SUCCESS || found == 1), "AUX_LD %lld: status %d, want %d",
                   (long long)lds[i], st, want[i]);
    }
    float alpha = 1, beta = 0;
    /* the default preference (256-byte buffers): the algorithm cannot take a D only 16-byte aligned */
    st = cublasLtMatmul(h, d, &alpha, a, la, b, lb, &beta, dd, lc, dd, lc, &res.algo, NULL, 0, NULL);
    test_check(st == CUBLAS_STATUS_SUCCESS, "256-byte aligned buffers, default preference: %d", st);
    uint16_t *d16 = dev_aligned(m * n + 8, 256) + 8;
    st = cublasLtMatmul(h, d, &alpha, a, la, b, lb, &beta, d16, lc, d16, lc, &res.algo, NULL, 0, NULL);
    test_check(st == CUBLAS_STATUS_INVALID_VALUE, "D 16-byte aligned, algorithm for 256: %d, want INVALID_VALUE", st);
    uint16_t *bias2 = bias + 1;   /* 2 bytes off what the heuristic saw */
    const void *bp2 = bias2;
    cublasLtMatmulDescSetAttribute(d, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &bp2, sizeof bp2);
    st = cublasLtMatmul(h, d, &alpha, a, la, b, lb, &beta, dd, lc, dd, lc, &res.algo, NULL, 0, NULL);
    test_check(st == CUBLAS_STATUS_INVALID_VALUE, "bias less aligned than at the query: %d, want INVALID_VALUE", st);
    cublasLtMatmulDescSetAttribute(d, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &bp, sizeof bp);
    /* a long k takes split-K workspace when the preference allows: then less workspace is refused */
    cublasLtMatrixLayout_t la2, lb2;
    uint64_t k2 = 2048;
    cublasLtMatrixLayoutCreate(&la2, CUDA_R_16BF, m, k2, (int64_t)m);
    cublasLtMatrixLayoutCreate(&lb2, CUDA_R_16BF, k2, n, (int64_t)k2);
    uint64_t ws = 4u << 20;
    cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws, sizeof ws);
    st = cublasLtMatmulAlgoGetHeuristic(h, d, la2, lb2, lc, lc, pref, 1, &res, &found);
    test_check(st == CUBLAS_STATUS_SUCCESS && res.workspaceSize > 0, "k 2048: an algorithm with workspace (%zu bytes)",
               res.workspaceSize);
    uint16_t *a2 = dev_aligned(m * k2, 256), *b2 = dev_aligned(k2 * n, 256);
    st = cublasLtMatmul(h, d, &alpha, a2, la2, b2, lb2, &beta, dd, lc, dd, lc, &res.algo, NULL, 0, NULL);
    test_check(st == CUBLAS_STATUS_INVALID_VALUE, "less workspace than the algorithm's: %d, want INVALID_VALUE", st);
    /* an algorithm of another shape */
    st = cublasLtMatmul(h, d, &alpha, a, la, b, lb, &beta, dd, lc, dd, lc, &res.algo, NULL, 0, NULL);
    test_check(st == CUBLAS_STATUS_INVALID_VALUE, "an algorithm found for another shape: %d, want INVALID_VALUE", st);
    /* in place with a C layout other than D's */
    cublasLtMatrixLayout_t lc2;
    cublasLtMatrixLayoutCreate(&lc2, CUDA_R_16BF, m, n, (int64_t)m + 8);
    st = cublasLtMatmulAlgoGetHeuristic(h, d, la, lb, lc2, lc, pref, 1, &res, &found);
    beta = 1;
    st = cublasLtMatmul(h, d, &alpha, a, la, b, lb, &beta, dd, lc2, dd, lc, &res.algo, NULL, 0, NULL);
    test_check(st == CUBLAS_STATUS_INVALID_VALUE, "C == D with another layout: %d, want INVALID_VALUE", st);
    cublasLtMatrixLayoutDestroy(la);
    cublasLtMatrixLayoutDestroy(lb);
    cublasLtMatrixLayoutDestroy(lc);
    cublasLtMatrixLayoutDestroy(la2);
    cublasLtMatrixLayoutDestroy(lb2);
    cublasLtMatrixLayoutDestroy(lc2);
    cublasLtMatmulPreferenceDestroy(pref);
    cublasLtMatmulDescDestroy(d);
    cublasLtDestroy(h);
    free_case();
}
#endif

/* ---- the counting device's line ---- */

static int meta_index(const char *want) {
    int n = 0;
    fsdp_meta_entry_count(&n);
    for (int i = 0; i < n; i++) {
        const char *name = NULL;
        fsdp_meta_entry(i, &name, NULL, NULL, NULL);
        if (name && strcmp(name, want) == 0) return i;
    }
    return -1;
}

static void test_meta(void) {
    test_check(fsdp_meta_mimic(FSDP_DEVICE_CUDA) == FSDP_OK, "meta mimics CUDA: %s", fsdp_last_error());
    const fsdp_device_kernels *mk = device_kernels(FSDP_DEVICE_META);
    int e = meta_index("matmul_epilogue_bf16");
    test_check(mk && mk->matmul_epilogue_bf16 && e >= 0, "the meta device has matmul_epilogue_bf16");
    if (!mk || !mk->matmul_epilogue_bf16 || e < 0) return;
    const char *family = NULL;
    fsdp_meta_entry(e, NULL, &family, NULL, NULL);
    test_check(family && strcmp(family, "gemm_bf16") == 0, "its family: %s", family ? family : "(null)");
    int64_t M = 3, N = 8, K = 5, MN = M * N;
    uint16_t *buf[7];
    for (int i = 0; i < 7; i++) buf[i] = mk->raw_alloc(4096);
    struct {
        int epi;
        float beta;
        int64_t rd, wr, fl;
    } cs[] = {
        {FSDP_EPILOGUE_BIAS, 0, 2 * (M * K + K * N + N), 2 * MN, 2 * M * N * K + MN},
        {FSDP_EPILOGUE_GELU_AUX_BIAS, 1, 2 * (M * K + K * N + MN + N), 2 * (MN + MN), 2 * M * N * K + 9 * MN},
        {FSDP_EPILOGUE_DGELU_BGRAD, 0, 2 * (M * K + K * N + MN), 2 * (MN + N), 2 * M * N * K + 14 * MN},
        {FSDP_EPILOGUE_BGRAD_A, 1, 2 * (M * K + K * N + MN), 2 * (MN + M), 2 * M * N * K + M * K},
        {FSDP_EPILOGUE_GELU_BIAS, 0, 2 * (M * K + K * N + N), 2 * MN, 2 * M * N * K + 9 * MN},
    };
    for (size_t i = 0; i < sizeof cs / sizeof cs[0]; i++) {
        fsdp_meta_reset();
        int ran = mk->matmul_epilogue_bf16(buf[0], buf[1], buf[2], buf[3], M, N, K, 0, 1, 1.0f, cs[i].beta, cs[i].epi,
                                           buf[4], buf[5], buf[6]);
        int64_t cnt[7] = {0};
        fsdp_meta_entry(e, NULL, NULL, NULL, cnt);
        test_check(ran == 1 && cnt[0] == 1 && cnt[1] == cs[i].rd && cnt[2] == cs[i].wr && cnt[3] == cs[i].fl &&
                       cnt[4] == 1 && cnt[5] == 0,
                   "meta %s beta %g: ran %d, calls %lld, read %lld (want %lld), written %lld (want %lld), FLOPs %lld "
                   "(want %lld), launches %lld, syncs %lld",
                   epi_name(cs[i].epi), cs[i].beta, ran, (long long)cnt[0], (long long)cnt[1], (long long)cs[i].rd,
                   (long long)cnt[2], (long long)cs[i].wr, (long long)cnt[3], (long long)cs[i].fl, (long long)cnt[4],
                   (long long)cnt[5]);
    }
    /* what the CUDA entry refuses costs nothing and returns 0, as there */
    fsdp_meta_reset();
    int ran = mk->matmul_epilogue_bf16(buf[0] + 1, buf[1], buf[2], buf[3], M, N, K, 0, 1, 1.0f, 0, FSDP_EPILOGUE_BIAS,
                                       buf[4], buf[5], buf[6]);
    int ran12 = mk->matmul_epilogue_bf16(buf[0], buf[1], buf[2], buf[3], M, 12, K, 0, 1, 1.0f, 0,
                                         FSDP_EPILOGUE_GELU_AUX_BIAS, buf[4], buf[5], buf[6]);
    int64_t cnt[7] = {0};
    fsdp_meta_entry(e, NULL, NULL, NULL, cnt);
    test_check(ran == 0 && ran12 == 0 && cnt[0] == 0 && cnt[1] == 0 && cnt[4] == 0,
               "meta: a misaligned D and GELU with N 12 return 0 (%d, %d) and count nothing (%lld calls)", ran, ran12,
               (long long)cnt[0]);
    for (int i = 0; i < 7; i++) mk->raw_free(buf[i]);
    fsdp_meta_mimic(FSDP_DEVICE_CPU);
}

/* The cuBLASLt workspace comes from the engine's allocator (tag other) at
 * the entry's first call that runs, so fsdp.memory counts it: none before,
 * none while a cap leaves no room (the entry returns 0, the op layer runs
 * unfused), then FSDP_EPILOGUE_WORKSPACE_BYTES, once. Runs first, in a
 * process that has made no fused GEMM yet. */
static int64_t other_bytes(fsdp_device dev, int64_t *reserved) {
    int64_t cur = -1;
    fsdp_mem_stats(dev, FSDP_TAG_OTHER, &cur, NULL, reserved);
    return cur;
}

static void test_workspace(void) {
    const int64_t ws = (int64_t)FSDP_EPILOGUE_WORKSPACE_BYTES, M = 3, N = 8, K = 5;
    test_check(ws == 32 << 20, "cuBLASLt's workspace is 32 MiB (%lld bytes)", (long long)ws);
    int64_t res = -1;
    test_check(cuda_lt_workspace_bytes() == 0 && other_bytes(FSDP_DEVICE_CUDA, &res) == 0 && res == 0,
               "before the first fused GEMM: no workspace (%zu bytes), none counted (other %lld, reserved %lld)",
               cuda_lt_workspace_bytes(), (long long)other_bytes(FSDP_DEVICE_CUDA, NULL), (long long)res);
    uint16_t *d = dalloc((size_t)(M * N) * 2), *a = dalloc((size_t)(M * K) * 2), *b = dalloc((size_t)(K * N) * 2);
    uint16_t *bias = dalloc((size_t)N * 2);
    fsdp_mem_set_cap(FSDP_DEVICE_CUDA, 1 << 20);
    int ran = G->matmul_epilogue_bf16(d, a, b, NULL, M, N, K, 0, 1, 1.0f, 0.0f, FSDP_EPILOGUE_BIAS, bias, NULL, NULL);
    test_check(ran == 0 && cuda_lt_workspace_bytes() == 0 && other_bytes(FSDP_DEVICE_CUDA, NULL) == 0,
               "a cap of 1 MiB: the fused GEMM returns 0 (%d) and takes no workspace (%zu bytes)", ran,
               cuda_lt_workspace_bytes());
    fsdp_mem_set_cap(FSDP_DEVICE_CUDA, 0);
    for (int call = 1; call <= 2; call++) {
        ran = G->matmul_epilogue_bf16(d, a, b, NULL, M, N, K, 0, 1, 1.0f, 0.0f, FSDP_EPILOGUE_BIAS, bias, NULL, NULL);
        int64_t cur = other_bytes(FSDP_DEVICE_CUDA, &res);
        test_check(ran == 1 && cuda_lt_workspace_bytes() == (size_t)ws && cur == ws && res == ws,
                   "fused GEMM %d without a cap: runs (%d), the workspace %zu bytes, counted as in use %lld and "
                   "reserved %lld under tag other", call, ran, cuda_lt_workspace_bytes(), (long long)cur,
                   (long long)res);
    }
    G->synchronize();
    free_case();
    /* the counting device: the same at its first fused GEMM after a mimic, given back by the next mimic */
    test_check(fsdp_meta_mimic(FSDP_DEVICE_CUDA) == FSDP_OK, "meta mimics CUDA: %s", fsdp_last_error());
    const fsdp_device_kernels *mk = device_kernels(FSDP_DEVICE_META);
    uint16_t *buf[4];
    for (int i = 0; i < 4; i++) buf[i] = mk->raw_alloc(4096);
    int64_t before = other_bytes(FSDP_DEVICE_META, NULL);
    ran = mk->matmul_epilogue_bf16(buf[0], buf[1], buf[2], NULL, M, N, K, 0, 1, 1.0f, 0.0f, FSDP_EPILOGUE_BIAS, buf[3],
                                   NULL, NULL);
    int ran2 = mk->matmul_epilogue_bf16(buf[0], buf[1], buf[2], NULL, M, N, K, 0, 1, 1.0f, 0.0f, FSDP_EPILOGUE_BIAS,
                                        buf[3], NULL, NULL);
    int64_t during = other_bytes(FSDP_DEVICE_META, NULL);
    fsdp_meta_mimic(FSDP_DEVICE_CPU);
    int64_t after = other_bytes(FSDP_DEVICE_META, NULL);
    test_check(ran == 1 && ran2 == 1 && before == 0 && during == ws && after == 0,
               "meta: tag other %lld before, %lld after two fused GEMMs (want %lld), %lld after the next mimic",
               (long long)before, (long long)during, (long long)ws, (long long)after);
    for (int i = 0; i < 4; i++) mk->raw_free(buf[i]);
}

/* An unknown epilogue is the caller's bug: the process ends, naming the op. */
static int fault(void) {
    uint16_t *d = dalloc(64), *a = dalloc(64), *b = dalloc(64);
    G->matmul_epilogue_bf16(d, a, b, NULL, 2, 8, 2, 0, 0, 1.0f, 0.0f, 9, NULL, NULL, NULL);
    printf("still alive after a fatal error\n");
    return 1;
}

/* FSDP_CUDA_EPILOGUES=0: the entry is left out of the CUDA table and of the
 * counting device's CUDA set, so the op layer composes the unfused ops. */
static int epilogues_off(void) {
    test_check(G->matmul_epilogue_bf16 == NULL && G->matmul_bf16 != NULL,
               "FSDP_CUDA_EPILOGUES=0: no matmul_epilogue_bf16 in the CUDA table");
    test_check(cuda_lt_workspace_bytes() == 0, "FSDP_CUDA_EPILOGUES=0: no cuBLASLt workspace (%zu bytes)",
               cuda_lt_workspace_bytes());
    test_check(fsdp_meta_mimic(FSDP_DEVICE_CUDA) == FSDP_OK &&
                   device_kernels(FSDP_DEVICE_META)->matmul_epilogue_bf16 == NULL,
               "FSDP_CUDA_EPILOGUES=0: none in the meta device's CUDA set either");
    fsdp_meta_mimic(FSDP_DEVICE_CPU);
    return test_summary();
}

int main(int argc, char **argv) {
    int do_fault = argc > 1 && strcmp(argv[1], "--fault") == 0;
    int do_off = argc > 1 && strcmp(argv[1], "--off") == 0;
    test_rng_seed(&rng, 20261201);
#ifdef FSDP_CUDA_EMU
    emu_set_device_count(1);
#endif
    fsdp_status st = cuda_backend_init(0);
    if (st == FSDP_OK && cuda_unavailable_reason()) {
        printf("SKIPPED: %s\n", cuda_unavailable_reason());
        return 77;
    }
    if (st != FSDP_OK) {
        printf("FAILED: cuda_backend_init: %s\n", fsdp_last_error());
        return 1;
    }
    G = device_kernels(FSDP_DEVICE_CUDA);
    if (G && do_off) return epilogues_off();
    test_check(G && G->matmul_epilogue_bf16, "the CUDA table has matmul_epilogue_bf16");
    if (!G || !G->matmul_epilogue_bf16) return test_summary();
    test_check(device_kernels(FSDP_DEVICE_CPU)->matmul_epilogue_bf16 == NULL, "the CPU table has none");
    char desc[256] = "";
    int avail = 0;
    cuda_device_info(&avail, desc, sizeof desc);
    printf("%s: %s\n", MODE, desc);
    if (do_fault) return fault();
    test_workspace();
    test_epilogues();
    test_refusals();
#ifdef FSDP_CUDA_EMU
    test_plans();
    test_plan_bound();
    test_emulated_rules();
#endif
    test_meta();
    G->synchronize();
    fsdp_status last = cuda_last_status();
    test_check(last == FSDP_OK, "no CUDA error recorded: %s", last == FSDP_OK ? "" : fsdp_last_error());
    return test_summary();
}
