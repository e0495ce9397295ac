/* test_cuda_kernels_optim.c: AdamW (one tensor, and many at once with their
 * bf16 copies) and SGD (momentum, dampening, Nesterov), against the CPU's.
 * Tolerance: rtol 1e-6 (contraction into FMAs may differ). */
#include "cuda_kernels_check.h"

/* ---- optimizers ---- */

/* adamw_many_f32: 70 tensors (more than a launch's group of 56; empty ones,
 * one element, odd and prime sizes, some over a block of 2048, several
 * slices of one buffer as a unit's shard gives them), each with its own
 * decay, step size and bias correction, against the CPU's adamw_f32 per
 * tensor: rtol 1e-6 as adamw_f32. Every tensor but each third writes its
 * bf16 copy too: bit for bit the device's cast_any of its new p (the cast
 * a gather makes), the others' copies untouched. */
void test_adamw_many(void) {
    test_check(G->adamw_many_f32 != NULL, "CUDA has adamw_many_f32");
    if (!G->adamw_many_f32) return;
    enum { N = 70 };
    int64_t counts[N], offs[N], total = 0;
    for (int i = 0; i < N; i++) {
        static const int64_t pick[] = {1, 0, 7, 2049, 4099, 3, 131, 5000, 2, 1};
        counts[i] = pick[i % 10] + (i / 10);   /* the empty ones grow by a few each round */
        if (i == 1) counts[i] = 0;
        offs[i] = total;
        total += counts[i];
    }
    /* one buffer per kind, tensor i a slice of it (device and host alike) */
    float *p = hrand(total, 1), *g = hrand(total, 0.1f), *m = hrand(total, 0.01f), *v = hrand(total, 0.001f);
    for (int64_t i = 0; i < total; i++) v[i] = fabsf(v[i]);
    float *dp = dupf(p, total), *dg = dupf(g, total), *dm = dupf(m, total), *dv = dupf(v, total);
    float *pp[N], *mp[N], *vp[N], decay[N], step[N], ibc2[N];
    const float *gp[N];
    uint16_t *pbp[N];
    uint16_t *sentinel = halloc((size_t)total * sizeof(uint16_t));
    for (int64_t i = 0; i < total; i++) sentinel[i] = 0x7fc1;   /* a NaN no cast writes */
    uint16_t *dpb = dup_bytes(sentinel, (size_t)total * sizeof(uint16_t));
    float b1 = 0.9f, b2 = 0.95f, eps = 1e-8f, grad_scale = 0.37f;   /* a clip coefficient */
    for (int i = 0; i < N; i++) {
        float lr = 1e-3f * (1 + i % 3), t = (float)(1 + i % 5), wd = i % 2 ? 0.1f : 0.0f;
        decay[i] = 1 - lr * wd;
        step[i] = lr / (1 - powf(b1, t));
        ibc2[i] = 1 / sqrtf(1 - powf(b2, t));
        C->adamw_f32(p + offs[i], g + offs[i], m + offs[i], v + offs[i], counts[i], b1, b2, eps, decay[i], step[i],
                     ibc2[i], grad_scale);
        pp[i] = dp + offs[i];
        gp[i] = dg + offs[i];
        mp[i] = dm + offs[i];
        vp[i] = dv + offs[i];
        pbp[i] = i % 3 == 2 ? NULL : dpb + offs[i];
    }
    G->adamw_many_f32(pp, pbp, gp, mp, vp, counts, decay, step, ibc2, N, b1, b2, eps, grad_scale);
    check_f("adamw_many_f32 p (70 tensors)", back(dp, total), p, total, 1e-6, 1e-7, -1);
    {
        uint16_t *cast = dalloc((size_t)(total > 0 ? total : 1) * sizeof(uint16_t));
        G->cast_any(cast, FSDP_BF16, dp, FSDP_F32, total);
        uint16_t *want = halloc((size_t)total * sizeof(uint16_t)), *got = halloc((size_t)total * sizeof(uint16_t));
        G->copy_to_host(want, cast, (size_t)total * sizeof(uint16_t));
        G->copy_to_host(got, dpb, (size_t)total * sizeof(uint16_t));
        int64_t bad = 0, written = 0;
        for (int i = 0; i < N; i++)
            for (int64_t j = offs[i]; j < offs[i] + counts[i]; j++) {
                uint16_t expect = pbp[i] ? want[j] : sentinel[j];
                bad += got[j] != expect;
                written += pbp[i] != NULL;
            }
        test_check(bad == 0 && written > 0, "adamw_many_f32 pb: %lld of %lld values differ from the cast of the new p "
                   "(or were written where no copy was given)", (long long)bad, (long long)total);
    }
    check_f("adamw_many_f32 m (70 tensors)", back(dm, total), m, total, 1e-6, 1e-7, -1);
    check_f("adamw_many_f32 v (70 tensors)", back(dv, total), v, total, 1e-6, 1e-7, -1);
    /* no tensors, and only empty ones: nothing to do, nothing touched */
    G->adamw_many_f32(pp, NULL, gp, mp, vp, counts, decay, step, ibc2, 0, b1, b2, eps, grad_scale);
    int64_t zeros[2] = {0, 0};
    G->adamw_many_f32(pp, pbp, gp, mp, vp, zeros, decay, step, ibc2, 2, b1, b2, eps, grad_scale);
    check_f("adamw_many_f32 of no elements leaves p alone", back(dp, total), p, total, 1e-6, 1e-7, -1);
    free_case();
}

