/* test_cuda_kernels_nn.c: activations (GELU, SiLU), softmax and
 * log-softmax, layernorm and rmsnorm, forward and backward, f32 and bf16;
 * the bf16 cross-entropy; the fused bias entries (bias + GELU, bias +
 * residual).
 * Tolerances: f32 rtol 1e-5, atol 1e-6 (the GPU's expf is within 2 ulp,
 * glibc's within 1; norm weight gradients sum rows in another order: atol
 * 1e-5); bf16 as cuda_kernels_check.h says; see test_fused for the fused
 * entries. */
#include "cuda_kernels_check.h"

/* ---- activations, softmax ---- */

typedef void (*unary_fn)(float *, const float *, int64_t);
typedef void (*unary_bwd_fn)(float *, const float *, const float *, int64_t);

void test_activations(void) {
    struct { const char *name; unary_fn gf, cf; unary_bwd_fn gb, cb; } acts[] = {
        {"gelu", G->gelu_forward_f32, C->gelu_forward_f32, G->gelu_backward_f32, C->gelu_backward_f32},
        {"silu", G->silu_forward_f32, C->silu_forward_f32, G->silu_backward_f32, C->silu_backward_f32},
        {"relu", G->relu_forward_f32, C->relu_forward_f32, G->relu_backward_f32, C->relu_backward_f32},
    };
    int64_t sizes[] = {1, 7, 4099};
    for (int a = 0; a < 3; a++)
        for (int s = 0; s < 3; s++) {
            int64_t n = sizes[s];
            float *x = hrand(n, 4), *dout = hrand(n, 1);
            float *want = hnan(n), *wdx = hnan(n);
            float *dx_ = dupf(x, n), *ddout = dupf(dout, n), *dy = dnan(n), *ddx = dnan(n);
            acts[a].cf(want, x, n);
            acts[a].gf(dy, dx_, n);
            acts[a].cb(wdx, x, dout, n);
            acts[a].gb(ddx, dx_, ddout, n);
            char name[64];
            snprintf(name, sizeof name, "%s_forward_f32 n=%lld", acts[a].name, (long long)n);
            check_f(name, back(dy, n), want, n, 1e-5, 1e-6, -1);
            snprintf(name, sizeof name, "%s_backward_f32 n=%lld", acts[a].name, (long long)n);
            check_f(name, back(ddx, n), wdx, n, 1e-5, 1e-6, -1);
            free_case();
        }
}

typedef void (*rows_fn)(float *, const float *, int64_t, int64_t);
typedef void (*rows_bwd_fn)(float *, const float *, const float *, int64_t, int64_t);

void test_softmax(void) {
    struct { const char *name; rows_fn gf, cf; rows_bwd_fn gb, cb; } sm[] = {
        {"softmax", G->softmax_forward_f32, C->softmax_forward_f32, G->softmax_backward_f32, C->softmax_backward_f32},
        {"log_softmax", G->log_softmax_forward_f32, C->log_softmax_forward_f32, G->log_softmax_backward_f32,
         C->log_softmax_backward_f32},
    };
    int64_t cs[][2] = {{1, 1}, {3, 7}, {5, 1000}, {70, 33}, {2, 50257}, BIG({64, 50257})};
    for (int a = 0; a < 2; a++)
        for (size_t i = 0; i < sizeof cs / sizeof cs[0]; i++) {
            int64_t rows = cs[i][0], cols = cs[i][1], n = rows * cols;
            float *x = hrand(n, 5), *dy = hrand(n, 1), *y = hnan(n), *wdx = hnan(n);
            sm[a].cf(y, x, rows, cols);
            sm[a].cb(wdx, y, dy, rows, cols);
            float *dx_ = dupf(x, n), *dyv = dnan(n), *dyy = dupf(y, n), *ddy = dupf(dy, n), *ddx = dnan(n);
            sm[a].gf(dyv, dx_, rows, cols);
            sm[a].gb(ddx, dyy, ddy, rows, cols);   /* from the CPU's y: checks backward alone */
            char name[80];
            snprintf(name, sizeof name, "%s_forward_f32 (%lld, %lld)", sm[a].name, (long long)rows, (long long)cols);
            check_f(name, back(dyv, n), y, n, 1e-5, 1e-6, -1);
            snprintf(name, sizeof name, "%s_backward_f32 (%lld, %lld)", sm[a].name, (long long)rows, (long long)cols);
            check_f(name, back(ddx, n), wdx, n, 1e-5, 1e-6, -1);
            free_case();
        }
}

