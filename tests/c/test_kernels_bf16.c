/* test_kernels_bf16.c: the CPU's bf16-native kernels (the `<op>_bf16` table
 * entries: elementwise, GELU, LayerNorm, cross-entropy, the embedding's
 * backward, sum over a dim, the f32 += bf16 gradient add) against two
 * references, at awkward sizes, with 1 and 3 threads:
 *
 * 1. exactly the f32 kernel on the same (widened) inputs, rounded once to
 *    bf16: the bf16 kernels do the f32 kernels' arithmetic in the same
 *    order, widening each element as it is loaded and rounding as it is
 *    stored, so any difference is a bug, not rounding;
 * 2. the double-precision reference (ref_nn.c, ref_basic.c) within the bf16
 *    tolerance: |got - want| <= 2^-8 |want| + atol, that is one bf16
 *    rounding of the output (<= 2^-9 relative) plus the f32 arithmetic
 *    inside; atol = 2^-8 times the output's largest magnitude for outputs
 *    that cancel (LayerNorm's dx, the weight and bias sums).
 * Inputs are exact bf16 values, so the references see what the kernel sees. */
#include "cpu_kernels.h"
#include "fsdp.h"
#include "ref_basic.h"
#include "ref_nn.h"
#include "testutil.h"
#include <math.h>
#include <stdbool.h>
#include <stdlib.h>
#include <string.h>

static test_rng rng;
static int nthreads;

#define RTOL_BF16 (1.0 / 256.0)

static void *xmalloc(size_t n) {
    void *p = malloc(n ? n : 1);
    if (!p) { fprintf(stderr, "out of memory\n"); exit(1); }
    return p;
}

/* n random exact-bf16 values: h (bf16 bits), f (the same as f32), d (as double) */
typedef struct { uint16_t *h; float *f; double *d; int64_t n; } bvec;

static bvec bvec_new(int64_t n, float scale) {
    bvec v = {xmalloc(n * 2), xmalloc(n * sizeof(float)), xmalloc(n * sizeof(double)), n};
    test_fill_nonzero(&rng, v.f, n, scale);
    cpu_cast_f32_to_bf16(v.h, v.f, n);
    cpu_cast_bf16_to_f32(v.f, v.h, n);
    ref_to_double(v.d, v.f, n);
    return v;
}
static void bvec_free(bvec *v) { free(v->h); free(v->f); free(v->d); }

/* got (bf16) == f32_to_bf16(f32[i]) for all i; and within tolerance of want */
static void check(const char *name, const uint16_t *got, const float *f32, const double *want, int64_t n,
                  double atol_scale) {
    int64_t diff = 0;
    double maxabs = 0;
    for (int64_t i = 0; i < n; i++) maxabs = fmax(maxabs, fabs(want[i]));
    for (int64_t i = 0; i < n; i++) {
        if (got[i] != f32_to_bf16(f32[i])) {
            if (diff < 3)
                fprintf(stderr, "  %s[%lld]: bf16 0x%04x, f32 kernel rounded 0x%04x\n", name, (long long)i, got[i],
                        f32_to_bf16(f32[i]));
            diff++;
        }
    }
    test_check(diff == 0, "%s: bf16 kernel == f32 kernel rounded once [threads %d] (%lld differ of %lld)", name,
               nthreads, (long long)diff, (long long)n);
    float *g = xmalloc(n * sizeof(float));
    cpu_cast_bf16_to_f32(g, got, n);
    int64_t wrong = test_compare(name, g, want, n, atol_scale * RTOL_BF16 * maxabs, RTOL_BF16);
    test_check(wrong == 0, "%s: within bf16 tolerance of the double reference [threads %d] (%lld of %lld out)", name,
               nthreads, (long long)wrong, (long long)n);
    free(g);
}

