/* test_kernels_nn.c: the NN kernels (activation, softmax, norm, embedding,
 * cross-entropy, attention) forward and backward against the double
 * references in ref_nn.c, at awkward sizes, with 1 and 3 threads.
 *
 * Tolerances, as |got - want| <= atol * max|want| + rtol * |want|:
 *   f32:  rtol 1e-4, atol 1e-5 (f32 accumulation error over <= a few hundred terms).
 *   bf16: inputs rounded to bf16, the f32 kernel run, its output rounded to
 *         bf16, against the reference of the rounded inputs: rtol 1e-2, atol 1e-3
 *         (bf16 keeps 8 bits: output rounding alone is 2^-9 relative).
 *   finite differences: kernel backward vs central differences (h = 1e-5) of
 *         the double forward reference: rtol 1e-3, atol 1e-4.
 * Outputs are prefilled with NaN, so a kernel that skips an element fails. */
#include "cpu_kernels.h"
#include "vec512.h"
#include "ref_nn.h"
#include "testutil.h"
#include <math.h>
#include <stdlib.h>
#include <string.h>

typedef struct {
    int bf16;
    double rtol, atol;
    const char *tag;
} prec;

static const prec F32 = {0, 1e-4, 1e-5, "f32"};
static const prec BF16 = {1, 1e-2, 1e-3, "bf16"};

static test_rng rng;
static int nthreads;

/* ---- allocation: everything a case allocates is freed by free_all() ---- */

static void *pool_ptrs[256];
static int pool_n;

static void *talloc(size_t bytes) {
    void *p = malloc(bytes ? bytes : 1);
    if (!p || pool_n == 256) abort();
    return pool_ptrs[pool_n++] = p;
}
static void free_all(void) {
    while (pool_n) free(pool_ptrs[--pool_n]);
}
static float *fnan(int64_t n) {   /* an output buffer, NaN until written */
    float *x = talloc((size_t)n * sizeof(float));
    for (int64_t i = 0; i < n; i++) x[i] = NAN;
    return x;
}
static double *dbuf(int64_t n) { return talloc((size_t)n * sizeof(double)); }

/* random non-zero input, rounded to bf16 in bf16 mode */
static float *finput(int64_t n, float scale, prec p) {
    float *x = talloc((size_t)n * sizeof(float));
    test_fill_nonzero(&rng, x, n, scale);
    if (p.bf16)
        for (int64_t i = 0; i < n; i++) x[i] = bf16_to_f32(f32_to_bf16(x[i]));
    return x;
}
static double *widen(const float *x, int64_t n) {
    double *d = dbuf(n);
    for (int64_t i = 0; i < n; i++) d[i] = x[i];
    return d;
}

/* atol is relative to max(max|want|, mag): mag is the size of the terms that
 * cancel in a result that is near 0 (e.g. a norm's dx over one column) */
static void check_mag(const char *what, const char *shape, const float *got, const double *want, int64_t n, prec p,
                      double mag) {
    if (p.bf16) {   /* compare a rounded copy: got may be the input of a backward still to run */
        float *r = talloc((size_t)n * sizeof(float));
        for (int64_t i = 0; i < n; i++) r[i] = bf16_to_f32(f32_to_bf16(got[i]));
        got = r;
    }
    double mx = mag;
    for (int64_t i = 0; i < n; i++) mx = fmax(mx, fabs(want[i]));
    char name[160];
    snprintf(name, sizeof name, "%s %s %s t%d", what, shape, p.tag, nthreads);
    test_compare(name, got, want, n, p.atol * mx + 1e-30, p.rtol);
}

static void check(const char *what, const char *shape, const float *got, const double *want, int64_t n, prec p) {
    check_mag(what, shape, got, want, n, p, 0.0);
}

/* the scale of the terms in a norm's dx: max |dout w rstd| */
static double norm_dx_mag(const float *dout, const float *w, const float *rstd, int64_t rows, int64_t cols) {
    double m = 0;
    for (int64_t r = 0; r < rows; r++)
        for (int64_t j = 0; j < cols; j++) m = fmax(m, fabs(dout[r * cols + j] * (w ? w[j] : 1.0f) * rstd[r]));
    return m;
}

static const int64_t SIZES[] = {1, 3, 7, 31, 97, 128};
#define NSIZES 6

/* ---- activations ---- */

