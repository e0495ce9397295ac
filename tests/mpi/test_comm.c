/* test_comm.c: every collective against a serial reference, under any
 * number of ranks (and without mpirun: the single-rank backend).
 *
 * Rank r's input element i is a pure function of (test tag, r, i), so each
 * rank computes locally what every other rank sent and the exact expected
 * result. As in nccl-tests, wrong values are counted on every rank and the
 * counts summed over the world before the verdict; rank 0 prints the
 * summary line and every rank exits with the global verdict.
 *
 * Tolerances: gathers, broadcasts, integer reductions and MAX are exact.
 * f32 sums: atol 1e-5 * size, rtol 1e-5 (MPI may sum in any order). bf16
 * sums are reduced in f32 and rounded once to bf16: rtol 2^-7 (twice the
 * bf16 half-ulp), atol 1e-4.
 */
#include "fsdp.h"
#include "comm_internal.h"   /* comm_reduce_scatter_add, the schedule's reduce-scatter into gradient shards */
#include "testutil.h"
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static int g_rank, g_world;
static int64_t g_local_fail, g_wrong_values;

static void check(int ok, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void check(int ok, const char *fmt, ...) {
    char buf[1024];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(buf, sizeof buf, fmt, ap);
    va_end(ap);
    test_check(ok, "rank %d: %s", g_rank, buf);
    if (!ok) g_local_fail++;
}

#define OK(call) check((call) == FSDP_OK, "%s: %s", #call, fsdp_last_error())

static void compare(const char *name, const float *got, const double *want, int64_t n, double atol, double rtol) {
    char full[256];
    snprintf(full, sizeof full, "rank %d: %s", g_rank, name);
    int64_t wrong = test_compare(full, got, want, n, atol, rtol);
    if (wrong) g_local_fail++;
    g_wrong_values += wrong;
}

/* ---- deterministic per-rank data ---- */

static double val(int tag, int r, int64_t i) {   /* in [-1, 1) */
    uint64_t z = ((uint64_t)tag << 48) ^ ((uint64_t)(r + 1) << 32) ^ (uint64_t)i;
    z += 0x9e3779b97f4a7c15ull;
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    z ^= z >> 31;
    /* 24 significant bits: exact in f32, so no rounding step is needed
     * (and none can be lost: gcc 12 -O3 -march=native with AVX-512 was seen
     * dropping a vectorized (double)(float)x round trip). */
    return (double)(int64_t)(z >> 40) * (1.0 / 8388608.0) - 1.0;
}

static int64_t ival(int tag, int r, int64_t i) {  /* i64 values need more than 32 bits */
    return ((int64_t)(r + 1) * 1000003 + i * 7919 + tag) % 30011 - 15000;
}

/* Rounds like the engine stores dtype dt (bf16 round to nearest even). */
static float as_dtype(int dt, double v) {
    float f = (float)v;
    if (dt != FSDP_BF16) return f;
    uint32_t u;
    memcpy(&u, &f, 4);
    u = (u + 0x7fffu + ((u >> 16) & 1u)) & 0xffff0000u;
    memcpy(&f, &u, 4);
    return f;
}

static fsdp_tensor *make(int dtype, int64_t n, const float *vals) {
    fsdp_tensor *f = NULL, *t = NULL;
    OK(fsdp_tensor_from_data(&f, FSDP_F32, 1, &n, vals, n * 4, FSDP_DEVICE_CPU, FSDP_TAG_OTHER));
    if (dtype == FSDP_F32) return f;
    OK(fsdp_cast(&t, f, dtype));
    fsdp_tensor_release(f);
    return t;
}

static fsdp_tensor *make_int(int dtype, int64_t n, const int64_t *vals) {
    size_t esz = dtype == FSDP_I64 ? 8 : dtype == FSDP_I32 ? 4 : 2;
    void *buf = malloc((size_t)n * esz + 1);
    for (int64_t i = 0; i < n; i++) {
        if (dtype == FSDP_I64) ((int64_t *)buf)[i] = vals[i];
        else if (dtype == FSDP_I32) ((int32_t *)buf)[i] = (int32_t)vals[i];
        else ((uint16_t *)buf)[i] = (uint16_t)vals[i];
    }
    fsdp_tensor *t = NULL;
    OK(fsdp_tensor_from_data(&t, dtype, 1, &n, buf, n * (int64_t)esz, FSDP_DEVICE_CPU, FSDP_TAG_OTHER));
    free(buf);
    return t;
}

static fsdp_tensor *zeros(int dtype, int64_t n) {
    fsdp_tensor *t = NULL;
    OK(fsdp_tensor_zeros(&t, dtype, 1, &n, FSDP_DEVICE_CPU, FSDP_TAG_OTHER));
    return t;
}

static void read_f(fsdp_tensor *t, float *out, int64_t n) {
    int dt = -1;
    fsdp_tensor_dtype(t, &dt);
    fsdp_tensor *f = t;
    if (dt != FSDP_F32) OK(fsdp_cast(&f, t, FSDP_F32));
    OK(fsdp_tensor_to_data(f, out, n * 4));
    if (f != t) fsdp_tensor_release(f);
}

static void read_int(fsdp_tensor *t, int dtype, int64_t *out, int64_t n) {
    size_t esz = dtype == FSDP_I64 ? 8 : dtype == FSDP_I32 ? 4 : 2;
    void *buf = malloc((size_t)n * esz + 1);
    OK(fsdp_tensor_to_data(t, buf, n * (int64_t)esz));
    for (int64_t i = 0; i < n; i++)
        out[i] = dtype == FSDP_I64 ? ((int64_t *)buf)[i]
               : dtype == FSDP_I32 ? ((int32_t *)buf)[i] : ((uint16_t *)buf)[i];
    free(buf);
}

static const char *dn(int dt) {
    return dt == FSDP_F32 ? "f32" : dt == FSDP_BF16 ? "bf16" : dt == FSDP_I32 ? "i32" : dt == FSDP_I64 ? "i64" : "u16";
}
static const char *opn(int op) { return op == FSDP_REDUCE_SUM ? "sum" : op == FSDP_REDUCE_AVG ? "avg" : "max"; }

/* ---- one test per collective; r, s: rank and size in c ---- */

static void t_all_gather(const char *cn, fsdp_comm *c, int r, int s, int dt, int64_t n) {
    float *v = malloc((size_t)n * 4), *got = malloc((size_t)(n * s) * 4);
    double *want = malloc((size_t)(n * s) * 8);
    for (int64_t i = 0; i < n; i++) v[i] = as_dtype(dt, val(1, r, i));
    for (int q = 0; q < s; q++)
        for (int64_t i = 0; i < n; i++) want[q * n + i] = as_dtype(dt, val(1, q, i));
    fsdp_tensor *src = make(dt, n, v), *dst = zeros(dt, n * s);
    OK(fsdp_all_gather(NULL, c, dst, src, "ag"));
    read_f(dst, got, n * s);
    char name[128];
    snprintf(name, sizeof name, "all_gather %s %s n=%lld", cn, dn(dt), (long long)n);
    compare(name, got, want, n * s, 0, 0);
    fsdp_tensor_release(src);
    fsdp_tensor_release(dst);
    free(v), free(got), free(want);
}

static void t_all_gather_int(const char *cn, fsdp_comm *c, int r, int s, int dt, int64_t n) {
    int64_t *v = malloc((size_t)n * 8), *got = malloc((size_t)(n * s) * 8);
    for (int64_t i = 0; i < n; i++) v[i] = dt == FSDP_U16 ? ival(1, r, i) + 15000 : ival(1, r, i) * (dt == FSDP_I64 ? (int64_t)1 << 20 : 1);
    fsdp_tensor *src = make_int(dt, n, v), *dst = zeros(dt, n * s);
    OK(fsdp_all_gather(NULL, c, dst, src, "ag.int"));
    read_int(dst, dt, got, n * s);
    int64_t wrong = 0;
    for (int q = 0; q < s; q++)
        for (int64_t i = 0; i < n; i++) {
            int64_t w = dt == FSDP_U16 ? ival(1, q, i) + 15000 : ival(1, q, i) * (dt == FSDP_I64 ? (int64_t)1 << 20 : 1);
            wrong += got[q * n + i] != w;
        }
    g_wrong_values += wrong;
    check(wrong == 0, "all_gather %s %s n=%lld: %lld wrong values", cn, dn(dt), (long long)n, (long long)wrong);
    fsdp_tensor_release(src);
    fsdp_tensor_release(dst);
    free(v), free(got);
}

static void tol_for(int dt, int s, double *atol, double *rtol) {
    if (dt == FSDP_BF16) *atol = 1e-4, *rtol = 1.0 / 128;
    else *atol = 1e-5 * s, *rtol = 1e-5;
}

static void t_reduce_scatter(const char *cn, fsdp_comm *c, int r, int s, int dt, int64_t n, int op) {
    float *v = malloc((size_t)(n * s) * 4), *got = malloc((size_t)n * 4);
    double *want = malloc((size_t)n * 8);
    for (int64_t j = 0; j < n * s; j++) v[j] = as_dtype(dt, val(2, r, j));
    for (int64_t i = 0; i < n; i++) {
        double sum = 0;
        for (int q = 0; q < s; q++) sum += as_dtype(dt, val(2, q, r * n + i));
        want[i] = op == FSDP_REDUCE_AVG ? sum / s : sum;
    }
    fsdp_tensor *src = make(dt, n * s, v), *dst = zeros(dt, n);
    OK(fsdp_reduce_scatter(NULL, c, dst, src, op, "rs"));
    read_f(dst, got, n);
    double atol, rtol;
    tol_for(dt, s, &atol, &rtol);
    char name[128];
    snprintf(name, sizeof name, "reduce_scatter %s %s %s n=%lld", opn(op), cn, dn(dt), (long long)n);
    compare(name, got, want, n, atol, rtol);
    fsdp_tensor_release(src);
    fsdp_tensor_release(dst);
    free(v), free(got), free(want);
}

/* Every element's sum is rounded the same way whichever block holds it:
 * the terms added in rank order 0, 1, ..., s-1 in f32, bit for bit (terms
 * of mixed magnitudes, so another order rounds differently). */
static float order_term(int q, int64_t j) {
    uint32_t h = (uint32_t)(q * 2654435761u) ^ (uint32_t)(j * 40503u + 17);
    h ^= h >> 13, h *= 0x5bd1e995u, h ^= h >> 15;
    return ldexpf((float)((int)(h % 2001) - 1000) + 0.37f, (int)((h >> 11) % 24) - 12);
}

static void t_reduce_scatter_order(const char *cn, fsdp_comm *c, int r, int s, int64_t n) {
    float *v = malloc((size_t)(n * s) * 4), *got = malloc((size_t)n * 4);
    for (int64_t j = 0; j < n * s; j++) v[j] = order_term(r, j);
    fsdp_tensor *src = make(FSDP_F32, n * s, v), *dst = zeros(FSDP_F32, n);
    OK(fsdp_reduce_scatter(NULL, c, dst, src, FSDP_REDUCE_SUM, "rs.order"));
    read_f(dst, got, n);
    int64_t wrong = 0;
    for (int64_t i = 0; i < n; i++) {
        volatile float acc = order_term(0, r * n + i);
        for (int q = 1; q < s; q++) acc = acc + order_term(q, r * n + i);
        wrong += memcmp((const void *)&acc, &got[i], 4) != 0;
    }
    g_wrong_values += wrong;
    check(wrong == 0, "reduce_scatter %s n=%lld: terms added in rank order in every block (%lld elements differ)", cn,
          (long long)n, (long long)wrong);
    fsdp_tensor_release(src);
    fsdp_tensor_release(dst);
    free(v), free(got);
}

/* The schedule's reduce-scatter that adds into the gradient shard
 * (comm_reduce_scatter_add): dst + (t_0 + ... + t_{s-1}) / s, bit for bit
 * what a reduce-scatter (terms in rank order, then the average's division)
 * followed by an add gives; dst's old values differ per rank. */
static void t_reduce_scatter_add(const char *cn, fsdp_comm *c, int r, int s, int64_t n, int op) {
    float *v = malloc((size_t)(n * s) * 4 + 4), *old = malloc((size_t)n * 4 + 4), *got = malloc((size_t)n * 4 + 4);
    for (int64_t j = 0; j < n * s; j++) v[j] = order_term(r, j);
    for (int64_t i = 0; i < n; i++) old[i] = order_term(s + r, i) * 3.0f;
    fsdp_tensor *src = make(FSDP_F32, n * s, v), *dst = make(FSDP_F32, n, old);
    fsdp_work *w = NULL;
    OK(comm_reduce_scatter_add(&w, c, dst, src, op, "rs.add"));
    OK(fsdp_work_wait(w));
    OK(fsdp_work_free(w));
    read_f(dst, got, n);
    int64_t wrong = 0;
    for (int64_t i = 0; i < n; i++) {
        volatile float acc = order_term(0, r * n + i);
        for (int q = 1; q < s; q++) acc = acc + order_term(q, r * n + i);
        if (op == FSDP_REDUCE_AVG) acc = acc / (float)s;
        volatile float want = old[i] + acc;
        wrong += memcmp((const void *)&want, &got[i], 4) != 0;
    }
    g_wrong_values += wrong;
    check(wrong == 0, "reduce_scatter adding into dst %s %s n=%lld: %lld elements differ from reduce, divide, add",
          opn(op), cn, (long long)n, (long long)wrong);
    fsdp_tensor_release(src);
    fsdp_tensor_release(dst);
    free(v), free(old), free(got);
}

static void t_all_reduce(const char *cn, fsdp_comm *c, int r, int s, int dt, int64_t n, int op) {
    float *v = malloc((size_t)n * 4), *got = malloc((size_t)n * 4);
    double *want = malloc((size_t)n * 8);
    for (int64_t i = 0; i < n; i++) v[i] = as_dtype(dt, val(3, r, i));
    for (int64_t i = 0; i < n; i++) {
        double acc = op == FSDP_REDUCE_MAX ? -INFINITY : 0;
        for (int q = 0; q < s; q++) {
            double x = as_dtype(dt, val(3, q, i));
            acc = op == FSDP_REDUCE_MAX ? fmax(acc, x) : acc + x;
        }
        want[i] = op == FSDP_REDUCE_AVG ? acc / s : acc;
    }
    fsdp_tensor *t = make(dt, n, v);
    OK(fsdp_all_reduce(NULL, c, t, op, "ar"));
    read_f(t, got, n);
    double atol = 0, rtol = 0;
    if (op != FSDP_REDUCE_MAX) tol_for(dt, s, &atol, &rtol);
    char name[128];
    snprintf(name, sizeof name, "all_reduce %s %s %s n=%lld", opn(op), cn, dn(dt), (long long)n);
    compare(name, got, want, n, atol, rtol);
    fsdp_tensor_release(t);
    free(v), free(got), free(want);
}

static void t_all_reduce_int(const char *cn, fsdp_comm *c, int r, int s, int dt, int64_t n, int op) {
    int64_t *v = calloc((size_t)n + 1, 8), *got = calloc((size_t)n + 1, 8);
    int sh = dt == FSDP_I64 ? 24 : 0;   /* i64 sums beyond 32 bits */
    for (int64_t i = 0; i < n; i++) v[i] = ival(3, r, i) * ((int64_t)1 << sh);
    fsdp_tensor *t = make_int(dt, n, v);
    OK(fsdp_all_reduce(NULL, c, t, op, "ar.int"));
    read_int(t, dt, got, n);
    int64_t wrong = 0;
    for (int64_t i = 0; i < n; i++) {
        int64_t acc = op == FSDP_REDUCE_MAX ? INT64_MIN : 0;
        for (int q = 0; q < s; q++) {
            int64_t x = ival(3, q, i) * ((int64_t)1 << sh);
            acc = op == FSDP_REDUCE_MAX ? (x > acc ? x : acc) : acc + x;
        }
        wrong += got[i] != acc;
    }
    g_wrong_values += wrong;
    check(wrong == 0, "all_reduce %s %s %s n=%lld: %lld wrong values", opn(op), cn, dn(dt), (long long)n,
          (long long)wrong);
    fsdp_tensor_release(t);
    free(v), free(got);
}

static void t_broadcast(const char *cn, fsdp_comm *c, int r, int s, int dt, int64_t n) {
    int root = s - 1;   /* not 0 whenever s > 1 */
    float *v = malloc((size_t)n * 4), *got = malloc((size_t)n * 4);
    double *want = malloc((size_t)n * 8);
    for (int64_t i = 0; i < n; i++) v[i] = as_dtype(dt, val(4, r, i)), want[i] = as_dtype(dt, val(4, root, i));
    fsdp_tensor *t = make(dt, n, v);
    OK(fsdp_broadcast(NULL, c, t, root, "bc"));
    read_f(t, got, n);
    char name[128];
    snprintf(name, sizeof name, "broadcast root %d %s %s n=%lld", root, cn, dn(dt), (long long)n);
    compare(name, got, want, n, 0, 0);
    fsdp_tensor_release(t);
    free(v), free(got), free(want);
}

static void suite(const char *cn, fsdp_comm *c) {
    int r = -1, s = 0;
    OK(fsdp_comm_info(c, &r, &s));
    const int64_t sizes[] = {1, 7, 13, 1009};
    const int fdt[] = {FSDP_F32, FSDP_BF16};
    for (int k = 0; k < 4; k++) {
        int64_t n = sizes[k];
        for (int d = 0; d < 2; d++) {
            t_all_gather(cn, c, r, s, fdt[d], n);
            t_reduce_scatter(cn, c, r, s, fdt[d], n, FSDP_REDUCE_SUM);
            t_reduce_scatter(cn, c, r, s, fdt[d], n, FSDP_REDUCE_AVG);
            t_all_reduce(cn, c, r, s, fdt[d], n, FSDP_REDUCE_SUM);
            t_all_reduce(cn, c, r, s, fdt[d], n, FSDP_REDUCE_AVG);
            t_all_reduce(cn, c, r, s, fdt[d], n, FSDP_REDUCE_MAX);
            t_broadcast(cn, c, r, s, fdt[d], n);
        }
        t_all_gather_int(cn, c, r, s, FSDP_I32, n);
        t_all_gather_int(cn, c, r, s, FSDP_I64, n);
        t_all_gather_int(cn, c, r, s, FSDP_U16, n);
        t_all_reduce_int(cn, c, r, s, FSDP_I32, n, FSDP_REDUCE_SUM);
        t_all_reduce_int(cn, c, r, s, FSDP_I64, n, FSDP_REDUCE_SUM);
        t_all_reduce_int(cn, c, r, s, FSDP_I32, n, FSDP_REDUCE_MAX);
        t_all_reduce_int(cn, c, r, s, FSDP_I64, n, FSDP_REDUCE_MAX);
    }
    /* Empty tensors are legal (a rank's share of a tiny unit). */
    t_all_gather(cn, c, r, s, FSDP_F32, 0);
    t_reduce_scatter(cn, c, r, s, FSDP_F32, 0, FSDP_REDUCE_SUM);
    /* Blocks that the MPI backend moves in several chunks (at most 8 MiB
     * of terms in flight), ending in a partial chunk. */
    if (strcmp(cn, "world") == 0) t_reduce_scatter(cn, c, r, s, FSDP_F32, ((int64_t)1 << 21) + 1003, FSDP_REDUCE_SUM);
    t_reduce_scatter_order(cn, c, r, s, 1);
    t_reduce_scatter_order(cn, c, r, s, 4099);
    if (strcmp(cn, "world") == 0) t_reduce_scatter_order(cn, c, r, s, ((int64_t)1 << 20) + 7);
    const int64_t add_sizes[] = {1, 13, 4099};
    for (int k = 0; k < 3; k++) {
        t_reduce_scatter_add(cn, c, r, s, add_sizes[k], FSDP_REDUCE_SUM);
        t_reduce_scatter_add(cn, c, r, s, add_sizes[k], FSDP_REDUCE_AVG);
    }
    if (strcmp(cn, "world") == 0) t_reduce_scatter_add(cn, c, r, s, ((int64_t)1 << 20) + 7, FSDP_REDUCE_AVG);

    double d[3] = {r + 1.0, -r, 0.5 * r}, want_sum[3] = {0, 0, 0}, want_max[3] = {-INFINITY, -INFINITY, -INFINITY};
    for (int q = 0; q < s; q++) {
        double x[3] = {q + 1.0, -q, 0.5 * q};
        for (int i = 0; i < 3; i++) want_sum[i] += x[i], want_max[i] = fmax(want_max[i], x[i]);
    }
    double e[3];
    memcpy(e, d, sizeof d);
    OK(fsdp_all_reduce_doubles(c, e, 3, FSDP_REDUCE_SUM));
    check(e[0] == want_sum[0] && e[1] == want_sum[1] && e[2] == want_sum[2], "all_reduce_doubles sum %s: %g %g %g",
          cn, e[0], e[1], e[2]);
    memcpy(e, d, sizeof d);
    OK(fsdp_all_reduce_doubles(c, e, 3, FSDP_REDUCE_AVG));
    check(fabs(e[0] - want_sum[0] / s) < 1e-12 && fabs(e[2] - want_sum[2] / s) < 1e-12,
          "all_reduce_doubles avg %s: %g %g %g", cn, e[0], e[1], e[2]);
    memcpy(e, d, sizeof d);
    OK(fsdp_all_reduce_doubles(c, e, 3, FSDP_REDUCE_MAX));
    check(e[0] == want_max[0] && e[1] == want_max[1] && e[2] == want_max[2], "all_reduce_doubles max %s: %g %g %g",
          cn, e[0], e[1], e[2]);
    OK(fsdp_barrier(c));
}

/* Several works in flight, waited in reverse order; inputs released by the
 * caller right after issue (the works keep them alive). In-place gather and
 * a reduce-scatter whose output lies inside its input. */
static void t_async(const char *cn, fsdp_comm *c) {
    int r = -1, s = 0;
    OK(fsdp_comm_info(c, &r, &s));
    const int64_t n = 13;
    enum { K = 6 };
    fsdp_work *w[K] = {0};
    float v[13];
    /* 0: gather f32 */
    for (int64_t i = 0; i < n; i++) v[i] = (float)val(5, r, i);
    fsdp_tensor *src0 = make(FSDP_F32, n, v), *dst0 = zeros(FSDP_F32, n * s);
    OK(fsdp_all_gather(&w[0], c, dst0, src0, "async.ag"));
    fsdp_tensor_release(src0);
    /* 1: reduce-scatter bf16 */
    float *big = malloc((size_t)(n * s) * 4);
    for (int64_t j = 0; j < n * s; j++) big[j] = as_dtype(FSDP_BF16, val(6, r, j));
    fsdp_tensor *src1 = make(FSDP_BF16, n * s, big), *dst1 = zeros(FSDP_BF16, n);
    OK(fsdp_reduce_scatter(&w[1], c, dst1, src1, FSDP_REDUCE_AVG, "async.rs"));
    fsdp_tensor_release(src1);
    /* 2: all-reduce f32 */
    for (int64_t i = 0; i < n; i++) v[i] = (float)val(7, r, i);
    fsdp_tensor *t2 = make(FSDP_F32, n, v);
    OK(fsdp_all_reduce(&w[2], c, t2, FSDP_REDUCE_SUM, "async.ar"));
    /* 3: broadcast i64 */
    int64_t iv[13];
    for (int64_t i = 0; i < n; i++) iv[i] = ival(8, r, i);
    fsdp_tensor *t3 = make_int(FSDP_I64, n, iv);
    OK(fsdp_broadcast(&w[3], c, t3, s > 1 ? 1 : 0, "async.bc"));
    /* 4: in-place gather: src is this rank's block of dst */
    fsdp_tensor *dst4 = zeros(FSDP_F32, n * s), *src4 = NULL;
    OK(fsdp_narrow(&src4, dst4, 0, r * n, n));
    for (int64_t i = 0; i < n; i++) v[i] = (float)val(9, r, i);
    fsdp_tensor *tmp = make(FSDP_F32, n, v);
    OK(fsdp_copy(src4, tmp));
    fsdp_tensor_release(tmp);
    OK(fsdp_all_gather(&w[4], c, dst4, src4, "async.ag.inplace"));
    /* 5: reduce-scatter into this rank's block of its own input */
    for (int64_t j = 0; j < n * s; j++) big[j] = (float)val(10, r, j);
    fsdp_tensor *src5 = make(FSDP_F32, n * s, big), *dst5 = NULL;
    OK(fsdp_narrow(&dst5, src5, 0, r * n, n));
    OK(fsdp_reduce_scatter(&w[5], c, dst5, src5, FSDP_REDUCE_SUM, "async.rs.alias"));
    free(big);

    for (int k = K - 1; k >= 0; k--) {
        check(fsdp_work_wait(w[k]) == FSDP_OK, "async %s: wait on work %d: %s", cn, k, fsdp_last_error());
        int done = 0;
        OK(fsdp_work_test(w[k], &done));
        check(done == 1, "async %s: work %d done after wait", cn, k);
        OK(fsdp_work_free(w[k]));
    }
    float *got = malloc((size_t)(n * s) * 4);
    double *want = malloc((size_t)(n * s) * 8);
    char name[128];
    read_f(dst0, got, n * s);
    for (int q = 0; q < s; q++)
        for (int64_t i = 0; i < n; i++) want[q * n + i] = (float)val(5, q, i);
    snprintf(name, sizeof name, "async all_gather %s", cn);
    compare(name, got, want, n * s, 0, 0);
    read_f(dst1, got, n);
    for (int64_t i = 0; i < n; i++) {
        double sum = 0;
        for (int q = 0; q < s; q++) sum += as_dtype(FSDP_BF16, val(6, q, r * n + i));
        want[i] = sum / s;
    }
    snprintf(name, sizeof name, "async reduce_scatter bf16 avg %s", cn);
    compare(name, got, want, n, 1e-4, 1.0 / 128);
    read_f(t2, got, n);
    for (int64_t i = 0; i < n; i++) {
        double sum = 0;
        for (int q = 0; q < s; q++) sum += (float)val(7, q, i);
        want[i] = sum;
    }
    snprintf(name, sizeof name, "async all_reduce %s", cn);
    compare(name, got, want, n, 1e-5 * s, 1e-5);
    int64_t gi[13];
    read_int(t3, FSDP_I64, gi, n);
    int64_t wrong = 0;
    for (int64_t i = 0; i < n; i++) wrong += gi[i] != ival(8, s > 1 ? 1 : 0, i);
    g_wrong_values += wrong;
    check(wrong == 0, "async broadcast i64 %s: %lld wrong", cn, (long long)wrong);
    read_f(dst4, got, n * s);
    for (int q = 0; q < s; q++)
        for (int64_t i = 0; i < n; i++) want[q * n + i] = (float)val(9, q, i);
    snprintf(name, sizeof name, "async in-place all_gather %s", cn);
    compare(name, got, want, n * s, 0, 0);
    read_f(dst5, got, n);
    for (int64_t i = 0; i < n; i++) {
        double sum = 0;
        for (int q = 0; q < s; q++) sum += (float)val(10, q, r * n + i);
        want[i] = sum;
    }
    snprintf(name, sizeof name, "async aliased reduce_scatter %s", cn);
    compare(name, got, want, n, 1e-5 * s, 1e-5);
    fsdp_tensor *rel[] = {dst0, dst1, t2, t3, dst4, src4, src5, dst5};
    for (int k = 0; k < 8; k++) fsdp_tensor_release(rel[k]);
    free(got), free(want);
}

static int has(const char *msg, const char *part) { return strstr(msg, part) != NULL; }

/* Bad arguments fail locally on every rank, before anything is queued; a
 * good collective afterwards proves nobody got out of step. */
static void t_bad_input(const char *cn, fsdp_comm *c) {
    int r = -1, s = 0;
    OK(fsdp_comm_info(c, &r, &s));
    char sz[64];   /* "on comm NAME(size):" */
    snprintf(sz, sizeof sz, "(%d):", s);
    fsdp_tensor *a = zeros(FSDP_F32, 5), *b = zeros(FSDP_F32, 5 * s + 1), *h = zeros(FSDP_BF16, 5 * s);
    fsdp_tensor *ia = zeros(FSDP_I32, 5), *ib = zeros(FSDP_I32, 5 * s);
    fsdp_work *w = (fsdp_work *)&w;   /* must come back NULL */
    fsdp_status st = fsdp_all_gather(&w, c, b, a, "bad.size");
    const char *m = fsdp_last_error();
    check(st == FSDP_ERR_SHAPE && w == NULL, "all_gather size mismatch %s: status %d", cn, (int)st);
    check(has(m, "f32[5]") && has(m, "cpu") && has(m, "bad.size") && has(m, "on comm ") && has(m, sz),
          "all_gather size message: %s", m);
    st = fsdp_all_gather(NULL, c, h, a, "bad.dtype");
    m = fsdp_last_error();
    check(st == FSDP_ERR_DTYPE, "all_gather dtype mismatch %s: status %d", cn, (int)st);
    check(has(m, "f32[5]") && has(m, "bf16[") && has(m, sz), "all_gather dtype message: %s", m);
    st = fsdp_reduce_scatter(NULL, c, ia, ib, FSDP_REDUCE_SUM, "bad.int");
    m = fsdp_last_error();
    check(st == FSDP_ERR_DTYPE, "reduce_scatter i32 %s: status %d", cn, (int)st);
    check(has(m, "i32[5]") && has(m, sz), "reduce_scatter i32 message: %s", m);
    st = fsdp_reduce_scatter(NULL, c, a, b, FSDP_REDUCE_SUM, "bad.rs.size");
    m = fsdp_last_error();
    check(st == FSDP_ERR_SHAPE && has(m, "f32[5]") && has(m, sz), "reduce_scatter size %s: %d %s", cn, (int)st, m);
    st = fsdp_reduce_scatter(NULL, c, a, h, FSDP_REDUCE_SUM, "bad.rs.dtype");
    check(st == FSDP_ERR_DTYPE, "reduce_scatter dtype mismatch %s: %d", cn, (int)st);
    st = fsdp_reduce_scatter(NULL, c, a, b, FSDP_REDUCE_MAX, "bad.rs.op");
    check(st == FSDP_ERR_INVALID, "reduce_scatter max %s: %d", cn, (int)st);
    /* adding into dst: f32 only, and dst must not lie inside src */
    fsdp_tensor *h1 = zeros(FSDP_BF16, 5), *big = zeros(FSDP_F32, 5 * s), *inside = NULL;
    st = comm_reduce_scatter_add(NULL, c, h1, h, FSDP_REDUCE_AVG, "bad.add.dtype");
    m = fsdp_last_error();
    check(st == FSDP_ERR_UNSUPPORTED && has(m, "bf16[5]") && has(m, "bad.add.dtype") && has(m, sz),
          "reduce_scatter adding into bf16 %s: %d %s", cn, (int)st, m);
    int64_t five = 5;
    OK(fsdp_narrow(&inside, big, 0, 0, five));
    st = comm_reduce_scatter_add(NULL, c, inside, big, FSDP_REDUCE_SUM, "bad.add.overlap");
    m = fsdp_last_error();
    check(st == FSDP_ERR_INVALID && has(m, "overlaps") && has(m, "bad.add.overlap"),
          "reduce_scatter adding into its own src %s: %d %s", cn, (int)st, m);
    fsdp_tensor_release(h1);
    fsdp_tensor_release(big);
    fsdp_tensor_release(inside);
    st = fsdp_broadcast(NULL, c, a, s, "bad.root");
    m = fsdp_last_error();
    check(st == FSDP_ERR_INVALID && has(m, "root") && has(m, "f32[5]") && has(m, sz), "broadcast root %d %s: %d %s",
          s, cn, (int)st, m);
    st = fsdp_broadcast(NULL, c, a, -1, "bad.root");
    check(st == FSDP_ERR_INVALID, "broadcast root -1 %s: %d", cn, (int)st);
    st = fsdp_all_reduce(NULL, c, ia, FSDP_REDUCE_AVG, "bad.int.avg");
    check(st == FSDP_ERR_INVALID, "all_reduce i32 avg %s: %d", cn, (int)st);
    st = fsdp_all_reduce(NULL, c, a, 7, "bad.op");
    check(st == FSDP_ERR_INVALID, "all_reduce op 7 %s: %d", cn, (int)st);
    st = fsdp_all_gather(NULL, NULL, a, a, "null");
    check(st == FSDP_ERR_INVALID, "all_gather NULL comm: %d", (int)st);
    st = fsdp_all_gather(NULL, c, NULL, a, "null");
    check(st == FSDP_ERR_INVALID, "all_gather NULL dst: %d", (int)st);
    fsdp_tensor *m2 = NULL, *tr = NULL;   /* a transposed view is not contiguous */
    int64_t shp[2] = {2, 3};
    OK(fsdp_tensor_zeros(&m2, FSDP_F32, 2, shp, FSDP_DEVICE_CPU, FSDP_TAG_OTHER));
    OK(fsdp_transpose(&tr, m2, 0, 1));
    st = fsdp_all_reduce(NULL, c, tr, FSDP_REDUCE_SUM, "bad.layout");
    check(st == FSDP_ERR_LAYOUT, "all_reduce non-contiguous %s: %d", cn, (int)st);
    st = fsdp_all_reduce_doubles(c, NULL, 3, FSDP_REDUCE_SUM);
    check(st == FSDP_ERR_INVALID, "all_reduce_doubles NULL: %d", (int)st);
    st = fsdp_work_wait(NULL);
    check(st == FSDP_ERR_INVALID, "work_wait NULL: %d", (int)st);
    fsdp_tensor *rel[] = {a, b, h, ia, ib, m2, tr};
    for (int k = 0; k < 7; k++) fsdp_tensor_release(rel[k]);
    t_all_gather(cn, c, r, s, FSDP_F32, 7);   /* still in step */
}

static void t_stats(fsdp_comm *c) {
    int r = -1, s = 0;
    OK(fsdp_comm_info(c, &r, &s));
    OK(fsdp_comm_reset_stats());
    int64_t g = -1, red = -1;
    double ws = -1;
    OK(fsdp_comm_stats(&g, &red, &ws));
    check(g == 0 && red == 0 && ws == 0, "stats after reset: %lld %lld %g", (long long)g, (long long)red, ws);
    t_all_gather("stats", c, r, s, FSDP_F32, 13);                       /* 13 * s * 4 gathered */
    t_reduce_scatter("stats", c, r, s, FSDP_BF16, 7, FSDP_REDUCE_SUM);  /* 7 * s * 2 reduced */
    t_all_reduce("stats", c, r, s, FSDP_F32, 5, FSDP_REDUCE_SUM);       /* 20 reduced */
    OK(fsdp_comm_stats(&g, &red, &ws));
    check(g == 13 * s * 4, "stats: gathered %lld bytes, expected %d", (long long)g, 13 * s * 4);
    check(red == 7 * s * 2 + 20, "stats: reduced %lld bytes, expected %d", (long long)red, 7 * s * 2 + 20);
    check(ws >= 0 && ws < 60, "stats: wait seconds %g", ws);
}

int main(void) {
    if (fsdp_runtime_init(&g_rank, &g_world) != FSDP_OK) {
        fprintf(stderr, "runtime init: %s\n", fsdp_last_error());
        return 1;
    }
    fsdp_comm *world = NULL, *odd_even = NULL, *pairs = NULL, *single = NULL;
    OK(fsdp_comm_world(&world));
    int r = -1, s = 0;
    OK(fsdp_comm_info(world, &r, &s));
    check(r == g_rank && s == g_world, "world info: rank %d size %d, runtime says %d of %d", r, s, g_rank, g_world);

    /* The two hybrid-sharding layouts: rank % 2 (strided) and rank / 2
     * (contiguous pairs). */
    OK(fsdp_comm_split(&odd_even, world, g_rank % 2, g_rank));
    OK(fsdp_comm_split(&pairs, world, g_rank / 2, g_rank));
    int er, es, pr, ps;
    OK(fsdp_comm_info(odd_even, &er, &es));
    OK(fsdp_comm_info(pairs, &pr, &ps));
    int want_es = (g_world - g_rank % 2 + 1) / 2, want_ps = g_world - 2 * (g_rank / 2) < 2 ? 1 : 2;
    check(er == g_rank / 2 && es == want_es, "split rank%%2: rank %d size %d, expected %d of %d", er, es, g_rank / 2,
          want_es);
    check(pr == g_rank % 2 && ps == want_ps, "split rank/2: rank %d size %d, expected %d of %d", pr, ps, g_rank % 2,
          want_ps);
    /* A split of a split: every rank alone (an MPI communicator of one under mpirun). */
    OK(fsdp_comm_split(&single, odd_even, er, 0));
    int sr, ss;
    OK(fsdp_comm_info(single, &sr, &ss));
    check(sr == 0 && ss == 1, "split to singles: rank %d size %d", sr, ss);

    /* A negative color fails on that rank only, after taking part: the
     * others get their communicator and nobody waits forever. */
    fsdp_comm *partial = NULL;
    fsdp_status pst = fsdp_comm_split(&partial, world, g_rank == g_world - 1 ? -1 : 0, g_rank);
    if (g_rank == g_world - 1)
        check(pst == FSDP_ERR_INVALID && partial == NULL && strstr(fsdp_last_error(), "color -1"),
              "negative color refused on its rank: %s", fsdp_last_error());
    else
        check(pst == FSDP_OK && partial != NULL, "the other ranks split (%d)", pst);
    if (partial) OK(fsdp_comm_free(partial));

    suite("world", world);
    suite("rank%2", odd_even);
    suite("rank/2", pairs);
    suite("single", single);
    t_async("world", world);
    t_async("rank/2", pairs);
    t_bad_input("world", world);
    t_bad_input("rank%2", odd_even);
    t_stats(world);

    /* Split communicators issue and wait interleaved with the world's. */
    fsdp_work *wa = NULL, *wb = NULL;
    fsdp_tensor *x = zeros(FSDP_F32, 3), *y = zeros(FSDP_F32, 3);
    OK(fsdp_fill(x, 1.0));
    OK(fsdp_fill(y, 2.0));
    OK(fsdp_all_reduce(&wa, pairs, x, FSDP_REDUCE_SUM, "mix.pairs"));
    OK(fsdp_all_reduce(&wb, world, y, FSDP_REDUCE_SUM, "mix.world"));
    OK(fsdp_work_free(wb));   /* free waits */
    OK(fsdp_work_wait(wa));
    OK(fsdp_work_free(wa));
    float gx[3], gy[3];
    read_f(x, gx, 3);
    read_f(y, gy, 3);
    check(gx[0] == (float)ps && gy[2] == 2.0f * (float)s, "interleaved comms: %g (want %d), %g (want %d)", gx[0], ps,
          gy[2], 2 * s);
    fsdp_tensor_release(x);
    fsdp_tensor_release(y);

    OK(fsdp_comm_free(single));
    OK(fsdp_comm_free(pairs));
    OK(fsdp_comm_free(odd_even));

    /* The verdict over every rank: failures and wrong values summed. */
    double tot[2] = {(double)g_local_fail, (double)g_wrong_values};
    fsdp_status st = fsdp_all_reduce_doubles(world, tot, 2, FSDP_REDUCE_SUM);
    if (st != FSDP_OK) {
        fprintf(stderr, "rank %d: final all_reduce_doubles: %s\n", g_rank, fsdp_last_error());
        tot[0] = tot[0] + 1;
    }
    OK(fsdp_comm_free(world));
    int code = 1;
    if (g_rank == 0) {
        printf("test_comm: %d ranks; failed checks on all ranks: %.0f; wrong values on all ranks: %.0f\n", g_world,
               tot[0], tot[1]);
        code = test_summary();
    }
    if (tot[0] != 0) code = 1;
    else if (g_rank != 0) code = 0;
    fsdp_runtime_finalize();
    return code;
}
