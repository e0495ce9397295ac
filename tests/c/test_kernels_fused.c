/* test_kernels_fused.c: the CPU's fused bias kernels (fused.c: bias + GELU
 * forward and backward with the bias gradient, bias + residual), f32 and
 * bf16, at awkward sizes, with 1 and 3 threads, against
 * 1. the unfused kernels (add, then gelu or add) in f32: the adds bit for
 *    bit, GELU within 1e-5 (the unfused kernel has an exp of its own); in
 *    bf16 exactly the fused f32 kernel on the widened inputs, rounded once;
 * 2. the double-precision reference (ref_nn.c) of gelu(x + b) and its
 *    gradient: f32 within 1e-5 relative (+ 1e-6 of the largest value),
 *    bf16 within one bf16 rounding (2^-8);
 * 3. the bias gradient: the double sum of dx as the kernel stored it, plus
 *    the old value when accumulating, rounded to f32 and then to the dtype
 *    (bf16: two roundings, bit for bit); and within tolerance of the double reference's
 *    gradient sum. Empty row counts give a zero sum, or leave an
 *    accumulated one as it was.
 * Inputs are exact bf16 values, so both dtypes see the same numbers. */
#include "cpu_kernels.h"
#include "fsdp.h"
#include "ref_basic.h"
#include "ref_nn.h"
#include "testutil.h"
#include <math.h>
#include <stdlib.h>
#include <string.h>

static test_rng rng;
static int nthreads;

static void *xmalloc(size_t n) {
    void *p = malloc(n ? n : 1);
    if (!p) { fprintf(stderr, "out of memory\n"); exit(1); }
    return p;
}

/* n random exact-bf16 values: h (bf16 bits), f (the same as f32), d (double) */
typedef struct { uint16_t *h; float *f; double *d; } bvec;
static bvec bvec_new(int64_t n, float scale) {
    bvec v = {xmalloc((size_t)n * 2), xmalloc((size_t)n * sizeof(float)), xmalloc((size_t)n * sizeof(double))};
    test_fill_nonzero(&rng, v.f, n, scale);
    cpu_cast_f32_to_bf16(v.h, v.f, n);
    cpu_cast_bf16_to_f32(v.f, v.h, n);
    ref_to_double(v.d, v.f, n);
    return v;
}
static void bvec_free(bvec *v) { free(v->h); free(v->f); free(v->d); }

static double max_abs(const double *w, int64_t n) {
    double m = 0;
    for (int64_t i = 0; i < n; i++) m = fmax(m, fabs(w[i]));
    return m;
}

/* near the unfused kernels (their exp is their own): rtol 1e-5 + 1e-6 of the
 * largest value, the activations' tolerance of the CUDA kernel test */
static void check_near_f32(const char *name, const float *got, const float *want, int64_t n) {
    double m = 0;
    for (int64_t i = 0; i < n; i++) m = fmax(m, fabs(want[i]));
    int64_t diff = 0;
    for (int64_t i = 0; i < n; i++) diff += !(fabs((double)got[i] - want[i]) <= 1e-5 * fabs(want[i]) + 1e-6 * m);
    test_check(diff == 0, "%s: near the unfused f32 kernels [threads %d] (%lld of %lld beyond)", name, nthreads,
               (long long)diff, (long long)n);
}
/* f32 bits equal */
static void check_same_f32(const char *name, const float *got, const float *want, int64_t n) {
    int64_t diff = 0;
    for (int64_t i = 0; i < n; i++) diff += memcmp(&got[i], &want[i], sizeof(float)) != 0;
    test_check(diff == 0, "%s: equals the unfused f32 kernels bit for bit [threads %d] (%lld of %lld differ)", name,
               nthreads, (long long)diff, (long long)n);
}
/* bf16 == the f32 result rounded once */
static void check_rounded(const char *name, const uint16_t *got, const float *f32, int64_t n) {
    int64_t diff = 0;
    for (int64_t i = 0; i < n; i++) diff += got[i] != f32_to_bf16(f32[i]);
    test_check(diff == 0, "%s: bf16 == the f32 kernel rounded once [threads %d] (%lld of %lld differ)", name, nthreads,
               (long long)diff, (long long)n);
}
static void check_ref(const char *name, const float *got, const double *want, int64_t n, double rtol, double atol) {
    int64_t wrong = test_compare(name, got, want, n, atol * max_abs(want, n), rtol);
    test_check(wrong == 0, "%s: within %g of the double reference [threads %d] (%lld of %lld out)", name, rtol,
               nthreads, (long long)wrong, (long long)n);
}

/* dbias against the double sum of dx as stored (+ old), rounded to f32 and
 * then to the dtype, bit for bit; f32 from bf16 bits when bf16 */