static void test_activations(prec p) {
    const int64_t ns[] = {1, 3, 7, 31, 97, 128, 40009};
    for (int s = 0; s < 7; s++) {
        int64_t n = ns[s];
        char shape[32];
        snprintf(shape, sizeof shape, "(%lld)", (long long)n);
        float *x = finput(n, 5.0f, p), *dout = finput(n, 1.0f, p), *out = fnan(n);
        double *xd = widen(x, n), *dd = widen(dout, n), *want = dbuf(n);

        cpu_gelu_forward_f32(out, x, n);
        ref_gelu(want, xd, n);
        check("gelu", shape, out, want, n, p);
        out = fnan(n);
        cpu_gelu_backward_f32(out, x, dout, n);
        ref_gelu_backward(want, xd, dd, n);
        check("gelu_bwd", shape, out, want, n, p);

        out = fnan(n);
        cpu_silu_forward_f32(out, x, n);
        ref_silu(want, xd, n);
        check("silu", shape, out, want, n, p);
        out = fnan(n);
        cpu_silu_backward_f32(out, x, dout, n);
        ref_silu_backward(want, xd, dd, n);
        check("silu_bwd", shape, out, want, n, p);

        out = fnan(n);
        cpu_relu_forward_f32(out, x, n);
        ref_relu(want, xd, n);
        check("relu", shape, out, want, n, p);
        out = fnan(n);
        cpu_relu_backward_f32(out, x, dout, n);
        ref_relu_backward(want, xd, dd, n);
        check("relu_bwd", shape, out, want, n, p);
        free_all();
    }
}

/* ---- softmax ---- */

static void softmax_case(int64_t rows, int64_t cols, float scale, prec p) {
    int64_t n = rows * cols;
    char shape[48];
    snprintf(shape, sizeof shape, "(%lld,%lld)x%g", (long long)rows, (long long)cols, scale);
    float *x = finput(n, scale, p), *dy = finput(n, 1.0f, p), *y = fnan(n), *dx = fnan(n);
    double *xd = widen(x, n), *dyd = widen(dy, n), *want = dbuf(n);

    cpu_softmax_forward_f32(y, x, rows, cols);
    ref_softmax(want, xd, rows, cols);
    check("softmax", shape, y, want, n, p);
    cpu_softmax_backward_f32(dx, y, dy, rows, cols);
    ref_softmax_backward(want, xd, dyd, rows, cols);
    check("softmax_bwd", shape, dx, want, n, p);

    y = fnan(n), dx = fnan(n);
    cpu_log_softmax_forward_f32(y, x, rows, cols);
    ref_log_softmax(want, xd, rows, cols);
    check("log_softmax", shape, y, want, n, p);
    cpu_log_softmax_backward_f32(dx, y, dy, rows, cols);
    ref_log_softmax_backward(want, xd, dyd, rows, cols);
    check("log_softmax_bwd", shape, dx, want, n, p);
    free_all();
}

static void test_softmax(prec p) {
    for (int a = 0; a < NSIZES; a++)
        for (int b = 0; b < NSIZES; b++) softmax_case(SIZES[a], SIZES[b], 4.0f, p);
    softmax_case(5, 3000, 4.0f, p);   /* a row wider than a chunk */
}

/* ---- layernorm and RMSNorm ---- */

