/* The vocabulary-chunked classifier and embedding kernels (engine/cpu/
 * classifier.c) against double-precision references over whole logits:
 * slices of a plain table (one run each) and of a table sharded over G
 * ranks (G runs each), at awkward sizes: V prime, chunks that do not divide
 * V, padded vocabulary rows, one row (T = 1), ignored targets. */
#include "cpu_kernels.h"
#include "testutil.h"
#include <math.h>
#include <stdlib.h>
#include <string.h>

#define IGNORE (-100)

typedef struct {
    int64_t blocks, stride, rows;   /* runs per slice, table rows between runs, rows per run */
} geometry;

static int64_t n_slices(geometry g) { return (g.stride + g.rows - 1) / g.rows; }
static int64_t run_rows(geometry g, int64_t j) { return g.stride - j * g.rows < g.rows ? g.stride - j * g.rows : g.rows; }

/* The slice's columns of full (N, Vt) logits (table rows past Vt read as 0). */
static void take_columns(float *dst, const float *full, int64_t N, int64_t Vt, geometry g, int64_t j) {
    int64_t br = run_rows(g, j), R = g.blocks * br;
    for (int64_t n = 0; n < N; n++)
        for (int64_t i = 0; i < R; i++) {
            int64_t row = (i / br) * g.stride + j * g.rows + i % br;
            dst[n * R + i] = row < Vt ? full[n * Vt + row] : 0.0f;
        }
}

static void put_columns(float *full, const float *src, int64_t N, int64_t Vt, geometry g, int64_t j) {
    int64_t br = run_rows(g, j), R = g.blocks * br;
    for (int64_t n = 0; n < N; n++)
        for (int64_t i = 0; i < R; i++) {
            int64_t row = (i / br) * g.stride + j * g.rows + i % br;
            if (row < Vt) full[n * Vt + row] = src[n * R + i];
        }
}

/* loss_n = log sum_{v < valid} exp(x_nv) - x_n,t; dlogits = g (softmax - onehot), g = 1 / count */
static void reference(const float *x, const int64_t *t, int64_t N, int64_t V, int64_t valid, double *lse,
                      double *loss, double *dx) {
    int64_t count = 0;
    for (int64_t n = 0; n < N; n++) count += t[n] != IGNORE;
    for (int64_t n = 0; n < N; n++) {
        double m = -INFINITY, s = 0;
        for (int64_t v = 0; v < valid; v++) m = fmax(m, x[n * V + v]);
        for (int64_t v = 0; v < valid; v++) s += exp((double)x[n * V + v] - m);
        lse[n] = m + log(s);
        loss[n] = t[n] == IGNORE ? 0 : lse[n] - x[n * V + t[n]];
        for (int64_t v = 0; v < V; v++) {
            double p = v < valid ? exp(x[n * V + v] - lse[n]) : 0;
            dx[n * V + v] = t[n] == IGNORE ? 0 : (p - (v == t[n])) / (double)count;
        }
    }
}

static void check_classifier(int64_t N, int64_t V, int64_t valid, geometry g, uint64_t seed) {
    char what[160];
    snprintf(what, sizeof what, "classifier N=%lld V=%lld valid=%lld, %lld runs of %lld rows (stride %lld)",
             (long long)N, (long long)V, (long long)valid, (long long)g.blocks, (long long)g.rows,
             (long long)g.stride);
    test_rng r;
    test_rng_seed(&r, seed);
    float *x = malloc(sizeof(float) * N * V), *slice = malloc(sizeof(float) * N * g.blocks * g.rows);
    float *m = malloc(sizeof(float) * N), *s = calloc(N, sizeof(float)), *tl = calloc(N, sizeof(float));
    float *lse = malloc(sizeof(float) * N), *loss = malloc(sizeof(float) * N), *dx = malloc(sizeof(float) * N * V);
    double *rlse = malloc(sizeof(double) * N), *rloss = malloc(sizeof(double) * N), *rdx = malloc(sizeof(double) * N * V);
    int64_t *t = malloc(sizeof(int64_t) * N);
    test_fill_nonzero(&r, x, N * V, 6.0f);
    for (int64_t n = 0; n < N; n++) t[n] = (n % 4 == 3) ? IGNORE : (int64_t)(test_rng_uniform(&r) * valid);
    if (N > 1) t[N - 1] = valid - 1;   /* the last valid row */
    reference(x, t, N, V, valid, rlse, rloss, rdx);
    for (int64_t n = 0; n < N; n++) m[n] = -INFINITY;
    for (int64_t j = 0; j < n_slices(g); j++) {
        take_columns(slice, x, N, V, g, j);
        cpu_classifier_lse_f32(m, s, tl, slice, t, N, g.blocks, run_rows(g, j), g.stride, j * g.rows, valid, IGNORE);
    }
    int64_t count = cpu_classifier_finish_f32(lse, loss, m, s, tl, t, N, IGNORE), want_count = 0;
    for (int64_t n = 0; n < N; n++) want_count += t[n] != IGNORE;
    test_check(count == want_count, "%s: count %lld, want %lld", what, (long long)count, (long long)want_count);
    test_check(test_compare(what, lse, rlse, N, 1e-5, 1e-5) == 0, "%s: lse", what);
    test_check(test_compare(what, loss, rloss, N, 1e-5, 1e-5) == 0, "%s: losses", what);
    float dloss = 1.0f;
    for (int64_t i = 0; i < N * V; i++) dx[i] = NAN;   /* every column must be written */
    for (int64_t j = 0; j < n_slices(g); j++) {
        take_columns(slice, x, N, V, g, j);
        cpu_classifier_dlogits_f32(slice, slice, lse, t, N, g.blocks, run_rows(g, j), g.stride, j * g.rows, valid,
                                   IGNORE, &dloss, count);
        put_columns(dx, slice, N, V, g, j);
    }
    test_check(test_compare(what, dx, rdx, N * V, 1e-6, 1e-5) == 0, "%s: dlogits", what);
    free(x); free(slice); free(m); free(s); free(tl); free(lse); free(loss); free(dx);
    free(rlse); free(rloss); free(rdx); free(t);
}

