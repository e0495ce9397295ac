/* optim.c: fused optimizer steps over flat f32 buffers, and the in-place
 * helpers (scale, axpy, sum of squares) that clipping and accumulation use.
 * Each step is a single pass: every element is read and written once. */
#include "ops_util.h"
#include <float.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>

/* float (f32 if need_f32), contiguous, with data, n elements (n >= 0), on
 * the device of `with` (named with_name; when given: one kernel reads them all) */
static fsdp_status check_flat(const char *op, const char *name, fsdp_tensor *t, int64_t n, bool need_f32,
                              fsdp_tensor *with, const char *with_name) {
    char d[200], w[200];
    if (!t) return fsdp_set_error(FSDP_ERR_INVALID, "%s: %s is NULL", op, name);
    if (with && tensor_device(t) != tensor_device(with))
        return fsdp_set_error(FSDP_ERR_DEVICE, "%s: %s %s and %s %s are on different devices (one kernel reads "
                              "them all)", op, name, tensor_desc(t, d, sizeof d), with_name,
                              tensor_desc(with, w, sizeof w));
    if (need_f32 && t->dtype != FSDP_F32)
        return fsdp_set_error(FSDP_ERR_DTYPE, "%s: %s %s must be f32", op, name, tensor_desc(t, d, sizeof d));
    if (!fsdp_dtype_is_float(t->dtype))
        return fsdp_set_error(FSDP_ERR_DTYPE, "%s: %s %s must be a float tensor", op, name, tensor_desc(t, d, sizeof d));
    if (!t->storage->data && t->storage->nbytes > 0)
        return fsdp_set_error(FSDP_ERR_STATE, "%s: %s %s belongs to a resharded unit (no data until it is gathered "
                              "again)", op, name, tensor_desc(t, d, sizeof d));
    if (!KERNELS(t))
        return fsdp_set_error(FSDP_ERR_UNSUPPORTED, "%s: %s %s: no %s kernels in this build", op, name,
                              tensor_desc(t, d, sizeof d), fsdp_device_name(tensor_device(t)));
    if (!tensor_is_contiguous(t))
        return fsdp_set_error(FSDP_ERR_LAYOUT, "%s: %s %s must be contiguous", op, name, tensor_desc(t, d, sizeof d));
    if (n >= 0 && tensor_numel(t) != n)
        return fsdp_set_error(FSDP_ERR_SHAPE, "%s: %s %s has %lld elements, expected %lld", op, name,
                              tensor_desc(t, d, sizeof d), (long long)tensor_numel(t), (long long)n);
    return FSDP_OK;
}

/* ---- in place ---- */

fsdp_status fsdp_scale_(fsdp_tensor *t, double s) {
    FSDP_TRY(check_flat("fsdp_scale_", "t", t, -1, false, NULL, NULL));
    storage_written(t->storage);
    if (t->dtype == FSDP_F32) {
        KERNELS(t)->scale_f32(tensor_data(t), tensor_data(t), (float)s, tensor_numel(t));
        return FSDP_OK;
    }
    fsdp_tensor *f;
    FSDP_TRY(tensor_as_f32(&f, t));
    KERNELS(f)->scale_f32(tensor_data(f), tensor_data(f), (float)s, tensor_numel(f));
    fsdp_status st = fsdp_copy(t, f);
    tensor_release(f);
    return st;
}

fsdp_status fsdp_axpy_(fsdp_tensor *y, fsdp_tensor *x, double alpha) {
    FSDP_TRY(check_flat("fsdp_axpy_", "y", y, -1, false, NULL, NULL));
    FSDP_TRY(check_flat("fsdp_axpy_", "x", x, tensor_numel(y), false, y, "y"));
    storage_written(y->storage);
    if (y->dtype == FSDP_F32 && x->dtype == FSDP_BF16 && KERNELS(y)->axpy_f32_bf16 &&
        y->storage != x->storage) {   /* widened in registers, no staged copy */
        KERNELS(y)->axpy_f32_bf16(tensor_data(y), tensor_data(x), (float)alpha, tensor_numel(y));
        return FSDP_OK;
    }
    fsdp_tensor *x32, *y32;
    FSDP_TRY(tensor_as_f32(&x32, x));
    fsdp_status st = tensor_as_f32(&y32, y);
    if (st == FSDP_OK) {
        KERNELS(y32)->axpy_f32(tensor_data(y32), tensor_data(x32), (float)alpha, tensor_numel(y));
        if (y32 != y) st = fsdp_copy(y, y32);
        tensor_release(y32);
    }
    tensor_release(x32);
    return st;
}

