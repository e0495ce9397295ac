/* The FSDP schedule on one rank (single-rank communicator): parameter views
 * of a resharded unit refuse work, an abandoned backward leaves nothing
 * behind for the next one, a failed gather frees what it took, and bad
 * shapes are errors. */
#include "fsdp.h"
#include "testutil.h"
#include <math.h>
#include <stdio.h>
#include <string.h>

static fsdp_sched *new_sched(int compute_dtype) {
    fsdp_comm *c = NULL;
    fsdp_sched *s = NULL;
    int rank, world;
    fsdp_runtime_init(&rank, &world);
    if (fsdp_comm_world(&c) != FSDP_OK || fsdp_sched_new(&s, c, NULL, compute_dtype, FSDP_F32, 0, 0, 2) != FSDP_OK) {
        fprintf(stderr, "schedule: %s\n", fsdp_last_error());
        return NULL;
    }
    fsdp_comm_free(c);
    return s;
}

static void check_resharded_views(void) {
    fsdp_sched *s = new_sched(FSDP_F32);
    int64_t n[1] = {16};
    int idx;
    fsdp_tensor *p = NULL, *q = NULL;
    test_check(fsdp_sched_add_unit(s, "u", 1, n, 0, &idx) == FSDP_OK, "add unit");
    test_check(fsdp_unit_param(s, idx, 0, 1, n, &p) == FSDP_OK, "parameter view");
    fsdp_status st = fsdp_init_normal(p, 0, 1, 1, 0, 0);
    test_check(st == FSDP_ERR_STATE && strstr(fsdp_last_error(), "resharded"), "init on a resharded view: %s",
               fsdp_last_error());
    double v;
    test_check(fsdp_sumsq(p, &v) == FSDP_ERR_STATE, "sumsq on a resharded view");
    test_check(fsdp_scale_(p, 2.0) == FSDP_ERR_STATE, "scale_ on a resharded view");
    st = fsdp_gelu(&q, p);
    test_check(st == FSDP_ERR_STATE && strstr(fsdp_last_error(), "fsdp_gelu"), "an op on a resharded view: %s",
               fsdp_last_error());
    test_check(fsdp_unit_unshard(s, idx) == FSDP_OK && fsdp_fill(p, 3.0) == FSDP_OK, "usable once gathered");
    int64_t neg[2] = {-2, -8};
    fsdp_tensor *bad = NULL;
    st = fsdp_unit_param(s, idx, 0, 2, neg, &bad);
    test_check(st == FSDP_ERR_SHAPE && strstr(fsdp_last_error(), "negative"), "negative view shape: %s",
               fsdp_last_error());
    fsdp_tensor_release(p);
    fsdp_sched_free(s);
}

/* loss = sum(p^2) (+ a Lua-style op on the first pass, which pauses the
 * walk and is abandoned): the second, complete backward alone counts. */
static void check_abandoned_backward(void) {
    fsdp_sched *s = new_sched(FSDP_F32);
    int64_t n[1] = {2};
    int idx;
    fsdp_tensor *master = NULL, *grad = NULL;
    fsdp_sched_add_unit(s, "u", 1, n, 1, &idx);
    fsdp_unit_shard(s, idx, &master, &grad);
    fsdp_fill(master, 1.0);
    for (int pass = 0; pass < 2; pass++) {
        fsdp_tensor *p = NULL, *sq = NULL, *sum = NULL, *r = NULL, *rsum = NULL, *loss = NULL;
        fsdp_unit_pre_forward(s, idx);
        fsdp_unit_param(s, idx, 0, 1, n, &p);
        if (pass == 0) {
            int prev;
            fsdp_set_grad_enabled(0, &prev);
            fsdp_scale(&r, p, 1.0);
            fsdp_set_grad_enabled(prev, NULL);
            fsdp_custom_record(7, 1, &p, 1, &r);
        }
        fsdp_mul(&sq, p, p);
        fsdp_sum(&sum, sq, 0, NULL, 0);
        if (pass == 0) {
            fsdp_sum(&rsum, r, 0, NULL, 0);
            fsdp_add(&loss, sum, rsum);
        } else {
            loss = sum;
            fsdp_tensor_retain(loss);
        }
        fsdp_unit_post_forward(s, idx);
        int id = -2;
        fsdp_backward_begin(loss, NULL);
        fsdp_backward_step(&id);
        if (pass == 0) {
            test_check(id == 7, "paused on the Lua-style op (%d)", id);
            fsdp_backward_abort();
            int on;
            fsdp_grad_enabled(&on);
            test_check(on == 1, "gradients enabled again after the abort");
        } else {
            test_check(id == -1, "second backward completes (%d)", id);
        }
        fsdp_tensor *all[] = {p, sq, sum, r, rsum, loss};
        for (int k = 0; k < 6; k++) fsdp_tensor_release(all[k]);
    }
    float g[2];
    double want[2] = {2.0, 2.0};
    fsdp_tensor_to_data(grad, g, sizeof g);
    test_compare("gradient shard after an abandoned backward", g, want, 2, 0, 1e-7);
    fsdp_tensor_release(master);
    fsdp_tensor_release(grad);
    fsdp_sched_free(s);
}

