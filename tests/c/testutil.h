/* testutil.h: deterministic random inputs, tolerance checks and a closing
 * "N passed, N failed" line for the C test executables. */
#ifndef FSDP_TESTUTIL_H
#define FSDP_TESTUTIL_H
#include <stdint.h>
#include <stdio.h>

typedef struct { uint64_t s; } test_rng;
void test_rng_seed(test_rng *r, uint64_t seed);
double test_rng_uniform(test_rng *r);                 /* [0, 1) */
/* Non-zero values in [-scale, -scale/10] U [scale/10, scale]. */
void test_fill_nonzero(test_rng *r, float *x, int64_t n, float scale);
void test_fill_nonzero_d(test_rng *r, double *x, int64_t n, double scale);

/* Counts elements with |got - want| > atol + rtol * |want|; prints the first
 * few offenders under the check's name. Returns the count of wrong values. */
int64_t test_compare(const char *name, const float *got, const double *want, int64_t n, double atol, double rtol);
double test_max_rel_err(const float *got, const double *want, int64_t n, double floor);

/* Records one check; prints FAIL lines. */
void test_check(int ok, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
/* Prints "N passed, N failed" and returns the process exit code. */
int test_summary(void);

#endif