/* ---- norms ---- */

/* dx = rstd (g - ...) with g = dout * w: its terms are of size rstd |g|, and
 * where they cancel (e.g. one column) both sides keep rounding noise of that
 * size, so dx is compared on that scale. */
static double dx_scale(const float *dout, const float *w, const float *rstd, int64_t rows, int64_t cols) {
    double m = 0;
    for (int64_t r = 0; r < rows; r++)
        for (int64_t j = 0; j < cols; j++) {
            double t = fabs((double)rstd[r] * dout[r * cols + j] * (w ? w[j] : 1.0f));
            if (t > m) m = t;
        }
    return m;
}

void test_norms(void) {
    /* (5, 2100): wider than the one-pass backward's shared memory, the two-pass path */
    int64_t cs[][2] = {{1, 1}, {7, 33}, {300, 64}, {3, 1031}, {1000, 5}, {5, 2100}, BIG({4096, 768})};
    for (size_t i = 0; i < sizeof cs / sizeof cs[0]; i++)
        for (int affine = 0; affine < 3; affine++) {   /* 0: none, 1: weight, 2: weight + bias */
            int64_t rows = cs[i][0], cols = cs[i][1], n = rows * cols;
            float *x = hrand(n, 2), *w = affine ? hrand(cols, 1) : NULL, *b = affine == 2 ? hrand(cols, 1) : NULL;
            for (int64_t k = 0; k < n; k++) x[k] += 0.5f;   /* a non-zero mean */
            float *dout = hrand(n, 1);
            float *dx_ = dupf(x, n), *dw = w ? dupf(w, cols) : NULL, *db = b ? dupf(b, cols) : NULL;
            float *ddout = dupf(dout, n);
            char name[160], tag[64];
            snprintf(tag, sizeof tag, "(%lld, %lld) %s", (long long)rows, (long long)cols,
                     affine == 0 ? "no affine" : affine == 1 ? "weight" : "weight+bias");
            /* layernorm */
            float *y = hnan(n), *mean = hnan(rows), *rstd = hnan(rows);
            C->layernorm_forward_f32(y, mean, rstd, x, w, b, rows, cols, 1e-5f);
            float *gy = dnan(n), *gmean = dnan(rows), *grstd = dnan(rows);
            G->layernorm_forward_f32(gy, gmean, grstd, dx_, dw, db, rows, cols, 1e-5f);
            snprintf(name, sizeof name, "layernorm_forward_f32 out %s", tag);
            check_f(name, back(gy, n), y, n, 1e-5, 1e-6, -1);
            snprintf(name, sizeof name, "layernorm_forward_f32 mean %s", tag);
            check_f(name, back(gmean, rows), mean, rows, 1e-5, 1e-6, -1);
            snprintf(name, sizeof name, "layernorm_forward_f32 rstd %s", tag);
            check_f(name, back(grstd, rows), rstd, rows, 1e-5, 1e-6, -1);
            float *wdx = hnan(n), *wdw = hnan(cols), *wdb = hnan(cols);
            /* from the CPU's mean and rstd: checks backward alone */
            float *cmean = dupf(mean, rows), *crstd = dupf(rstd, rows);
            float *gdx = dnan(n), *gdw = dnan(cols), *gdb = dnan(cols);
            int want_w = affine >= 1, want_b = affine == 2;
            C->layernorm_backward_f32(wdx, want_w ? wdw : NULL, want_b ? wdb : NULL, dout, x, w, mean, rstd, rows,
                                      cols);
            G->layernorm_backward_f32(gdx, want_w ? gdw : NULL, want_b ? gdb : NULL, ddout, dx_, dw, cmean, crstd,
                                      rows, cols);
            snprintf(name, sizeof name, "layernorm_backward_f32 dx %s", tag);
            check_f(name, back(gdx, n), wdx, n, 1e-5, 1e-6, dx_scale(dout, w, rstd, rows, cols));
            if (want_w) {
                snprintf(name, sizeof name, "layernorm_backward_f32 dweight %s", tag);
                check_f(name, back(gdw, cols), wdw, cols, 1e-5, 1e-5, -1);
            }
            if (want_b) {
                snprintf(name, sizeof name, "layernorm_backward_f32 dbias %s", tag);
                check_f(name, back(gdb, cols), wdb, cols, 1e-5, 1e-5, -1);
            }
            /* rmsnorm (weight or none) */
            if (affine < 2) {
                float *ry = hnan(n), *rr = hnan(rows);
                C->rmsnorm_forward_f32(ry, rr, x, w, rows, cols, 1e-6f);
                float *gry = dnan(n), *grr = dnan(rows);
                G->rmsnorm_forward_f32(gry, grr, dx_, dw, rows, cols, 1e-6f);
                snprintf(name, sizeof name, "rmsnorm_forward_f32 out %s", tag);
                check_f(name, back(gry, n), ry, n, 1e-5, 1e-6, -1);
                snprintf(name, sizeof name, "rmsnorm_forward_f32 rstd %s", tag);
                check_f(name, back(grr, rows), rr, rows, 1e-5, 1e-6, -1);
                float *rdx = hnan(n), *rdw = hnan(cols), *crr = dupf(rr, rows), *grdx = dnan(n), *grdw = dnan(cols);
                C->rmsnorm_backward_f32(rdx, want_w ? rdw : NULL, dout, x, w, rr, rows, cols);
                G->rmsnorm_backward_f32(grdx, want_w ? grdw : NULL, ddout, dx_, dw, crr, rows, cols);
                snprintf(name, sizeof name, "rmsnorm_backward_f32 dx %s", tag);
                check_f(name, back(grdx, n), rdx, n, 1e-5, 1e-6, dx_scale(dout, w, rr, rows, cols));
                if (want_w) {
                    snprintf(name, sizeof name, "rmsnorm_backward_f32 dweight %s", tag);
                    check_f(name, back(grdw, cols), rdw, cols, 1e-5, 1e-5, -1);
                }
            }
            free_case();
        }
}