static void norm_case(int64_t rows, int64_t cols, int affine, prec p) {
    int64_t n = rows * cols;
    const float eps = 1e-5f;
    char shape[48];
    snprintf(shape, sizeof shape, "(%lld,%lld)%s", (long long)rows, (long long)cols, affine ? "" : " noaffine");
    float *x = finput(n, 3.0f, p), *dout = finput(n, 1.0f, p);
    for (int64_t i = 0; i < n; i++) x[i] += 1.5f;   /* a non-zero mean to subtract (exact in bf16) */
    float *w = affine ? finput(cols, 2.0f, p) : NULL, *b = affine ? finput(cols, 1.0f, p) : NULL;
    double *xd = widen(x, n), *dd = widen(dout, n);
    double *wd = affine ? widen(w, cols) : NULL, *bd = affine ? widen(b, cols) : NULL;
    double *want = dbuf(n), *mean_d = dbuf(rows), *rstd_d = dbuf(rows), *dw_d = dbuf(cols), *db_d = dbuf(cols);

    float *out = fnan(n), *mean = fnan(rows), *rstd = fnan(rows), *dx = fnan(n), *dw = fnan(cols), *db = fnan(cols);
    cpu_layernorm_forward_f32(out, mean, rstd, x, w, b, rows, cols, eps);
    ref_layernorm(want, mean_d, rstd_d, xd, wd, bd, rows, cols, eps);
    check("layernorm", shape, out, want, n, p);
    check("layernorm mean", shape, mean, mean_d, rows, F32);   /* stats stay f32 */
    check("layernorm rstd", shape, rstd, rstd_d, rows, F32);
    cpu_layernorm_backward_f32(dx, affine ? dw : NULL, affine ? db : NULL, dout, x, w, mean, rstd, rows, cols);
    ref_layernorm_backward(want, dw_d, db_d, dd, xd, wd, rows, cols, eps);
    check_mag("layernorm_bwd dx", shape, dx, want, n, p, norm_dx_mag(dout, w, rstd, rows, cols));
    if (affine) {
        check("layernorm_bwd dw", shape, dw, dw_d, cols, p);
        check("layernorm_bwd db", shape, db, db_d, cols, p);
    }

    out = fnan(n), rstd = fnan(rows), dx = fnan(n), dw = fnan(cols);
    cpu_rmsnorm_forward_f32(out, rstd, x, w, rows, cols, eps);
    ref_rmsnorm(want, rstd_d, xd, wd, rows, cols, eps);
    check("rmsnorm", shape, out, want, n, p);
    check("rmsnorm rstd", shape, rstd, rstd_d, rows, F32);
    cpu_rmsnorm_backward_f32(dx, affine ? dw : NULL, dout, x, w, rstd, rows, cols);
    ref_rmsnorm_backward(want, dw_d, dd, xd, wd, rows, cols, eps);
    check_mag("rmsnorm_bwd dx", shape, dx, want, n, p, norm_dx_mag(dout, w, rstd, rows, cols));
    if (affine) check("rmsnorm_bwd dw", shape, dw, dw_d, cols, p);
    free_all();
}

static void test_norm(prec p) {
    for (int a = 0; a < NSIZES; a++)
        for (int b = 0; b < NSIZES; b++) norm_case(SIZES[a], SIZES[b], 1, p);
    norm_case(7, 97, 0, p);
    norm_case(300, 200, 1, p);   /* several column blocks for the weight gradient */
    norm_case(4, 777, 1, p);     /* wide rows: the row sums in 16 lanes, and a tail */
}

/* ---- embedding ---- */

static void embedding_case(int64_t vocab, int64_t n, int64_t dim, prec p) {
    char shape[64];
    snprintf(shape, sizeof shape, "V%lld n%lld d%lld", (long long)vocab, (long long)n, (long long)dim);
    float *table = finput(vocab * dim, 1.0f, p), *dout = finput(n * dim, 1.0f, p);
    int64_t *ids = talloc((size_t)n * sizeof(int64_t));
    for (int64_t i = 0; i < n; i++) ids[i] = (int64_t)(test_rng_uniform(&rng) * (double)vocab) % vocab;
    double *want = dbuf((vocab > n ? vocab : n) * dim);
    float *out = fnan(n * dim), *dtable = fnan(vocab * dim);
    cpu_embedding_forward_f32(out, ids, n, table, dim);
    ref_embedding(want, ids, n, widen(table, vocab * dim), dim);
    check("embedding", shape, out, want, n * dim, p);
    cpu_embedding_backward_f32(dtable, vocab, ids, n, dout, dim);
    ref_embedding_backward(want, vocab, ids, n, widen(dout, n * dim), dim);
    check("embedding_bwd", shape, dtable, want, vocab * dim, p);
    /* added into an existing gradient: old + each id's rows, others untouched */
    float *old = finput(vocab * dim, 1.0f, p), *acc = fnan(vocab * dim);
    memcpy(acc, old, (size_t)(vocab * dim) * sizeof(float));
    cpu_embedding_backward_acc_f32(acc, ids, n, dout, dim);
    double *old_d = widen(old, vocab * dim);
    for (int64_t i = 0; i < vocab * dim; i++) want[i] += old_d[i];
    check("embedding_bwd_acc", shape, acc, want, vocab * dim, p);
    free_all();
}

