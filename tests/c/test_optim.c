/* AdamW and SGD against double-precision references of PyTorch's update
 * rules, several steps, prime sizes; the in-place helpers; bad input. */
#include "fsdp.h"
#include "testutil.h"
#include <math.h>
#include <stdlib.h>
#include <string.h>

#define CPU FSDP_DEVICE_CPU

static fsdp_tensor *make(const float *v, int64_t n) {
    fsdp_tensor *t;
    fsdp_tensor_from_data(&t, FSDP_F32, 1, &n, v, n * 4, CPU, FSDP_TAG_OTHER);
    return t;
}

static void check_adamw(int64_t n, double wd) {
    test_rng r;
    test_rng_seed(&r, (uint64_t)n);
    float *p = malloc((size_t)n * 4), *g = malloc((size_t)n * 4), *zero = calloc((size_t)n, 4), *out = malloc((size_t)n * 4);
    double *P = malloc((size_t)n * 8), *M = calloc((size_t)n, 8), *V = calloc((size_t)n, 8);
    test_fill_nonzero(&r, p, n, 1.0f);
    for (int64_t i = 0; i < n; i++) P[i] = p[i];
    fsdp_tensor *tp = make(p, n), *tm = make(zero, n), *tv = make(zero, n);
    const double lr = 1e-2, b1 = 0.9, b2 = 0.95, eps = 1e-8;
    for (int step = 1; step <= 5; step++) {
        test_fill_nonzero(&r, g, n, 0.5f);
        fsdp_tensor *tg = make(g, n);
        test_check(fsdp_adamw_step(tp, tg, tm, tv, lr, b1, b2, eps, wd, step) == FSDP_OK, "adamw: %s", fsdp_last_error());
        fsdp_tensor_release(tg);
        double bc1 = 1 - pow(b1, step), bc2 = 1 - pow(b2, step);
        for (int64_t i = 0; i < n; i++) {
            P[i] *= 1 - lr * wd;
            M[i] = b1 * M[i] + (1 - b1) * g[i];
            V[i] = b2 * V[i] + (1 - b2) * (double)g[i] * g[i];
            P[i] -= lr * (M[i] / bc1) / (sqrt(V[i] / bc2) + eps);
        }
    }
    fsdp_tensor_to_data(tp, out, n * 4);
    char name[64];
    snprintf(name, sizeof name, "adamw n=%lld wd=%g", (long long)n, wd);
    test_compare(name, out, P, n, 1e-6, 1e-5);
    fsdp_tensor_release(tp);
    fsdp_tensor_release(tm);
    fsdp_tensor_release(tv);
    free(p), free(g), free(zero), free(out), free(P), free(M), free(V);
}

static void check_sgd(int64_t n, double momentum, double damp, double wd, int nesterov) {
    test_rng r;
    test_rng_seed(&r, (uint64_t)n + 99);
    float *p = malloc((size_t)n * 4), *g = malloc((size_t)n * 4), *zero = calloc((size_t)n, 4), *out = malloc((size_t)n * 4);
    double *P = malloc((size_t)n * 8), *B = calloc((size_t)n, 8);
    test_fill_nonzero(&r, p, n, 1.0f);
    for (int64_t i = 0; i < n; i++) P[i] = p[i];
    fsdp_tensor *tp = make(p, n), *tb = momentum != 0 ? make(zero, n) : NULL;
    const double lr = 0.05;
    for (int step = 1; step <= 4; step++) {
        test_fill_nonzero(&r, g, n, 0.5f);
        fsdp_tensor *tg = make(g, n);
        test_check(fsdp_sgd_step(tp, tg, tb, lr, momentum, damp, wd, nesterov, step == 1) == FSDP_OK, "sgd: %s",
                   fsdp_last_error());
        fsdp_tensor_release(tg);
        for (int64_t i = 0; i < n; i++) {
            double d = g[i] + wd * P[i];
            if (momentum != 0) {
                B[i] = step == 1 ? d : momentum * B[i] + (1 - damp) * d;
                d = nesterov ? d + momentum * B[i] : B[i];
            }
            P[i] -= lr * d;
        }
    }
    fsdp_tensor_to_data(tp, out, n * 4);
    char name[96];
    snprintf(name, sizeof name, "sgd n=%lld momentum=%g damp=%g wd=%g nesterov=%d", (long long)n, momentum, damp, wd,
             nesterov);
    test_compare(name, out, P, n, 1e-6, 1e-5);
    fsdp_tensor_release(tp);
    fsdp_tensor_release(tb);
    free(p), free(g), free(zero), free(out), free(P), free(B);
}