/* The fused bias entries (fused.cu) against the CPU's (fused.c, itself
 * checked against the unfused kernels and a double reference in
 * tests/c/test_kernels_fused.c), f32 and bf16: the 16-byte paths (rows of a
 * multiple of 8 bf16 or 4 f32), the element paths (odd rows, a pointer off
 * by one element), and enough rows for the bias sum to be cut into chunks.
 * Tolerances: bias_residual bit for bit (the same two f32 adds); GELU and
 * its gradient as the activations (f32 rtol 1e-5, bf16 one ulp); the bias
 * gradient within 1e-6 (f32) or one bf16 ulp of sum |dx| over its column. */
/* a device copy of n values (bf16 when bf16) starting off elements into its allocation */
static void *dev_at(const float *h, int64_t n, int64_t off, int bf16) {
    size_t es = bf16 ? 2 : 4;
    char *d = dalloc((size_t)(n + off) * es);
    if (bf16) {
        uint16_t *t = halloc((size_t)(n > 0 ? n : 1) * 2);
        for (int64_t i = 0; i < n; i++) t[i] = f32_to_bf16(h[i]);
        if (n) G->copy_from_host(d + off * es, t, (size_t)n * es);
    } else if (n) {
        G->copy_from_host(d + off * es, h, (size_t)n * es);
    }
    return d + off * es;
}