static void test_embedding(prec p) {
    for (int a = 0; a < NSIZES; a++)
        for (int b = 0; b < NSIZES; b++) embedding_case(SIZES[a] < 100 ? SIZES[a] : 50, SIZES[b], SIZES[(a + b) % NSIZES], p);
    embedding_case(7, 500, 300, p);   /* many repeats, several column chunks */
}

/* ---- cross-entropy ---- */

#define IGNORE (-100)

static void ce_case(int64_t N, int64_t V, int64_t valid_v, float scale, prec p) {
    char shape[64];
    snprintf(shape, sizeof shape, "(%lld,%lld) valid %lld x%g", (long long)N, (long long)V, (long long)valid_v, scale);
    float *logits = finput(N * V, scale, p);
    int64_t *targets = talloc((size_t)N * sizeof(int64_t));
    for (int64_t n = 0; n < N; n++)
        targets[n] = n % 3 == 1 ? IGNORE : (int64_t)(test_rng_uniform(&rng) * (double)valid_v) % valid_v;
    double *ld = widen(logits, N * V), *loss_d = dbuf(N), *lse_d = dbuf(N), *want = dbuf(N * V);
    float *losses = fnan(N), *lse = fnan(N), *dlogits = fnan(N * V);

    int64_t count = cpu_cross_entropy_forward_f32(losses, lse, logits, targets, N, V, valid_v, IGNORE);
    int64_t count_d = ref_cross_entropy(loss_d, lse_d, ld, targets, N, V, valid_v, IGNORE);
    test_check(count == count_d, "ce count %s: got %lld want %lld", shape, (long long)count, (long long)count_d);
    check("ce loss", shape, losses, loss_d, N, p);
    check("ce lse", shape, lse, lse_d, N, F32);   /* saved in f32 */
    float dloss = count ? 1.0f / (float)count : 1.0f;
    const float one = 1.0f;
    cpu_cross_entropy_backward_f32(dlogits, logits, lse, targets, N, V, valid_v, IGNORE, &one, count ? count : 1);
    ref_cross_entropy_backward(want, ld, targets, N, V, valid_v, IGNORE, dloss);
    check("ce_bwd", shape, dlogits, want, N * V, p);
    int64_t nonzero = 0;   /* ignored rows and padded columns must be exactly 0 */
    for (int64_t n = 0; n < N; n++)
        for (int64_t j = 0; j < V; j++)
            if ((targets[n] == IGNORE || j >= valid_v) && dlogits[n * V + j] != 0.0f) nonzero++;
    test_check(nonzero == 0, "ce_bwd %s: %lld masked gradients not 0", shape, (long long)nonzero);
    /* the fused kernel, dlogits written over a copy of the logits: the two kernels' values, bit for bit */
    float *fx = talloc((size_t)(N * V) * sizeof(float)), *floss = fnan(N);
    memcpy(fx, logits, (size_t)(N * V) * sizeof(float));
    cpu_cross_entropy_fused_f32(floss, fx, targets, N, V, valid_v, IGNORE, count);
    test_check(!memcmp(floss, losses, (size_t)N * sizeof(float)) &&
                   !memcmp(fx, dlogits, (size_t)(N * V) * sizeof(float)),
               "ce fused %s: losses and dlogits equal the forward's and the backward's", shape);
    free_all();
}

static void test_cross_entropy(prec p) {
    for (int a = 0; a < NSIZES; a++)
        for (int b = 0; b < NSIZES; b++) {
            ce_case(SIZES[a], SIZES[b], SIZES[b], 4.0f, p);
            if (SIZES[b] > 1) ce_case(SIZES[a], SIZES[b], SIZES[b] - SIZES[b] / 3 - 1 + (SIZES[b] <= 3), 4.0f, p);
        }
    ce_case(1, 1, 1, 4.0f, p);     /* V = 1, target 0: loss 0, gradient 0 */
    ce_case(9, 5000, 4097, 4.0f, p);
}

/* ---- attention ---- */

