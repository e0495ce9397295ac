#include "testutil.h"
#include <math.h>
#include <stdarg.h>

static int g_passed, g_failed;

void test_rng_seed(test_rng *r, uint64_t seed) { r->s = seed * 0x9e3779b97f4a7c15ull + 1; }

double test_rng_uniform(test_rng *r) {
    /* splitmix64: independent of the engine's Philox, so a test never checks
     * the RNG against itself. */
    uint64_t z = (r->s += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    z ^= z >> 31;
    return (double)(z >> 11) * (1.0 / 9007199254740992.0);
}

void test_fill_nonzero_d(test_rng *r, double *x, int64_t n, double scale) {
    for (int64_t i = 0; i < n; i++) {
        double m = 0.1 + 0.9 * test_rng_uniform(r);
        x[i] = (test_rng_uniform(r) < 0.5 ? -m : m) * scale;
    }
}

void test_fill_nonzero(test_rng *r, float *x, int64_t n, float scale) {
    for (int64_t i = 0; i < n; i++) {
        double m = 0.1 + 0.9 * test_rng_uniform(r);
        x[i] = (float)((test_rng_uniform(r) < 0.5 ? -m : m) * scale);
    }
}

int64_t test_compare(const char *name, const float *got, const double *want, int64_t n, double atol, double rtol) {
    int64_t wrong = 0;
    for (int64_t i = 0; i < n; i++) {
        double err = fabs((double)got[i] - want[i]);
        if (!(err <= atol + rtol * fabs(want[i]))) {   /* catches NaN too */
            if (wrong < 5)
                fprintf(stderr, "  %s[%lld]: got %.9g want %.9g (err %.3g)\n", name, (long long)i,
                        (double)got[i], want[i], err);
            wrong++;
        }
    }
    test_check(wrong == 0, "%s: %lld of %lld values out of tolerance (atol %g, rtol %g)", name,
               (long long)wrong, (long long)n, atol, rtol);
    return wrong;
}

double test_max_rel_err(const float *got, const double *want, int64_t n, double floor) {
    double m = 0;
    for (int64_t i = 0; i < n; i++) {
        double e = fabs((double)got[i] - want[i]) / fmax(fabs(want[i]), floor);
        if (!(e <= m)) m = e;
    }
    return m;
}

void test_check(int ok, const char *fmt, ...) {
    if (ok) { g_passed++; return; }
    g_failed++;
    va_list ap;
    va_start(ap, fmt);
    fprintf(stderr, "FAIL: ");
    vfprintf(stderr, fmt, ap);
    fprintf(stderr, "\n");
    va_end(ap);
}

int test_summary(void) {
    printf("%d passed, %d failed\n", g_passed, g_failed);
    return g_failed == 0 && g_passed > 0 ? 0 : 1;
}