/* The flat gradient is not zeroed: each parameter's first gradient is
 * written (a weight's GEMM with beta = 0, a copy), later ones are added (a
 * parameter used twice), and a parameter the loss does not reach reads 0,
 * whatever the reused memory held (a freed gradient-sized block of NaNs is
 * what the allocator hands back). Unit: a (5), b (7, unused), W (3 x 4),
 * c (3, used twice); loss = sum(a * a) + sum(X @ W) + sum(c) + sum(c * c). */
static void check_unwritten_gradient(int compute_dtype) {
    fsdp_sched *s = new_sched(compute_dtype);
    int64_t n[4] = {5, 7, 12, 3}, ws[2] = {3, 4}, xs[2] = {2, 3}, total = 27;
    int idx;
    fsdp_tensor *master = NULL, *grad = NULL, *init = NULL, *x = NULL;
    float m0[27], xv[6] = {0.5f, -1.0f, 2.0f, 1.5f, 0.25f, -3.0f};
    for (int i = 0; i < 27; i++) m0[i] = 0.125f * (float)(i % 9) - 0.5f;
    test_check(fsdp_sched_add_unit(s, "u", 4, n, 0, &idx) == FSDP_OK, "add unit");
    fsdp_unit_shard(s, idx, &master, &grad);
    fsdp_tensor_from_data(&init, FSDP_F32, 1, &total, m0, sizeof m0, FSDP_DEVICE_CPU, FSDP_TAG_OTHER);
    fsdp_copy(master, init);
    fsdp_tensor_from_data(&x, FSDP_F32, 2, xs, xv, sizeof xv, FSDP_DEVICE_CPU, FSDP_TAG_ACTIVATION);
    if (compute_dtype != FSDP_F32) {
        fsdp_tensor *xc = NULL;
        fsdp_cast(&xc, x, compute_dtype);
        fsdp_tensor_release(x);
        x = xc;
    }
    for (int pass = 0; pass < 2; pass++) {
        fsdp_tensor *junk = NULL;   /* a gradient-sized block of NaNs, freed: the flat gradient may get it */
        fsdp_tensor_zeros(&junk, compute_dtype, 1, &total, FSDP_DEVICE_CPU, FSDP_TAG_GRAD);
        fsdp_fill(junk, NAN);
        fsdp_tensor_release(junk);
        fsdp_tensor *a = NULL, *b = NULL, *w = NULL, *c = NULL, *t[12] = {0};
        fsdp_unit_pre_forward(s, idx);
        fsdp_unit_param(s, idx, 0, 1, &n[0], &a);
        fsdp_unit_param(s, idx, 1, 1, &n[1], &b);
        fsdp_unit_param(s, idx, 2, 2, ws, &w);
        fsdp_unit_param(s, idx, 3, 1, &n[3], &c);
        fsdp_mul(&t[0], a, a);
        fsdp_sum(&t[1], t[0], 0, NULL, 0);
        fsdp_matmul(&t[2], x, w, 0, 0);
        fsdp_sum(&t[3], t[2], 0, NULL, 0);
        fsdp_sum(&t[4], c, 0, NULL, 0);
        fsdp_mul(&t[5], c, c);
        fsdp_sum(&t[6], t[5], 0, NULL, 0);
        fsdp_add(&t[7], t[1], t[3]);
        fsdp_add(&t[8], t[7], t[4]);
        fsdp_add(&t[9], t[8], t[6]);
        fsdp_unit_post_forward(s, idx);
        int id = -2;
        test_check(fsdp_backward_begin(t[9], NULL) == FSDP_OK && fsdp_backward_step(&id) == FSDP_OK && id == -1,
                   "backward (%s compute, pass %d): %s", compute_dtype == FSDP_F32 ? "f32" : "bf16", pass, fsdp_last_error());
        fsdp_tensor *all[] = {a, b, w, c};
        for (int k = 0; k < 4; k++) fsdp_tensor_release(all[k]);
        for (int k = 0; k < 10; k++) fsdp_tensor_release(t[k]);
        /* the gradient shard after pass + 1 backwards without zero_grad */
        double want[27];
        for (int i = 0; i < 5; i++) want[i] = 2.0 * m0[i];
        for (int i = 5; i < 12; i++) want[i] = 0.0;
        for (int k = 0; k < 3; k++)
            for (int j = 0; j < 4; j++) want[12 + 4 * k + j] = (double)xv[k] + xv[3 + k];   /* X^T @ ones */
        for (int i = 24; i < 27; i++) want[i] = 1.0 + 2.0 * m0[i];
        for (int i = 0; i < 27; i++) want[i] *= pass + 1;
        float g[27];
        fsdp_tensor_to_data(grad, g, sizeof g);
        char name[96];
        snprintf(name, sizeof name, "unzeroed flat gradient, %s compute, %d backward(s)", compute_dtype == FSDP_F32 ? "f32" : "bf16",
                 pass + 1);
        double tol = compute_dtype == FSDP_F32 ? 1e-6 : 1.0 / 64;
        test_compare(name, g, want, 27, 1e-6, tol);
        int unused_exact = 1;
        for (int i = 5; i < 12; i++) unused_exact = unused_exact && g[i] == 0.0f;
        test_check(unused_exact, "%s: the unused parameter's gradient is exactly 0", name);
    }
    fsdp_tensor_release(master);
    fsdp_tensor_release(grad);
    fsdp_tensor_release(init);
    fsdp_tensor_release(x);
    fsdp_sched_free(s);
}