static void attention_case(int64_t B, int64_t H, int64_t T, int64_t D, int causal, prec p) {
    int64_t n = B * H * T * D;
    double scale = 1.0 / sqrt((double)D);
    char shape[64];
    snprintf(shape, sizeof shape, "(%lld,%lld,%lld,%lld)%s", (long long)B, (long long)H, (long long)T, (long long)D,
             causal ? " causal" : "");
    float *q = finput(n, 2.0f, p), *k = finput(n, 2.0f, p), *v = finput(n, 1.0f, p), *dout = finput(n, 1.0f, p);
    double *qd = widen(q, n), *kd = widen(k, n), *vd = widen(v, n), *dd = widen(dout, n);
    double *want = dbuf(n), *lse_d = dbuf(B * H * T), *dk_d = dbuf(n), *dv_d = dbuf(n);
    float *out = fnan(n), *lse = fnan(B * H * T), *dq = fnan(n), *dk = fnan(n), *dv = fnan(n);

    cpu_attention_forward_f32(out, lse, q, k, v, B, H, T, D, causal, (float)scale);
    ref_attention(want, lse_d, qd, kd, vd, B, H, T, D, causal, scale);
    check("attention", shape, out, want, n, p);
    check("attention lse", shape, lse, lse_d, B * H * T, F32);
    cpu_attention_backward_f32(dq, dk, dv, dout, q, k, v, out, lse, B, H, T, D, causal, (float)scale);
    ref_attention_backward(want, dk_d, dv_d, dd, qd, kd, vd, B, H, T, D, causal, scale);
    check("attention_bwd dq", shape, dq, want, n, p);
    check("attention_bwd dk", shape, dk, dk_d, n, p);
    check("attention_bwd dv", shape, dv, dv_d, n, p);
    free_all();
}

static void test_attention(prec p) {
    const int64_t shapes[][4] = {{1, 1, 1, 1}, {2, 3, 7, 5}, {1, 2, 33, 16}, {2, 2, 64, 64}, {1, 1, 200, 8}, {1, 3, 129, 3}};
    for (int s = 0; s < 6; s++)
        for (int causal = 0; causal < 2; causal++)
            attention_case(shapes[s][0], shapes[s][1], shapes[s][2], shapes[s][3], causal, p);
}

/* ---- finite differences: backward kernels vs the double forward references ---- */

/* grad[i] = dL/dparam[i] by central differences; L reads param through ctx */
static void fd_grad(double *grad, double *param, int64_t n, double (*L)(void *), void *ctx) {
    const double h = 1e-5;
    for (int64_t i = 0; i < n; i++) {
        double saved = param[i];
        param[i] = saved + h;
        double lp = L(ctx);
        param[i] = saved - h;
        double lm = L(ctx);
        param[i] = saved;
        grad[i] = (lp - lm) / (2 * h);
    }
}

static const prec FD = {0, 1e-3, 1e-4, "fd"};

/* L = sum(dout * f(inputs)), f one of the forward references */
typedef struct {
    int kind;
    double *x, *w, *b, *dout, *out;
    int64_t rows, cols;
    /* attention */
    double *q, *k, *v;
    int64_t B, H, T, D;
    int causal;
    /* cross-entropy, embedding */
    const int64_t *ids;
} fd_ctx;

enum { FD_GELU, FD_SILU, FD_SOFTMAX, FD_LOG_SOFTMAX, FD_LAYERNORM, FD_RMSNORM, FD_CE, FD_ATTENTION, FD_EMBEDDING };

static double fd_loss(void *p) {
    fd_ctx *c = p;
    int64_t n = c->rows * c->cols;
    switch (c->kind) {
    case FD_GELU: ref_gelu(c->out, c->x, n); break;
    case FD_SILU: ref_silu(c->out, c->x, n); break;
    case FD_SOFTMAX: ref_softmax(c->out, c->x, c->rows, c->cols); break;
    case FD_LOG_SOFTMAX: ref_log_softmax(c->out, c->x, c->rows, c->cols); break;
    case FD_LAYERNORM: ref_layernorm(c->out, NULL, NULL, c->x, c->w, c->b, c->rows, c->cols, 1e-5); break;
    case FD_RMSNORM: ref_rmsnorm(c->out, NULL, c->x, c->w, c->rows, c->cols, 1e-5); break;
    case FD_CE: {   /* mean loss over the rows not ignored */
        int64_t count = ref_cross_entropy(c->out, NULL, c->x, c->ids, c->rows, c->cols, c->cols - 1, IGNORE);
        double sum = 0;
        for (int64_t i = 0; i < c->rows; i++) sum += c->out[i];
        return sum / (double)count;
    }
    case FD_EMBEDDING: ref_embedding(c->out, c->ids, c->rows, c->w, c->cols); break;
    case FD_ATTENTION:
        n = c->B * c->H * c->T * c->D;
        ref_attention(c->out, NULL, c->q, c->k, c->v, c->B, c->H, c->T, c->D, c->causal, 1.0 / sqrt((double)c->D));
        break;
    }
    double sum = 0;
    for (int64_t i = 0; i < n; i++) sum += c->dout[i] * c->out[i];
    return sum;
}