static void test_binary(void) {
    /* (name, ndim, shape, a strides, b strides) over an output of shape */
    static const struct { const char *name; int nd; int64_t shape[3], sa[3], sb[3]; int64_t na, nb; } cases[] = {
        {"same shape", 1, {100003}, {1}, {1}, 100003, 100003},
        {"one element", 1, {1}, {1}, {1}, 1, 1},
        {"bias (rows, C) + (C)", 2, {37, 769}, {769, 1}, {0, 1}, 37 * 769, 769},
        {"scalar b", 2, {13, 7}, {7, 1}, {0, 0}, 91, 1},
        {"column (M, 1)", 2, {31, 257}, {257, 1}, {1, 0}, 31 * 257, 31},
        {"transposed a", 2, {29, 17}, {1, 29}, {17, 1}, 29 * 17, 29 * 17},
        {"3-d broadcast", 3, {3, 5, 11}, {55, 11, 1}, {0, 11, 1}, 165, 55},
    };
    static const char *ops[] = {"add", "sub", "mul", "div"};
    for (size_t c = 0; c < sizeof cases / sizeof cases[0]; c++)
        for (int op = 0; op < 4; op++) {
            int64_t n = 1;
            for (int k = 0; k < cases[c].nd; k++) n *= cases[c].shape[k];
            bvec a = bvec_new(cases[c].na, 2.0f), b = bvec_new(cases[c].nb, 2.0f);
            uint16_t *got = xmalloc(n * 2);
            float *f = xmalloc(n * sizeof(float));
            double *want = xmalloc(n * sizeof(double));
            cpu_binary_bf16(op, got, a.h, cases[c].sa, b.h, cases[c].sb, cases[c].nd, cases[c].shape);
            cpu_binary_f32(op, f, a.f, cases[c].sa, b.f, cases[c].sb, cases[c].nd, cases[c].shape);
            ref_binary(op, want, a.d, cases[c].sa, b.d, cases[c].sb, cases[c].nd, cases[c].shape);
            char name[128];
            snprintf(name, sizeof name, "binary %s %s", ops[op], cases[c].name);
            check(name, got, f, want, n, 0);
            bvec_free(&a); bvec_free(&b); free(got); free(f); free(want);
        }
    /* in place: out aliases a */
    bvec a = bvec_new(1001, 1.0f), b = bvec_new(1001, 1.0f);
    int64_t shape[1] = {1001}, st[1] = {1};
    float *f = xmalloc(1001 * sizeof(float));
    double *want = xmalloc(1001 * sizeof(double));
    cpu_binary_f32(FSDP_ADD, f, a.f, st, b.f, st, 1, shape);
    ref_binary(FSDP_ADD, want, a.d, st, b.d, st, 1, shape);
    cpu_binary_bf16(FSDP_ADD, a.h, a.h, st, b.h, st, 1, shape);
    check("binary add in place", a.h, f, want, 1001, 0);
    bvec_free(&a); bvec_free(&b); free(f); free(want);
}

static void test_gelu(void) {
    static const int64_t ns[] = {1, 13, 16385, 100003};
    for (int t = 0; t < 4; t++) {
        int64_t n = ns[t];
        bvec x = bvec_new(n, 4.0f), d = bvec_new(n, 1.0f);
        uint16_t *got = xmalloc(n * 2);
        float *f = xmalloc(n * sizeof(float));
        double *want = xmalloc(n * sizeof(double));
        char name[64];
        cpu_gelu_forward_bf16(got, x.h, n);
        cpu_gelu_forward_f32(f, x.f, n);
        ref_gelu(want, x.d, n);
        snprintf(name, sizeof name, "gelu forward n=%lld", (long long)n);
        check(name, got, f, want, n, 0);
        cpu_gelu_backward_bf16(got, x.h, d.h, n);
        cpu_gelu_backward_f32(f, x.f, d.f, n);
        ref_gelu_backward(want, x.d, d.d, n);
        snprintf(name, sizeof name, "gelu backward n=%lld", (long long)n);
        check(name, got, f, want, n, 2.0 / 256);   /* near the gradient's zero at x ~ -0.75 */
        bvec_free(&x); bvec_free(&d); free(got); free(f); free(want);
    }
}

