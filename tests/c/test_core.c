/* The allocator's statistics and cap, tensors, views and in-place calls,
 * through the public API. */
#include "fsdp.h"
#include "internal.h"
#include "testutil.h"
#include <math.h>
#include <string.h>

#define CPU FSDP_DEVICE_CPU

static void check_allocator(void) {
    int64_t cur0, peak0, res0, cur, peak, res;
    fsdp_mem_stats(CPU, FSDP_TAG_OPTIMIZER, &cur0, &peak0, &res0);
    int64_t shape[2] = {100, 1000};   /* 400000 bytes: class rounding is at most 25% */
    fsdp_tensor *t;
    test_check(fsdp_tensor_zeros(&t, FSDP_F32, 2, shape, CPU, FSDP_TAG_OPTIMIZER) == FSDP_OK, "zeros: %s",
               fsdp_last_error());
    fsdp_mem_stats(CPU, FSDP_TAG_OPTIMIZER, &cur, &peak, &res);
    test_check(cur - cur0 >= 400000 && cur - cur0 <= 500000, "optimizer tag grew by %lld", (long long)(cur - cur0));
    test_check(peak >= cur && res >= cur, "peak %lld and reserved %lld cover current %lld", (long long)peak,
               (long long)res, (long long)cur);
    int64_t other_before;
    fsdp_mem_stats(CPU, FSDP_TAG_PARAM, &other_before, NULL, NULL);
    fsdp_tensor_release(t);
    fsdp_mem_stats(CPU, FSDP_TAG_OPTIMIZER, &cur, &peak, &res);
    test_check(cur == cur0, "freed: current back to %lld (is %lld)", (long long)cur0, (long long)cur);
    test_check(peak - cur0 >= 400000, "peak remembers the tensor");
    test_check(res >= 400000, "the block stays cached (reserved %lld)", (long long)res);
    /* the cached block is reused: reserved does not grow */
    int64_t tres0;
    fsdp_mem_stats(CPU, -1, NULL, NULL, &tres0);
    fsdp_tensor_zeros(&t, FSDP_F32, 2, shape, CPU, FSDP_TAG_PARAM);
    int64_t tres1;
    fsdp_mem_stats(CPU, -1, NULL, NULL, &tres1);
    test_check(tres1 == tres0, "cache reuse: total reserved %lld -> %lld", (long long)tres0, (long long)tres1);
    fsdp_tensor_release(t);
    fsdp_mem_reset_peak(CPU);
    fsdp_mem_stats(CPU, FSDP_TAG_OPTIMIZER, &cur, &peak, NULL);
    test_check(peak == cur, "reset peak: %lld == %lld", (long long)peak, (long long)cur);
    fsdp_mem_empty_cache(CPU);
    int64_t tcur;
    fsdp_mem_stats(CPU, -1, &tcur, NULL, &res);
    test_check(res == tcur, "empty cache: reserved %lld == current %lld", (long long)res, (long long)tcur);

    /* the cap: a clear error naming the request, the tag and the cap */
    test_check(fsdp_mem_set_cap(CPU, tcur + (1 << 20)) == FSDP_OK, "set cap");
    int64_t big[1] = {1 << 20};   /* 4 MiB of f32 */
    fsdp_status st = fsdp_tensor_empty(&t, FSDP_F32, 1, big, CPU, FSDP_TAG_GRAD);
    const char *msg = fsdp_last_error();
    test_check(st == FSDP_ERR_OOM, "over the cap gives FSDP_ERR_OOM (%d)", st);
    test_check(strstr(msg, "4.00 MiB") && strstr(msg, "grad") && strstr(msg, "cap") && strstr(msg, "rank 0"),
               "OOM message names request, tag, cap and rank: %s", msg);
    /* a message that wraps it names the rank once, at the end */
    char inner[512];
    snprintf(inner, sizeof inner, "%s", msg);
    fsdp_set_error(FSDP_ERR_OOM, "unit h.0: backward: %s; while gathering", inner);
    const char *wrapped = fsdp_last_error(), *first = strstr(wrapped, "[rank 0]");
    test_check(first && !strstr(first + 1, "[rank 0]") && strcmp(first, "[rank 0]") == 0 &&
                   strstr(wrapped, "4.00 MiB") && strstr(wrapped, "while gathering"),
               "a wrapped message names the rank once, at the end: %s", wrapped);
    int64_t small[1] = {1000};
    test_check(fsdp_tensor_empty(&t, FSDP_F32, 1, small, CPU, FSDP_TAG_GRAD) == FSDP_OK, "under the cap works");
    fsdp_tensor_release(t);
    fsdp_mem_set_cap(CPU, 0);
    test_check(fsdp_tensor_empty(&t, FSDP_F32, 1, big, CPU, FSDP_TAG_GRAD) == FSDP_OK, "cap removed");
    fsdp_tensor_release(t);
    test_check(fsdp_mem_stats(CPU, 17, &cur, NULL, NULL) == FSDP_ERR_INVALID, "unknown tag rejected");
    test_check(fsdp_mem_stats(9, -1, &cur, NULL, NULL) == FSDP_ERR_DEVICE, "unknown device rejected");
}