static void fd_check(const char *what, fd_ctx *c, double *param, int64_t n, const float *got) {
    double *want = dbuf(n);
    fd_grad(want, param, n, fd_loss, c);
    check(what, "fd", got, want, n, FD);
}

static void test_finite_differences(void) {
    const int64_t R = 3, C = 7, N = R * C;
    float *x = finput(N, 3.0f, F32), *dout = finput(N, 1.0f, F32), *w = finput(C, 2.0f, F32), *b = finput(C, 1.0f, F32);
    fd_ctx c = {.x = widen(x, N), .w = widen(w, C), .b = widen(b, C), .dout = widen(dout, N), .out = dbuf(4096),
                .rows = R, .cols = C};
    float *y = fnan(N), *dx = fnan(N), *dw = fnan(C), *db = fnan(C), *mean = fnan(R), *rstd = fnan(R);

    c.kind = FD_GELU;
    cpu_gelu_backward_f32(dx, x, dout, N);
    fd_check("gelu_bwd", &c, c.x, N, dx);
    c.kind = FD_SILU;
    cpu_silu_backward_f32(dx, x, dout, N);
    fd_check("silu_bwd", &c, c.x, N, dx);
    c.kind = FD_SOFTMAX;
    cpu_softmax_forward_f32(y, x, R, C);
    cpu_softmax_backward_f32(dx, y, dout, R, C);
    fd_check("softmax_bwd", &c, c.x, N, dx);
    c.kind = FD_LOG_SOFTMAX;
    cpu_log_softmax_forward_f32(y, x, R, C);
    cpu_log_softmax_backward_f32(dx, y, dout, R, C);
    fd_check("log_softmax_bwd", &c, c.x, N, dx);

    c.kind = FD_LAYERNORM;
    cpu_layernorm_forward_f32(y, mean, rstd, x, w, b, R, C, 1e-5f);
    cpu_layernorm_backward_f32(dx, dw, db, dout, x, w, mean, rstd, R, C);
    fd_check("layernorm_bwd dx", &c, c.x, N, dx);
    fd_check("layernorm_bwd dw", &c, c.w, C, dw);
    fd_check("layernorm_bwd db", &c, c.b, C, db);
    c.kind = FD_RMSNORM;
    cpu_rmsnorm_forward_f32(y, rstd, x, w, R, C, 1e-5f);
    cpu_rmsnorm_backward_f32(dx, dw, dout, x, w, rstd, R, C);
    fd_check("rmsnorm_bwd dx", &c, c.x, N, dx);
    fd_check("rmsnorm_bwd dw", &c, c.w, C, dw);

    /* cross-entropy: (3, 7) logits, valid_v 6, row 1 ignored */
    int64_t targets[3] = {2, IGNORE, 5};
    c.kind = FD_CE;
    c.ids = targets;
    float losses[3], lse[3];
    int64_t count = cpu_cross_entropy_forward_f32(losses, lse, x, targets, R, C, C - 1, IGNORE);
    const float one = 1.0f;   /* the mean's gradient: 1 / count per row */
    cpu_cross_entropy_backward_f32(dx, x, lse, targets, R, C, C - 1, IGNORE, &one, count);
    fd_check("ce_bwd", &c, c.x, N, dx);

    /* embedding: 5 ids into a (3, 7) table, gradient w.r.t. the table */
    int64_t ids[5] = {2, 0, 2, 2, 1};
    float *table = finput(N, 1.0f, F32), *edout = finput(5 * C, 1.0f, F32), *dtable = fnan(N);
    fd_ctx e = {.kind = FD_EMBEDDING, .w = widen(table, N), .dout = widen(edout, 5 * C), .out = dbuf(5 * C),
                .rows = 5, .cols = C, .ids = ids};
    cpu_embedding_backward_f32(dtable, R, ids, 5, edout, C);
    fd_check("embedding_bwd", &e, e.w, N, dtable);

    for (int causal = 0; causal < 2; causal++) {
        const int64_t B = 1, H = 2, T = 5, D = 3, n = B * H * T * D;
        float *q = finput(n, 1.5f, F32), *k = finput(n, 1.5f, F32), *v = finput(n, 1.0f, F32);
        float *adout = finput(n, 1.0f, F32), *out = fnan(n), *alse = fnan(B * H * T);
        float *dq = fnan(n), *dk = fnan(n), *dv = fnan(n);
        fd_ctx a = {.kind = FD_ATTENTION, .q = widen(q, n), .k = widen(k, n), .v = widen(v, n),
                    .dout = widen(adout, n), .out = dbuf(n), .B = B, .H = H, .T = T, .D = D, .causal = causal};
        float scale = 1.0f / sqrtf((float)D);
        cpu_attention_forward_f32(out, alse, q, k, v, B, H, T, D, causal, scale);
        cpu_attention_backward_f32(dq, dk, dv, adout, q, k, v, out, alse, B, H, T, D, causal, scale);
        fd_check(causal ? "attention_bwd dq causal" : "attention_bwd dq", &a, a.q, n, dq);
        fd_check(causal ? "attention_bwd dk causal" : "attention_bwd dk", &a, a.k, n, dk);
        fd_check(causal ? "attention_bwd dv causal" : "attention_bwd dv", &a, a.v, n, dv);
    }
    free_all();
}