fsdp_status fsdp_sumsq(fsdp_tensor *t, double *out) {
    if (!out) return fsdp_set_error(FSDP_ERR_INVALID, "fsdp_sumsq: out is NULL");
    if (!t) return fsdp_set_error(FSDP_ERR_INVALID, "fsdp_sumsq: t is NULL");
    char d[200];
    if (!fsdp_dtype_is_float(t->dtype))
        return fsdp_set_error(FSDP_ERR_DTYPE, "fsdp_sumsq: t %s must be a float tensor", tensor_desc(t, d, sizeof d));
    if (!t->storage->data && t->storage->nbytes > 0)
        return fsdp_set_error(FSDP_ERR_STATE, "fsdp_sumsq: t %s belongs to a resharded unit", tensor_desc(t, d, sizeof d));
    fsdp_tensor *f;
    FSDP_TRY(tensor_as_f32(&f, t));
    *out = KERNELS(f)->sumsq_f32(tensor_data(f), tensor_numel(f));
    tensor_release(f);
    return FSDP_OK;
}

fsdp_status fsdp_sumsq_many(fsdp_tensor *const *ts, int n, double *out) {
    const char *op = "fsdp_sumsq_many";
    if (!out) return fsdp_set_error(FSDP_ERR_INVALID, "%s: out is NULL", op);
    if (n < 0 || (n > 0 && !ts)) return fsdp_set_error(FSDP_ERR_INVALID, "%s: %d tensors at %p", op, n, (void *)ts);
    *out = 0.0;
    char d[200], w[200];
    fsdp_tensor *first = NULL;
    for (int i = 0; i < n; i++) {
        fsdp_tensor *t = ts[i];
        if (!t) continue;
        if (!fsdp_dtype_is_float(t->dtype))
            return fsdp_set_error(FSDP_ERR_DTYPE, "%s: tensor %d %s must be a float tensor", op, i,
                                  tensor_desc(t, d, sizeof d));
        if (!t->storage->data && t->storage->nbytes > 0)
            return fsdp_set_error(FSDP_ERR_STATE, "%s: tensor %d %s belongs to a resharded unit", op, i,
                                  tensor_desc(t, d, sizeof d));
        if (first && tensor_device(t) != tensor_device(first))
            return fsdp_set_error(FSDP_ERR_DEVICE, "%s: tensor %d %s and %s are on different devices", op, i,
                                  tensor_desc(t, d, sizeof d), tensor_desc(first, w, sizeof w));
        if (!first) first = t;
    }
    if (!first) return FSDP_OK;
    const fsdp_device_kernels *k = KERNELS(first);
    /* f32 contiguous views of every tensor (a staged copy only where needed) */
    fsdp_tensor **f = calloc((size_t)n, sizeof *f);
    const float **ptrs = calloc((size_t)n, sizeof *ptrs);
    int64_t *counts = calloc((size_t)n, sizeof *counts);
    fsdp_status st = f && ptrs && counts ? FSDP_OK : fsdp_set_error(FSDP_ERR_OOM, "%s: out of host memory", op);
    int m = 0;
    for (int i = 0; i < n && st == FSDP_OK; i++) {
        if (!ts[i]) continue;
        st = tensor_as_f32(&f[m], ts[i]);
        if (st != FSDP_OK) break;
        ptrs[m] = tensor_data(f[m]);
        counts[m] = tensor_numel(f[m]);
        m++;
    }
    if (st == FSDP_OK) {
        if (k->sumsq_many_f32) {
            *out = k->sumsq_many_f32(ptrs, counts, m);
        } else {   /* one tensor at a time, added in order */
            double total = 0.0;
            for (int i = 0; i < m; i++) total += k->sumsq_f32(ptrs[i], counts[i]);
            *out = total;
        }
    }
    for (int i = 0; f && i < m; i++) tensor_release(f[i]);
    free(f);
    free(ptrs);
    free(counts);
    return st;
}

/* ---- AdamW ---- */