static void check_embedding(int64_t n, int64_t V, int64_t dim, geometry g, uint64_t seed) {
    char what[160];
    snprintf(what, sizeof what, "embedding n=%lld V=%lld dim=%lld, %lld runs of %lld rows", (long long)n,
             (long long)V, (long long)dim, (long long)g.blocks, (long long)g.rows);
    test_rng r;
    test_rng_seed(&r, seed);
    int64_t Vt = g.blocks * g.stride;   /* the padded table */
    float *table = calloc(Vt * dim, sizeof(float)), *out = malloc(sizeof(float) * n * dim);
    float *dout = malloc(sizeof(float) * n * dim), *rows = malloc(sizeof(float) * g.blocks * g.rows * dim);
    float *dtable = calloc(Vt * dim, sizeof(float));
    double *want = malloc(sizeof(double) * n * dim), *dwant = calloc(Vt * dim, sizeof(double));
    int64_t *ids = malloc(sizeof(int64_t) * n);
    test_fill_nonzero(&r, table, V * dim, 1.0f);
    test_fill_nonzero(&r, dout, n * dim, 1.0f);
    for (int64_t k = 0; k < n; k++) ids[k] = k % 3 == 2 ? ids[k - 1] : (int64_t)(test_rng_uniform(&r) * V);
    for (int64_t k = 0; k < n; k++)
        for (int64_t c = 0; c < dim; c++) {
            want[k * dim + c] = table[ids[k] * dim + c];
            dwant[ids[k] * dim + c] += dout[k * dim + c];
        }
    for (int64_t i = 0; i < n * dim; i++) out[i] = NAN;
    for (int64_t j = 0; j < n_slices(g); j++) {
        int64_t br = run_rows(g, j);
        for (int64_t i = 0; i < g.blocks * br; i++)   /* gather the slice's rows */
            memcpy(rows + i * dim, table + ((i / br) * g.stride + j * g.rows + i % br) * dim, sizeof(float) * dim);
        cpu_embedding_slice_forward_f32(out, ids, n, rows, dim, g.blocks, br, g.stride, j * g.rows);
        cpu_embedding_slice_backward_f32(rows, ids, n, dout, dim, g.blocks, br, g.stride, j * g.rows);
        for (int64_t i = 0; i < g.blocks * br; i++)
            memcpy(dtable + ((i / br) * g.stride + j * g.rows + i % br) * dim, rows + i * dim, sizeof(float) * dim);
    }
    test_check(test_compare(what, out, want, n * dim, 0, 0) == 0, "%s: forward", what);
    test_check(test_compare(what, dtable, dwant, Vt * dim, 1e-6, 1e-6) == 0, "%s: backward", what);
    free(table); free(out); free(dout); free(rows); free(dtable); free(want); free(dwant); free(ids);
}

int main(void) {
    /* plain tables: one run per slice */
    check_classifier(5, 97, 97, (geometry){1, 97, 10}, 1);    /* V prime, chunk does not divide */
    check_classifier(7, 96, 89, (geometry){1, 96, 7}, 2);     /* padded rows past valid */
    check_classifier(1, 97, 91, (geometry){1, 97, 97}, 3);    /* T = 1, one slice */
    check_classifier(3, 13, 13, (geometry){1, 13, 1}, 4);     /* one row per slice */
    check_classifier(6, 97, 97, (geometry){1, 97, 97}, 5);    /* the whole table in one slice */
    /* sharded over G ranks: G runs per slice, the table padded to G * stride rows */
    check_classifier(5, 99, 97, (geometry){3, 33, 4}, 6);     /* valid 97 (prime) of 99 padded */
    check_classifier(1, 128, 101, (geometry){4, 32, 5}, 7);
    check_classifier(9, 14, 11, (geometry){7, 2, 1}, 8);
    check_embedding(11, 97, 3, (geometry){1, 97, 10}, 9);
    check_embedding(1, 97, 5, (geometry){1, 97, 97}, 10);
    check_embedding(13, 97, 4, (geometry){3, 33, 4}, 11);
    check_embedding(8, 30, 2, (geometry){4, 8, 3}, 12);
    return test_summary();
}