/* ---- large logits: max subtraction keeps softmax and cross-entropy finite ---- */

static void test_stability(void) {
    const int64_t R = 4, C = 31, N = R * C;
    float *x = talloc(N * sizeof(float));
    test_fill_nonzero(&rng, x, N, 10.0f);
    for (int64_t j = 0; j < C; j++) {
        x[0 * C + j] += 1e4f;                     /* all large */
        x[1 * C + j] -= 1e4f;                     /* all very negative */
        x[2 * C + j] = j % 2 ? 1e4f : -1e4f;      /* huge spread */
        x[3 * C + j] *= 3e3f;
    }
    double *xd = widen(x, N), *want = dbuf(N), *dyd = dbuf(N);
    float *dy = finput(N, 1.0f, F32), *y = fnan(N), *dx = fnan(N);
    for (int64_t i = 0; i < N; i++) dyd[i] = dy[i];
    cpu_softmax_forward_f32(y, x, R, C);
    ref_softmax(want, xd, R, C);
    check("softmax", "large", y, want, N, F32);
    cpu_softmax_backward_f32(dx, y, dy, R, C);
    ref_softmax_backward(want, xd, dyd, R, C);
    check("softmax_bwd", "large", dx, want, N, F32);
    cpu_log_softmax_forward_f32(y, x, R, C);
    ref_log_softmax(want, xd, R, C);
    check("log_softmax", "large", y, want, N, F32);
    cpu_log_softmax_backward_f32(dx, y, dy, R, C);
    ref_log_softmax_backward(want, xd, dyd, R, C);
    check("log_softmax_bwd", "large", dx, want, N, F32);

    int64_t targets[4] = {3, 0, 1, 30};
    float losses[4], lse[4];
    double loss_d[4], lse_d[4];
    cpu_cross_entropy_forward_f32(losses, lse, x, targets, R, C, C, IGNORE);
    ref_cross_entropy(loss_d, lse_d, xd, targets, R, C, C, IGNORE);
    check("ce loss", "large", losses, loss_d, R, F32);
    check("ce lse", "large", lse, lse_d, R, F32);
    /* lse is saved in f32: at 1e4 its rounding (~5e-4) shifts every
     * probability by that much relative, hence the looser atol */
    const prec LARGE = {0, 1e-3, 1e-3, "f32"};
    const float quarter = 0.25f;
    cpu_cross_entropy_backward_f32(dx, x, lse, targets, R, C, C, IGNORE, &quarter, 1);
    ref_cross_entropy_backward(want, xd, targets, R, C, C, IGNORE, 0.25);
    check("ce_bwd", "large", dx, want, N, LARGE);
    free_all();
}

/* ---- weight and table gradients are the same bits for any thread count ---- */