static void check_colsum(const char *name, const float *db, const float *dx, const float *old, int64_t rows,
                         int64_t cols, int bf16) {
    int64_t wrong = 0;
    for (int64_t j = 0; j < cols; j++) {
        double s = old ? old[j] : 0.0;
        for (int64_t r = 0; r < rows; r++) s += dx[r * cols + j];
        float want = bf16 ? bf16_to_f32(f32_to_bf16((float)s)) : (float)s;
        wrong += memcmp(&db[j], &want, sizeof(float)) != 0;
    }
    test_check(wrong == 0,
               "%s: the double sum of dx as stored, rounded to f32 then the dtype [threads %d] (%lld of %lld differ)",
               name, nthreads, (long long)wrong, (long long)cols);
}

static void widen(float *f, const uint16_t *h, int64_t n) { cpu_cast_bf16_to_f32(f, h, n); }

static void test_bias_gelu(void) {
    static const int64_t shp[][2] = {{1, 1}, {3, 7}, {5, 8}, {37, 769}, {300, 64}, {2, 3001}, {129, 24}};
    for (size_t s = 0; s < sizeof shp / sizeof shp[0]; s++) {
        int64_t rows = shp[s][0], cols = shp[s][1], n = rows * cols;
        bvec x = bvec_new(n, 3.0f), b = bvec_new(cols, 1.0f), d = bvec_new(n, 1.0f), old = bvec_new(cols, 2.0f);
        float *f = xmalloc((size_t)n * 4), *u = xmalloc((size_t)n * 4), *t = xmalloc((size_t)n * 4);
        float *g = xmalloc((size_t)n * 4), *db = xmalloc((size_t)cols * 4), *ud = xmalloc((size_t)cols * 4);
        uint16_t *h = xmalloc((size_t)n * 2), *hdb = xmalloc((size_t)cols * 2);
        double *xb = xmalloc((size_t)n * 8), *want = xmalloc((size_t)n * 8), *wdb = xmalloc((size_t)cols * 8);
        for (int64_t i = 0; i < n; i++) xb[i] = x.d[i] + b.d[i % cols];
        int64_t sx[2] = {cols, 1}, sb[2] = {0, 1}, shape[2] = {rows, cols};
        char name[128];

        /* forward */
        cpu_bias_gelu_forward_f32(f, x.f, b.f, rows, cols);
        cpu_binary_f32(FSDP_ADD, t, x.f, sx, b.f, sb, 2, shape);
        cpu_gelu_forward_f32(u, t, n);
        ref_gelu(want, xb, n);
        snprintf(name, sizeof name, "bias_gelu forward f32 (%lld, %lld)", (long long)rows, (long long)cols);
        check_near_f32(name, f, u, n);
        check_ref(name, f, want, n, 1e-5, 1e-6);
        cpu_bias_gelu_forward_bf16(h, x.h, b.h, rows, cols);
        snprintf(name, sizeof name, "bias_gelu forward bf16 (%lld, %lld)", (long long)rows, (long long)cols);
        check_rounded(name, h, f, n);
        widen(g, h, n);
        check_ref(name, g, want, n, 1.0 / 256, 0);

        /* backward: dx and the bias gradient */
        ref_gelu_backward(want, xb, d.d, n);
        for (int64_t j = 0; j < cols; j++) wdb[j] = 0;
        for (int64_t i = 0; i < n; i++) wdb[i % cols] += want[i];
        cpu_bias_gelu_backward_f32(f, db, d.f, x.f, b.f, rows, cols, 0);
        cpu_gelu_backward_f32(u, t, d.f, n);
        snprintf(name, sizeof name, "bias_gelu backward f32 dx (%lld, %lld)", (long long)rows, (long long)cols);
        check_near_f32(name, f, u, n);
        check_ref(name, f, want, n, 1e-5, 1e-6);
        snprintf(name, sizeof name, "bias_gelu backward f32 dbias (%lld, %lld)", (long long)rows, (long long)cols);
        check_colsum(name, db, f, NULL, rows, cols, 0);
        check_ref(name, db, wdb, cols, 1e-5, 1e-5);
        memcpy(ud, old.f, (size_t)cols * 4);
        cpu_bias_gelu_backward_f32(u, ud, d.f, x.f, b.f, rows, cols, 1);
        snprintf(name, sizeof name, "bias_gelu backward f32 dbias accumulated (%lld, %lld)", (long long)rows,
                 (long long)cols);
        check_colsum(name, ud, f, old.f, rows, cols, 0);
        cpu_bias_gelu_backward_f32(u, NULL, d.f, x.f, b.f, rows, cols, 0);
        snprintf(name, sizeof name, "bias_gelu backward f32 dx without dbias (%lld, %lld)", (long long)rows,
                 (long long)cols);
        check_same_f32(name, u, f, n);

        cpu_bias_gelu_backward_bf16(h, hdb, d.h, x.h, b.h, rows, cols, 0);
        snprintf(name, sizeof name, "bias_gelu backward bf16 dx (%lld, %lld)", (long long)rows, (long long)cols);
        check_rounded(name, h, f, n);
        widen(g, h, n);
        check_ref(name, g, want, n, 1.0 / 256, 2.0 / 256);   /* near the gradient's zero at x ~ -0.75 */
        widen(db, hdb, cols);
        snprintf(name, sizeof name, "bias_gelu backward bf16 dbias (%lld, %lld)", (long long)rows, (long long)cols);
        check_colsum(name, db, g, NULL, rows, cols, 1);
        check_ref(name, db, wdb, cols, 2.0 / 256, 2.0 / 256);
        uint16_t *hacc = xmalloc((size_t)cols * 2);
        memcpy(hacc, old.h, (size_t)cols * 2);
        cpu_bias_gelu_backward_bf16(h, hacc, d.h, x.h, b.h, rows, cols, 1);
        widen(db, hacc, cols);
        snprintf(name, sizeof name, "bias_gelu backward bf16 dbias accumulated (%lld, %lld)", (long long)rows,
                 (long long)cols);
        check_colsum(name, db, g, old.f, rows, cols, 1);
        free(hacc);

        bvec_free(&x); bvec_free(&b); bvec_free(&d); bvec_free(&old);
        free(f); free(u); free(t); free(g); free(db); free(ud); free(h); free(hdb); free(xb); free(want); free(wdb);
    }
    /* no rows: the bias gradient is 0, or stays as it was when accumulating */
    float db[3] = {7, 7, 7}, acc[3] = {1, 2, 3};
    uint16_t hdb[3] = {0x3f80, 0x3f80, 0x3f80}, hacc[3] = {0x4000, 0x4000, 0x4000};
    cpu_bias_gelu_backward_f32(NULL, db, NULL, NULL, NULL, 0, 3, 0);
    cpu_bias_gelu_backward_f32(NULL, acc, NULL, NULL, NULL, 0, 3, 1);
    cpu_bias_gelu_backward_bf16(NULL, hdb, NULL, NULL, NULL, 0, 3, 0);
    cpu_bias_gelu_backward_bf16(NULL, hacc, NULL, NULL, NULL, 0, 3, 1);
    test_check(db[0] == 0 && db[2] == 0 && hdb[0] == 0 && hdb[2] == 0, "no rows: the bias gradient is 0");
    test_check(acc[0] == 1 && acc[2] == 3 && hacc[0] == 0x4000 && hacc[2] == 0x4000,
               "no rows, accumulating: the bias gradient is unchanged");
}