static void check_inplace_and_errors(void) {
    float a[5] = {1, -2, 3, -4, 5}, b[5] = {0.5f, 0.5f, 0.5f, 0.5f, 0.5f};
    fsdp_tensor *ta = make(a, 5), *tb = make(b, 5);
    double ss;
    fsdp_sumsq(ta, &ss);
    test_check(ss == 55.0, "sumsq = 55 (%g)", ss);
    fsdp_axpy_(ta, tb, 2.0);
    fsdp_scale_(ta, 0.5);
    float out[5];
    double want[5];
    fsdp_tensor_to_data(ta, out, sizeof out);
    for (int i = 0; i < 5; i++) want[i] = (a[i] + 1.0) * 0.5;
    test_compare("axpy then scale", out, want, 5, 0, 1e-7);
    float c[3] = {1, 2, 3};
    fsdp_tensor *tc = make(c, 3), *bf;
    fsdp_cast(&bf, ta, FSDP_BF16);
    fsdp_status st = fsdp_adamw_step(ta, tc, tb, tb, 1e-3, 0.9, 0.999, 1e-8, 0, 1);
    test_check(st == FSDP_ERR_SHAPE && strstr(fsdp_last_error(), "grad f32[3]") && strstr(fsdp_last_error(), "expected 5"),
               "adamw with a short grad: %s", fsdp_last_error());
    st = fsdp_adamw_step(bf, tb, tb, tb, 1e-3, 0.9, 0.999, 1e-8, 0, 1);
    test_check(st == FSDP_ERR_DTYPE && strstr(fsdp_last_error(), "bf16"), "adamw on a bf16 param: %s",
               fsdp_last_error());
    st = fsdp_adamw_step(ta, tb, tb, tb, 1e-3, 0.9, 0.999, 1e-8, 0, 0);
    test_check(st == FSDP_ERR_INVALID && strstr(fsdp_last_error(), "step 0"), "adamw step 0: %s", fsdp_last_error());
    st = fsdp_sgd_step(ta, tb, NULL, 0.1, 0.9, 0, 0, 0, 1);
    test_check(st == FSDP_ERR_INVALID && strstr(fsdp_last_error(), "momentum_buf"), "sgd momentum without buffer: %s",
               fsdp_last_error());
    fsdp_tensor_release(ta);
    fsdp_tensor_release(tb);
    fsdp_tensor_release(tc);
    fsdp_tensor_release(bf);
}

/* fsdp_adamw_step_many: bit for bit n calls of fsdp_adamw_step (each
 * tensor its own lr, weight decay and step), over several steps, with the
 * gradients read as grad * grad_scale bit for bit as fsdp_scale_ and then
 * the step (a clip folded into the pass: 1, a coefficient, 0), the
 * gradients left as they were; bad input anywhere in the list updates
 * nothing and names the tensor. */
