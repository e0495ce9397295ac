/* test_cuda_kernels_memory.c: the CUDA table's memory entries against the
 * CPU's: host <-> device copies, zero, cast_any between every pair of dtypes
 * (specials: NaN, inf, out of range), strided copies, fill, and the random
 * init and dropout kernels (Philox, counter-based: an offset picks up a
 * stream in the middle).
 * Tolerances: bit for bit, except the normal init: within 4 ulp
 * (cuda_internal.h: equal but where glibc's logf/cosf are not correctly
 * rounded, ~0.8% of values, <= 3 ulp). */
#include "cuda_kernels_check.h"
#include <string.h>

static int32_t ulp_key(float f) {   /* monotonic integer order of floats */
    int32_t i;
    memcpy(&i, &f, sizeof i);
    return i < 0 ? (int32_t)0x80000000 - i : i;
}
static int64_t ulp_diff(float a, float b) {
    return llabs((long long)ulp_key(a) - (long long)ulp_key(b));
}

/* ---- memory ---- */

void test_memory(void) {
    size_t sizes[] = {1, 7, 4099};
    for (int s = 0; s < 3; s++) {
        size_t n = sizes[s];
        unsigned char *h = halloc(n), *z = halloc(n), *r = halloc(n);
        for (size_t i = 0; i < n; i++) {
            h[i] = (unsigned char)(test_rng_uniform(&rng) * 255 + 1);
            z[i] = 0;
        }
        void *d = dup_bytes(h, n);
        G->synchronize();
        G->copy_to_host(r, d, n);
        char name[64];
        snprintf(name, sizeof name, "copy_from_host/copy_to_host n=%zu", n);
        check_bits(name, r, h, n);
        G->zero(d, n);
        G->copy_to_host(r, d, n);
        snprintf(name, sizeof name, "zero n=%zu", n);
        check_bits(name, r, z, n);
        free_case();
    }
    G->synchronize();
}

/* ---- casts ---- */

static size_t dtype_bytes(int dt) { return dt == FSDP_I64 ? 8 : dt == FSDP_F32 || dt == FSDP_I32 ? 4 : 2; }

static void fill_dtype(void *p, int dt, int64_t n) {
    const float specials[] = {NAN, INFINITY, -INFINITY, 3e9f, -3e9f, 1e20f, -1e20f, 70000.0f, -0.5f, 0.0f, -0.0f,
                              2.5f, -2.5f, 65535.5f};
    for (int64_t i = 0; i < n; i++) {
        double u = test_rng_uniform(&rng);
        float f = i % 3 == 0 ? specials[i / 3 % 14] : (float)((u - 0.5) * 1000.0);
        int64_t k = (int64_t)((u - 0.5) * 4e12);
        switch (dt) {
        case FSDP_F32: ((float *)p)[i] = f; break;
        case FSDP_BF16: ((uint16_t *)p)[i] = f32_to_bf16(f); break;
        case FSDP_I32: ((int32_t *)p)[i] = (int32_t)(k % 3000000000LL); break;
        case FSDP_I64: ((int64_t *)p)[i] = k * 1000003; break;
        default: ((uint16_t *)p)[i] = (uint16_t)k; break;
        }
    }
}

void test_cast(void) {
    int64_t sizes[] = {1, 7, 1031};
    for (int s = 0; s < 3; s++)
        for (int in_dt = 0; in_dt < FSDP_DTYPE_COUNT; in_dt++)
            for (int out_dt = 0; out_dt < FSDP_DTYPE_COUNT; out_dt++) {
                int64_t n = sizes[s];
                void *in = halloc((size_t)n * dtype_bytes(in_dt));
                fill_dtype(in, in_dt, n);
                size_t ob = (size_t)n * dtype_bytes(out_dt);
                void *want = halloc(ob), *got = halloc(ob);
                memset(want, 0xab, ob);
                C->cast_any(want, out_dt, in, in_dt, n);
                void *din = dup_bytes(in, (size_t)n * dtype_bytes(in_dt)), *dout = dup_bytes(want, ob);
                G->zero(dout, ob);
                G->cast_any(dout, out_dt, din, in_dt, n);
                G->copy_to_host(got, dout, ob);
                char name[80];
                snprintf(name, sizeof name, "cast_any %s -> %s n=%lld", fsdp_dtype_name(in_dt), fsdp_dtype_name(out_dt),
                         (long long)n);
                check_bits(name, got, want, ob);
                free_case();
            }
}

/* ---- strided copy ---- */

typedef struct {
    const char *name;
    int ndim;
    int64_t shape[8], dst_strides[8], src_strides[8];
    int64_t dst_extent, src_extent;   /* elements the buffers hold */
} copy_case;

static void run_copy(const copy_case *c, size_t elem) {
    size_t db = (size_t)c->dst_extent * elem, sb = (size_t)c->src_extent * elem;
    unsigned char *src = halloc(sb), *want = halloc(db), *got = halloc(db);
    for (size_t i = 0; i < sb; i++) src[i] = (unsigned char)(test_rng_uniform(&rng) * 256);
    for (size_t i = 0; i < db; i++) want[i] = (unsigned char)(test_rng_uniform(&rng) * 256);   /* untouched bytes stay */
    void *dsrc = dup_bytes(src, sb), *ddst = dup_bytes(want, db);
    C->copy_strided(want, c->dst_strides, src, c->src_strides, c->ndim, c->shape, elem);
    G->copy_strided(ddst, c->dst_strides, dsrc, c->src_strides, c->ndim, c->shape, elem);
    G->copy_to_host(got, ddst, db);
    char name[96];
    snprintf(name, sizeof name, "copy_strided %s elem %zu", c->name, elem);
    check_bits(name, got, want, db);
    free_case();
}