static void test_layernorm(void) {
    static const int64_t shp[][2] = {{1, 1}, {7, 13}, {33, 768}, {5, 4099}};
    for (int s = 0; s < 4; s++)
        for (int affine = 0; affine < 2; affine++) {
            int64_t R = shp[s][0], C = shp[s][1], n = R * C;
            bvec x = bvec_new(n, 3.0f), w = bvec_new(C, 1.5f), b = bvec_new(C, 1.0f), dout = bvec_new(n, 1.0f);
            const uint16_t *wh = affine ? w.h : NULL, *bh = affine ? b.h : NULL;
            const float *wf = affine ? w.f : NULL, *bf = affine ? b.f : NULL;
            const double *wd = affine ? w.d : NULL, *bd = affine ? b.d : NULL;
            uint16_t *got = xmalloc(n * 2), *gw = xmalloc(C * 2), *gb = xmalloc(C * 2);
            float *f = xmalloc(n * sizeof(float)), *fw = xmalloc(C * sizeof(float)), *fb = xmalloc(C * sizeof(float));
            float *mean = xmalloc(R * sizeof(float)), *rstd = xmalloc(R * sizeof(float));
            float *mean2 = xmalloc(R * sizeof(float)), *rstd2 = xmalloc(R * sizeof(float));
            double *want = xmalloc(n * sizeof(double)), *ww = xmalloc(C * sizeof(double)), *wb = xmalloc(C * sizeof(double));
            double *dm = xmalloc(R * sizeof(double)), *dr = xmalloc(R * sizeof(double));
            char name[96];
            cpu_layernorm_forward_bf16(got, mean, rstd, x.h, wh, bh, R, C, 1e-5f);
            cpu_layernorm_forward_f32(f, mean2, rstd2, x.f, wf, bf, R, C, 1e-5f);
            ref_layernorm(want, dm, dr, x.d, wd, bd, R, C, 1e-5);
            snprintf(name, sizeof name, "layernorm forward %lldx%lld%s", (long long)R, (long long)C,
                     affine ? " affine" : "");
            check(name, got, f, want, n, 0);
            test_check(memcmp(mean, mean2, R * sizeof(float)) == 0 && memcmp(rstd, rstd2, R * sizeof(float)) == 0,
                       "%s: mean and rstd (f32) equal the f32 kernel's [threads %d]", name, nthreads);
            cpu_layernorm_backward_bf16(got, affine ? gw : NULL, affine ? gb : NULL, dout.h, x.h, wh, mean, rstd, R, C);
            cpu_layernorm_backward_f32(f, affine ? fw : NULL, affine ? fb : NULL, dout.f, x.f, wf, mean, rstd, R, C);
            ref_layernorm_backward(want, ww, wb, dout.d, x.d, wd, R, C, 1e-5);
            snprintf(name, sizeof name, "layernorm backward dx %lldx%lld%s", (long long)R, (long long)C,
                     affine ? " affine" : "");
            check(name, got, f, want, n, 1.0);
            if (affine) {
                snprintf(name, sizeof name, "layernorm backward dweight %lldx%lld", (long long)R, (long long)C);
                check(name, gw, fw, ww, C, 1.0);
                snprintf(name, sizeof name, "layernorm backward dbias %lldx%lld", (long long)R, (long long)C);
                check(name, gb, fb, wb, C, 1.0);
            }
            bvec_free(&x); bvec_free(&w); bvec_free(&b); bvec_free(&dout);
            free(got); free(gw); free(gb); free(f); free(fw); free(fb); free(mean); free(rstd); free(mean2);
            free(rstd2); free(want); free(ww); free(wb); free(dm); free(dr);
        }
}