static void test_determinism(void) {
    const int64_t R = 257, C = 300, V = 11;
    float *x = finput(R * C, 2.0f, F32), *dout = finput(R * C, 1.0f, F32), *w = finput(C, 1.0f, F32);
    float *y = fnan(R * C), *mean = fnan(R), *rstd = fnan(R), *dx = fnan(R * C);
    float *dw[2] = {fnan(C), fnan(C)}, *db[2] = {fnan(C), fnan(C)}, *dt[2] = {fnan(V * C), fnan(V * C)};
    int64_t *ids = talloc(R * sizeof(int64_t));
    for (int64_t i = 0; i < R; i++) ids[i] = (i * 7) % V;
    cpu_layernorm_forward_f32(y, mean, rstd, x, w, NULL, R, C, 1e-5f);
    for (int t = 0; t < 2; t++) {
        cpu_threads_set(t ? 2 : 1);
        cpu_layernorm_backward_f32(dx, dw[t], db[t], dout, x, w, mean, rstd, R, C);
        cpu_embedding_backward_f32(dt[t], V, ids, R, dout, C);
    }
    test_check(!memcmp(dw[0], dw[1], C * sizeof(float)) && !memcmp(db[0], db[1], C * sizeof(float)),
               "layernorm_bwd dweight/dbias differ between 1 and 2 threads");
    test_check(!memcmp(dt[0], dt[1], V * C * sizeof(float)), "embedding_bwd differs between 1 and 2 threads");
    free_all();
}

#ifdef FSDP_VEC512
/* v16_exp (the activations' exp on AVX-512) against exp in double: 2^19
 * points evenly over [-104, 89] (normal and subnormal results) within 1 ulp of the result's binade (the smallest
 * subnormal below 2^-126), results past FLT_MAX infinite; and the edges: NaN
 * stays NaN, exp(+inf) = inf, exp(-inf) = 0, exp(0) = 1 exactly, a masked
 * load's unused lanes never reach memory. */
static void test_vexp(void) {
    double worst = 0;
    float worst_x = 0;
    int64_t count = 0, bad_inf = 0;
    float lanes[16], out[16];
    int nl = 0;
    const int64_t samples = 1 << 19;
    for (int64_t k = 0; k < samples; k++) {
        lanes[nl++] = (float)(-104.0 + 193.0 * ((double)k + 0.37) / (double)samples);
        if (nl < 16 && k + 1 < samples) continue;
        v16_store(out, v16_mask(nl), v16_exp(v16_load(lanes, v16_mask(nl))));
        for (int j = 0; j < nl; j++, count++) {
            double want = exp((double)lanes[j]);
            if (want > 3.4028234663852886e38) {
                bad_inf += !isinf(out[j]);
                continue;
            }
            double ulp = want < 1.1754943508222875e-38 ? ldexp(1.0, -149) : ldexp(1.0, ilogb(want) - 23);
            double e = fabs((double)out[j] - want) / ulp;
            if (!(e <= worst)) worst = e, worst_x = lanes[j];
        }
        nl = 0;
    }
    test_check(worst <= 1.0 && bad_inf == 0, "v16_exp: %lld values within 1 ulp of exp (worst %.3f ulp at %.9g), %lld "
               "past FLT_MAX not infinite", (long long)count, worst, worst_x, (long long)bad_inf);
    float edge[5] = {NAN, INFINITY, -INFINITY, 0.0f, -0.0f}, guard[16];
    for (int j = 0; j < 16; j++) guard[j] = -7.0f;
    v16_store(guard, v16_mask(5), v16_exp(v16_load(edge, v16_mask(5))));
    int untouched = 1;
    for (int j = 5; j < 16; j++) untouched &= guard[j] == -7.0f;
    test_check(isnan(guard[0]) && isinf(guard[1]) && guard[1] > 0 && guard[2] == 0.0f && guard[3] == 1.0f &&
                   guard[4] == 1.0f && untouched,
               "v16_exp edges: exp(nan) %g, exp(inf) %g, exp(-inf) %g, exp(0) %g, exp(-0) %g, tail lanes untouched %d",
               guard[0], guard[1], guard[2], guard[3], guard[4], untouched);
}
#endif

int main(void) {
    test_rng_seed(&rng, 20240611);
#ifdef FSDP_VEC512
    test_vexp();
#endif
    const int threads[2] = {1, 3};
    for (int t = 0; t < 2; t++) {
        nthreads = threads[t];
        cpu_threads_set(nthreads);
        for (int b = 0; b < 2; b++) {
            prec p = b ? BF16 : F32;
            test_activations(p);
            test_softmax(p);
            test_norm(p);
            test_embedding(p);
            test_cross_entropy(p);
            test_attention(p);
        }
        test_finite_differences();
        test_stability();
    }
    test_determinism();
    return test_summary();
}