void test_copy_strided(void) {
    copy_case cases[] = {
        {"scalar", 0, {0}, {0}, {0}, 1, 1},
        {"contiguous 1031", 1, {1031}, {1}, {1}, 1031, 1031},
        {"transpose 37x53", 2, {37, 53}, {53, 1}, {1, 37}, 37 * 53, 37 * 53},
        {"permute 5x7x3", 3, {5, 7, 3}, {21, 3, 1}, {1, 15, 5}, 105, 105},
        {"broadcast 11x13 from 13", 2, {11, 13}, {13, 1}, {0, 1}, 143, 13},
        {"broadcast 11x13 from 11x1", 2, {11, 13}, {13, 1}, {1, 0}, 143, 11},
        {"narrow 6x5 of 6x9", 2, {6, 5}, {5, 1}, {9, 1}, 30, 54},
        {"into strided dst 4x3x2", 3, {4, 3, 2}, {12, 4, 1}, {6, 2, 1}, 48, 24},
        {"size-1 dims 1x7x1x3", 4, {1, 7, 1, 3}, {21, 3, 3, 1}, {100, 1, 50, 7}, 21, 21},
        {"empty", 2, {3, 0}, {1, 1}, {1, 1}, 1, 1},
        {"8-d 2x1x3x1x2x2x1x3", 8, {2, 1, 3, 1, 2, 2, 1, 3}, {72, 72, 24, 24, 12, 6, 3, 1},
         {1, 2, 2, 6, 6, 12, 24, 24}, 144, 72},
    };
    size_t elems[] = {1, 2, 4, 8, 12};
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++)
        for (int e = 0; e < 5; e++) run_copy(&cases[i], elems[e]);
}

void test_fill(void) {
    int64_t sizes[] = {1, 7, 100003};
    for (int s = 0; s < 3; s++) {
        int64_t n = sizes[s];
        float *want = hnan(n);
        float *d = dnan(n);
        C->fill_f32(want, -1.25f, n);
        G->fill_f32(d, -1.25f, n);
        char name[64];
        snprintf(name, sizeof name, "fill_f32 n=%lld", (long long)n);
        check_bits(name, back(d, n), want, (size_t)n * sizeof(float));
        free_case();
    }
}

/* ---- random ---- */

void test_random(void) {
    int64_t sizes[] = {1, 7, 100003};
    uint64_t seeds[] = {0, 1234, 0xfedcba9876543210ull};
    int64_t offsets[] = {0, 5, ((int64_t)1 << 33) + 11};
    for (int s = 0; s < 3; s++)
        for (int k = 0; k < 3; k++) {
            int64_t n = sizes[s], off = offsets[k];
            uint64_t seed = seeds[k], stream = 7 + (uint64_t)k * 0x100000001ull;
            char name[128];
            float *want = hnan(n), *got = dnan(n);
            C->init_uniform_f32(want, n, -0.1f, 0.3f, seed, stream, off);
            G->init_uniform_f32(got, n, -0.1f, 0.3f, seed, stream, off);
            snprintf(name, sizeof name, "init_uniform_f32 n=%lld seed %llx offset %lld", (long long)n,
                     (unsigned long long)seed, (long long)off);
            check_bits(name, back(got, n), want, (size_t)n * sizeof(float));
            C->init_uniform_f32(want, n, 2.0f, 2.0f, seed, stream, off);
            G->init_uniform_f32(got, n, 2.0f, 2.0f, seed, stream, off);
            snprintf(name, sizeof name, "init_uniform_f32 low == high n=%lld", (long long)n);
            check_bits(name, back(got, n), want, (size_t)n * sizeof(float));
            C->init_normal_f32(want, n, 0.5f, 0.02f, seed, stream, off);
            G->init_normal_f32(got, n, 0.5f, 0.02f, seed, stream, off);
            float *g = back(got, n);
            int64_t max_ulp = 0, differ = 0;
            for (int64_t i = 0; i < n; i++) {
                int64_t u = ulp_diff(g[i], want[i]);
                differ += u != 0;
                if (u > max_ulp) max_ulp = u;
            }
            test_check(max_ulp <= 4, "init_normal_f32 n=%lld seed %llx offset %lld: %lld values differ, by up to %lld ulp",
                       (long long)n, (unsigned long long)seed, (long long)off, (long long)differ, (long long)max_ulp);
            if (differ)
                printf("  init_normal_f32 n=%lld: %lld of %lld values differ from the CPU's, by at most %lld ulp\n",
                       (long long)n, (long long)differ, (long long)n, (long long)max_ulp);
            float ps[] = {0.0f, 0.1f, 0.5f, 0.999f};
            for (int p = 0; p < 4; p++) {
                float *x = hrand(n, 2), *wd = hnan(n), *dx = dupf(x, n), *gd = dnan(n);
                C->dropout_f32(wd, x, n, ps[p], seed, off);
                G->dropout_f32(gd, dx, n, ps[p], seed, off);
                snprintf(name, sizeof name, "dropout_f32 p %g n=%lld offset %lld", ps[p], (long long)n, (long long)off);
                check_bits(name, back(gd, n), wd, (size_t)n * sizeof(float));
                G->dropout_f32(dx, dx, n, ps[p], seed, off);   /* in place */
                snprintf(name, sizeof name, "dropout_f32 in place p %g n=%lld", ps[p], (long long)n);
                check_bits(name, back(dx, n), wd, (size_t)n * sizeof(float));
            }
            free_case();
        }
}