/* Persistent tags (param, grad, optimizer) round a request up by under 2%;
 * activations by at most 25% (their classes are coarser, for reuse). */
static void check_rounding(void) {
    const int64_t sizes[] = {1025, 1537, 4099, 250001, 1 << 20 | 1, 4862209, 39 * 1000 * 1000 + 7};
    const int tags[] = {FSDP_TAG_PARAM, FSDP_TAG_GRAD, FSDP_TAG_OPTIMIZER, FSDP_TAG_ACTIVATION};
    for (int k = 0; k < 4; k++) {
        for (size_t i = 0; i < sizeof sizes / sizeof sizes[0]; i++) {
            int64_t cur0, cur, n = sizes[i], bytes = 4 * n;
            fsdp_tensor *t;
            fsdp_mem_stats(CPU, tags[k], &cur0, NULL, NULL);
            test_check(fsdp_tensor_empty(&t, FSDP_F32, 1, &n, CPU, tags[k]) == FSDP_OK, "empty: %s", fsdp_last_error());
            fsdp_mem_stats(CPU, tags[k], &cur, NULL, NULL);
            double slack = (double)(cur - cur0 - bytes) / (double)bytes;
            double limit = tags[k] == FSDP_TAG_ACTIVATION ? 0.25 : 0.02;
            test_check(cur - cur0 >= bytes && slack <= limit, "tag %d, %lld bytes: held %lld (slack %.4f, limit %.2f)",
                       tags[k], (long long)bytes, (long long)(cur - cur0), slack, limit);
            fsdp_tensor_release(t);
        }
    }
    fsdp_mem_empty_cache(CPU);
}