void test_optim(void) {
    int64_t sizes[] = {1, 7, 4099};
    for (int s = 0; s < 3; s++) {
        int64_t n = sizes[s];
        char name[96];
        float *p = hrand(n, 1), *g = hrand(n, 0.1f), *m = hrand(n, 0.01f), *v = hrand(n, 0.001f);
        for (int64_t i = 0; i < n; i++) v[i] = fabsf(v[i]);
        float *dp = dupf(p, n), *dg = dupf(g, n), *dm = dupf(m, n), *dv = dupf(v, n);
        float lr = 1e-3f, b1 = 0.9f, b2 = 0.999f, t = 3;
        float step = lr / (1 - powf(b1, t)), ibc2 = 1 / sqrtf(1 - powf(b2, t));
        float grad_scale = s == 1 ? 1.0f : 0.61f;   /* as stored, and a clip coefficient */
        C->adamw_f32(p, g, m, v, n, b1, b2, 1e-8f, 1 - lr * 0.1f, step, ibc2, grad_scale);
        G->adamw_f32(dp, dg, dm, dv, n, b1, b2, 1e-8f, 1 - lr * 0.1f, step, ibc2, grad_scale);
        snprintf(name, sizeof name, "adamw_f32 p n=%lld", (long long)n);
        check_f(name, back(dp, n), p, n, 1e-6, 1e-7, -1);
        snprintf(name, sizeof name, "adamw_f32 m n=%lld", (long long)n);
        check_f(name, back(dm, n), m, n, 1e-6, 1e-7, -1);
        snprintf(name, sizeof name, "adamw_f32 v n=%lld", (long long)n);
        check_f(name, back(dv, n), v, n, 1e-6, 1e-7, -1);
        /* sgd: no momentum; momentum (first step, then a later one); nesterov */
        struct { float mom, damp, wd; int nesterov; } cfg[] = {{0, 0, 0.01f, 0}, {0.9f, 0.1f, 0.01f, 0}, {0.9f, 0, 0, 1}};
        for (int c = 0; c < 3; c++)
            for (int first = 1; first >= 0; first--) {
                float *buf = cfg[c].mom != 0 ? hrand(n, 0.1f) : NULL, *dbuf = buf ? dupf(buf, n) : NULL;
                float *p2 = hrand(n, 1), *dp2 = dupf(p2, n);
                C->sgd_f32(p2, g, buf, n, 0.1f, cfg[c].mom, cfg[c].damp, cfg[c].wd, cfg[c].nesterov, first);
                G->sgd_f32(dp2, dg, dbuf, n, 0.1f, cfg[c].mom, cfg[c].damp, cfg[c].wd, cfg[c].nesterov, first);
                snprintf(name, sizeof name, "sgd_f32 p momentum %g nesterov %d first %d n=%lld", cfg[c].mom,
                         cfg[c].nesterov, first, (long long)n);
                check_f(name, back(dp2, n), p2, n, 1e-6, 1e-7, -1);
                if (buf) {
                    snprintf(name, sizeof name, "sgd_f32 buf momentum %g nesterov %d first %d n=%lld", cfg[c].mom,
                             cfg[c].nesterov, first, (long long)n);
                    check_f(name, back(dbuf, n), buf, n, 1e-6, 1e-7, -1);
                }
            }
        free_case();
    }
}