static void check_adamw_many(void) {
    enum { N = 6 };
    int64_t sizes[N] = {1, 7, 97, 0, 1009, 100003};   /* 100003: split over threads, a vector tail */
    double lrs[N] = {1e-2, 3e-3, 1e-3, 1e-2, 2e-2, 1e-3}, wds[N] = {0.1, 0, 0.1, 0, 0.01, 0.1};
    const double grad_scales[4] = {1.0, 0.37, 0.0, 0.8123};
    int64_t steps[N];
    fsdp_tensor *p1[N], *p2[N], *m1[N], *m2[N], *v1[N], *v2[N], *g[N];
    test_rng r;
    test_rng_seed(&r, 5);
    for (int i = 0; i < N; i++) {
        int64_t n = sizes[i];
        float *x = malloc((size_t)(n ? n : 1) * 4), *zero = calloc((size_t)(n ? n : 1), 4);
        test_fill_nonzero(&r, x, n, 1.0f);
        p1[i] = make(x, n), p2[i] = make(x, n);
        m1[i] = make(zero, n), m2[i] = make(zero, n), v1[i] = make(zero, n), v2[i] = make(zero, n);
        steps[i] = 0;
        free(x), free(zero);
    }
    int grads_kept = 1;
    for (int step = 1; step <= 4; step++) {
        double s = grad_scales[step - 1];
        float *xs[N];
        for (int i = 0; i < N; i++) {
            xs[i] = malloc((size_t)(sizes[i] ? sizes[i] : 1) * 4);
            test_fill_nonzero(&r, xs[i], sizes[i], 0.5f);
            g[i] = make(xs[i], sizes[i]);
            fsdp_tensor *scaled = make(xs[i], sizes[i]);   /* the clip as a pass of its own */
            test_check(fsdp_scale_(scaled, s) == FSDP_OK, "scale: %s", fsdp_last_error());
            steps[i] = step + i % 2;   /* steps may differ between tensors */
            test_check(fsdp_adamw_step(p1[i], scaled, m1[i], v1[i], lrs[i], 0.9, 0.95, 1e-8, wds[i], steps[i]) == FSDP_OK,
                       "adamw: %s", fsdp_last_error());
            fsdp_tensor_release(scaled);
        }
        test_check(fsdp_adamw_step_many(p2, g, m2, v2, lrs, wds, steps, N, 0.9, 0.95, 1e-8, s) == FSDP_OK,
                   "adamw_many: %s", fsdp_last_error());
        for (int i = 0; i < N; i++) {   /* the gradients are read, not scaled */
            int64_t n = sizes[i];
            float *got = malloc((size_t)(n ? n : 1) * 4);
            fsdp_tensor_to_data(g[i], got, n * 4);
            grads_kept &= memcmp(got, xs[i], (size_t)n * 4) == 0;
            fsdp_tensor_release(g[i]);
            free(got), free(xs[i]);
        }
    }
    test_check(grads_kept, "adamw_many with grad_scale leaves the gradients as they were");
    int same = 1;
    for (int i = 0; i < N; i++) {
        int64_t n = sizes[i];
        float *a = malloc((size_t)(n ? n : 1) * 4), *b = malloc((size_t)(n ? n : 1) * 4);
        fsdp_tensor *pairs[3][2] = {{p1[i], p2[i]}, {m1[i], m2[i]}, {v1[i], v2[i]}};
        for (int k = 0; k < 3; k++) {
            fsdp_tensor_to_data(pairs[k][0], a, n * 4);
            fsdp_tensor_to_data(pairs[k][1], b, n * 4);
            same &= memcmp(a, b, (size_t)n * 4) == 0;
        }
        free(a), free(b);
    }
    test_check(same, "adamw_many with grad_scale 1, 0.37, 0, 0.8123 equals scale then adamw per tensor, bit for bit "
                     "(params and both moments)");

    /* bad input: a short gradient at index 4, a step 0, a bf16 moment; nothing changes */
    float before[7], after[7], one[2] = {1, 2};
    fsdp_tensor_to_data(p2[1], before, sizeof before);
    fsdp_tensor *gs[N];
    for (int i = 0; i < N; i++) gs[i] = p1[i];   /* right sizes */
    fsdp_tensor *short_g = make(one, 2);
    gs[4] = short_g;
    fsdp_status st = fsdp_adamw_step_many(p2, gs, m2, v2, lrs, wds, steps, N, 0.9, 0.95, 1e-8, 1.0);
    test_check(st == FSDP_ERR_SHAPE && strstr(fsdp_last_error(), "fsdp_adamw_step_many: grads[4] f32[2]") &&
                   strstr(fsdp_last_error(), "expected 1009"),
               "adamw_many with a short grad: %s", fsdp_last_error());
    fsdp_tensor_to_data(p2[1], after, sizeof after);
    test_check(memcmp(before, after, sizeof before) == 0, "adamw_many that fails updates nothing");
    int64_t bad_steps[N] = {1, 1, 0, 1, 1, 1};
    st = fsdp_adamw_step_many(p2, p1, m2, v2, lrs, wds, bad_steps, N, 0.9, 0.95, 1e-8, 1.0);
    test_check(st == FSDP_ERR_INVALID && strstr(fsdp_last_error(), "steps[2] is 0"), "adamw_many step 0: %s",
               fsdp_last_error());
    fsdp_tensor *bf;
    fsdp_cast(&bf, p2[0], FSDP_BF16);
    fsdp_tensor *ms[N] = {m2[0], m2[1], m2[2], m2[3], m2[4], m2[5]};
    ms[0] = bf;
    st = fsdp_adamw_step_many(p2, p1, ms, v2, lrs, wds, steps, N, 0.9, 0.95, 1e-8, 1.0);
    test_check(st == FSDP_ERR_DTYPE && strstr(fsdp_last_error(), "exp_avgs[0] bf16"), "adamw_many bf16 state: %s",
               fsdp_last_error());
    st = fsdp_adamw_step_many(p2, NULL, m2, v2, lrs, wds, steps, N, 0.9, 0.95, 1e-8, 1.0);
    test_check(st == FSDP_ERR_INVALID && strstr(fsdp_last_error(), "NULL array"), "adamw_many NULL grads: %s",
               fsdp_last_error());
    st = fsdp_adamw_step_many(p2, p1, m2, v2, lrs, wds, steps, N, 1.0, 0.95, 1e-8, 1.0);
    test_check(st == FSDP_ERR_INVALID && strstr(fsdp_last_error(), "betas (1, 0.95)"), "adamw_many beta1 1: %s",
               fsdp_last_error());
    const double bad_scales[3] = {-0.5, NAN, INFINITY};
    for (int k = 0; k < 3; k++) {
        st = fsdp_adamw_step_many(p2, p1, m2, v2, lrs, wds, steps, N, 0.9, 0.95, 1e-8, bad_scales[k]);
        test_check(st == FSDP_ERR_INVALID && strstr(fsdp_last_error(), "fsdp_adamw_step_many: grad_scale") &&
                       strstr(fsdp_last_error(), "finite number >= 0"),
                   "adamw_many grad_scale %g: %s", bad_scales[k], fsdp_last_error());
    }
    fsdp_tensor_to_data(p2[1], after, sizeof after);
    test_check(memcmp(before, after, sizeof before) == 0, "adamw_many with a bad grad_scale updates nothing");
    test_check(fsdp_adamw_step_many(NULL, NULL, NULL, NULL, NULL, NULL, NULL, 0, 0.9, 0.95, 1e-8, 1.0) == FSDP_OK,
               "adamw_many of no parameters: %s", fsdp_last_error());
    fsdp_tensor_release(bf);
    fsdp_tensor_release(short_g);
    for (int i = 0; i < N; i++) {
        fsdp_tensor_release(p1[i]), fsdp_tensor_release(p2[i]);
        fsdp_tensor_release(m1[i]), fsdp_tensor_release(m2[i]);
        fsdp_tensor_release(v1[i]), fsdp_tensor_release(v2[i]);
    }
}

int main(void) {
    int64_t sizes[] = {1, 7, 97, 100003};
    for (int i = 0; i < 4; i++) {
        check_adamw(sizes[i], 0.0);
        check_adamw(sizes[i], 0.1);
        check_sgd(sizes[i], 0, 0, 0, 0);
        check_sgd(sizes[i], 0.9, 0, 0.01, 0);
        check_sgd(sizes[i], 0.9, 0.1, 0, 0);
        check_sgd(sizes[i], 0.9, 0, 0.01, 1);
    }
    check_inplace_and_errors();
    check_adamw_many();
    return test_summary();
}