static void check_views(void) {
    float v[24];
    for (int i = 0; i < 24; i++) v[i] = (float)i + 1;
    int64_t shape[3] = {2, 3, 4};
    fsdp_tensor *t, *p, *n, *e, *c;
    fsdp_tensor_from_data(&t, FSDP_F32, 3, shape, v, sizeof v, CPU, FSDP_TAG_OTHER);
    int perm[3] = {2, 0, 1};
    fsdp_permute(&p, t, 3, perm);                      /* (4,2,3) */
    int64_t ps[8], pst[8];
    fsdp_tensor_shape(p, ps);
    fsdp_tensor_strides(p, pst);
    test_check(ps[0] == 4 && ps[1] == 2 && ps[2] == 3 && pst[0] == 1 && pst[1] == 12 && pst[2] == 4,
               "permute shape/strides");
    int contig;
    fsdp_tensor_is_contiguous(p, &contig);
    test_check(!contig, "permuted view is not contiguous");
    fsdp_contiguous(&c, p);
    float out[24];
    fsdp_tensor_to_data(c, out, sizeof out);
    int bad = 0;
    for (int a = 0; a < 4; a++)
        for (int b = 0; b < 2; b++)
            for (int d = 0; d < 3; d++)
                if (out[(a * 2 + b) * 3 + d] != v[(b * 3 + d) * 4 + a]) bad++;
    test_check(bad == 0, "contiguous copy of a permuted view (%d wrong)", bad);
    /* narrow shares storage: writes show in the base */
    fsdp_narrow(&n, t, 2, 1, 2);                       /* (2,3,2) */
    fsdp_fill(n, -5.0);
    fsdp_tensor_to_data(t, out, sizeof out);
    bad = 0;
    for (int i = 0; i < 24; i++) {
        int k = i % 4;
        float want = (k == 1 || k == 2) ? -5.0f : v[i];
        if (out[i] != want) bad++;
    }
    test_check(bad == 0, "fill through a narrowed view (%d wrong)", bad);
    /* writing into an expanded view is refused */
    int64_t one[2] = {1, 3}, eshape[2] = {4, 3};
    fsdp_tensor *row;
    float rv[3] = {1, 2, 3};
    fsdp_tensor_from_data(&row, FSDP_F32, 2, one, rv, sizeof rv, CPU, FSDP_TAG_OTHER);
    fsdp_expand(&e, row, 2, eshape);
    fsdp_status st = fsdp_fill(e, 1.0);
    test_check(st == FSDP_ERR_LAYOUT && strstr(fsdp_last_error(), "f32[4,3]") && strstr(fsdp_last_error(), "stride 0"),
               "fill into an expanded view: %s", fsdp_last_error());
    /* copy broadcasts and converts */
    fsdp_tensor *dst;
    int64_t dshape[2] = {4, 3};
    fsdp_tensor_zeros(&dst, FSDP_BF16, 2, dshape, CPU, FSDP_TAG_OTHER);
    test_check(fsdp_copy(dst, row) == FSDP_OK, "copy broadcasting a row into bf16");
    double item;
    fsdp_tensor *last;
    fsdp_narrow(&last, dst, 0, 3, 1);
    fsdp_tensor *last2;
    fsdp_narrow(&last2, last, 1, 2, 1);
    fsdp_tensor_item(last2, &item);
    test_check(item == 3.0, "item of dst[3][2] is 3 (%g)", item);
    st = fsdp_tensor_item(dst, &item);
    test_check(st == FSDP_ERR_SHAPE && strstr(fsdp_last_error(), "bf16[4,3]"), "item of a non-scalar: %s",
               fsdp_last_error());
    /* reshape errors and -1 */
    fsdp_tensor *r;
    int64_t bad_shape[2] = {5, 5};
    st = fsdp_reshape(&r, t, 2, bad_shape);
    test_check(st == FSDP_ERR_SHAPE && strstr(fsdp_last_error(), "[5,5]") && strstr(fsdp_last_error(), "24"),
               "reshape to a wrong size: %s", fsdp_last_error());
    int64_t infer[2] = {-1, 6};
    test_check(fsdp_reshape(&r, p, 2, infer) == FSDP_OK, "reshape a permuted view with -1");
    int64_t rs[8];
    fsdp_tensor_shape(r, rs);
    test_check(rs[0] == 4 && rs[1] == 6, "inferred dim is 4");
    fsdp_tensor_release(r);
    st = fsdp_narrow(&r, t, 1, 2, 2);
    test_check(st == FSDP_ERR_INDEX && strstr(fsdp_last_error(), "[2, 4)"), "narrow out of range: %s",
               fsdp_last_error());
    int64_t toolong[1] = {5};
    st = fsdp_tensor_from_data(&r, FSDP_F32, 1, toolong, v, 8, CPU, FSDP_TAG_OTHER);
    test_check(st == FSDP_ERR_SHAPE, "from_data with too few bytes");
    int64_t neg[1] = {-2};
    test_check(fsdp_tensor_zeros(&r, FSDP_F32, 1, neg, CPU, FSDP_TAG_OTHER) == FSDP_ERR_SHAPE, "negative shape");
    test_check(fsdp_tensor_zeros(&r, 42, 1, toolong, CPU, FSDP_TAG_OTHER) == FSDP_ERR_DTYPE, "unknown dtype");
    test_check(fsdp_tensor_zeros(&r, FSDP_F32, 1, toolong, FSDP_DEVICE_CUDA, FSDP_TAG_OTHER) == FSDP_ERR_DEVICE,
               "no CUDA device in a CPU build: %s", fsdp_last_error());
    fsdp_tensor *list[] = {t, p, n, e, c, row, dst, last, last2};
    for (size_t i = 0; i < sizeof list / sizeof list[0]; i++) fsdp_tensor_release(list[i]);
}