static void test_cross_entropy(void) {
    /* N, V, valid_v; targets include ignored rows */
    static const int64_t shp[][3] = {{1, 1, 1}, {7, 13, 11}, {9, 50304, 50257}, {64, 301, 300}};
    for (int s = 0; s < 4; s++) {
        int64_t N = shp[s][0], V = shp[s][1], valid = shp[s][2], n = N * V;
        bvec x = bvec_new(n, 8.0f);
        int64_t *tg = xmalloc(N * sizeof(int64_t));
        for (int64_t i = 0; i < N; i++) tg[i] = (i % 5 == 3) ? -100 : (int64_t)(test_rng_uniform(&rng) * valid);
        float *loss = xmalloc(N * sizeof(float)), *lse = xmalloc(N * sizeof(float));
        float *loss2 = xmalloc(N * sizeof(float)), *lse2 = xmalloc(N * sizeof(float));
        double *dl = xmalloc(N * sizeof(double)), *dlse = xmalloc(N * sizeof(double));
        int64_t c1 = cpu_cross_entropy_forward_bf16(loss, lse, x.h, tg, N, V, valid, -100);
        int64_t c2 = cpu_cross_entropy_forward_f32(loss2, lse2, x.f, tg, N, V, valid, -100);
        int64_t c3 = ref_cross_entropy(dl, dlse, x.d, tg, N, V, valid, -100);
        int same = c1 == c2 && memcmp(loss, loss2, N * sizeof(float)) == 0 && memcmp(lse, lse2, N * sizeof(float)) == 0;
        test_check(same && c1 == c3, "cross-entropy forward %lldx%lld: losses, lse, count equal the f32 kernel's "
                   "[threads %d]", (long long)N, (long long)V, nthreads);
        char name[96];
        snprintf(name, sizeof name, "cross-entropy forward %lldx%lld losses", (long long)N, (long long)V);
        test_check(test_compare(name, loss, dl, N, 1e-5, 1e-5) == 0, "%s: within f32 tolerance of the double "
                   "reference (inputs exact bf16, f32 math) [threads %d]", name, nthreads);
        uint16_t *got = xmalloc(n * 2);
        float *f = xmalloc(n * sizeof(float));
        double *want = xmalloc(n * sizeof(double));
        float one = 1.0f, dloss = c1 ? 1.0f / (float)c1 : 0.0f;   /* the mean's gradient, shared by c1 rows */
        cpu_cross_entropy_backward_bf16(got, x.h, lse, tg, N, V, valid, -100, &one, c1);
        cpu_cross_entropy_backward_f32(f, x.f, lse, tg, N, V, valid, -100, &one, c1);
        ref_cross_entropy_backward(want, x.d, tg, N, V, valid, -100, dloss);
        snprintf(name, sizeof name, "cross-entropy backward %lldx%lld", (long long)N, (long long)V);
        check(name, got, f, want, n, 1.0 / 256);
        /* the fused kernel, in place: the forward's losses and the backward's dlogits, bit for bit */
        uint16_t *fx = xmalloc(n * 2);
        float *floss = xmalloc(N * sizeof(float));
        memcpy(fx, x.h, n * 2);
        cpu_cross_entropy_fused_bf16(floss, fx, tg, N, V, valid, -100, c1);
        test_check(memcmp(floss, loss, N * sizeof(float)) == 0 && memcmp(fx, got, n * 2) == 0,
                   "cross-entropy fused bf16 %lldx%lld: losses and dlogits (over the logits) equal the forward's and "
                   "the backward's [threads %d]", (long long)N, (long long)V, nthreads);
        bvec_free(&x); free(tg); free(loss); free(lse); free(loss2); free(lse2); free(dl); free(dlse);
        free(got); free(f); free(want); free(fx); free(floss);
    }
}

/* The embedding's backward: ids that repeat (vocab smaller than n), a dim
 * over one 256-column block, odd sizes. The dense kernel against the f32
 * kernel rounded once and the double sum; the accumulating one against
 * old + the double sum, rows of ids not present untouched. */