void test_fused(void) {
    test_check(G->bias_gelu_forward_f32 && G->bias_gelu_forward_bf16 && G->bias_gelu_backward_f32 &&
                   G->bias_gelu_backward_bf16 && G->bias_residual_f32 && G->bias_residual_bf16,
               "CUDA has the fused bias entries");
    if (!G->bias_gelu_forward_f32 || !G->bias_gelu_forward_bf16 || !G->bias_gelu_backward_f32 ||
        !G->bias_gelu_backward_bf16 || !G->bias_residual_f32 || !G->bias_residual_bf16)
        return;
    /* rows, cols, element offset of every pointer (0: aligned) */
    static const int64_t cs[][3] = {{1, 1, 0}, {3, 7, 0}, {5, 8, 0}, {4, 12, 0}, {33, 37, 0},
                                    {70, 256, 0}, {600, 40, 0}, {9, 16, 1}, {130, 264, 0}};
    char name[128];
    for (size_t c = 0; c < sizeof cs / sizeof cs[0]; c++) {
        int64_t rows = cs[c][0], cols = cs[c][1], off = cs[c][2], n = rows * cols;
        for (int bf16 = 0; bf16 < 2; bf16++) {
            const char *dt = bf16 ? "bf16" : "f32";
            float *x = hrand16(n, 3), *b = hrand16(cols, 1), *d = hrand16(n, 1), *r = hrand16(n, 2);
            float *old = hrand16(cols, 2);
            float *y = hnan(n), *dx = hnan(n), *db = hnan(cols), *dacc = hcopy(old, cols), *res = hnan(n);
            C->bias_gelu_forward_f32(y, x, b, rows, cols);
            C->bias_gelu_backward_f32(dx, db, d, x, b, rows, cols, 0);
            C->bias_gelu_backward_f32(dx, dacc, d, x, b, rows, cols, 1);
            C->bias_residual_f32(res, x, b, r, rows, cols);
            double *bound = halloc((size_t)cols * sizeof(double)), *bound_acc = halloc((size_t)cols * sizeof(double));
            for (int64_t j = 0; j < cols; j++) bound[j] = 1e-30;
            for (int64_t i = 0; i < n; i++) bound[i % cols] += fabsf(dx[i]);
            for (int64_t j = 0; j < cols; j++) bound_acc[j] = bound[j] + fabsf(old[j]);
            /* device copies at element offset off */
#define DEV(h, count) dev_at(h, count, off, bf16)
            void *gx = DEV(x, n), *gb = DEV(b, cols), *gd = DEV(d, n), *gr = DEV(r, n);
            void *gy = DEV(hnan(n), n), *gdx = DEV(hnan(n), n), *gdx2 = DEV(hnan(n), n), *gdb = DEV(hnan(cols), cols);
            void *gacc = DEV(old, cols), *gres = DEV(hnan(n), n);
#undef DEV
            if (bf16) {
                G->bias_gelu_forward_bf16(gy, gx, gb, rows, cols);
                G->bias_gelu_backward_bf16(gdx, gdb, gd, gx, gb, rows, cols, 0);
                G->bias_gelu_backward_bf16(gdx2, gacc, gd, gx, gb, rows, cols, 1);
                G->bias_residual_bf16(gres, gx, gb, gr, rows, cols);
            } else {
                G->bias_gelu_forward_f32(gy, gx, gb, rows, cols);
                G->bias_gelu_backward_f32(gdx, gdb, gd, gx, gb, rows, cols, 0);
                G->bias_gelu_backward_f32(gdx2, gacc, gd, gx, gb, rows, cols, 1);
                G->bias_residual_f32(gres, gx, gb, gr, rows, cols);
            }
            float *(*get)(const void *, int64_t) = bf16 ? back_bf16 : back;
            double tol = bf16 ? ULP16 : 1e-5, sum_tol = bf16 ? ULP16 : 1e-6;
            snprintf(name, sizeof name, "bias_gelu_forward_%s (%lld, %lld)%s", dt, (long long)rows, (long long)cols,
                     off ? " unaligned" : "");
            check_f(name, get(gy, n), bf16 ? round_bf16_host(y, n) : y, n, tol, 1e-6, -1);
            snprintf(name, sizeof name, "bias_gelu_backward_%s dx (%lld, %lld)%s", dt, (long long)rows,
                     (long long)cols, off ? " unaligned" : "");
            float *gdx_h = get(gdx, n);
            check_f(name, gdx_h, bf16 ? round_bf16_host(hcopy(dx, n), n) : dx, n, tol, 1e-6, -1);
            snprintf(name, sizeof name, "bias_gelu_backward_%s dx accumulating (%lld, %lld)", dt, (long long)rows,
                     (long long)cols);
            check_f(name, get(gdx2, n), gdx_h, n, 0, 0, 0);
            snprintf(name, sizeof name, "bias_gelu_backward_%s dbias (%lld, %lld)%s", dt, (long long)rows,
                     (long long)cols, off ? " unaligned" : "");
            check_bound(name, get(gdb, cols), db, bound, cols, sum_tol);
            snprintf(name, sizeof name, "bias_gelu_backward_%s dbias accumulated (%lld, %lld)", dt, (long long)rows,
                     (long long)cols);
            check_bound(name, get(gacc, cols), dacc, bound_acc, cols, sum_tol);
            snprintf(name, sizeof name, "bias_residual_%s (%lld, %lld)%s", dt, (long long)rows, (long long)cols,
                     off ? " unaligned" : "");
            check_f(name, get(gres, n), bf16 ? round_bf16_host(res, n) : res, n, 0, 0, 0);
            free_case();
        }
    }
    /* without a bias gradient, and with no rows (0, or left as it was) */
    float *x = hrand16(40, 3), *b = hrand16(8, 1), *d = hrand16(40, 1), *want = hnan(40);
    C->bias_gelu_backward_f32(want, NULL, d, x, b, 5, 8, 0);
    uint16_t *gx = dup16(x, 40), *gb = dup16(b, 8), *gd = dup16(d, 40), *gdx = dnan16(40);
    G->bias_gelu_backward_bf16(gdx, NULL, gd, gx, gb, 5, 8, 0);
    check_f("bias_gelu_backward_bf16 without dbias", back_bf16(gdx, 40), round_bf16_host(want, 40), 40, ULP16, 1e-6,
            -1);
    float ones[3] = {1, 2, 3};
    uint16_t *z = dup16(ones, 3), *keep = dup16(ones, 3);
    G->bias_gelu_backward_bf16(NULL, z, NULL, NULL, NULL, 0, 3, 0);
    G->bias_gelu_backward_bf16(NULL, keep, NULL, NULL, NULL, 0, 3, 1);
    float zero[3] = {0, 0, 0};
    check_f("bias_gelu_backward_bf16 no rows: dbias 0", back_bf16(z, 3), zero, 3, 0, 0, 0);
    check_f("bias_gelu_backward_bf16 no rows, accumulating: dbias unchanged", back_bf16(keep, 3), ones, 3, 0, 0, 0);
    free_case();
}