/* The compute copy of param's elements (an FSDP master shard's, sched.c)
 * when AdamW may write it: it holds the master's current values and
 * nothing reads it now. AdamW then writes the update's bf16 rounding
 * beside the f32 value (bit for bit the cast a gather makes) and the copy
 * stays current; otherwise it is left alone and goes stale with the
 * master's write. Called for every parameter before any is written. */
static uint16_t *adamw_copy_target(fsdp_tensor *param) {
    fsdp_storage *s = param->storage;
    if (!storage_copy_current(s) || s->copy_readers > 0 || s->copy_dtype != FSDP_BF16 || s->copy->device != s->device)
        return NULL;
    return (uint16_t *)s->copy->data + param->offset;
}

/* AdamW over n elements, then their bf16 copy into pb (when given) with
 * the device's cast. On a device without the fused entry (the CPU) a chunk
 * at a time, so that the cast reads p while it is still in cache; elsewhere
 * in one piece (one launch each). */
#define ADAMW_COPY_CHUNK ((int64_t)1 << 18)

static void adamw_then_copy(const fsdp_device_kernels *k, float *p, uint16_t *pb, const float *g, float *m, float *v,
                            int64_t n, float beta1, float beta2, float eps, float decay, float step_size,
                            float inv_sqrt_bc2, float grad_scale) {
    if (!pb) {
        k->adamw_f32(p, g, m, v, n, beta1, beta2, eps, decay, step_size, inv_sqrt_bc2, grad_scale);
        return;
    }
    int64_t chunk = k->adamw_many_f32 ? n : ADAMW_COPY_CHUNK;
    for (int64_t at = 0; at < n; at += chunk) {
        int64_t len = n - at < chunk ? n - at : chunk;
        k->adamw_f32(p + at, g + at, m + at, v + at, len, beta1, beta2, eps, decay, step_size, inv_sqrt_bc2,
                     grad_scale);
        k->cast_any(pb + at, FSDP_BF16, p + at, FSDP_F32, len);
    }
}

/* After AdamW wrote param (and its copy where target was given): the
 * master's version moves on, the copy's with it when it was written. */
static void adamw_written(fsdp_tensor *param, const uint16_t *target) {
    fsdp_storage *s = param->storage;
    storage_written(s);
    if (target) s->copy_version = s->version;
}

fsdp_status fsdp_adamw_step(fsdp_tensor *param, fsdp_tensor *grad, fsdp_tensor *exp_avg, fsdp_tensor *exp_avg_sq,
                            double lr, double beta1, double beta2, double eps, double weight_decay, int64_t step) {
    const char *op = "fsdp_adamw_step";
    FSDP_TRY(check_flat(op, "param", param, -1, true, NULL, NULL));
    int64_t n = tensor_numel(param);
    FSDP_TRY(check_flat(op, "grad", grad, n, false, param, "param"));
    FSDP_TRY(check_flat(op, "exp_avg", exp_avg, n, true, param, "param"));
    FSDP_TRY(check_flat(op, "exp_avg_sq", exp_avg_sq, n, true, param, "param"));
    if (step < 1) return fsdp_set_error(FSDP_ERR_INVALID, "%s: step %lld, expected >= 1", op, (long long)step);
    if (!(beta1 >= 0 && beta1 < 1 && beta2 >= 0 && beta2 < 1 && eps >= 0 && lr >= 0 && weight_decay >= 0))
        return fsdp_set_error(FSDP_ERR_INVALID, "%s: lr %g, betas (%g, %g), eps %g, weight decay %g out of range", op,
                              lr, beta1, beta2, eps, weight_decay);
    fsdp_tensor *g32;
    FSDP_TRY(tensor_as_f32(&g32, grad));
    double bc1 = 1.0 - pow(beta1, (double)step), bc2 = 1.0 - pow(beta2, (double)step);
    uint16_t *pb = adamw_copy_target(param);
    adamw_then_copy(KERNELS(param), tensor_data(param), pb, tensor_data(g32), tensor_data(exp_avg),
                    tensor_data(exp_avg_sq), n, (float)beta1, (float)beta2, (float)eps,
                    (float)(1.0 - lr * weight_decay), (float)(lr / bc1), (float)(1.0 / sqrt(bc2)), 1.0f);
    adamw_written(param, pb);
    tensor_release(g32);
    return FSDP_OK;
}

