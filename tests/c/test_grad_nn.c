/* test_grad_nn.c: the NN ops (engine/ops: activation, softmax, norm,
 * embedding, loss, random, attention) through the public API only:
 * gradients from the tape against central differences of the op's own
 * forward, bf16 against f32, and the error paths.
 *
 * Gradient check: loss = sum(out * R) for a fixed random R, so the analytic
 * side is a backward seeded with R (fsdp_backward_begin(out, R)); the
 * numeric side perturbs each f32 input element by +-h (h = 1e-2, inputs of
 * magnitude 0.1..1) with gradients off and sums out * R in double.
 *   tolerance: |analytic - numeric| <= 1e-3 + 2e-2 * |numeric|
 *   (f32 rounding of the forward, divided by 2h, stays near 1e-5 at these
 *   sizes; the O(h^2) truncation near 1e-4).
 * bf16: the op on bf16 inputs against the f32 op on the same (rounded)
 * inputs: outputs within |b - f| <= 1e-2 |f| + 1e-6 (both run the same f32
 * kernel, so only the output rounding differs, 2^-9 relative); gradients
 * come back as bf16 and within 3e-2 * max|f32 gradient| (the backward also
 * sees the bf16-rounded output). */
#include "fsdp.h"
#include "testutil.h"
#include <math.h>
#include <stdlib.h>
#include <string.h>

static test_rng rng;

