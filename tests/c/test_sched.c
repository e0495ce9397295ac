/* The FSDP schedule on one rank (single-rank communicator): parameter views
 * of a resharded unit refuse work, an abandoned backward leaves nothing
 * behind for the next one, a failed gather frees what it took, and bad
 * shapes are errors. */
#include "fsdp.h"
#include "testutil.h"
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
    check_failed_gather();
    return test_summary();
}