/* bf16 compute: the gather casts the f32 master straight into the bf16
 * buffer, so room for that buffer is enough; with less, the gather fails
 * cleanly and leaves the parameter bytes as they were */
static void check_failed_gather(void) {
    fsdp_sched *s = new_sched(FSDP_BF16);
    int64_t n[1] = {1 << 16};
    int idx;
    fsdp_sched_add_unit(s, "u", 1, n, 0, &idx);
    fsdp_mem_empty_cache(FSDP_DEVICE_CPU);
    int64_t before, after, total;
    fsdp_mem_stats(FSDP_DEVICE_CPU, FSDP_TAG_PARAM, &before, NULL, NULL);
    fsdp_mem_stats(FSDP_DEVICE_CPU, -1, &total, NULL, NULL);
    fsdp_mem_set_cap(FSDP_DEVICE_CPU, total + (1 << 16));   /* half the bf16 buffer */
    fsdp_status st = fsdp_unit_unshard(s, idx);
    fsdp_mem_stats(FSDP_DEVICE_CPU, FSDP_TAG_PARAM, &after, NULL, NULL);
    test_check(st == FSDP_ERR_OOM, "the gather fails under the cap (%d): %s", st, fsdp_last_error());
    test_check(after == before, "and leaves the param bytes as they were (%lld -> %lld)", (long long)before,
               (long long)after);
    fsdp_mem_set_cap(FSDP_DEVICE_CPU, total + (1 << 17) + 4096);   /* the bf16 buffer, no f32 staging */
    st = fsdp_unit_unshard(s, idx);
    fsdp_mem_stats(FSDP_DEVICE_CPU, FSDP_TAG_PARAM, &after, NULL, NULL);
    test_check(st == FSDP_OK, "room for the bf16 buffer alone is enough (%d): %s", st,
               st == FSDP_OK ? "" : fsdp_last_error());
    test_check(after - before >= (1 << 17) && after - before < (1 << 17) + 4096,
               "and it costs the bf16 buffer only (param bytes %lld -> %lld)", (long long)before, (long long)after);
    fsdp_mem_set_cap(FSDP_DEVICE_CPU, 0);
    fsdp_sched_free(s);
}

int main(void) {
    check_resharded_views();
    check_abandoned_backward();
    check_unwritten_gradient(FSDP_F32);
    check_unwritten_gradient(FSDP_BF16);
    check_failed_gather();
    return test_summary();
}