/* Many parameters: every tensor checked first, then one call of the
 * device's adamw_many_f32 (or adamw_f32 per tensor where it has none). The
 * kernels read each gradient as g * grad_scale, in their one pass. */
fsdp_status fsdp_adamw_step_many(fsdp_tensor *const *params, fsdp_tensor *const *grads, fsdp_tensor *const *exp_avgs,
                                 fsdp_tensor *const *exp_avg_sqs, const double *lrs, const double *weight_decays,
                                 const int64_t *steps, int n, double beta1, double beta2, double eps,
                                 double grad_scale) {
    const char *op = "fsdp_adamw_step_many";
    if (n < 0 || (n > 0 && (!params || !grads || !exp_avgs || !exp_avg_sqs || !lrs || !weight_decays || !steps)))
        return fsdp_set_error(FSDP_ERR_INVALID, "%s: %d parameters, with a NULL array among params, grads, exp_avgs, "
                              "exp_avg_sqs, lrs, weight_decays, steps", op, n);
    if (n == 0) return FSDP_OK;
    if (!(beta1 >= 0 && beta1 < 1 && beta2 >= 0 && beta2 < 1 && eps >= 0))
        return fsdp_set_error(FSDP_ERR_INVALID, "%s: betas (%g, %g), eps %g out of range", op, beta1, beta2, eps);
    /* a float as the kernels take it: finite (a NaN or infinite norm's
     * coefficient is the caller's to handle, as clip_coef does) */
    if (!(grad_scale >= 0 && grad_scale <= FLT_MAX))
        return fsdp_set_error(FSDP_ERR_INVALID, "%s: grad_scale %g, expected a finite number >= 0", op, grad_scale);
    char name[64];
    for (int i = 0; i < n; i++) {
        snprintf(name, sizeof name, "params[%d]", i);
        FSDP_TRY(check_flat(op, name, params[i], -1, true, i ? params[0] : NULL, "params[0]"));
        int64_t numel = tensor_numel(params[i]);
        snprintf(name, sizeof name, "grads[%d]", i);
        FSDP_TRY(check_flat(op, name, grads[i], numel, false, params[0], "params[0]"));
        snprintf(name, sizeof name, "exp_avgs[%d]", i);
        FSDP_TRY(check_flat(op, name, exp_avgs[i], numel, true, params[0], "params[0]"));
        snprintf(name, sizeof name, "exp_avg_sqs[%d]", i);
        FSDP_TRY(check_flat(op, name, exp_avg_sqs[i], numel, true, params[0], "params[0]"));
        if (steps[i] < 1)
            return fsdp_set_error(FSDP_ERR_INVALID, "%s: steps[%d] is %lld, expected >= 1", op, i, (long long)steps[i]);
        if (!(lrs[i] >= 0 && weight_decays[i] >= 0))
            return fsdp_set_error(FSDP_ERR_INVALID, "%s: parameter %d: lr %g, weight decay %g out of range", op, i,
                                  lrs[i], weight_decays[i]);
    }
    const fsdp_device_kernels *k = KERNELS(params[0]);
    float **pp = calloc((size_t)n, sizeof *pp), **mp = calloc((size_t)n, sizeof *mp);
    float **vp = calloc((size_t)n, sizeof *vp);
    uint16_t **cp = calloc((size_t)n, sizeof *cp);   /* (n) compute copies AdamW writes, by m below */
    uint16_t **targets = calloc((size_t)n, sizeof *targets);   /* (n) by parameter */
    const float **gp = calloc((size_t)n, sizeof *gp);
    int64_t *counts = calloc((size_t)n, sizeof *counts);
    float *decay = calloc((size_t)n, sizeof *decay), *step_size = calloc((size_t)n, sizeof *step_size);
    float *ibc2 = calloc((size_t)n, sizeof *ibc2);
    fsdp_status st = pp && mp && vp && cp && targets && gp && counts && decay && step_size && ibc2
                         ? FSDP_OK
                         : fsdp_set_error(FSDP_ERR_OOM, "%s: out of host memory for %d parameters", op, n);
    /* which copies are written, decided before anything is: parameters
     * sharing a master storage all see the version it had */
    for (int i = 0; i < n && st == FSDP_OK; i++) targets[i] = adamw_copy_target(params[i]);
    int m = 0;   /* tensors with an f32 gradient, updated together below */
    for (int i = 0; i < n && st == FSDP_OK; i++) {
        double bc1 = 1.0 - pow(beta1, (double)steps[i]), bc2 = 1.0 - pow(beta2, (double)steps[i]);
        float d = (float)(1.0 - lrs[i] * weight_decays[i]), ss = (float)(lrs[i] / bc1), ib = (float)(1.0 / sqrt(bc2));
        if (grads[i]->dtype != FSDP_F32) {
            /* a gradient of another dtype (shards keep f32 ones): widened and
             * stepped now, so that one staged copy at a time exists */
            fsdp_tensor *g = NULL;
            st = tensor_as_f32(&g, grads[i]);
            if (st != FSDP_OK) break;
            adamw_then_copy(k, tensor_data(params[i]), targets[i], tensor_data(g), tensor_data(exp_avgs[i]),
                            tensor_data(exp_avg_sqs[i]), tensor_numel(params[i]), (float)beta1, (float)beta2,
                            (float)eps, d, ss, ib, (float)grad_scale);
            tensor_release(g);
            continue;
        }
        pp[m] = tensor_data(params[i]);
        cp[m] = targets[i];
        gp[m] = tensor_data(grads[i]);
        mp[m] = tensor_data(exp_avgs[i]);
        vp[m] = tensor_data(exp_avg_sqs[i]);
        counts[m] = tensor_numel(params[i]);
        decay[m] = d;
        step_size[m] = ss;
        ibc2[m] = ib;
        m++;
    }
    if (st == FSDP_OK) {
        if (k->adamw_many_f32) {
            k->adamw_many_f32(pp, cp, gp, mp, vp, counts, decay, step_size, ibc2, m, (float)beta1, (float)beta2,
                              (float)eps, (float)grad_scale);
        } else {
            for (int i = 0; i < m; i++)
                adamw_then_copy(k, pp[i], cp[i], gp[i], mp[i], vp[i], counts[i], (float)beta1, (float)beta2,
                                (float)eps, decay[i], step_size[i], ibc2[i], (float)grad_scale);
        }
    }
    /* every parameter stepped or none (a failure above comes before any
     * kernel ran, except the widened ones before it: written all the same) */
    for (int i = 0; i < n && targets; i++) adamw_written(params[i], st == FSDP_OK ? targets[i] : NULL);
    free(pp);
    free(cp);
    free(targets);
    free(gp);
    free(mp);
    free(vp);
    free(counts);
    free(decay);
    free(step_size);
    free(ibc2);
    return st;
}