static void check_threads_and_version(void) {
    const char *v;
    test_check(fsdp_version(&v) == FSDP_OK && strlen(v) > 0, "version");
    int n;
    test_check(fsdp_set_num_threads(3) == FSDP_OK, "set 3 threads");
    fsdp_get_num_threads(&n);
    test_check(n == 3, "3 threads (%d)", n);
    test_check(fsdp_set_num_threads(0) == FSDP_ERR_INVALID && strstr(fsdp_last_error(), "0 threads"),
               "0 threads rejected");
    int rank, world;
    fsdp_runtime_init(&rank, &world);
    test_check(rank == 0 && world == 1, "single process: rank 0 of 1");
}

/* fsdp_copy between contiguous tensors of one shape and different dtypes
 * converts in one pass: f32 -> bf16 rounds to nearest even (reference:
 * frexp and nearbyint on 8 significant bits), bf16 -> f32 is exact. */
static void check_copy_convert(void) {
    enum { N = 1001 };   /* odd: not a multiple of any vector width */
    float v[N];
    for (int i = 0; i < N; i++) v[i] = (float)((i * 37 % 1000) - 500) * 0.0137f * (i % 3 ? 1.0f : 1e-3f);
    v[1] = 1.0f + 1.0f / 256;   /* a tie, rounds down to even: 1 */
    v[2] = 1.0f + 3.0f / 256;   /* a tie, rounds up to even: 1 + 4/256 */
    v[3] = NAN;
    int64_t shape[2] = {7, 143};
    fsdp_tensor *f, *h, *back;
    fsdp_tensor_from_data(&f, FSDP_F32, 2, shape, v, sizeof v, CPU, FSDP_TAG_OTHER);
    fsdp_tensor_zeros(&h, FSDP_BF16, 2, shape, CPU, FSDP_TAG_OTHER);
    fsdp_tensor_zeros(&back, FSDP_F32, 2, shape, CPU, FSDP_TAG_OTHER);
    test_check(fsdp_copy(h, f) == FSDP_OK, "copy f32 -> bf16");
    test_check(fsdp_copy(back, h) == FSDP_OK, "copy bf16 -> f32");
    float got[N];
    fsdp_tensor_to_data(back, got, sizeof got);
    int bad = 0;
    for (int i = 0; i < N; i++) {
        if (isnan(v[i])) {
            bad += !isnan(got[i]);
            continue;
        }
        int e;
        double m = frexp((double)v[i], &e);
        double want = ldexp(nearbyint(m * 256.0) / 256.0, e);
        bad += (double)got[i] != want;
    }
    test_check(bad == 0, "f32 -> bf16 -> f32 through fsdp_copy rounds to nearest even (%d of %d wrong)", bad, N);
    test_check(got[1] == 1.0f && got[2] == 1.0f + 4.0f / 256, "ties to even: %g %g", got[1], got[2]);
    fsdp_tensor_release(f);
    fsdp_tensor_release(h);
    fsdp_tensor_release(back);
}

int main(void) {
    check_allocator();
    check_rounding();
    check_views();
    check_copy_convert();
    check_threads_and_version();
    return test_summary();
}
