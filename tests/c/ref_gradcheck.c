/* The finite-difference gradient checker (see gradcheck.h). */
#include "gradcheck.h"
#include "testutil.h"
#include <math.h>
#include <stdlib.h>

static int64_t numel_of(int ndim, const int64_t *shape) {
    int64_t n = 1;
    for (int d = 0; d < ndim; d++) n *= shape[d];
    return n;
}

fsdp_tensor *gc_tensor(int ndim, const int64_t *shape, const float *values) {
    fsdp_tensor *t = NULL;
    int64_t n = numel_of(ndim, shape);
    if (fsdp_tensor_from_data(&t, FSDP_F32, ndim, shape, values, n * 4, FSDP_DEVICE_CPU, FSDP_TAG_OTHER) != FSDP_OK) {
        fprintf(stderr, "gc_tensor: %s\n", fsdp_last_error());
        exit(2);
    }
    return t;
}

/* sum(out * R) in double, with gradients off */
static double objective(gc_forward_fn fn, void *ctx, fsdp_tensor **in, const float *R, int64_t *rn) {
    int prev;
    fsdp_set_grad_enabled(0, &prev);
    fsdp_tensor *out = NULL;
    if (fn(&out, in, ctx) != FSDP_OK) {
        fprintf(stderr, "gradcheck forward failed: %s\n", fsdp_last_error());
        exit(2);
    }
    fsdp_set_grad_enabled(prev, NULL);
    int64_t n;
    fsdp_tensor_numel(out, &n);
    fsdp_tensor *o32;
    fsdp_cast(&o32, out, FSDP_F32);
    float *v = malloc((size_t)n * 4);
    fsdp_tensor_to_data(o32, v, n * 4);
    double s = 0;
    for (int64_t i = 0; i < n; i++) s += (double)v[i] * (R ? R[i] : 1.0);
    free(v);
    fsdp_tensor_release(o32);
    fsdp_tensor_release(out);
    if (rn) *rn = n;
    return s;
}

int gradcheck(const char *name, gc_forward_fn fn, void *ctx, const gc_spec *spec, unsigned seed, double eps,
              double tol) {
    test_rng rng;
    test_rng_seed(&rng, seed);
    fsdp_tensor *in[4] = {0};
    float *vals[4] = {0};
    int64_t nel[4] = {0};
    for (int k = 0; k < spec->n_in; k++) {
        if (spec->fixed[k]) {
            in[k] = spec->fixed[k];
            fsdp_tensor_retain(in[k]);
            continue;
        }
        nel[k] = numel_of(spec->ndim[k], spec->shape[k]);
        vals[k] = malloc((size_t)(nel[k] ? nel[k] : 1) * 4);
        test_fill_nonzero(&rng, vals[k], nel[k], 1.0f);
        in[k] = gc_tensor(spec->ndim[k], spec->shape[k], vals[k]);
        if (spec->differentiable[k]) fsdp_tensor_set_requires_grad(in[k], 1);
    }
    /* analytic: backward of out seeded with R */
    fsdp_tensor *out = NULL;
    if (fn(&out, in, ctx) != FSDP_OK) {
        fprintf(stderr, "%s: forward failed: %s\n", name, fsdp_last_error());
        exit(2);
    }
    int nd;
    int64_t oshape[8], on;
    fsdp_tensor_ndim(out, &nd);
    fsdp_tensor_shape(out, oshape);
    fsdp_tensor_numel(out, &on);
    float *R = malloc((size_t)(on ? on : 1) * 4);
    test_fill_nonzero(&rng, R, on, 1.0f);
    fsdp_tensor *Rt = gc_tensor(nd, oshape, R), *Rc = NULL;
    int odt;
    fsdp_tensor_dtype(out, &odt);
    fsdp_cast(&Rc, Rt, odt);
    int id = 0;
    int wrong = 0;
    if (fsdp_backward_begin(out, Rc) != FSDP_OK) {
        fprintf(stderr, "%s: backward failed: %s\n", name, fsdp_last_error());
        wrong++;
    } else {
        do {
            if (fsdp_backward_step(&id) != FSDP_OK) {
                fprintf(stderr, "%s: backward failed: %s\n", name, fsdp_last_error());
                wrong++;
                break;
            }
        } while (id != -1);
    }
    for (int k = 0; k < spec->n_in && !wrong; k++) {
        if (spec->fixed[k] || !spec->differentiable[k]) continue;
        fsdp_tensor *g = NULL, *g32 = NULL;
        fsdp_tensor_grad(in[k], &g);
        float *ga = calloc((size_t)(nel[k] ? nel[k] : 1), 4);
        if (g) {
            fsdp_cast(&g32, g, FSDP_F32);
            fsdp_tensor_to_data(g32, ga, nel[k] * 4);
        }
        int bad = 0;
        for (int64_t i = 0; i < nel[k]; i++) {
            float keep = vals[k][i];
            fsdp_tensor *saved = in[k];
            vals[k][i] = keep + (float)eps;
            in[k] = gc_tensor(spec->ndim[k], spec->shape[k], vals[k]);
            double fp = objective(fn, ctx, in, R, NULL);
            fsdp_tensor_release(in[k]);
            vals[k][i] = keep - (float)eps;
            in[k] = gc_tensor(spec->ndim[k], spec->shape[k], vals[k]);
            double fm = objective(fn, ctx, in, R, NULL);
            fsdp_tensor_release(in[k]);
            vals[k][i] = keep;
            in[k] = saved;
            double num = (fp - fm) / (2 * eps);
            double err = fabs(num - ga[i]);
            if (!(err <= tol * fmax(1.0, fabs(num)))) {
                if (bad < 4)
                    fprintf(stderr, "  %s: input %d [%lld]: analytic %.6g numeric %.6g\n", name, k, (long long)i,
                            (double)ga[i], num);
                bad++;
            }
        }
        test_check(bad == 0, "%s: gradient of input %d: %d of %lld entries off (eps %g, tol %g)", name, k, bad,
                   (long long)nel[k], eps, tol);
        wrong += bad;
        free(ga);
        fsdp_tensor_release(g);
        fsdp_tensor_release(g32);
    }
    for (int k = 0; k < spec->n_in; k++) {
        fsdp_tensor_release(in[k]);
        free(vals[k]);
    }
    fsdp_tensor_release(out);
    fsdp_tensor_release(Rt);
    fsdp_tensor_release(Rc);
    free(R);
    return wrong;
}