#define OK(call)                                                                                    \
    do {                                                                                            \
        fsdp_status s_ = (call);                                                                    \
        if (s_ != FSDP_OK) {                                                                        \
            test_check(0, "%s:%d: %s returned %d: %s", __FILE__, __LINE__, #call, (int)s_, fsdp_last_error()); \
            test_summary();                                                                         \
            exit(1);                                                                                \
        }                                                                                           \
    } while (0)

/* ---- tensors from and to float arrays ---- */

static uint16_t to_bf16(float f) {   /* round to nearest even, as the engine does */
    uint32_t u;
    memcpy(&u, &f, 4);
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}
static float from_bf16(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}
static float round_bf16(float f) { return from_bf16(to_bf16(f)); }

static int64_t numel_of(int ndim, const int64_t *shape) {
    int64_t n = 1;
    for (int d = 0; d < ndim; d++) n *= shape[d];
    return n;
}
static int64_t tnumel(fsdp_tensor *t) {
    int64_t n;
    OK(fsdp_tensor_numel(t, &n));
    return n;
}
static int tdtype(fsdp_tensor *t) {
    int d;
    OK(fsdp_tensor_dtype(t, &d));
    return d;
}

/* A float tensor (f32 or bf16) holding data. */
static fsdp_tensor *mk(int dtype, int ndim, const int64_t *shape, const float *data) {
    int64_t n = numel_of(ndim, shape);
    fsdp_tensor *t;
    if (dtype == FSDP_F32) {
        OK(fsdp_tensor_from_data(&t, FSDP_F32, ndim, shape, data, n * 4, FSDP_DEVICE_CPU, FSDP_TAG_OTHER));
    } else {
        uint16_t *h = malloc((size_t)(n ? n : 1) * 2);
        for (int64_t i = 0; i < n; i++) h[i] = to_bf16(data[i]);
        OK(fsdp_tensor_from_data(&t, FSDP_BF16, ndim, shape, h, n * 2, FSDP_DEVICE_CPU, FSDP_TAG_OTHER));
        free(h);
    }
    return t;
}

/* An index tensor of dtype (i32, i64, u16) holding ids. */
static fsdp_tensor *mk_ids(int dtype, int ndim, const int64_t *shape, const int64_t *ids) {
    int64_t n = numel_of(ndim, shape);
    size_t es = dtype == FSDP_I64 ? 8 : dtype == FSDP_I32 ? 4 : 2;
    char *buf = malloc((size_t)(n ? n : 1) * es);
    for (int64_t i = 0; i < n; i++) {
        if (dtype == FSDP_I64) ((int64_t *)buf)[i] = ids[i];
        else if (dtype == FSDP_I32) ((int32_t *)buf)[i] = (int32_t)ids[i];
        else ((uint16_t *)buf)[i] = (uint16_t)ids[i];
    }
    fsdp_tensor *t;
    OK(fsdp_tensor_from_data(&t, dtype, ndim, shape, buf, n * (int64_t)es, FSDP_DEVICE_CPU, FSDP_TAG_OTHER));
    free(buf);
    return t;
}

/* Reads a float tensor as f32 into a new array (freed by the caller). */
static float *readf(fsdp_tensor *t) {
    int64_t n = tnumel(t);
    float *x = malloc((size_t)(n ? n : 1) * 4);
    if (tdtype(t) == FSDP_F32) {
        OK(fsdp_tensor_to_data(t, x, n * 4));
    } else {
        uint16_t *h = malloc((size_t)(n ? n : 1) * 2);
        OK(fsdp_tensor_to_data(t, h, n * 2));
        for (int64_t i = 0; i < n; i++) x[i] = from_bf16(h[i]);
        free(h);
    }
    return x;
}

static float *rand_array(int64_t n, float scale) {
    float *x = malloc((size_t)(n ? n : 1) * 4);
    test_fill_nonzero(&rng, x, n, scale);
    return x;
}

/* Runs a backward from out seeded with grad, to the end. */
static void run_backward(fsdp_tensor *out, fsdp_tensor *grad) {
    int id = 0;
    OK(fsdp_backward_begin(out, grad));
    do OK(fsdp_backward_step(&id));
    while (id != -1);
}

static int set_grad(int on) {
    int prev;
    OK(fsdp_set_grad_enabled(on, &prev));
    return prev;
}

/* ---- the ops under test, behind one signature ---- */

typedef fsdp_status (*op_fn)(fsdp_tensor **out, fsdp_tensor *const *in, const void *ctx);

static fsdp_status op_gelu(fsdp_tensor **o, fsdp_tensor *const *in, const void *c) { (void)c; return fsdp_gelu(o, in[0]); }
static fsdp_status op_silu(fsdp_tensor **o, fsdp_tensor *const *in, const void *c) { (void)c; return fsdp_silu(o, in[0]); }
static fsdp_status op_softmax(fsdp_tensor **o, fsdp_tensor *const *in, const void *c) { (void)c; return fsdp_softmax(o, in[0]); }
static fsdp_status op_log_softmax(fsdp_tensor **o, fsdp_tensor *const *in, const void *c) {
    (void)c;
    return fsdp_log_softmax(o, in[0]);
}

typedef struct { int has_w, has_b; double eps; } norm_ctx;
static fsdp_status op_layernorm(fsdp_tensor **o, fsdp_tensor *const *in, const void *c) {
    const norm_ctx *n = c;
    fsdp_tensor *w = n->has_w ? in[1] : NULL, *b = n->has_b ? in[1 + n->has_w] : NULL;
    return fsdp_layernorm(o, in[0], w, b, n->eps);
}
static fsdp_status op_rmsnorm(fsdp_tensor **o, fsdp_tensor *const *in, const void *c) {
    const norm_ctx *n = c;
    return fsdp_rmsnorm(o, in[0], n->has_w ? in[1] : NULL, n->eps);
}

typedef struct { fsdp_tensor *ids; } emb_ctx;
static fsdp_status op_embedding(fsdp_tensor **o, fsdp_tensor *const *in, const void *c) {
    return fsdp_embedding(o, in[0], ((const emb_ctx *)c)->ids);
}

typedef struct { fsdp_tensor *targets; int64_t ignore, valid; } ce_ctx;
static fsdp_status op_ce(fsdp_tensor **o, fsdp_tensor *const *in, const void *c) {
    const ce_ctx *x = c;
    return fsdp_cross_entropy(o, in[0], x->targets, x->ignore, x->valid);
}

typedef struct { int causal; double scale; } attn_ctx;
static fsdp_status op_attention(fsdp_tensor **o, fsdp_tensor *const *in, const void *c) {
    const attn_ctx *a = c;
    return fsdp_attention(o, in[0], in[1], in[2], a->causal, a->scale);
}

typedef struct { double p; uint64_t seed; int64_t offset; } drop_ctx;
static fsdp_status op_dropout(fsdp_tensor **o, fsdp_tensor *const *in, const void *c) {
    const drop_ctx *d = c;
    return fsdp_dropout(o, in[0], d->p, d->seed, d->offset);
}

/* An input of a case: its shape and values (f32, owned by the case). */
typedef struct {
    int ndim;
    int64_t shape[4];
    float *data;
} input;

static input in_rand(int ndim, int64_t d0, int64_t d1, int64_t d2, int64_t d3, float scale) {
    input x = {ndim, {d0, d1, d2, d3}, NULL};
    x.data = rand_array(numel_of(ndim, x.shape), scale);
    return x;
}

/* sum(out * R) in double */
static double loss_of(fsdp_tensor *out, const float *R) {
    float *y = readf(out);
    double s = 0;
    for (int64_t i = 0; i < tnumel(out); i++) s += (double)y[i] * R[i];
    free(y);
    return s;
}

/* The analytic gradients of sum(out * R) for inputs ts (which get
 * requires_grad), as new arrays in grads[]; returns out's numel. R is made
 * here (when *R is NULL) and handed back. */
static void analytic(const char *name, op_fn fn, const void *ctx, int n, fsdp_tensor **ts, float **R, int64_t *rn,
                     float **grads) {
    for (int i = 0; i < n; i++) {
        OK(fsdp_tensor_set_requires_grad(ts[i], 1));
        OK(fsdp_tensor_set_grad(ts[i], NULL));
    }
    fsdp_tensor *out, *Rt;
    OK(fn(&out, ts, ctx));
    int ndim;
    int64_t shape[8];
    OK(fsdp_tensor_ndim(out, &ndim));
    OK(fsdp_tensor_shape(out, shape));
    *rn = tnumel(out);
    if (!*R) {
        *R = rand_array(*rn, 1.0f);
        /* bf16-exact, so an f32 and a bf16 root are seeded alike */
        for (int64_t i = 0; i < *rn; i++) (*R)[i] = round_bf16((*R)[i]);
    }
    Rt = mk(FSDP_F32, ndim, shape, *R);
    run_backward(out, Rt);
    OK(fsdp_tensor_release(Rt));
    OK(fsdp_tensor_release(out));
    for (int i = 0; i < n; i++) {
        fsdp_tensor *g;
        OK(fsdp_tensor_grad(ts[i], &g));
        int64_t m = tnumel(ts[i]);
        if (!g) {
            grads[i] = calloc((size_t)(m ? m : 1), 4);   /* nothing flowed: zero */
            continue;
        }
        test_check(tdtype(g) == tdtype(ts[i]), "%s: gradient of input %d has dtype %d, expected %d", name, i,
                   tdtype(g), tdtype(ts[i]));
        grads[i] = readf(g);
        OK(fsdp_tensor_release(g));
    }
}

/* Gradient check of fn over f32 inputs (see the header for the tolerance). */
static void gradcheck(const char *name, op_fn fn, const void *ctx, int n, const input *ins) {
    fsdp_tensor *ts[4];
    float *grads[4], *R = NULL;
    int64_t rn;
    const float h = 1e-2f;
    for (int i = 0; i < n; i++) ts[i] = mk(FSDP_F32, ins[i].ndim, ins[i].shape, ins[i].data);
    analytic(name, fn, ctx, n, ts, &R, &rn, grads);
    int prev = set_grad(0);
    for (int i = 0; i < n; i++) {
        float *p;
        OK(fsdp_tensor_data_ptr(ts[i], (void **)&p));
        int64_t m = tnumel(ts[i]), bad = 0;
        double worst = 0;
        for (int64_t j = 0; j < m; j++) {
            float x0 = p[j];
            double f[2];
            for (int s = 0; s < 2; s++) {
                fsdp_tensor *out;
                p[j] = x0 + (s ? -h : h);
                OK(fn(&out, ts, ctx));
                f[s] = loss_of(out, R);
                OK(fsdp_tensor_release(out));
            }
            p[j] = x0;
            /* the perturbation actually applied, in f32 */
            double num = (f[0] - f[1]) / ((double)(x0 + h) - (double)(x0 - h));
            double err = fabs(grads[i][j] - num);
            if (err > worst) worst = err;
            if (!(err <= 1e-3 + 2e-2 * fabs(num))) {
                if (bad < 4)
                    fprintf(stderr, "  %s: input %d [%lld]: analytic %.6g numeric %.6g\n", name, i, (long long)j,
                            (double)grads[i][j], num);
                bad++;
            }
        }
        test_check(bad == 0, "%s: input %d: %lld of %lld gradient values off (worst error %.3g)", name, i,
                   (long long)bad, (long long)m, worst);
        free(grads[i]);
    }
    for (int i = 0; i < n; i++) OK(fsdp_tensor_release(ts[i]));
    set_grad(prev);
    free(R);
}

/* bf16 against f32 on the same rounded inputs, forward and backward. */
static void bf16check(const char *name, op_fn fn, const void *ctx, int n, const input *ins) {
    fsdp_tensor *tb[4], *tf[4];
    float *gb[4], *gf[4], *R = NULL;
    int64_t rn;
    for (int i = 0; i < n; i++) {
        int64_t m = numel_of(ins[i].ndim, ins[i].shape);
        float *r = malloc((size_t)m * 4);
        for (int64_t j = 0; j < m; j++) r[j] = round_bf16(ins[i].data[j]);
        tb[i] = mk(FSDP_BF16, ins[i].ndim, ins[i].shape, r);
        tf[i] = mk(FSDP_F32, ins[i].ndim, ins[i].shape, r);
        free(r);
    }
    /* forward, gradients off */
    int prev = set_grad(0);
    fsdp_tensor *ob, *of;
    OK(fn(&ob, tb, ctx));
    OK(fn(&of, tf, ctx));
    test_check(tdtype(ob) == FSDP_BF16, "%s bf16: output dtype %d, expected bf16", name, tdtype(ob));
    float *yb = readf(ob), *yf = readf(of);
    int64_t m = tnumel(of), bad = 0;
    for (int64_t j = 0; j < m; j++)
        if (!(fabsf(yb[j] - yf[j]) <= 1e-2f * fabsf(yf[j]) + 1e-6f)) {
            if (bad < 4) fprintf(stderr, "  %s bf16 [%lld]: %.6g vs f32 %.6g\n", name, (long long)j, yb[j], yf[j]);
            bad++;
        }
    test_check(bad == 0, "%s bf16: %lld of %lld outputs differ from f32 by more than 1e-2 relative", name,
               (long long)bad, (long long)m);
    free(yb);
    free(yf);
    OK(fsdp_tensor_release(ob));
    OK(fsdp_tensor_release(of));
    set_grad(prev);
    /* backward with one R */
    analytic(name, fn, ctx, n, tf, &R, &rn, gf);
    analytic(name, fn, ctx, n, tb, &R, &rn, gb);   /* also checks the gradients' dtype is bf16 */
    for (int i = 0; i < n; i++) {
        int64_t k = tnumel(tf[i]);
        double mx = 0, err = 0;
        for (int64_t j = 0; j < k; j++) {
            mx = fmax(mx, fabs(gf[i][j]));
            err = fmax(err, fabs((double)gb[i][j] - gf[i][j]));
        }
        test_check(err <= 3e-2 * mx + 1e-6, "%s bf16: gradient of input %d off by %.3g (max |f32 grad| %.3g)", name,
                   i, err, mx);
        free(gb[i]);
        free(gf[i]);
        OK(fsdp_tensor_release(tb[i]));
        OK(fsdp_tensor_release(tf[i]));
    }
    free(R);
}

static void check_both(const char *name, op_fn fn, const void *ctx, int n, input *ins) {
    gradcheck(name, fn, ctx, n, ins);
    bf16check(name, fn, ctx, n, ins);
    for (int i = 0; i < n; i++) free(ins[i].data);
}

/* ---- cases ---- */

static void test_activations(void) {
    const int64_t sizes[][2] = {{1, 1}, {1, 13}, {7, 3}};
    for (int s = 0; s < 3; s++) {
        input x[] = {in_rand(2, sizes[s][0], sizes[s][1], 0, 0, 2.0f)};
        check_both("gelu", op_gelu, NULL, 1, x);
        input y[] = {in_rand(2, sizes[s][0], sizes[s][1], 0, 0, 2.0f)};
        check_both("silu", op_silu, NULL, 1, y);
        input z[] = {in_rand(2, sizes[s][0], sizes[s][1], 0, 0, 2.0f)};
        check_both("softmax", op_softmax, NULL, 1, z);
        input u[] = {in_rand(2, sizes[s][0], sizes[s][1], 0, 0, 2.0f)};
        check_both("log_softmax", op_log_softmax, NULL, 1, u);
    }
    /* 3-D: rows over the leading dims */
    input z[] = {in_rand(3, 2, 3, 5, 0, 2.0f)};
    check_both("softmax 3-D", op_softmax, NULL, 1, z);
    /* softmax rows sum to 1 */
    float *d = rand_array(3 * 11, 3.0f);
    int64_t sh[2] = {3, 11};
    fsdp_tensor *x = mk(FSDP_F32, 2, sh, d), *y;
    OK(fsdp_softmax(&y, x));
    float *p = readf(y);
    double worst = 0;
    for (int r = 0; r < 3; r++) {
        double s = 0;
        for (int j = 0; j < 11; j++) s += p[r * 11 + j];
        worst = fmax(worst, fabs(s - 1));
    }
    test_check(worst < 1e-5, "softmax: a row sums to 1 +- %.3g", worst);
    free(p);
    free(d);
    OK(fsdp_tensor_release(x));
    OK(fsdp_tensor_release(y));
}

/* Rows of x (R, C) whose values lie at least 0.2 apart, in random order
 * and place: a row of nearly equal values has a tiny variance, where the
 * layernorm's curvature is too large for a finite difference step of 1e-2. */
static input norm_x(int ndim, int64_t d0, int64_t d1, int64_t d2) {
    input x = in_rand(ndim, d0, d1, d2, 0, 1.0f);
    int64_t C = x.shape[ndim - 1], rows = numel_of(ndim, x.shape) / C;
    for (int64_t r = 0; r < rows; r++) {
        float *row = x.data + r * C, shift = (float)(2 * test_rng_uniform(&rng) - 1);
        for (int64_t j = 0; j < C; j++) row[j] = 0.4f * ((float)j - 0.5f * (float)(C - 1)) + shift + 0.1f * row[j];
        for (int64_t j = C - 1; j > 0; j--) {   /* Fisher-Yates */
            int64_t k = (int64_t)(test_rng_uniform(&rng) * (double)(j + 1));
            float t = row[j];
            row[j] = row[k];
            row[k] = t;
        }
    }
    return x;
}

static void test_norms(void) {
    const int64_t shapes[][2] = {{3, 7}, {1, 13}, {5, 2}};
    for (int s = 0; s < 3; s++) {
        int64_t R = shapes[s][0], C = shapes[s][1];
        for (int mode = 0; mode < 4; mode++) {   /* weight and bias each present or not */
            norm_ctx c = {mode & 1, (mode >> 1) & 1, 1e-5};
            input ins[3];
            int n = 0;
            ins[n++] = norm_x(2, R, C, 0);
            if (c.has_w) ins[n++] = in_rand(1, C, 0, 0, 0, 1.5f);
            if (c.has_b) ins[n++] = in_rand(1, C, 0, 0, 0, 1.0f);
            char name[64];
            snprintf(name, sizeof name, "layernorm [%lld,%lld] w%d b%d", (long long)R, (long long)C, c.has_w,
                     c.has_b);
            check_both(name, op_layernorm, &c, n, ins);
        }
        for (int w = 0; w < 2; w++) {
            norm_ctx c = {w, 0, 1e-5};
            input ins[2] = {in_rand(2, R, C, 0, 0, 2.0f), in_rand(1, C, 0, 0, 0, 1.5f)};
            char name[64];
            snprintf(name, sizeof name, "rmsnorm [%lld,%lld] w%d", (long long)R, (long long)C, w);
            if (!w) free(ins[1].data);
            check_both(name, op_rmsnorm, &c, 1 + w, ins);
        }
    }
    /* 3-D x, and the forward against a double reference */
    {
        norm_ctx c = {1, 1, 1e-5};
        input ins[3] = {norm_x(3, 2, 3, 5), in_rand(1, 5, 0, 0, 0, 1.0f), in_rand(1, 5, 0, 0, 0, 1.0f)};
        fsdp_tensor *x = mk(FSDP_F32, 3, ins[0].shape, ins[0].data), *w = mk(FSDP_F32, 1, ins[1].shape, ins[1].data),
                    *b = mk(FSDP_F32, 1, ins[2].shape, ins[2].data), *y;
        OK(fsdp_layernorm(&y, x, w, b, 1e-5));
        float *got = readf(y);
        double worst = 0;
        for (int r = 0; r < 6; r++) {
            const float *xr = ins[0].data + r * 5;
            double m = 0, v = 0;
            for (int j = 0; j < 5; j++) m += xr[j] / 5.0;
            for (int j = 0; j < 5; j++) v += (xr[j] - m) * (xr[j] - m) / 5.0;
            for (int j = 0; j < 5; j++) {
                double want = (xr[j] - m) / sqrt(v + 1e-5) * ins[1].data[j] + ins[2].data[j];
                worst = fmax(worst, fabs(got[r * 5 + j] - want));
            }
        }
        test_check(worst < 1e-5, "layernorm forward: off the double reference by %.3g", worst);
        free(got);
        OK(fsdp_tensor_release(x));
        OK(fsdp_tensor_release(w));
        OK(fsdp_tensor_release(b));
        OK(fsdp_tensor_release(y));
        check_both("layernorm 3-D", op_layernorm, &c, 3, ins);
    }
}

static void test_embedding(void) {
    const int64_t V = 7, C = 5;
    /* ids (2, 3) with repeats: 3 three times, 0 twice; 6 is the last row */
    static const int64_t ids[6] = {3, 0, 3, 6, 3, 0}, ish[2] = {2, 3};
    const int dts[3] = {FSDP_I32, FSDP_I64, FSDP_U16};
    float *table = rand_array(V * C, 1.0f);
    for (int d = 0; d < 3; d++) {
        emb_ctx c = {mk_ids(dts[d], 2, ish, ids)};
        /* forward picks the rows, output (2, 3, C) */
        int64_t tsh[2] = {V, C};
        fsdp_tensor *t = mk(FSDP_F32, 2, tsh, table), *y;
        OK(fsdp_embedding(&y, t, c.ids));
        int ndim;
        int64_t ysh[8];
        OK(fsdp_tensor_ndim(y, &ndim));
        OK(fsdp_tensor_shape(y, ysh));
        test_check(ndim == 3 && ysh[0] == 2 && ysh[1] == 3 && ysh[2] == C, "embedding: output shape (dtype %d)",
                   dts[d]);
        float *got = readf(y);
        int same = 1;
        for (int i = 0; i < 6; i++)
            for (int j = 0; j < C; j++) same &= got[i * C + j] == table[ids[i] * C + j];
        test_check(same, "embedding forward: rows not gathered (ids dtype %d)", dts[d]);
        free(got);
        OK(fsdp_tensor_release(y));
        /* the gradient of a repeated row is the sum of its output rows' gradients */
        float *R = NULL, *g[1];
        int64_t rn;
        analytic("embedding", op_embedding, &c, 1, &t, &R, &rn, g);
        double worst = 0;
        for (int v = 0; v < V; v++)
            for (int j = 0; j < C; j++) {
                double want = 0;
                for (int i = 0; i < 6; i++)
                    if (ids[i] == v) want += R[i * C + j];
                worst = fmax(worst, fabs(g[0][v * C + j] - want));
            }
        test_check(worst < 1e-6, "embedding backward: scatter-add off by %.3g (ids dtype %d)", worst, dts[d]);
        free(g[0]);
        free(R);
        OK(fsdp_tensor_release(t));
        input ins[1] = {{2, {V, C}, malloc(V * C * 4)}};
        memcpy(ins[0].data, table, V * C * 4);
        check_both("embedding", op_embedding, &c, 1, ins);
        OK(fsdp_tensor_release(c.ids));
    }
    /* 1-D and 0-D ids */
    {
        const int64_t one[1] = {4};
        emb_ctx c = {mk_ids(FSDP_I64, 1, one, ids)};
        input ins[1] = {{2, {V, C}, malloc(V * C * 4)}};
        memcpy(ins[0].data, table, V * C * 4);
        check_both("embedding 1-D ids", op_embedding, &c, 1, ins);
        OK(fsdp_tensor_release(c.ids));
        c.ids = mk_ids(FSDP_I64, 0, NULL, ids + 3);
        input ins0[1] = {{2, {V, C}, malloc(V * C * 4)}};
        memcpy(ins0[0].data, table, V * C * 4);
        check_both("embedding 0-D ids", op_embedding, &c, 1, ins0);
        OK(fsdp_tensor_release(c.ids));
    }
    free(table);
}

static void test_cross_entropy(void) {
    const int64_t N = 6, V = 9;
    const int64_t tg[6] = {2, -100, 0, 6, -100, 4}, tsh[1] = {N};
    /* valid_vocab 7 < V: the padded columns 7, 8 get no gradient; then all of V */
    const int64_t valids[2] = {7, 0};
    for (int k = 0; k < 2; k++) {
        ce_ctx c = {mk_ids(k ? FSDP_I32 : FSDP_I64, 1, tsh, tg), -100, valids[k]};
        input ins[1] = {in_rand(2, N, V, 0, 0, 3.0f)};
        /* forward against a double reference */
        fsdp_tensor *x = mk(FSDP_F32, 2, ins[0].shape, ins[0].data), *loss;
        OK(fsdp_cross_entropy(&loss, x, c.targets, -100, valids[k]));
        int ndim;
        OK(fsdp_tensor_ndim(loss, &ndim));
        test_check(ndim == 0, "cross_entropy: loss has %d dims, expected 0", ndim);
        double got, want = 0;
        int count = 0;
        int64_t vv = valids[k] ? valids[k] : V;
        OK(fsdp_tensor_item(loss, &got));
        for (int n = 0; n < N; n++) {
            if (tg[n] == -100) continue;
            double m = -INFINITY, s = 0;
            for (int j = 0; j < vv; j++) m = fmax(m, ins[0].data[n * V + j]);
            for (int j = 0; j < vv; j++) s += exp(ins[0].data[n * V + j] - m);
            want += m + log(s) - ins[0].data[n * V + tg[n]];
            count++;
        }
        want /= count;
        test_check(fabs(got - want) <= 1e-5 * fmax(1, fabs(want)), "cross_entropy: loss %.9g, expected %.9g", got,
                   want);
        OK(fsdp_tensor_release(x));
        OK(fsdp_tensor_release(loss));
        check_both(k ? "cross_entropy all columns" : "cross_entropy valid_vocab 7 of 9", op_ce, &c, 1, ins);
        OK(fsdp_tensor_release(c.targets));
    }
    /* every row ignored: loss 0, zero gradient */
    {
        const int64_t all[3] = {5, 5, 5}, sh[2] = {3, 4}, s1[1] = {3};
        float *d = rand_array(12, 1.0f);
        fsdp_tensor *x = mk(FSDP_F32, 2, sh, d), *t = mk_ids(FSDP_U16, 1, s1, all), *loss, *g;
        OK(fsdp_tensor_set_requires_grad(x, 1));
        OK(fsdp_cross_entropy(&loss, x, t, 5, 0));
        double v;
        OK(fsdp_tensor_item(loss, &v));
        test_check(v == 0, "cross_entropy all ignored: loss %g, expected 0", v);
        run_backward(loss, NULL);
        OK(fsdp_tensor_grad(x, &g));
        int zero = 1;
        if (g) {
            float *gv = readf(g);
            for (int i = 0; i < 12; i++) zero &= gv[i] == 0.0f;
            free(gv);
            OK(fsdp_tensor_release(g));
        }
        test_check(zero, "cross_entropy all ignored: gradient not zero");
        free(d);
        OK(fsdp_tensor_release(x));
        OK(fsdp_tensor_release(t));
        OK(fsdp_tensor_release(loss));
    }
}

static void test_attention(void) {
    const struct { int64_t B, H, T, D; int causal; double scale; } cases[] = {
        {2, 3, 5, 3, 1, 0.0},     /* default scale 1/sqrt(D) */
        {2, 3, 5, 3, 0, 0.7},
        {1, 2, 1, 1, 1, -1.0},    /* T = 1 */
        {1, 1, 67, 2, 1, 0.0},    /* crosses a 64-query block */
        {1, 1, 131, 2, 0, 0.0},   /* crosses a 128-key tile */
    };
    for (size_t k = 0; k < sizeof cases / sizeof cases[0]; k++) {
        attn_ctx c = {cases[k].causal, cases[k].scale};
        input ins[3];
        for (int i = 0; i < 3; i++) ins[i] = in_rand(4, cases[k].B, cases[k].H, cases[k].T, cases[k].D, 1.5f);
        char name[80];
        snprintf(name, sizeof name, "attention (%lld,%lld,%lld,%lld) %s", (long long)cases[k].B,
                 (long long)cases[k].H, (long long)cases[k].T, (long long)cases[k].D,
                 c.causal ? "causal" : "non-causal");
        check_both(name, op_attention, &c, 3, ins);
    }
    /* T = 1 causal: each query sees only its own key, so out = v */
    {
        const int64_t sh[4] = {2, 1, 1, 3};
        float *q = rand_array(6, 1), *kk = rand_array(6, 1), *v = rand_array(6, 1);
        fsdp_tensor *tq = mk(FSDP_F32, 4, sh, q), *tk = mk(FSDP_F32, 4, sh, kk), *tv = mk(FSDP_F32, 4, sh, v), *o;
        OK(fsdp_attention(&o, tq, tk, tv, 1, 0));
        float *got = readf(o);
        double worst = 0;
        for (int i = 0; i < 6; i++) worst = fmax(worst, fabs(got[i] - v[i]));
        test_check(worst < 1e-6, "attention T=1: out differs from v by %.3g", worst);
        free(got);
        free(q);
        free(kk);
        free(v);
        OK(fsdp_tensor_release(tq));
        OK(fsdp_tensor_release(tk));
        OK(fsdp_tensor_release(tv));
        OK(fsdp_tensor_release(o));
    }
}

static void test_dropout(void) {
    const int64_t n = 4001, sh[1] = {n};
    const double p = 0.3;
    float *x = rand_array(n, 1.0f);
    fsdp_tensor *t = mk(FSDP_F32, 1, sh, x), *y;
    float *R = NULL, *g[1];
    int64_t rn;
    drop_ctx c = {p, 1234, 17};
    /* gradient = R * mask / (1 - p), with the mask read off the forward */
    OK(fsdp_dropout(&y, t, p, 1234, 17));
    float *out = readf(y);
    analytic("dropout", op_dropout, &c, 1, &t, &R, &rn, g);
    int64_t dropped = 0, bad = 0;
    float sc = (float)(1.0 / (1.0 - p));
    for (int64_t i = 0; i < n; i++) {
        int kept = out[i] != 0.0f;   /* x is never 0 */
        dropped += !kept;
        float want_out = kept ? x[i] * (1.0f / (1.0f - (float)p)) : 0.0f;
        double want_g = kept ? (double)R[i] * sc : 0.0;
        if (fabsf(out[i] - want_out) > 1e-6f * fabsf(want_out) || fabs(g[0][i] - want_g) > 1e-6 * fabs(want_g))
            bad++;
    }
    test_check(bad == 0, "dropout: %lld values where out != x*mask/(1-p) or grad != R*mask/(1-p)", (long long)bad);
    /* 3 sigma of a binomial(4001, 0.3) is about 87 */
    test_check(llabs(dropped - (int64_t)(p * n)) < 100, "dropout: %lld of %lld dropped at p = %g", (long long)dropped,
               (long long)n, p);
    /* the mask depends on offset + i only: a shifted window matches */
    {
        fsdp_tensor *y2;
        OK(fsdp_dropout(&y2, t, p, 1234, 18));
        float *o2 = readf(y2);
        int64_t mism = 0;
        for (int64_t i = 0; i + 1 < n; i++) mism += (o2[i] != 0.0f) != (out[i + 1] != 0.0f);
        test_check(mism == 0, "dropout: mask at offset 18 is not the mask at offset 17 shifted (%lld differ)",
                   (long long)mism);
        free(o2);
        OK(fsdp_tensor_release(y2));
    }
    free(out);
    free(g[0]);
    free(R);
    R = NULL;
    OK(fsdp_tensor_release(y));
    /* p = 0: identity, gradient R */
    drop_ctx c0 = {0.0, 99, 0};
    OK(fsdp_dropout(&y, t, 0.0, 99, 0));
    out = readf(y);
    analytic("dropout p=0", op_dropout, &c0, 1, &t, &R, &rn, g);
    bad = 0;
    for (int64_t i = 0; i < n; i++) bad += out[i] != x[i] || g[0][i] != R[i];
    test_check(bad == 0, "dropout p=0: %lld values not the identity", (long long)bad);
    free(out);
    free(g[0]);
    free(R);
    OK(fsdp_tensor_release(y));
    OK(fsdp_tensor_release(t));
    free(x);
    /* finite differences and bf16 at an odd size */
    input ins[1] = {in_rand(2, 3, 7, 0, 0, 1.0f)};
    drop_ctx c2 = {0.5, 7, 3};
    check_both("dropout", op_dropout, &c2, 1, ins);
}

/* Non-contiguous inputs (a transposed view) give what the contiguous copy
 * gives, and gradients reach the base tensor through the view. */
static void test_strided(void) {
    const int64_t R = 4, C = 6, sb[2] = {C, R}, sc[2] = {R, C};
    float *base = rand_array(R * C, 1.5f), *tr = malloc(R * C * 4), *Rg = rand_array(R * C, 1.0f);
    for (int i = 0; i < R; i++)
        for (int j = 0; j < C; j++) tr[i * C + j] = base[j * R + i];   /* tr = base^T, (R, C) */
    const char *names[3] = {"gelu", "softmax", "layernorm"};
    for (int k = 0; k < 3; k++) {
        for (int dt = 0; dt < 2; dt++) {
            int dtype = dt ? FSDP_BF16 : FSDP_F32;
            fsdp_tensor *b = mk(dtype, 2, sb, base), *c = mk(dtype, 2, sc, tr), *v, *Rt = mk(FSDP_F32, 2, sc, Rg), *gb, *gc;
            OK(fsdp_tensor_set_requires_grad(b, 1));
            OK(fsdp_tensor_set_requires_grad(c, 1));
            OK(fsdp_transpose(&v, b, 0, 1));   /* (R, C) view of b's storage */
            fsdp_tensor *ins[2] = {v, c};
            float *y[2];
            /* one forward and backward each: a backward consumes the whole tape */
            for (int i = 0; i < 2; i++) {
                fsdp_tensor *out;
                if (k == 0) OK(fsdp_gelu(&out, ins[i]));
                else if (k == 1) OK(fsdp_softmax(&out, ins[i]));
                else OK(fsdp_layernorm(&out, ins[i], NULL, NULL, 1e-5));
                y[i] = readf(out);
                run_backward(out, Rt);
                OK(fsdp_tensor_release(out));
            }
            test_check(!memcmp(y[0], y[1], R * C * 4), "%s on a transposed %s view differs from the contiguous input",
                       names[k], dt ? "bf16" : "f32");
            free(y[0]);
            free(y[1]);
            OK(fsdp_tensor_grad(b, &gb));
            OK(fsdp_tensor_grad(c, &gc));
            if (gb && gc) {
                float *x = readf(gb), *z = readf(gc);
                int same = 1;
                for (int i = 0; i < R; i++)
                    for (int j = 0; j < C; j++) same &= x[j * R + i] == z[i * C + j];
                test_check(same, "%s %s: gradient through the transposed view differs", names[k],
                           dt ? "bf16" : "f32");
                free(x);
                free(z);
            } else {
                test_check(0, "%s %s: no gradient reached the inputs", names[k], dt ? "bf16" : "f32");
            }
            fsdp_tensor *all[] = {b, c, v, Rt, gb, gc};
            for (int i = 0; i < 6; i++) OK(fsdp_tensor_release(all[i]));
        }
    }
    free(base);
    free(tr);
    free(Rg);
}

/* Empty tensors go through every op and its backward. A zero size after
 * dim 0 gives a stride of 0 over a longer dim, which fsdp_copy (tensor.c)
 * refuses as a broadcast view, so a gradient seed of such a shape cannot be
 * made: those shapes run forward only. */
static void test_empty(void) {
    const int64_t s03[2] = {0, 3}, s30[2] = {3, 0}, s3[1] = {3}, s0[1] = {0}, sq[4] = {0, 2, 3, 4}, s07[2] = {0, 7},
                  st0[4] = {1, 2, 0, 4};
    float one[3] = {1, 1, 1};
    fsdp_tensor *a = mk(FSDP_F32, 2, s03, NULL), *w = mk(FSDP_F32, 1, s3, one), *q = mk(FSDP_F32, 4, sq, NULL);
    fsdp_tensor *lg = mk(FSDP_F32, 2, s07, NULL), *t = mk_ids(FSDP_I64, 1, s0, NULL);
    fsdp_tensor *b = mk(FSDP_F32, 2, s30, NULL), *q0 = mk(FSDP_F32, 4, st0, NULL);
    fsdp_tensor *in[] = {a, w, q, lg, b, q0};
    for (int i = 0; i < 4; i++) OK(fsdp_tensor_set_requires_grad(in[i], 1));
    fsdp_tensor *o[11];
    /* One op per graph: a backward consumes the whole tape, so each op's
     * backward runs from a forward of its own. */
    for (int i = 0; i < 8; i++) {
        switch (i) {
        case 0: OK(fsdp_gelu(&o[0], a)); break;
        case 1: OK(fsdp_silu(&o[1], a)); break;
        case 2: OK(fsdp_log_softmax(&o[2], a)); break;
        case 3: OK(fsdp_layernorm(&o[3], a, w, w, 1e-5)); break;
        case 4: OK(fsdp_rmsnorm(&o[4], a, w, 1e-5)); break;
        case 5: OK(fsdp_embedding(&o[5], a, t)); break;
        case 6: OK(fsdp_attention(&o[6], q, q, q, 1, 0)); break;
        case 7: OK(fsdp_dropout(&o[7], a, 0.5, 1, 0)); break;
        }
        int ndim;
        int64_t sh[8];
        OK(fsdp_tensor_ndim(o[i], &ndim));
        OK(fsdp_tensor_shape(o[i], sh));
        fsdp_tensor *z;
        OK(fsdp_tensor_zeros(&z, FSDP_F32, ndim, sh, FSDP_DEVICE_CPU, FSDP_TAG_OTHER));
        run_backward(o[i], z);
        OK(fsdp_tensor_release(z));
    }
    OK(fsdp_cross_entropy(&o[8], lg, t, -100, 0));
    OK(fsdp_softmax(&o[9], b));
    OK(fsdp_attention(&o[10], q0, q0, q0, 1, 0));
    double v = 1;
    OK(fsdp_tensor_item(o[8], &v));
    test_check(v == 0, "cross_entropy of no rows: loss %g, expected 0", v);
    run_backward(o[8], NULL);
    /* each output keeps its input's (empty) shape */
    const int64_t *want[11] = {s03, s03, s03, s03, s03, s03, sq, s03, NULL, s30, st0};
    const int want_nd[11] = {2, 2, 2, 2, 2, 2, 4, 2, 0, 2, 4};
    for (int i = 0; i < 11; i++) {
        int ndim;
        int64_t sh[8];
        OK(fsdp_tensor_ndim(o[i], &ndim));
        OK(fsdp_tensor_shape(o[i], sh));
        int same = ndim == want_nd[i];
        for (int d = 0; same && d < ndim; d++) same = sh[d] == want[i][d];
        test_check(same, "empty op %d: output of %d dims (first %lld), expected %d dims", i, ndim,
                   ndim ? (long long)sh[0] : -1LL, want_nd[i]);
    }
    /* the norms' weight gradient sums over no rows: present, and exactly 0 */
    fsdp_tensor *dw;
    OK(fsdp_tensor_grad(w, &dw));
    test_check(dw != NULL && tnumel(dw) == 3, "empty rows: the norm weight has a gradient of 3 elements");
    if (dw) {
        float *g = readf(dw);
        test_check(g[0] == 0 && g[1] == 0 && g[2] == 0, "empty rows: norm weight gradient %g %g %g, expected 0", g[0],
                   g[1], g[2]);
        free(g);
        OK(fsdp_tensor_release(dw));
    }
    for (int i = 0; i < 11; i++) OK(fsdp_tensor_release(o[i]));
    for (int i = 0; i < 6; i++) OK(fsdp_tensor_release(in[i]));
    OK(fsdp_tensor_release(t));
}

/* ---- error paths ---- */

static void expect_error(const char *what, fsdp_status got, fsdp_status want, const char *const *needles) {
    const char *msg = fsdp_last_error();
    test_check(got == want, "%s: status %d, expected %d (%s)", what, (int)got, (int)want, msg);
    for (int i = 0; needles[i]; i++)
        test_check(strstr(msg, needles[i]) != NULL, "%s: message lacks \"%s\": %s", what, needles[i], msg);
}

static void test_errors(void) {
    fsdp_tensor *out = NULL;
    float d[64];
    for (int i = 0; i < 64; i++) d[i] = 0.5f + 0.01f * i;
    const int64_t s25[2] = {2, 5}, s4[1] = {4}, s5[1] = {5}, s74[2] = {7, 4}, s3[1] = {3};
    fsdp_tensor *x = mk(FSDP_F32, 2, s25, d), *w4 = mk(FSDP_F32, 1, s4, d), *w5 = mk(FSDP_F32, 1, s5, d);
    fsdp_tensor *xb = mk(FSDP_BF16, 2, s25, d), *table = mk(FSDP_F32, 2, s74, d);

    expect_error("layernorm weight size", fsdp_layernorm(&out, x, w4, NULL, 1e-5), FSDP_ERR_SHAPE,
                 (const char *[]){"fsdp_layernorm", "f32[2,5]", "f32[4]", "expected 5", "bias none", NULL});
    expect_error("layernorm bias size", fsdp_layernorm(&out, x, w5, w4, 1e-5), FSDP_ERR_SHAPE,
                 (const char *[]){"fsdp_layernorm", "bias", "expected 5", NULL});
    expect_error("rmsnorm weight size", fsdp_rmsnorm(&out, x, w4, 1e-5), FSDP_ERR_SHAPE,
                 (const char *[]){"fsdp_rmsnorm", "f32[4]", "expected 5", NULL});
    expect_error("layernorm mixed dtypes", fsdp_layernorm(&out, xb, w5, NULL, 1e-5), FSDP_ERR_DTYPE,
                 (const char *[]){"fsdp_layernorm", "bf16[2,5]", "f32[5]", NULL});

    const int64_t big[3] = {1, 12, 2}, neg[3] = {1, -1, 2};
    fsdp_tensor *ids = mk_ids(FSDP_I64, 1, s3, big);
    expect_error("embedding id too large", fsdp_embedding(&out, table, ids), FSDP_ERR_INDEX,
                 (const char *[]){"fsdp_embedding", "12", "[1]", "7", NULL});
    OK(fsdp_tensor_release(ids));
    ids = mk_ids(FSDP_I32, 1, s3, neg);
    expect_error("embedding negative id", fsdp_embedding(&out, table, ids), FSDP_ERR_INDEX,
                 (const char *[]){"fsdp_embedding", "-1", "[1]", NULL});
    OK(fsdp_tensor_release(ids));
    expect_error("embedding float ids", fsdp_embedding(&out, table, x), FSDP_ERR_DTYPE,
                 (const char *[]){"fsdp_embedding", "ids", NULL});

    const int64_t tg[3] = {1, 9, 0}, s2[1] = {2};
    fsdp_tensor *t = mk_ids(FSDP_I64, 1, s2, tg);
    expect_error("cross_entropy target out of range", fsdp_cross_entropy(&out, x, t, -100, 0), FSDP_ERR_INDEX,
                 (const char *[]){"fsdp_cross_entropy", "9", "targets[1]", "< 5", NULL});
    OK(fsdp_tensor_release(t));
    const int64_t tg2[2] = {1, 4};
    t = mk_ids(FSDP_I64, 1, s2, tg2);
    expect_error("cross_entropy target in the padding", fsdp_cross_entropy(&out, x, t, -100, 3), FSDP_ERR_INDEX,
                 (const char *[]){"fsdp_cross_entropy", "is 4", "< 3", NULL});
    expect_error("cross_entropy valid_vocab > V", fsdp_cross_entropy(&out, x, t, -100, 6), FSDP_ERR_INVALID,
                 (const char *[]){"fsdp_cross_entropy", "valid_vocab", "6", NULL});
    OK(fsdp_tensor_release(t));
    t = mk_ids(FSDP_I64, 1, s3, tg);
    expect_error("cross_entropy targets shape", fsdp_cross_entropy(&out, x, t, -100, 0), FSDP_ERR_SHAPE,
                 (const char *[]){"fsdp_cross_entropy", "i64[3]", NULL});
    OK(fsdp_tensor_release(t));

    const int64_t q4[4] = {1, 2, 3, 4}, k4[4] = {1, 2, 5, 4};
    fsdp_tensor *q = mk(FSDP_F32, 4, q4, d), *k = mk(FSDP_F32, 4, k4, d);
    expect_error("attention q/k shapes", fsdp_attention(&out, q, k, q, 1, 0), FSDP_ERR_SHAPE,
                 (const char *[]){"fsdp_attention", "f32[1,2,3,4]", "f32[1,2,5,4]", NULL});
    expect_error("attention 2-D q", fsdp_attention(&out, x, x, x, 0, 0), FSDP_ERR_SHAPE,
                 (const char *[]){"fsdp_attention", "f32[2,5]", NULL});
    OK(fsdp_tensor_release(q));
    OK(fsdp_tensor_release(k));

    expect_error("dropout p = 1", fsdp_dropout(&out, x, 1.0, 1, 0), FSDP_ERR_INVALID,
                 (const char *[]){"fsdp_dropout", "p is 1", NULL});
    expect_error("dropout p < 0", fsdp_dropout(&out, x, -0.1, 1, 0), FSDP_ERR_INVALID,
                 (const char *[]){"fsdp_dropout", "-0.1", NULL});

    fsdp_tensor *xi = mk_ids(FSDP_I32, 1, s3, tg);
    expect_error("gelu of i32", fsdp_gelu(&out, xi), FSDP_ERR_DTYPE, (const char *[]){"fsdp_gelu", "i32[3]", NULL});
    expect_error("softmax of i32", fsdp_softmax(&out, xi), FSDP_ERR_DTYPE, (const char *[]){"fsdp_softmax", "i32", NULL});
    OK(fsdp_tensor_release(xi));
    expect_error("gelu NULL", fsdp_gelu(&out, NULL), FSDP_ERR_INVALID, (const char *[]){"fsdp_gelu", "NULL", NULL});
    expect_error("layernorm NULL x", fsdp_layernorm(&out, NULL, w5, NULL, 1e-5), FSDP_ERR_INVALID,
                 (const char *[]){"fsdp_layernorm", "x is NULL", NULL});
    expect_error("cross_entropy NULL targets", fsdp_cross_entropy(&out, x, NULL, -100, 0), FSDP_ERR_INVALID,
                 (const char *[]){"fsdp_cross_entropy", "targets", NULL});
    expect_error("silu NULL out", fsdp_silu(NULL, x), FSDP_ERR_INVALID, (const char *[]){"fsdp_silu", NULL});
    test_check(out == NULL, "a failed op wrote its output");

    OK(fsdp_tensor_release(x));
    OK(fsdp_tensor_release(w4));
    OK(fsdp_tensor_release(w5));
    OK(fsdp_tensor_release(xb));
    OK(fsdp_tensor_release(table));
}

int main(void) {
    int64_t base, cur, peak, res;
    test_rng_seed(&rng, 20240612);
    OK(fsdp_mem_stats(FSDP_DEVICE_CPU, -1, &base, &peak, &res));
    test_activations();
    test_norms();
    test_embedding();
    test_cross_entropy();
    test_attention();
    test_dropout();
    test_strided();
    test_empty();
    test_errors();
    /* every tensor made here, and every temporary of the ops, is freed */
    OK(fsdp_tape_clear());
    OK(fsdp_mem_stats(FSDP_DEVICE_CPU, -1, &cur, &peak, &res));
    test_check(cur == base, "memory in use at the end: %lld bytes, at the start %lld", (long long)cur,
               (long long)base);
    return test_summary();
}