static void test_bias_residual(void) {
    static const int64_t shp[][2] = {{1, 1}, {3, 7}, {5, 8}, {37, 769}, {2, 3001}};
    for (size_t s = 0; s < sizeof shp / sizeof shp[0]; s++) {
        int64_t rows = shp[s][0], cols = shp[s][1], n = rows * cols;
        bvec x = bvec_new(n, 3.0f), b = bvec_new(cols, 1.0f), r = bvec_new(n, 2.0f);
        float *f = xmalloc((size_t)n * 4), *u = xmalloc((size_t)n * 4), *t = xmalloc((size_t)n * 4);
        uint16_t *h = xmalloc((size_t)n * 2);
        double *want = xmalloc((size_t)n * 8);
        for (int64_t i = 0; i < n; i++) want[i] = r.d[i] + (x.d[i] + b.d[i % cols]);
        int64_t sx[2] = {cols, 1}, sb[2] = {0, 1}, shape[2] = {rows, cols};
        char name[128];
        cpu_bias_residual_f32(f, x.f, b.f, r.f, rows, cols);
        cpu_binary_f32(FSDP_ADD, t, x.f, sx, b.f, sb, 2, shape);
        cpu_binary_f32(FSDP_ADD, u, r.f, sx, t, sx, 2, shape);
        snprintf(name, sizeof name, "bias_residual f32 (%lld, %lld)", (long long)rows, (long long)cols);
        check_same_f32(name, f, u, n);
        check_ref(name, f, want, n, 1e-6, 1e-7);
        cpu_bias_residual_bf16(h, x.h, b.h, r.h, rows, cols);
        snprintf(name, sizeof name, "bias_residual bf16 (%lld, %lld)", (long long)rows, (long long)cols);
        check_rounded(name, h, f, n);
        widen(t, h, n);
        check_ref(name, t, want, n, 1.0 / 256, 1.0 / 256);   /* (x + b and r cancel) */
        bvec_free(&x); bvec_free(&b); bvec_free(&r);
        free(f); free(u); free(t); free(h); free(want);
    }
}

int main(void) {
    static const int thread_counts[] = {1, 3};
    for (int k = 0; k < 2; k++) {
        nthreads = thread_counts[k];
        cpu_threads_set(nthreads);
        test_rng_seed(&rng, 20240611u + (uint64_t)k);
        test_bias_gelu();
        test_bias_residual();
    }
    return test_summary();
}