/* ---- SGD ---- */

fsdp_status fsdp_sgd_step(fsdp_tensor *param, fsdp_tensor *grad, fsdp_tensor *momentum_buf, double lr,
                          double momentum, double dampening, double weight_decay, int nesterov, int first_step) {
    const char *op = "fsdp_sgd_step";
    FSDP_TRY(check_flat(op, "param", param, -1, true, NULL, NULL));
    int64_t n = tensor_numel(param);
    FSDP_TRY(check_flat(op, "grad", grad, n, false, param, "param"));
    if (momentum != 0) FSDP_TRY(check_flat(op, "momentum_buf", momentum_buf, n, true, param, "param"));
    if (!(lr >= 0 && momentum >= 0 && weight_decay >= 0 && dampening >= 0 && dampening <= 1))
        return fsdp_set_error(FSDP_ERR_INVALID, "%s: lr %g, momentum %g, dampening %g, weight decay %g out of range",
                              op, lr, momentum, dampening, weight_decay);
    if (nesterov && (momentum <= 0 || dampening != 0))
        return fsdp_set_error(FSDP_ERR_INVALID, "%s: nesterov needs momentum > 0 and dampening 0 (got %g, %g)", op,
                              momentum, dampening);
    fsdp_tensor *g32;
    FSDP_TRY(tensor_as_f32(&g32, grad));
    storage_written(param->storage);   /* a compute copy of it goes stale: a gather casts it again */
    KERNELS(param)->sgd_f32(tensor_data(param), tensor_data(g32), momentum != 0 ? tensor_data(momentum_buf) : NULL, n,
                            (float)lr, (float)momentum, (float)dampening, (float)weight_decay, nesterov != 0,
                            first_step != 0);
    tensor_release(g32);
    return FSDP_OK;
}