static void test_embedding_backward(void) {
    static const int64_t shp[][3] = {{1, 1, 1}, {11, 37, 5}, {50304, 9, 7}, {13, 40, 300}};   /* vocab, n, dim */
    for (int s = 0; s < 4; s++) {
        int64_t V = shp[s][0], n = shp[s][1], D = shp[s][2];
        bvec dout = bvec_new(n * D, 2.0f), old = bvec_new(V * D, 1.0f);
        int64_t *ids = xmalloc(n * sizeof(int64_t));
        for (int64_t i = 0; i < n; i++) ids[i] = (int64_t)(test_rng_uniform(&rng) * V) % V;
        if (n > 2) ids[n - 1] = ids[0];   /* at least one repeat */
        uint16_t *got = xmalloc(V * D * 2);
        float *f = xmalloc(V * D * sizeof(float));
        double *want = xmalloc(V * D * sizeof(double));
        for (int64_t k = 0; k < V * D; k++) want[k] = 0;
        for (int64_t i = 0; i < n; i++)
            for (int64_t j = 0; j < D; j++) want[ids[i] * D + j] += dout.d[i * D + j];
        cpu_embedding_backward_bf16(got, V, ids, n, dout.h, D);
        cpu_embedding_backward_f32(f, V, ids, n, dout.f, D);
        char name[96];
        snprintf(name, sizeof name, "embedding backward %lldx%lld, %lld ids", (long long)V, (long long)D, (long long)n);
        check(name, got, f, want, V * D, 1.0 / 256);
        /* accumulating: old + sum, one rounding; other rows exactly as they were */
        memcpy(got, old.h, V * D * 2);
        cpu_embedding_backward_acc_bf16(got, ids, n, dout.h, D);
        bool *hit = calloc((size_t)V, sizeof(bool));
        for (int64_t i = 0; i < n; i++) hit[ids[i]] = true;
        int64_t moved = 0;
        for (int64_t k = 0; k < V * D; k++) {
            moved += !hit[k / D] && got[k] != old.h[k];
            want[k] += old.d[k];
        }
        test_check(moved == 0, "%s, accumulating: rows of absent ids untouched [threads %d] (%lld moved)", name,
                   nthreads, (long long)moved);
        float *g = xmalloc(V * D * sizeof(float));
        cpu_cast_bf16_to_f32(g, got, V * D);
        double maxabs = 0;
        for (int64_t k = 0; k < V * D; k++) maxabs = fmax(maxabs, fabs(want[k]));
        int64_t wrong = test_compare(name, g, want, V * D, RTOL_BF16 / 256 * maxabs, RTOL_BF16);
        test_check(wrong == 0, "%s, accumulating: old + sum within one bf16 rounding [threads %d] (%lld out)", name,
                   nthreads, (long long)wrong);
        bvec_free(&dout); bvec_free(&old); free(ids); free(got); free(f); free(want); free(hit); free(g);
    }
}

/* bf16 sum over the middle dim of (outer, red, inner), plain and added to
 * what out holds, against the double reference; an empty red gives zeros
 * (plain) or leaves out as it was (accumulating). */
static void test_sum_dim(void) {
    static const int64_t shp[][3] = {{1, 1, 1}, {1, 256, 768}, {3, 7, 5}, {2, 13, 1}, {4, 0, 3}, {1, 3001, 300}};
    for (int s = 0; s < 6; s++) {
        int64_t O = shp[s][0], R = shp[s][1], I = shp[s][2], n = O * I;
        bvec x = bvec_new(O * R * I > 0 ? O * R * I : 1, 1.0f), old = bvec_new(n, 4.0f);
        uint16_t *got = xmalloc(n * 2);
        double *want = xmalloc(n * sizeof(double));
        ref_sum_dim(want, x.d, O, R, I);
        if (R == 0)
            for (int64_t k = 0; k < n; k++) want[k] = 0;
        cpu_sum_dim_bf16(got, x.h, O, R, I);
        char name[96];
        snprintf(name, sizeof name, "sum_dim bf16 (%lld, %lld, %lld)", (long long)O, (long long)R, (long long)I);
        float *g = xmalloc(n * sizeof(float));
        double maxabs = 0;
        for (int64_t k = 0; k < n; k++) maxabs = fmax(maxabs, fabs(want[k]));
        cpu_cast_bf16_to_f32(g, got, n);
        test_check(test_compare(name, g, want, n, RTOL_BF16 / 256 * maxabs, RTOL_BF16) == 0,
                   "%s: within one bf16 rounding of the double sum [threads %d]", name, nthreads);
        memcpy(got, old.h, n * 2);
        cpu_sum_dim_acc_bf16(got, x.h, O, R, I);
        maxabs = 0;
        for (int64_t k = 0; k < n; k++) maxabs = fmax(maxabs, fabs(want[k] += old.d[k]));
        cpu_cast_bf16_to_f32(g, got, n);
        test_check(test_compare(name, g, want, n, RTOL_BF16 / 256 * maxabs, RTOL_BF16) == 0,
                   "%s, accumulating: old + the double sum within one bf16 rounding [threads %d]", name, nthreads);
        bvec_free(&x); bvec_free(&old); free(got); free(want); free(g);
    }
}

