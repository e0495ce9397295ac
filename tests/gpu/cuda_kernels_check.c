/* cuda_kernels_check.c: the shared pieces of the CUDA kernel tests
 * (cuda_kernels_check.h says what each is). */
#include "cuda_kernels_check.h"
#include <string.h>

const fsdp_device_kernels *C;
test_rng rng;

float *hrand(int64_t n, float scale) {
    float *x = halloc((size_t)n * sizeof(float));
    test_fill_nonzero(&rng, x, n, scale);
    return x;
}
float *hnan(int64_t n) {
    float *x = halloc((size_t)n * sizeof(float));
    for (int64_t i = 0; i < n; i++) x[i] = NAN;
    return x;
}
float *hcopy(const float *x, int64_t n) {
    float *y = halloc((size_t)n * sizeof(float));
    memcpy(y, x, (size_t)n * sizeof(float));
    return y;
}
void *dup_bytes(const void *h, size_t bytes) {
    void *d = dalloc(bytes);
    if (bytes) G->copy_from_host(d, h, bytes);
    return d;
}
float *dupf(const float *h, int64_t n) { return dup_bytes(h, (size_t)n * sizeof(float)); }
float *dnan(int64_t n) { return dupf(hnan(n), n); }
float *back(const void *d, int64_t n) {
    float *h = halloc((size_t)(n > 0 ? n : 1) * sizeof(float));
    if (n > 0) G->copy_to_host(h, d, (size_t)n * sizeof(float));
    return h;
}

/* ---- comparisons ---- */

void check_f(const char *what, const float *got, const float *want, int64_t n, double rtol, double atol,
                    double scale) {
    if (scale < 0) {
        scale = 0;
        for (int64_t i = 0; i < n; i++)
            if (fabs(want[i]) > scale) scale = fabs(want[i]);
    }
    int64_t wrong = 0, first = -1;
    double max_err = 0;
    for (int64_t i = 0; i < n; i++) {
        double g = got[i], w = want[i];
        int ok = isnan(w) ? isnan(g) : fabs(g - w) <= rtol * fabs(w) + atol * scale;
        if (!isnan(w) && !isnan(g) && fabs(g - w) > max_err) max_err = fabs(g - w);
        if (!ok) {
            if (first < 0) first = i;
            wrong++;
        }
    }
    if (wrong)
        fprintf(stderr, "  %s: first wrong at %lld: got %.9g want %.9g\n", what, (long long)first,
                (double)got[first], (double)want[first]);
    test_check(wrong == 0, "%s: %lld of %lld values wrong (rtol %g, atol %g x %g; max err %.3g)", what,
               (long long)wrong, (long long)n, rtol, atol, scale, max_err);
}

void check_bits(const char *what, const void *got, const void *want, size_t bytes) {
    const unsigned char *g = got, *w = want;
    size_t wrong = 0, first = 0;
    for (size_t i = 0; i < bytes; i++)
        if (g[i] != w[i]) {
            if (!wrong) first = i;
            wrong++;
        }
    if (wrong) fprintf(stderr, "  %s: first differing byte %zu: got 0x%02x want 0x%02x\n", what, first, g[first], w[first]);
    test_check(wrong == 0, "%s: %zu of %zu bytes differ (expected bit for bit)", what, wrong, bytes);
}

void check_bound(const char *what, const float *got, const float *want, const double *bound, int64_t n,
                        double tol) {
    int64_t wrong = 0, first = -1;
    for (int64_t i = 0; i < n; i++) {
        double err = fabs((double)got[i] - want[i]);
        if (!(err <= tol * bound[i] + 1e-30)) {
            if (first < 0) first = i;
            wrong++;
        }
    }
    if (wrong)
        fprintf(stderr, "  %s: first wrong at %lld: got %.9g want %.9g (bound %.3g)\n", what, (long long)first,
                (double)got[first], (double)want[first], tol * bound[first]);
    test_check(wrong == 0, "%s: %lld of %lld values beyond %g x their bound", what, (long long)wrong, (long long)n,
               tol);
}

float *round_bf16_host(float *x, int64_t n) {
    for (int64_t i = 0; i < n; i++) x[i] = bf16_to_f32(f32_to_bf16(x[i]));
    return x;
}
float *hrand16(int64_t n, float scale) { return round_bf16_host(hrand(n, scale), n); }
uint16_t *dup16(const float *h, int64_t n) {
    uint16_t *t = halloc((size_t)(n > 0 ? n : 1) * 2);
    for (int64_t i = 0; i < n; i++) t[i] = f32_to_bf16(h[i]);
    return dup_bytes(t, (size_t)(n > 0 ? n : 1) * 2);
}
uint16_t *dnan16(int64_t n) { return (uint16_t *)dup16(hnan(n), n); }

float *back_bf16(const void *d, int64_t n) {
    uint16_t *h = halloc((size_t)(n > 0 ? n : 1) * 2);
    float *f = halloc((size_t)(n > 0 ? n : 1) * sizeof(float));
    if (n > 0) G->copy_to_host(h, d, (size_t)n * 2);
    for (int64_t i = 0; i < n; i++) f[i] = bf16_to_f32(h[i]);
    return f;
}