typedef void (*unary16_fn)(uint16_t *, const uint16_t *, int64_t);
typedef void (*unary16_bwd_fn)(uint16_t *, const uint16_t *, const uint16_t *, int64_t);
typedef void (*rows16_fn)(uint16_t *, const uint16_t *, int64_t, int64_t);
typedef void (*rows16_bwd_fn)(uint16_t *, const uint16_t *, const uint16_t *, int64_t, int64_t);

void test_bf16_nn(void) {
    test_check(G->gelu_forward_bf16 && G->softmax_forward_bf16 && G->layernorm_forward_bf16 &&
                   G->cross_entropy_forward_bf16,
               "CUDA has the bf16 nn entries");
    if (!G->gelu_forward_bf16 || !G->softmax_forward_bf16 || !G->layernorm_forward_bf16 ||
        !G->cross_entropy_forward_bf16)
        return;
    struct { const char *name; unary16_fn gf; unary_fn cf; unary16_bwd_fn gb; unary_bwd_fn cb; } acts[] = {
        {"gelu", G->gelu_forward_bf16, C->gelu_forward_f32, G->gelu_backward_bf16, C->gelu_backward_f32},
        {"silu", G->silu_forward_bf16, C->silu_forward_f32, G->silu_backward_bf16, C->silu_backward_f32},
        {"relu", G->relu_forward_bf16, C->relu_forward_f32, G->relu_backward_bf16, C->relu_backward_f32},
    };
    for (int a = 0; a < 3; a++)
        for (int64_t n = 1; n <= 5000; n = n * 71 + 2) {
            float *x = hrand16(n, 4), *dout = hrand16(n, 1), *want = hnan(n), *wdx = hnan(n);
            acts[a].cf(want, x, n);
            acts[a].cb(wdx, x, dout, n);
            uint16_t *gx = dup16(x, n), *gd = dup16(dout, n), *gy = dnan16(n), *gdx = dnan16(n);
            acts[a].gf(gy, gx, n);
            acts[a].gb(gdx, gx, gd, n);
            char name[64];
            snprintf(name, sizeof name, "%s_forward_bf16 n=%lld", acts[a].name, (long long)n);
            check_f(name, back_bf16(gy, n), want, n, ULP16, 1e-6, -1);
            snprintf(name, sizeof name, "%s_backward_bf16 n=%lld", acts[a].name, (long long)n);
            check_f(name, back_bf16(gdx, n), wdx, n, ULP16, 1e-6, -1);
            free_case();
        }
    struct { const char *name; rows16_fn gf; rows_fn cf; rows16_bwd_fn gb; rows_bwd_fn cb; } sm[] = {
        {"softmax", G->softmax_forward_bf16, C->softmax_forward_f32, G->softmax_backward_bf16, C->softmax_backward_f32},
        {"log_softmax", G->log_softmax_forward_bf16, C->log_softmax_forward_f32, G->log_softmax_backward_bf16,
         C->log_softmax_backward_f32},
    };
    int64_t rc[][2] = {{1, 1}, {3, 7}, {5, 1000}, {70, 33}};
    for (int a = 0; a < 2; a++)
        for (size_t i = 0; i < sizeof rc / sizeof rc[0]; i++) {
            int64_t rows = rc[i][0], cols = rc[i][1], n = rows * cols;
            float *x = hrand16(n, 5), *dy = hrand16(n, 1), *y = hnan(n), *wdx = hnan(n);
            sm[a].cf(y, x, rows, cols);
            round_bf16_host(y, n);   /* the backward's input, as the forward stores it */
            sm[a].cb(wdx, y, dy, rows, cols);
            uint16_t *gx = dup16(x, n), *gy = dnan16(n), *cy = dup16(y, n), *gdy = dup16(dy, n), *gdx = dnan16(n);
            float *yf = hnan(n);
            sm[a].cf(yf, x, rows, cols);
            sm[a].gf(gy, gx, rows, cols);
            sm[a].gb(gdx, cy, gdy, rows, cols);
            char name[80];
            snprintf(name, sizeof name, "%s_forward_bf16 (%lld, %lld)", sm[a].name, (long long)rows, (long long)cols);
            check_f(name, back_bf16(gy, n), yf, n, ULP16, 1e-6, -1);
            snprintf(name, sizeof name, "%s_backward_bf16 (%lld, %lld)", sm[a].name, (long long)rows, (long long)cols);
            check_f(name, back_bf16(gdx, n), wdx, n, ULP16, 1.0 / 256, -1);
            free_case();
        }
    int64_t nc[][2] = {{1, 1}, {7, 33}, {300, 64}, {3, 1031}, {5, 2100}};
    for (size_t i = 0; i < sizeof nc / sizeof nc[0]; i++)
        for (int affine = 0; affine < 3; affine++) {
            int64_t rows = nc[i][0], cols = nc[i][1], n = rows * cols;
            float *x = hrand(n, 2), *w = affine ? hrand16(cols, 1) : NULL, *b = affine == 2 ? hrand16(cols, 1) : NULL;
            for (int64_t k = 0; k < n; k++) x[k] += 0.5f;
            round_bf16_host(x, n);
            float *dout = hrand16(n, 1);
            uint16_t *gx = dup16(x, n), *gw = w ? dup16(w, cols) : NULL, *gb = b ? dup16(b, cols) : NULL;
            uint16_t *gd = dup16(dout, n);
            int want_w = affine >= 1, want_b = affine == 2;
            char name[160], tag[64];
            snprintf(tag, sizeof tag, "(%lld, %lld) %s", (long long)rows, (long long)cols,
                     affine == 0 ? "no affine" : affine == 1 ? "weight" : "weight+bias");
            float *y = hnan(n), *mean = hnan(rows), *rstd = hnan(rows);
            C->layernorm_forward_f32(y, mean, rstd, x, w, b, rows, cols, 1e-5f);
            uint16_t *gy = dnan16(n);
            float *gmean = dnan(rows), *grstd = dnan(rows);
            G->layernorm_forward_bf16(gy, gmean, grstd, gx, gw, gb, rows, cols, 1e-5f);
            snprintf(name, sizeof name, "layernorm_forward_bf16 out %s", tag);
            check_f(name, back_bf16(gy, n), y, n, ULP16, 1e-6, -1);
            snprintf(name, sizeof name, "layernorm_forward_bf16 mean %s", tag);
            check_f(name, back(gmean, rows), mean, rows, 1e-5, 1e-6, -1);
            snprintf(name, sizeof name, "layernorm_forward_bf16 rstd %s", tag);
            check_f(name, back(grstd, rows), rstd, rows, 1e-5, 1e-6, -1);
            float *wdx = hnan(n), *wdw = hnan(cols), *wdb = hnan(cols), *cmean = dupf(mean, rows), *crstd = dupf(rstd, rows);
            uint16_t *gdx = dnan16(n), *gdw = dnan16(cols), *gdb = dnan16(cols);
            C->layernorm_backward_f32(wdx, want_w ? wdw : NULL, want_b ? wdb : NULL, dout, x, w, mean, rstd, rows, cols);
            G->layernorm_backward_bf16(gdx, want_w ? gdw : NULL, want_b ? gdb : NULL, gd, gx, gw, cmean, crstd, rows,
                                       cols);
            double sc = dx_scale(dout, w, rstd, rows, cols);
            snprintf(name, sizeof name, "layernorm_backward_bf16 dx %s", tag);
            check_f(name, back_bf16(gdx, n), wdx, n, ULP16, 1e-5, sc);
            if (want_w) {
                snprintf(name, sizeof name, "layernorm_backward_bf16 dweight %s", tag);
                check_f(name, back_bf16(gdw, cols), wdw, cols, ULP16, 1e-5, -1);
            }
            if (want_b) {
                snprintf(name, sizeof name, "layernorm_backward_bf16 dbias %s", tag);
                check_f(name, back_bf16(gdb, cols), wdb, cols, ULP16, 1e-5, -1);
            }
            /* accumulating into gradients that hold bf16 values: old + the CPU's sums */
            if (G->layernorm_backward_acc_bf16 && (want_w || want_b)) {
                float *ow = hrand16(cols, 1), *ob = hrand16(cols, 1), *ww = hnan(cols), *wb = hnan(cols);
                for (int64_t k = 0; k < cols; k++) {
                    if (want_w) ww[k] = ow[k] + wdw[k];
                    if (want_b) wb[k] = ob[k] + wdb[k];
                }
                uint16_t *adw = dup16(ow, cols), *adb = dup16(ob, cols), *adx = dnan16(n);
                G->layernorm_backward_acc_bf16(adx, want_w ? adw : NULL, want_b ? adb : NULL, gd, gx, gw, cmean, crstd,
                                               rows, cols);
                snprintf(name, sizeof name, "layernorm_backward_acc_bf16 dx %s", tag);
                check_f(name, back_bf16(adx, n), wdx, n, ULP16, 1e-5, sc);
                if (want_w) {
                    snprintf(name, sizeof name, "layernorm_backward_acc_bf16 dweight %s", tag);
                    check_f(name, back_bf16(adw, cols), ww, cols, ULP16, 1e-5, -1);
                }
                if (want_b) {
                    snprintf(name, sizeof name, "layernorm_backward_acc_bf16 dbias %s", tag);
                    check_f(name, back_bf16(adb, cols), wb, cols, ULP16, 1e-5, -1);
                }
            }
            /* dx added into a gradient that holds bf16 values (a residual's): old + the CPU's dx, one
             * rounding; the parameter gradients written (acc 0) or added to (acc 1) */
            test_check(G->layernorm_backward_addx_bf16 != NULL, "CUDA has layernorm_backward_addx_bf16");
            for (int acc = 0; acc < 2 && G->layernorm_backward_addx_bf16; acc++) {
                float *odx = hrand16(n, 1), *ow = hrand16(cols, 1), *ob = hrand16(cols, 1);
                float *wx = hnan(n), *ww = hnan(cols), *wb = hnan(cols);
                for (int64_t k = 0; k < n; k++) wx[k] = odx[k] + wdx[k];
                for (int64_t k = 0; k < cols; k++) {
                    if (want_w) ww[k] = (acc ? ow[k] : 0.0f) + wdw[k];
                    if (want_b) wb[k] = (acc ? ob[k] : 0.0f) + wdb[k];
                }
                uint16_t *xdx = dup16(odx, n), *xdw = acc ? dup16(ow, cols) : dnan16(cols);
                uint16_t *xdb = acc ? dup16(ob, cols) : dnan16(cols);
                G->layernorm_backward_addx_bf16(xdx, want_w ? xdw : NULL, want_b ? xdb : NULL, gd, gx, gw, cmean,
                                                crstd, rows, cols, acc);
                snprintf(name, sizeof name, "layernorm_backward_addx_bf16 dx %s acc %d", tag, acc);
                check_f(name, back_bf16(xdx, n), wx, n, ULP16, 1e-5, sc);
                if (want_w) {
                    snprintf(name, sizeof name, "layernorm_backward_addx_bf16 dweight %s acc %d", tag, acc);
                    check_f(name, back_bf16(xdw, cols), ww, cols, ULP16, 1e-5, -1);
                }
                if (want_b) {
                    snprintf(name, sizeof name, "layernorm_backward_addx_bf16 dbias %s acc %d", tag, acc);
                    check_f(name, back_bf16(xdb, cols), wb, cols, ULP16, 1e-5, -1);
                }
            }
            if (affine < 2) {
                float *ry = hnan(n), *rr = hnan(rows);
                C->rmsnorm_forward_f32(ry, rr, x, w, rows, cols, 1e-6f);
                uint16_t *gry = dnan16(n);
                float *grr = dnan(rows);
                G->rmsnorm_forward_bf16(gry, grr, gx, gw, rows, cols, 1e-6f);
                snprintf(name, sizeof name, "rmsnorm_forward_bf16 out %s", tag);
                check_f(name, back_bf16(gry, n), ry, n, ULP16, 1e-6, -1);
                snprintf(name, sizeof name, "rmsnorm_forward_bf16 rstd %s", tag);
                check_f(name, back(grr, rows), rr, rows, 1e-5, 1e-6, -1);
                float *rdx = hnan(n), *rdw = hnan(cols), *crr = dupf(rr, rows);
                uint16_t *grdx = dnan16(n), *grdw = dnan16(cols);
                C->rmsnorm_backward_f32(rdx, want_w ? rdw : NULL, dout, x, w, rr, rows, cols);
                G->rmsnorm_backward_bf16(grdx, want_w ? grdw : NULL, gd, gx, gw, crr, rows, cols);
                snprintf(name, sizeof name, "rmsnorm_backward_bf16 dx %s", tag);
                check_f(name, back_bf16(grdx, n), rdx, n, ULP16, 1e-5, dx_scale(dout, w, rr, rows, cols));
                if (want_w) {
                    snprintf(name, sizeof name, "rmsnorm_backward_bf16 dweight %s", tag);
                    check_f(name, back_bf16(grdw, cols), rdw, cols, ULP16, 1e-5, -1);
                }
            }
            free_case();
        }
    int64_t ce[][3] = {{1, 1, 1}, {7, 13, 13}, {5, 1000, 997}, {40, 17, 16}};
    const int64_t ignore = -100;
    for (size_t i = 0; i < sizeof ce / sizeof ce[0]; i++) {
        int64_t N = ce[i][0], V = ce[i][1], valid = ce[i][2];
        int64_t *t = halloc((size_t)N * sizeof(int64_t));
        for (int64_t k = 0; k < N; k++)
            t[k] = k % 4 == 3 ? ignore : (int64_t)(test_rng_uniform(&rng) * (double)valid) % valid;
        float *x = hrand16(N * V, 8), *losses = hnan(N), *lse = hnan(N);
        int64_t count = C->cross_entropy_forward_f32(losses, lse, x, t, N, V, valid, ignore);
        int64_t *dt = dup_bytes(t, (size_t)N * sizeof(int64_t));
        uint16_t *gx = dup16(x, N * V);
        float *gl = dnan(N), *glse = dnan(N);
        int64_t gcount = G->cross_entropy_forward_bf16(gl, glse, gx, dt, N, V, valid, ignore);
        char name[96];
        snprintf(name, sizeof name, "cross_entropy_forward_bf16 (%lld, %lld) valid %lld", (long long)N, (long long)V,
                 (long long)valid);
        test_check(gcount == count, "%s: count %lld, want %lld", name, (long long)gcount, (long long)count);
        check_f(name, back(gl, N), losses, N, 1e-5, 1e-6, -1);
        check_f(name, back(glse, N), lse, N, 1e-5, 1e-6, -1);
        int64_t div = count ? count : 1;
        float dloss = 1.0f / (float)div, one = 1.0f, *gone = dupf(&one, 1);
        float *wdx = hnan(N * V), *clse = dupf(lse, N);
        uint16_t *gdx = dnan16(N * V);
        C->cross_entropy_backward_f32(wdx, x, lse, t, N, V, valid, ignore, &one, div);
        G->cross_entropy_backward_bf16(gdx, gx, clse, dt, N, V, valid, ignore, gone, div);
        snprintf(name, sizeof name, "cross_entropy_backward_bf16 (%lld, %lld) valid %lld", (long long)N, (long long)V,
                 (long long)valid);
        check_f(name, back_bf16(gdx, N * V), wdx, N * V, ULP16, 1e-6, dloss);
        free_case();
    }
}