/* axpy_f32_bf16: y (f32) += alpha * x (bf16), the gradient add of a group
 * of one. Bit for bit axpy_f32 on the widened x (the same FMA per element),
 * and within f32 rounding of the double reference: |got - want| <= 1e-6
 * (|y| + |alpha x|) per element (one rounding of the sum, cancellation
 * allowed for). */
static void test_axpy_f32_bf16(void) {
    static const int64_t sizes[] = {1, 15, 16, 17, 1009, 100003};
    const float alpha = -0.37f;
    test_rng saved = rng;   /* its own inputs: the other tests' draws stay as they were */
    test_rng_seed(&rng, 2029 + (uint64_t)nthreads);
    for (size_t t = 0; t < sizeof sizes / sizeof *sizes; t++) {
        int64_t n = sizes[t];
        char name[64];
        snprintf(name, sizeof name, "axpy_f32_bf16 n=%lld", (long long)n);
        bvec x = bvec_new(n, 3.0f);
        float *y = xmalloc(n * sizeof(float)), *y32 = xmalloc(n * sizeof(float));
        double *want = xmalloc(n * sizeof(double)), *scale = xmalloc(n * sizeof(double));
        test_fill_nonzero(&rng, y, n, 2.0f);
        memcpy(y32, y, n * sizeof(float));
        for (int64_t i = 0; i < n; i++) {
            want[i] = (double)y[i] + (double)alpha * x.d[i];
            scale[i] = fabs((double)y[i]) + fabs((double)alpha * x.d[i]);
        }
        cpu_axpy_f32_bf16(y, x.h, alpha, n);
        cpu_axpy_f32(y32, x.f, alpha, n);
        test_check(memcmp(y, y32, n * sizeof(float)) == 0, "%s: == axpy_f32 on the widened x [threads %d]", name,
                   nthreads);
        int64_t wrong = 0;
        for (int64_t i = 0; i < n; i++)
            if (!(fabs((double)y[i] - want[i]) <= 1e-6 * scale[i])) {
                if (wrong < 3)
                    fprintf(stderr, "  %s[%lld]: %.9g, want %.9g\n", name, (long long)i, y[i], want[i]);
                wrong++;
            }
        test_check(wrong == 0, "%s: within f32 rounding of the double reference [threads %d] (%lld of %lld out)",
                   name, nthreads, (long long)wrong, (long long)n);
        bvec_free(&x);
        free(y); free(y32); free(want); free(scale);
    }
    rng = saved;
}

int main(void) {
    test_rng_seed(&rng, 1612);
    static const int thread_counts[] = {1, 3};
    for (int t = 0; t < 2; t++) {
        nthreads = thread_counts[t];
        cpu_threads_set(nthreads);
        test_binary();
        test_gelu();
        test_layernorm();
        test_cross_entropy();
        test_embedding_backward();
        test_sum_dim();
        test_axpy_f32_bf16();
    }
    return test_summary();
}
