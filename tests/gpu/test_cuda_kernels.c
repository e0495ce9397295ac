/* test_cuda_kernels.c: every entry of the CUDA kernel table against the
 * CPU table's entry of the same name, on random non-zero inputs of awkward
 * sizes (1, odd, prime, a few thousand), then a few ops end to end through
 * the public API with tensors on the GPU.
 *
 * Built twice (tests/gpu/CMakeLists.txt):
 * - test_cuda_kernels: the real CUDA backend. Without a GPU it prints
 *   "SKIPPED: <why>" and exits 77, which ctest reports as skipped.
 * - test_cuda_kernels_emu (FSDP_CUDA_EMU): the same .cu sources compiled for
 *   the host over tests/gpu/emu, which runs each kernel's threads as fibers
 *   with real barriers and checks launches and pointers: the kernels' logic
 *   is checked on every machine, the GPU build then checks the hardware.
 *
 * Tolerances, |gpu - cpu| <= rtol |cpu| + atol * scale (scale: the largest
 * |cpu| of the output, or the bound named):
 *   memory, casts, copies, fill, binary ops, scale, add_scalar, embedding
 *   (both ways: same order of adds), uniform init, dropout: bit for bit.
 *   axpy, adamw (one tensor or many), sgd: rtol 1e-6 (contraction into FMAs
 *   may differ).
 *   matmul: 1e-5 * (|alpha| sum_k |a_ik||b_kj| + |beta||c_ij|) per element.
 *   sum_dim: 1e-6 * the sum of |x| over the reduced elements; sum_all, sumsq:
 *   1e-10 relative to sum |x| (both accumulate in double).
 *   activations, softmax, norms, cross-entropy: rtol 1e-5, atol 1e-6 (the
 *   GPU's expf is within 2 ulp, glibc's within 1; norm weight gradients sum
 *   rows in another order: atol 1e-5).
 *   attention: rtol 1e-4, atol 1e-4 (flash tiling and exp differ); the bf16
 *   packed and flash attention: see their tests.
 *   normal init: within 4 ulp (cuda_internal.h: equal but where glibc's
 *   logf/cosf are not correctly rounded, ~0.8% of values, <= 3 ulp).
 * Outputs start as NaN on both sides, so a skipped element fails.
 *
 * Flags: --init-only (start-up checks only), --fault (a failing op must end
 * the process with a message naming device and op), --bench (time per call
 * of the main kernels at GPT-2 small sizes; toy sizes in the emulation),
 * --flash B H T D (the flash attention once at that shape, for a profiler). */
#include "cpu_kernels.h"
#include "cuda_internal.h"
#include "device.h"
#include "fsdp.h"
#include "internal.h"
#include "cuda_case.h"
#include "testutil.h"
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#ifdef FSDP_CUDA_EMU
void emu_set_device_count(int n);
#define MODE "emulated CUDA"
#else
#define MODE "CUDA"
#endif

/* Cases of GPT-2 size, on the GPU only (the emulation runs a thread at a time). */
#if defined(FSDP_CUDA_EMU) && !defined(FSDP_TEST_BIG)
#define BIG(...)
#else
#define BIG(...) __VA_ARGS__,
#endif

static const fsdp_device_kernels *C;   /* the CPU table (G, the CUDA table: cuda_case.h) */
static test_rng rng;

static float *hrand(int64_t n, float scale) {
    float *x = halloc((size_t)n * sizeof(float));
    test_fill_nonzero(&rng, x, n, scale);
    return x;
}
static float *hnan(int64_t n) {
    float *x = halloc((size_t)n * sizeof(float));
    for (int64_t i = 0; i < n; i++) x[i] = NAN;
    return x;
}
static float *hcopy(const float *x, int64_t n) {
    float *y = halloc((size_t)n * sizeof(float));
    memcpy(y, x, (size_t)n * sizeof(float));
    return y;
}
/* a device copy of host bytes */
static void *dup(const void *h, size_t bytes) {
    void *d = dalloc(bytes);
    if (bytes) G->copy_from_host(d, h, bytes);
    return d;
}
static float *dupf(const float *h, int64_t n) { return dup(h, (size_t)n * sizeof(float)); }
static float *dnan(int64_t n) { return dupf(hnan(n), n); }
static float *back(const void *d, int64_t n) {
    float *h = halloc((size_t)(n > 0 ? n : 1) * sizeof(float));
    if (n > 0) G->copy_to_host(h, d, (size_t)n * sizeof(float));
    return h;
}

/* ---- comparisons ---- */

static int32_t ulp_key(float f) {   /* monotonic integer order of floats */
    int32_t i;
    memcpy(&i, &f, sizeof i);
    return i < 0 ? (int32_t)0x80000000 - i : i;
}
static int64_t ulp_diff(float a, float b) {
    return llabs((long long)ulp_key(a) - (long long)ulp_key(b));
}

/* Counts values with |got - want| > rtol |want| + atol * scale (NaN must be
 * NaN on both sides); scale < 0 means max |want|. */
static void check_f(const char *what, const float *got, const float *want, int64_t n, double rtol, double atol,
                    double scale) {
    if (scale < 0) {
        scale = 0;
        for (int64_t i = 0; i < n; i++)
            if (fabs(want[i]) > scale) scale = fabs(want[i]);
    }
    int64_t wrong = 0, first = -1;
    double max_err = 0;
    for (int64_t i = 0; i < n; i++) {
        double g = got[i], w = want[i];
        int ok = isnan(w) ? isnan(g) : fabs(g - w) <= rtol * fabs(w) + atol * scale;
        if (!isnan(w) && !isnan(g) && fabs(g - w) > max_err) max_err = fabs(g - w);
        if (!ok) {
            if (first < 0) first = i;
            wrong++;
        }
    }
    if (wrong)
        fprintf(stderr, "  %s: first wrong at %lld: got %.9g want %.9g\n", what, (long long)first,
                (double)got[first], (double)want[first]);
    test_check(wrong == 0, "%s: %lld of %lld values wrong (rtol %g, atol %g x %g; max err %.3g)", what,
               (long long)wrong, (long long)n, rtol, atol, scale, max_err);
}

static void check_bits(const char *what, const void *got, const void *want, size_t bytes) {
    const unsigned char *g = got, *w = want;
    size_t wrong = 0, first = 0;
    for (size_t i = 0; i < bytes; i++)
        if (g[i] != w[i]) {
            if (!wrong) first = i;
            wrong++;
        }
    if (wrong) fprintf(stderr, "  %s: first differing byte %zu: got 0x%02x want 0x%02x\n", what, first, g[first], w[first]);
    test_check(wrong == 0, "%s: %zu of %zu bytes differ (expected bit for bit)", what, wrong, bytes);
}

/* per element bound: |got - want| <= tol * bound[i] */
static void check_bound(const char *what, const float *got, const float *want, const double *bound, int64_t n,
                        double tol) {
    int64_t wrong = 0, first = -1;
    for (int64_t i = 0; i < n; i++) {
        double err = fabs((double)got[i] - want[i]);
        if (!(err <= tol * bound[i] + 1e-30)) {
            if (first < 0) first = i;
            wrong++;
        }
    }
    if (wrong)
        fprintf(stderr, "  %s: first wrong at %lld: got %.9g want %.9g (bound %.3g)\n", what, (long long)first,
                (double)got[first], (double)want[first], tol * bound[first]);
    test_check(wrong == 0, "%s: %lld of %lld values beyond %g x their bound", what, (long long)wrong, (long long)n,
               tol);
}

/* ---- memory ---- */

static void test_memory(void) {
    size_t sizes[] = {1, 7, 4099};
    for (int s = 0; s < 3; s++) {
        size_t n = sizes[s];
        unsigned char *h = halloc(n), *z = halloc(n), *r = halloc(n);
        for (size_t i = 0; i < n; i++) {
            h[i] = (unsigned char)(test_rng_uniform(&rng) * 255 + 1);
            z[i] = 0;
        }
        void *d = dup(h, n);
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

static void test_cast(void) {
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
                void *din = dup(in, (size_t)n * dtype_bytes(in_dt)), *dout = dup(want, ob);
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
    void *dsrc = dup(src, sb), *ddst = dup(want, db);
    C->copy_strided(want, c->dst_strides, src, c->src_strides, c->ndim, c->shape, elem);
    G->copy_strided(ddst, c->dst_strides, dsrc, c->src_strides, c->ndim, c->shape, elem);
    G->copy_to_host(got, ddst, db);
    char name[96];
    snprintf(name, sizeof name, "copy_strided %s elem %zu", c->name, elem);
    check_bits(name, got, want, db);
    free_case();
}

static void test_copy_strided(void) {
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

static void test_fill(void) {
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

/* ---- matmul ---- */

typedef struct {
    int64_t batch, M, N, K;
    int ta, tb;
    float alpha, beta;
    int shared_b;
} mm_case;

/* For every element of C: the error bound |alpha| sum_k |a_ik b_kj| + |beta c_ij|
 * and, when exact is given, alpha sum_k a_ik b_kj + beta c_ij in double. */
static void mm_reference(const mm_case *m, const float *a, const float *b, const float *c0, float *exact,
                         double *bound) {
    int64_t sa = m->M * m->K, sb = m->shared_b ? 0 : m->K * m->N, sc = m->M * m->N;
    for (int64_t bi = 0; bi < m->batch; bi++)
        for (int64_t i = 0; i < m->M; i++)
            for (int64_t j = 0; j < m->N; j++) {
                const float *A = a + bi * sa, *B = b + bi * sb;
                double s = 0, mag = 0;
                for (int64_t k = 0; k < m->K; k++) {
                    double x = m->ta ? A[k * m->M + i] : A[i * m->K + k];
                    double y = m->tb ? B[j * m->K + k] : B[k * m->N + j];
                    s += x * y;
                    mag += fabs(x * y);
                }
                int64_t at = bi * sc + i * m->N + j;
                double c = m->beta != 0 ? (double)c0[at] : 0;
                if (exact) exact[at] = (float)(m->alpha * s + m->beta * c);
                bound[at] = fabs(m->alpha) * mag + fabs(m->beta * c) + 1e-30;
            }
}

static void run_matmul(const mm_case *m) {
    int64_t sa = m->M * m->K, sb = m->shared_b ? 0 : m->K * m->N, sc = m->M * m->N;
    int64_t na = m->batch * sa, nb = m->shared_b ? m->K * m->N : m->batch * sb, nc = m->batch * sc;
    float *a = hrand(na, 1), *b = hrand(nb, 1), *c0 = m->beta != 0 ? hrand(nc, 1) : hnan(nc);
    float *want = hcopy(c0, nc);
    float *da = dupf(a, na), *db = dupf(b, nb), *dc = dupf(c0, nc);
    C->matmul_f32(want, a, b, m->batch, m->M, m->N, m->K, m->ta, m->tb, m->alpha, m->beta, sa, sb, sc);
    G->matmul_f32(dc, da, db, m->batch, m->M, m->N, m->K, m->ta, m->tb, m->alpha, m->beta, sa, sb, sc);
    double *bound = halloc((size_t)nc * sizeof(double));
    mm_reference(m, a, b, c0, NULL, bound);
    char name[128];
    snprintf(name, sizeof name, "matmul_f32 batch %lld M %lld N %lld K %lld ta %d tb %d alpha %g beta %g%s",
             (long long)m->batch, (long long)m->M, (long long)m->N, (long long)m->K, m->ta, m->tb, m->alpha, m->beta,
             m->shared_b ? " shared b" : "");
    check_bound(name, back(dc, nc), want, bound, nc, 1e-5);
    free_case();
}

/* The bf16 GEMM (tensor cores, f32 accumulation): against the product of
 * the same bf16 values in double, within one bf16 rounding of the result
 * (2^-8 relative to sum |a||b|, which also covers f32 accumulation). */
static void run_matmul_bf16(const mm_case *m) {
    int64_t sa = m->M * m->K, sb = m->shared_b ? 0 : m->K * m->N, sc = m->M * m->N;
    int64_t na = m->batch * sa, nb = m->shared_b ? m->K * m->N : m->batch * sb, nc = m->batch * sc;
    float *a = hrand(na, 1), *b = hrand(nb, 1), *c0 = hrand(nc, 1);
    uint16_t *ah = halloc((size_t)na * 2), *bh = halloc((size_t)nb * 2), *ch = halloc((size_t)nc * 2);
    for (int64_t i = 0; i < na; i++) a[i] = bf16_to_f32(ah[i] = f32_to_bf16(a[i]));
    for (int64_t i = 0; i < nb; i++) b[i] = bf16_to_f32(bh[i] = f32_to_bf16(b[i]));
    for (int64_t i = 0; i < nc; i++) c0[i] = bf16_to_f32(ch[i] = f32_to_bf16(c0[i]));
    uint16_t *da = dup(ah, (size_t)na * 2), *db = dup(bh, (size_t)nb * 2), *dc = dup(ch, (size_t)nc * 2);
    G->matmul_bf16(dc, da, db, m->batch, m->M, m->N, m->K, m->ta, m->tb, m->alpha, m->beta, sa, sb, sc);
    uint16_t *got16 = halloc((size_t)nc * 2);
    G->copy_to_host(got16, dc, (size_t)nc * 2);
    float *got = halloc((size_t)nc * sizeof(float)), *want = halloc((size_t)nc * sizeof(float));
    double *bound = halloc((size_t)nc * sizeof(double));
    mm_reference(m, a, b, c0, want, bound);
    for (int64_t i = 0; i < nc; i++) got[i] = bf16_to_f32(got16[i]);
    char name[128];
    snprintf(name, sizeof name, "matmul_bf16 batch %lld M %lld N %lld K %lld ta %d tb %d alpha %g beta %g%s",
             (long long)m->batch, (long long)m->M, (long long)m->N, (long long)m->K, m->ta, m->tb, m->alpha, m->beta,
             m->shared_b ? " shared b" : "");
    check_bound(name, got, want, bound, nc, 1.0 / 256);
    free_case();
}

static void test_matmul(void) {
    for (int ta = 0; ta < 2; ta++)
        for (int tb = 0; tb < 2; tb++) {
            mm_case cs[] = {
                {1, 1, 1, 1, ta, tb, 1, 0, 0},
                {1, 7, 13, 5, ta, tb, 1, 0, 0},
                {3, 17, 9, 31, ta, tb, 0.5f, 0, 0},
                {2, 5, 11, 37, ta, tb, 1, 1, 1},
                {4, 3, 7, 2, ta, tb, -2, 0.25f, 0},
                {1, 65, 33, 129, ta, tb, 1, 0, 0},
            };
            for (size_t i = 0; i < sizeof cs / sizeof cs[0]; i++) {
                run_matmul(&cs[i]);
                if (cs[i].K > 0) run_matmul_bf16(&cs[i]);
            }
        }
    mm_case k0[] = {{2, 3, 4, 0, 0, 0, 1, 0.5f, 0}, {2, 3, 4, 0, 1, 1, 1, 0, 0},
                    BIG({4, 128, 384, 512, 0, 1, 1, 0, 0}, {1, 512, 768, 1024, 1, 0, 1, 1, 0})};
    for (size_t i = 0; i < sizeof k0 / sizeof k0[0]; i++) run_matmul(&k0[i]);
}

/* ---- elementwise ---- */

typedef struct {
    const char *name;
    int ndim;
    int64_t shape[4], sa[4], sb[4];
    int64_t na, nb;   /* elements a and b hold */
} bin_case;

static void test_binary(void) {
    bin_case cs[] = {
        {"same 1", 1, {1}, {1}, {1}, 1, 1},
        {"same 1031", 1, {1031}, {1}, {1}, 1031, 1031},
        {"scalar b", 2, {7, 9}, {9, 1}, {0, 0}, 63, 1},
        {"scalar a", 2, {7, 9}, {0, 0}, {9, 1}, 1, 63},
        {"bias (13,37)+(37)", 2, {13, 37}, {37, 1}, {0, 1}, 481, 37},
        {"column (13,37)+(13,1)", 2, {13, 37}, {37, 1}, {1, 0}, 481, 13},
        {"both broadcast (5,1,3)x(1,4,3)", 3, {5, 4, 3}, {3, 0, 1}, {0, 3, 1}, 15, 12},
        {"transposed a (6,5)", 2, {6, 5}, {1, 6}, {5, 1}, 30, 30},
        {"4-d with size-1", 4, {2, 1, 3, 5}, {15, 15, 5, 1}, {0, 0, 5, 1}, 30, 15},
    };
    const char *ops[] = {"add", "sub", "mul", "div"};
    for (int op = 0; op < 4; op++)
        for (size_t i = 0; i < sizeof cs / sizeof cs[0]; i++) {
            const bin_case *c = &cs[i];
            int64_t n = 1;
            for (int k = 0; k < c->ndim; k++) n *= c->shape[k];
            float *a = hrand(c->na, 3), *b = hrand(c->nb, 2), *want = hnan(n);
            float *da = dupf(a, c->na), *db = dupf(b, c->nb), *dout = dnan(n);
            C->binary_f32(op, want, a, c->sa, b, c->sb, c->ndim, c->shape);
            G->binary_f32(op, dout, da, c->sa, db, c->sb, c->ndim, c->shape);
            char name[96];
            snprintf(name, sizeof name, "binary_f32 %s %s", ops[op], c->name);
            check_bits(name, back(dout, n), want, (size_t)n * sizeof(float));
            free_case();
        }
}

static void test_scalar_ops(void) {
    int64_t sizes[] = {1, 7, 4099};
    for (int s = 0; s < 3; s++) {
        int64_t n = sizes[s];
        char name[64];
        float *a = hrand(n, 3), *y = hrand(n, 2);
        float *want = hnan(n), *da = dupf(a, n), *dout = dnan(n);
        C->scale_f32(want, a, -0.37f, n);
        G->scale_f32(dout, da, -0.37f, n);
        snprintf(name, sizeof name, "scale_f32 n=%lld", (long long)n);
        check_bits(name, back(dout, n), want, (size_t)n * sizeof(float));
        C->add_scalar_f32(want, a, 1.7f, n);
        G->add_scalar_f32(dout, da, 1.7f, n);
        snprintf(name, sizeof name, "add_scalar_f32 n=%lld", (long long)n);
        check_bits(name, back(dout, n), want, (size_t)n * sizeof(float));
        float *wy = hcopy(y, n), *dy = dupf(y, n);
        C->axpy_f32(wy, a, 0.3f, n);
        G->axpy_f32(dy, da, 0.3f, n);
        snprintf(name, sizeof name, "axpy_f32 n=%lld", (long long)n);
        check_f(name, back(dy, n), wy, n, 1e-6, 1e-7, -1);
        G->scale_f32(da, da, 2.0f, n);   /* in place */
        C->scale_f32(a, a, 2.0f, n);
        snprintf(name, sizeof name, "scale_f32 in place n=%lld", (long long)n);
        check_bits(name, back(da, n), a, (size_t)n * sizeof(float));
        free_case();
    }
}

/* ---- reductions ---- */

static void test_sum_dim(void) {
    int64_t cs[][3] = {{1, 1, 1},   {3, 7, 1},    {5, 100, 1},   {2, 1000, 1}, {1, 5000, 13},
                       {7, 33, 37}, {1, 70001, 3}, {600, 3, 1},  {2, 0, 5},    {3, 600, 2},
                       BIG({1, 65536, 768}, {64, 1024, 1})};
    for (size_t i = 0; i < sizeof cs / sizeof cs[0]; i++) {
        int64_t outer = cs[i][0], red = cs[i][1], inner = cs[i][2], n = outer * red * inner, no = outer * inner;
        float *x = hrand(n, 1), *ax = halloc((size_t)(n > 0 ? n : 1) * sizeof(float));
        for (int64_t k = 0; k < n; k++) ax[k] = fabsf(x[k]);
        float *want = hnan(no), *abs_sum = hnan(no);
        C->sum_dim_f32(want, x, outer, red, inner);
        C->sum_dim_f32(abs_sum, ax, outer, red, inner);
        float *dx = dupf(x, n), *dout = dnan(no);
        G->sum_dim_f32(dout, dx, outer, red, inner);
        double *bound = halloc((size_t)no * sizeof(double));
        for (int64_t k = 0; k < no; k++) bound[k] = abs_sum[k] + 1e-30;
        char name[96];
        snprintf(name, sizeof name, "sum_dim_f32 (%lld, %lld, %lld)", (long long)outer, (long long)red,
                 (long long)inner);
        check_bound(name, back(dout, no), want, bound, no, 1e-6);
        free_case();
    }
}

static void test_sum_all(void) {
    int64_t sizes[] = {0, 1, 7, 1031, 300007};
    for (int s = 0; s < 5; s++) {
        int64_t n = sizes[s];
        float *x = hrand(n > 0 ? n : 1, 1);
        float *dx = dupf(x, n > 0 ? n : 1);
        double abs = 0, sq = 0;
        for (int64_t i = 0; i < n; i++) abs += fabs(x[i]), sq += (double)x[i] * x[i];
        double ws = C->sum_all_f32(x, n), gs = G->sum_all_f32(dx, n);
        double wq = C->sumsq_f32(x, n), gq = G->sumsq_f32(dx, n);
        test_check(fabs(gs - ws) <= 1e-10 * abs, "sum_all_f32 n=%lld: got %.17g want %.17g", (long long)n, gs, ws);
        test_check(fabs(gq - wq) <= 1e-10 * sq, "sumsq_f32 n=%lld: got %.17g want %.17g", (long long)n, gq, wq);
        free_case();
    }
}

/* many tensors at once (empty ones, some larger than a block, more than a
 * launch's group of 14), against the
 * CPU's sumsq per tensor added in order: 1e-10 relative to the sum */
static void test_sumsq_many(void) {
    test_check(G->sumsq_many_f32 != NULL, "CUDA has sumsq_many_f32");
    if (!G->sumsq_many_f32) return;
    int64_t counts[] = {7, 0, 1, 5000, 4096, 4097, 3, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9000, 10};
    const int n = (int)(sizeof counts / sizeof counts[0]);
    const float *ptrs[sizeof counts / sizeof counts[0]];
    double want = 0, abs = 0;
    for (int i = 0; i < n; i++) {
        float *x = hrand(counts[i] > 0 ? counts[i] : 1, 2);
        want += C->sumsq_f32(x, counts[i]);
        for (int64_t k = 0; k < counts[i]; k++) abs += (double)x[k] * x[k];
        ptrs[i] = dupf(x, counts[i] > 0 ? counts[i] : 1);
    }
    double got = G->sumsq_many_f32(ptrs, counts, n);
    test_check(fabs(got - want) <= 1e-10 * abs, "sumsq_many_f32 over %d tensors: got %.17g want %.17g", n, got, want);
    test_check(G->sumsq_many_f32(ptrs, counts, 0) == 0.0, "sumsq_many_f32 of no tensors is 0");
    int64_t zeros[] = {0, 0};
    test_check(G->sumsq_many_f32(ptrs, zeros, 2) == 0.0, "sumsq_many_f32 of empty tensors is 0");
    free_case();
}

/* ---- activations, softmax ---- */

typedef void (*unary_fn)(float *, const float *, int64_t);
typedef void (*unary_bwd_fn)(float *, const float *, const float *, int64_t);

static void test_activations(void) {
    struct { const char *name; unary_fn gf, cf; unary_bwd_fn gb, cb; } acts[] = {
        {"gelu", G->gelu_forward_f32, C->gelu_forward_f32, G->gelu_backward_f32, C->gelu_backward_f32},
        {"silu", G->silu_forward_f32, C->silu_forward_f32, G->silu_backward_f32, C->silu_backward_f32},
    };
    int64_t sizes[] = {1, 7, 4099};
    for (int a = 0; a < 2; a++)
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

static void test_softmax(void) {
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

static void test_norms(void) {
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

/* ---- embedding, cross-entropy ---- */

static void test_embedding(void) {
    int64_t cs[][3] = {{1, 1, 1}, {13, 50, 7}, {1000, 300, 65}, {5, 2000, 33}, {70000, 100, 3}, BIG({50257, 8192, 768})};
    for (size_t i = 0; i < sizeof cs / sizeof cs[0]; i++) {
        int64_t V = cs[i][0], n = cs[i][1], dim = cs[i][2];
        int64_t *ids = halloc((size_t)n * sizeof(int64_t));
        for (int64_t k = 0; k < n; k++) ids[k] = (int64_t)(test_rng_uniform(&rng) * (double)V) % V;
        float *table = hrand(V * dim, 1), *dout = hrand(n * dim, 1);
        float *want = hnan(n * dim), *wdt = hnan(V * dim);
        C->embedding_forward_f32(want, ids, n, table, dim);
        C->embedding_backward_f32(wdt, V, ids, n, dout, dim);
        int64_t *dids = dup(ids, (size_t)n * sizeof(int64_t));
        float *dtab = dupf(table, V * dim), *ddout = dupf(dout, n * dim), *gout = dnan(n * dim), *gdt = dnan(V * dim);
        G->embedding_forward_f32(gout, dids, n, dtab, dim);
        G->embedding_backward_f32(gdt, V, dids, n, ddout, dim);
        char name[96];
        snprintf(name, sizeof name, "embedding_forward_f32 V %lld n %lld dim %lld", (long long)V, (long long)n,
                 (long long)dim);
        check_bits(name, back(gout, n * dim), want, (size_t)(n * dim) * sizeof(float));
        snprintf(name, sizeof name, "embedding_backward_f32 V %lld n %lld dim %lld", (long long)V, (long long)n,
                 (long long)dim);
        check_bits(name, back(gdt, V * dim), wdt, (size_t)(V * dim) * sizeof(float));
        /* a bf16 table: the picked rows bit for bit (the host's gather of the same bits) */
        if (G->embedding_forward_bf16) {
            uint16_t *t16 = halloc((size_t)(V * dim) * sizeof(uint16_t)), *w16 = halloc((size_t)(n * dim) * 2);
            for (int64_t k = 0; k < V * dim; k++) t16[k] = f32_to_bf16(table[k]);
            for (int64_t r = 0; r < n; r++) memcpy(w16 + r * dim, t16 + ids[r] * dim, (size_t)dim * 2);
            uint16_t *h16 = halloc((size_t)(n * dim) * 2);
            for (int64_t k = 0; k < n * dim; k++) h16[k] = 0x7fc1;   /* a NaN where nothing was written */
            uint16_t *dt16 = dup(t16, (size_t)(V * dim) * 2), *g16 = dup(h16, (size_t)(n * dim) * 2);
            G->embedding_forward_bf16(g16, dids, n, dt16, dim);
            snprintf(name, sizeof name, "embedding_forward_bf16 V %lld n %lld dim %lld", (long long)V, (long long)n,
                     (long long)dim);
            G->copy_to_host(h16, g16, (size_t)(n * dim) * 2);
            check_bits(name, h16, w16, (size_t)(n * dim) * 2);
        }
        free_case();
    }
}

static void test_cross_entropy(void) {
    int64_t cs[][3] = {{1, 1, 1}, {7, 13, 13}, {5, 1000, 997}, {3, 50304, 50257}, {40, 17, 16}, BIG({64, 50304, 50257})};
    const int64_t ignore = -100;
    for (size_t i = 0; i < sizeof cs / sizeof cs[0]; i++) {
        int64_t N = cs[i][0], V = cs[i][1], valid = cs[i][2];
        int64_t *t = halloc((size_t)N * sizeof(int64_t));
        for (int64_t k = 0; k < N; k++)
            t[k] = k % 4 == 3 ? ignore : (int64_t)(test_rng_uniform(&rng) * (double)valid) % valid;
        float *x = hrand(N * V, 8), *losses = hnan(N), *lse = hnan(N);
        int64_t count = C->cross_entropy_forward_f32(losses, lse, x, t, N, V, valid, ignore);
        int64_t *dt = dup(t, (size_t)N * sizeof(int64_t));
        float *dx = dupf(x, N * V), *gl = dnan(N), *glse = dnan(N);
        int64_t gcount = G->cross_entropy_forward_f32(gl, glse, dx, dt, N, V, valid, ignore);
        char name[96];
        snprintf(name, sizeof name, "cross_entropy_forward_f32 (%lld, %lld) valid %lld", (long long)N, (long long)V,
                 (long long)valid);
        test_check(gcount == count, "%s: count %lld, want %lld", name, (long long)gcount, (long long)count);
        check_f(name, back(gl, N), losses, N, 1e-5, 1e-6, -1);
        snprintf(name, sizeof name, "cross_entropy_forward_f32 lse (%lld, %lld)", (long long)N, (long long)V);
        check_f(name, back(glse, N), lse, N, 1e-5, 1e-6, -1);
        /* the rows alone (the count known to the caller): the same losses and lse */
        float *rl = dnan(N), *rlse = dnan(N);
        G->cross_entropy_rows_f32(rl, rlse, dx, dt, N, V, valid, ignore);
        snprintf(name, sizeof name, "cross_entropy_rows_f32 (%lld, %lld) valid %lld", (long long)N, (long long)V,
                 (long long)valid);
        check_f(name, back(rl, N), losses, N, 1e-5, 1e-6, -1);
        check_f(name, back(rlse, N), lse, N, 1e-5, 1e-6, -1);
        /* bf16 logits: against the CPU's bf16 forward on the same bits */
        uint16_t *xb = halloc((size_t)(N * V) * sizeof(uint16_t));
        for (int64_t k = 0; k < N * V; k++) xb[k] = f32_to_bf16(x[k]);
        float *bl = hnan(N), *blse = hnan(N), *gbl = dnan(N), *gblse = dnan(N);
        C->cross_entropy_forward_bf16(bl, blse, xb, t, N, V, valid, ignore);
        G->cross_entropy_rows_bf16(gbl, gblse, dup(xb, (size_t)(N * V) * sizeof(uint16_t)), dt, N, V, valid, ignore);
        snprintf(name, sizeof name, "cross_entropy_rows_bf16 (%lld, %lld) valid %lld", (long long)N, (long long)V,
                 (long long)valid);
        check_f(name, back(gbl, N), bl, N, 1e-5, 1e-6, -1);
        check_f(name, back(gblse, N), blse, N, 1e-5, 1e-6, -1);
        /* the gradient of the mean loss (1), on each side's device; each row gets 1 / count */
        int64_t div = count ? count : 1;
        float dloss = 1.0f / (float)div, one = 1.0f, *gone = dupf(&one, 1);
        float *wdx = hnan(N * V), *clse = dupf(lse, N), *gdx = dnan(N * V);
        C->cross_entropy_backward_f32(wdx, x, lse, t, N, V, valid, ignore, &one, div);
        G->cross_entropy_backward_f32(gdx, dx, clse, dt, N, V, valid, ignore, gone, div);
        snprintf(name, sizeof name, "cross_entropy_backward_f32 (%lld, %lld) valid %lld", (long long)N, (long long)V,
                 (long long)valid);
        check_f(name, back(gdx, N * V), wdx, N * V, 1e-5, 1e-6, dloss);
        free_case();
    }
}

/* ---- the vocabulary-chunked classifier and embedding (slice geometry: engine/cpu/classifier.c) ---- */

static void test_classifier(void) {
    /* N, blocks, rows per run, table rows between runs, valid rows */
    int64_t cs[][5] = {{1, 1, 1, 1, 1}, {5, 1, 10, 97, 97}, {7, 1, 7, 96, 89}, {5, 3, 4, 33, 97}, {9, 7, 1, 2, 11},
                       {3, 8, 517, 6288, 50257}};
    const int64_t ignore = -100;
    for (size_t c = 0; c < sizeof cs / sizeof cs[0]; c++) {
        int64_t N = cs[c][0], blocks = cs[c][1], br = cs[c][2], stride = cs[c][3], valid = cs[c][4];
        int64_t R = blocks * br, row0 = stride > br ? stride - br : 0;   /* the last slice of each run */
        int64_t *t = halloc((size_t)N * sizeof(int64_t));
        for (int64_t k = 0; k < N; k++)
            t[k] = k % 4 == 3 ? ignore : (int64_t)(test_rng_uniform(&rng) * (double)valid) % valid;
        float *x = hrand(N * R, 8), *m = halloc((size_t)N * sizeof(float)), *s = hrand(N, 1), *tl = hrand(N, 1);
        for (int64_t k = 0; k < N; k++) {   /* a first slice (where it has real rows), and one after others */
            bool first = k % 2 && row0 < valid;
            m[k] = first ? -INFINITY : 1.5f;
            s[k] = first ? 0.0f : fabsf(s[k]);
        }
        int64_t *dt = dup(t, (size_t)N * sizeof(int64_t));
        float *dx = dupf(x, N * R), *gm = dupf(m, N), *gs = dupf(s, N), *gtl = dupf(tl, N);
        C->classifier_lse_f32(m, s, tl, x, t, N, blocks, br, stride, row0, valid, ignore);
        G->classifier_lse_f32(gm, gs, gtl, dx, dt, N, blocks, br, stride, row0, valid, ignore);
        char name[128];
        snprintf(name, sizeof name, "classifier_lse_f32 N %lld, %lld runs of %lld (stride %lld, valid %lld)",
                 (long long)N, (long long)blocks, (long long)br, (long long)stride, (long long)valid);
        check_f(name, back(gm, N), m, N, 0, 0, 0);
        check_f(name, back(gs, N), s, N, 1e-5, 0, 0);
        check_f(name, back(gtl, N), tl, N, 0, 0, 0);
        float *lse = hnan(N), *losses = hnan(N), *glse = dnan(N), *gl = dnan(N);
        int64_t count = C->classifier_finish_f32(lse, losses, m, s, tl, t, N, ignore);
        float *cm = dupf(m, N), *cs_ = dupf(s, N), *ctl = dupf(tl, N);
        int64_t gcount = G->classifier_finish_f32(glse, gl, cm, cs_, ctl, dt, N, ignore);
        test_check(gcount == count, "%s: count %lld, want %lld", name, (long long)gcount, (long long)count);
        check_f(name, back(glse, N), lse, N, 1e-6, 1e-6, -1);
        check_f(name, back(gl, N), losses, N, 1e-6, 1e-6, -1);
        float one = 1.0f, *gone = dupf(&one, 1), *want = hnan(N * R), *clse = dupf(lse, N), *gdx = dnan(N * R);
        C->classifier_dlogits_f32(want, x, lse, t, N, blocks, br, stride, row0, valid, ignore, &one, count);
        G->classifier_dlogits_f32(gdx, dx, clse, dt, N, blocks, br, stride, row0, valid, ignore, gone, count);
        snprintf(name, sizeof name, "classifier_dlogits_f32 N %lld, %lld runs of %lld", (long long)N,
                 (long long)blocks, (long long)br);
        check_f(name, back(gdx, N * R), want, N * R, 1e-5, 1e-6, count ? 1.0 / (double)count : 1.0);
        /* the embedding: rows of the slice picked and scattered back */
        int64_t dim = c % 2 ? 3 : 40, n = N * 3 + 1;
        int64_t *ids = halloc((size_t)n * sizeof(int64_t));
        for (int64_t k = 0; k < n; k++) ids[k] = (int64_t)(test_rng_uniform(&rng) * (double)(blocks * stride));
        ids[0] = row0;   /* one in the slice for sure */
        float *rows = hrand(R * dim, 1), *dout = hrand(n * dim, 1), *out = hrand(n * dim, 1);
        int64_t *dids = dup(ids, (size_t)n * sizeof(int64_t));
        float *grows = dupf(rows, R * dim), *gdout = dupf(dout, n * dim), *gout = dupf(out, n * dim);
        float *dr = hnan(R * dim), *gdr = dnan(R * dim);
        C->embedding_slice_forward_f32(out, ids, n, rows, dim, blocks, br, stride, row0);
        G->embedding_slice_forward_f32(gout, dids, n, grows, dim, blocks, br, stride, row0);
        C->embedding_slice_backward_f32(dr, ids, n, dout, dim, blocks, br, stride, row0);
        G->embedding_slice_backward_f32(gdr, dids, n, gdout, dim, blocks, br, stride, row0);
        snprintf(name, sizeof name, "embedding_slice_forward_f32 n %lld dim %lld", (long long)n, (long long)dim);
        check_bits(name, back(gout, n * dim), out, (size_t)(n * dim) * sizeof(float));
        snprintf(name, sizeof name, "embedding_slice_backward_f32 n %lld dim %lld", (long long)n, (long long)dim);
        check_bits(name, back(gdr, R * dim), dr, (size_t)(R * dim) * sizeof(float));
        free_case();
    }
}

/* ---- attention ---- */

static void test_attention(void) {
    int64_t cs[][4] = {{1, 1, 1, 1}, {2, 3, 17, 8}, {1, 2, 70, 64}, {1, 1, 33, 128},
                       {1, 1, 5, 200}, {1, 1, 9, 520}, {2, 1, 40, 3}, BIG({2, 4, 257, 64}, {1, 2, 1024, 64})};
    for (size_t i = 0; i < sizeof cs / sizeof cs[0]; i++)
        for (int causal = 0; causal < 2; causal++) {
            int64_t B = cs[i][0], H = cs[i][1], T = cs[i][2], D = cs[i][3], n = B * H * T * D, nl = B * H * T;
            float scale = 1.0f / sqrtf((float)D);
            float *q = hrand(n, 1), *k = hrand(n, 1), *v = hrand(n, 1), *dout = hrand(n, 1);
            float *o = hnan(n), *lse = hnan(nl);
            C->attention_forward_f32(o, lse, q, k, v, B, H, T, D, causal, scale);
            float *dq = hnan(n), *dk = hnan(n), *dv = hnan(n);
            C->attention_backward_f32(dq, dk, dv, dout, q, k, v, o, lse, B, H, T, D, causal, scale);
            float *gq = dupf(q, n), *gk = dupf(k, n), *gv = dupf(v, n), *gdo = dupf(dout, n);
            float *go = dnan(n), *glse = dnan(nl);
            G->attention_forward_f32(go, glse, gq, gk, gv, B, H, T, D, causal, scale);
            float *co = dupf(o, n), *clse = dupf(lse, nl), *gdq = dnan(n), *gdk = dnan(n), *gdv = dnan(n);
            G->attention_backward_f32(gdq, gdk, gdv, gdo, gq, gk, gv, co, clse, B, H, T, D, causal, scale);
            char tag[64], name[128];
            snprintf(tag, sizeof tag, "(%lld, %lld, %lld, %lld)%s", (long long)B, (long long)H, (long long)T,
                     (long long)D, causal ? " causal" : "");
            snprintf(name, sizeof name, "attention_forward_f32 out %s", tag);
            check_f(name, back(go, n), o, n, 1e-4, 1e-4, -1);
            snprintf(name, sizeof name, "attention_forward_f32 lse %s", tag);
            check_f(name, back(glse, nl), lse, nl, 1e-4, 1e-4, -1);
            snprintf(name, sizeof name, "attention_backward_f32 dq %s", tag);
            check_f(name, back(gdq, n), dq, n, 1e-4, 1e-4, -1);
            snprintf(name, sizeof name, "attention_backward_f32 dk %s", tag);
            check_f(name, back(gdk, n), dk, n, 1e-4, 1e-4, -1);
            snprintf(name, sizeof name, "attention_backward_f32 dv %s", tag);
            check_f(name, back(gdv, n), dv, n, 1e-4, 1e-4, -1);
            free_case();
        }
}

/* ---- bf16 entries ----
 * Each against the CPU's f32 kernel on the same bf16 values, the f32 result
 * rounded to bf16 (to nearest even) as the reference. Tolerances:
 *   binary ops, scale, add_scalar: bit for bit (one f32 op, one rounding).
 *   everything else: within one bf16 ulp (2^-7 relative: the GPU's f32 math
 *   may differ from the CPU's by an f32 ulp, which can move the rounding),
 *   plus 2^-8 of the output's largest value where sums cancel (softmax and
 *   norm backward), or the bounds named. */
static float *round_bf16_host(float *x, int64_t n) {   /* in place; returns x */
    for (int64_t i = 0; i < n; i++) x[i] = bf16_to_f32(f32_to_bf16(x[i]));
    return x;
}
static float *hrand16(int64_t n, float scale) { return round_bf16_host(hrand(n, scale), n); }
static uint16_t *dup16(const float *h, int64_t n) {   /* h holds bf16 values */
    uint16_t *t = halloc((size_t)(n > 0 ? n : 1) * 2);
    for (int64_t i = 0; i < n; i++) t[i] = f32_to_bf16(h[i]);
    return dup(t, (size_t)(n > 0 ? n : 1) * 2);
}
static uint16_t *dnan16(int64_t n) { return (uint16_t *)dup16(hnan(n), n); }
static float *back_bf16(const void *d, int64_t n);
static uint16_t *da_host16(const float *h, int64_t n) {   /* h holds bf16 values: their bits, on the host */
    uint16_t *t = halloc((size_t)(n > 0 ? n : 1) * 2);
    for (int64_t i = 0; i < n; i++) t[i] = f32_to_bf16(h[i]);
    return t;
}

#define ULP16 (1.0 / 128)

static void test_bf16_elementwise(void) {
    test_check(G->binary_bf16 && G->scale_bf16 && G->add_scalar_bf16 && G->axpy_bf16 && G->sum_dim_bf16,
               "CUDA has the bf16 elementwise entries");
    if (!G->binary_bf16 || !G->scale_bf16 || !G->add_scalar_bf16 || !G->axpy_bf16 || !G->sum_dim_bf16) return;
    bin_case cs[] = {
        {"same shape (vector path)", 1, {4096}, {1}, {1}, 4096, 4096},
        {"same shape, odd", 1, {4099}, {1}, {1}, 4099, 4099},
        {"bias (3, 5, 8) + (8)", 3, {3, 5, 8}, {40, 8, 1}, {0, 0, 1}, 120, 8},
        {"transposed a", 2, {7, 5}, {1, 7}, {5, 1}, 35, 35},
        {"scalar b", 2, {3, 9}, {9, 1}, {0, 0}, 27, 1},
    };
    const char *ops[] = {"add", "sub", "mul", "div"};
    for (int op = 0; op < 4; op++)
        for (size_t i = 0; i < sizeof cs / sizeof cs[0]; i++) {
            const bin_case *c = &cs[i];
            int64_t n = 1;
            for (int k = 0; k < c->ndim; k++) n *= c->shape[k];
            float *a = hrand16(c->na, 3), *b = hrand16(c->nb, 2), *want = hnan(n);
            C->binary_f32(op, want, a, c->sa, b, c->sb, c->ndim, c->shape);
            uint16_t *da = dup16(a, c->na), *db = dup16(b, c->nb), *dout = dnan16(n);
            G->binary_bf16(op, dout, da, c->sa, db, c->sb, c->ndim, c->shape);
            char name[96];
            snprintf(name, sizeof name, "binary_bf16 %s %s", ops[op], c->name);
            check_f(name, back_bf16(dout, n), round_bf16_host(want, n), n, 0, 0, 0);
            free_case();
        }
    int64_t sizes[] = {1, 7, 4096, 4099};
    for (int s = 0; s < 4; s++) {
        int64_t n = sizes[s];
        char name[64];
        float *a = hrand16(n, 3), *y = hrand16(n, 2), *want = hnan(n);
        uint16_t *da = dup16(a, n), *dout = dnan16(n);
        C->scale_f32(want, a, -0.37f, n);
        G->scale_bf16(dout, da, -0.37f, n);
        snprintf(name, sizeof name, "scale_bf16 n=%lld", (long long)n);
        check_f(name, back_bf16(dout, n), round_bf16_host(want, n), n, 0, 0, 0);
        C->add_scalar_f32(want, a, 1.7f, n);
        G->add_scalar_bf16(dout, da, 1.7f, n);
        snprintf(name, sizeof name, "add_scalar_bf16 n=%lld", (long long)n);
        check_f(name, back_bf16(dout, n), round_bf16_host(want, n), n, 0, 0, 0);
        float *wy = hcopy(y, n);
        uint16_t *dy = dup16(y, n);
        C->axpy_f32(wy, a, 0.3f, n);
        G->axpy_bf16(dy, da, 0.3f, n);
        snprintf(name, sizeof name, "axpy_bf16 n=%lld", (long long)n);
        check_f(name, back_bf16(dy, n), wy, n, ULP16, 1e-6, -1);   /* (FMA on the CPU: cancellation) */
        /* f32 y += alpha x (bf16): against the CPU's, at an unaligned y too */
        test_check(G->axpy_f32_bf16 != NULL, "CUDA has axpy_f32_bf16");
        if (G->axpy_f32_bf16) {
            for (int off = 0; off < 2; off++) {
                float *wf = hcopy(y, n);
                C->axpy_f32_bf16(wf, da_host16(a, n), -0.7f, n);
                float *dyf = (float *)dalloc((size_t)(n + 1) * sizeof(float)) + off;
                G->copy_from_host(dyf, y, (size_t)n * sizeof(float));
                G->axpy_f32_bf16(dyf, da, -0.7f, n);
                snprintf(name, sizeof name, "axpy_f32_bf16 n=%lld%s", (long long)n, off ? " (y unaligned)" : "");
                check_f(name, back(dyf, n), wf, n, 1e-6, 0, 0);
            }
        }
        free_case();
    }
    int64_t sd[][3] = {{1, 1, 1}, {3, 7, 1}, {2, 1000, 1}, {7, 33, 37}, {1, 3000, 13}, {3, 600, 2}};
    for (size_t i = 0; i < sizeof sd / sizeof sd[0]; i++) {
        int64_t outer = sd[i][0], red = sd[i][1], inner = sd[i][2], n = outer * red * inner, no = outer * inner;
        float *x = hrand16(n, 1), *ax = halloc((size_t)n * sizeof(float)), *want = hnan(no), *abs_sum = hnan(no);
        for (int64_t k = 0; k < n; k++) ax[k] = fabsf(x[k]);
        C->sum_dim_f32(want, x, outer, red, inner);
        C->sum_dim_f32(abs_sum, ax, outer, red, inner);
        uint16_t *dx = dup16(x, n), *dout = dnan16(no);
        G->sum_dim_bf16(dout, dx, outer, red, inner);
        double *bound = halloc((size_t)no * sizeof(double));
        for (int64_t k = 0; k < no; k++) bound[k] = abs_sum[k] + 1e-30;
        char name[96];
        snprintf(name, sizeof name, "sum_dim_bf16 (%lld, %lld, %lld)", (long long)outer, (long long)red,
                 (long long)inner);
        check_bound(name, back_bf16(dout, no), want, bound, no, ULP16);   /* |want| <= sum |x| */
        /* accumulating: out holds a bf16 value first, gets old + sum (one rounding) */
        test_check(G->sum_dim_acc_bf16 != NULL, "CUDA has sum_dim_acc_bf16");
        if (G->sum_dim_acc_bf16) {
            float *old = hrand16(no, 4), *want_acc = hnan(no);
            for (int64_t k = 0; k < no; k++) {
                want_acc[k] = old[k] + want[k];
                bound[k] = abs_sum[k] + fabsf(old[k]) + 1e-30;
            }
            uint16_t *dacc = dup16(old, no);
            G->sum_dim_acc_bf16(dacc, dx, outer, red, inner);
            snprintf(name, sizeof name, "sum_dim_acc_bf16 (%lld, %lld, %lld)", (long long)outer, (long long)red,
                     (long long)inner);
            check_bound(name, back_bf16(dacc, no), want_acc, bound, no, ULP16);
        }
        free_case();
    }
}

/* The fused bias entries (cuda_fused.cu) against the CPU's (fused.c, itself
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

static void test_fused(void) {
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

static void test_bf16_nn(void) {
    test_check(G->gelu_forward_bf16 && G->softmax_forward_bf16 && G->layernorm_forward_bf16 &&
                   G->cross_entropy_forward_bf16,
               "CUDA has the bf16 nn entries");
    if (!G->gelu_forward_bf16 || !G->softmax_forward_bf16 || !G->layernorm_forward_bf16 ||
        !G->cross_entropy_forward_bf16)
        return;
    struct { const char *name; unary16_fn gf; unary_fn cf; unary16_bwd_fn gb; unary_bwd_fn cb; } acts[] = {
        {"gelu", G->gelu_forward_bf16, C->gelu_forward_f32, G->gelu_backward_bf16, C->gelu_backward_f32},
        {"silu", G->silu_forward_bf16, C->silu_forward_f32, G->silu_backward_bf16, C->silu_backward_f32},
    };
    for (int a = 0; a < 2; a++)
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
        int64_t *dt = dup(t, (size_t)N * sizeof(int64_t));
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

/* Cross-entropy, forward in one pass (online max and sum per thread), against
 * a double reference on the same values: rows of one element, a prime
 * vocabulary, rows of a multiple of 16 bytes with a tail of padding (the
 * 16-byte path) and the same rows one element off 16 bytes (the element
 * path), logits that rise along the row (a new max at every element), huge
 * logits (exp would overflow without the max taken out), a -inf logit,
 * targets at both ends, ignored rows and a batch of only ignored rows. The
 * backward, f32 and bf16, against the double formula on the lse given. */
static void ce_reference(double *loss, double *lse, const float *x, const int64_t *t, int64_t N, int64_t V,
                         int64_t valid, int64_t ignore) {
    for (int64_t n = 0; n < N; n++) {
        const float *r = x + n * V;
        double m = -INFINITY, s = 0;
        for (int64_t j = 0; j < valid; j++) m = fmax(m, r[j]);
        for (int64_t j = 0; j < valid; j++) s += exp((double)r[j] - m);
        lse[n] = m + log(s);
        loss[n] = t[n] == ignore ? 0.0 : lse[n] - r[t[n]];
    }
}

static void test_cross_entropy_online(void) {
    /* N, V, valid, kind (0 random, 1 rising, 2 huge, 3 a -inf logit), all rows ignored */
    int64_t cs[][5] = {{1, 1, 1, 0, 0},    {5, 1, 1, 2, 0},      {4, 1009, 1009, 0, 0}, {6, 64, 61, 0, 0},
                       {6, 64, 61, 1, 0},  {3, 1009, 1009, 2, 0}, {5, 48, 48, 3, 0},    {4, 64, 61, 0, 1},
                       {3, 4096, 4093, 1, 0}};
    const int64_t ignore = -100;
    for (size_t c = 0; c < sizeof cs / sizeof cs[0]; c++) {
        int64_t N = cs[c][0], V = cs[c][1], valid = cs[c][2], kind = cs[c][3], none = cs[c][4];
        for (int off = 0; off < 2; off++) {   /* off 1: logits one element off 16 bytes */
            float *x = hrand(N * V, 8);
            for (int64_t n = 0; n < N; n++)
                for (int64_t j = 0; j < V; j++) {
                    float *v = &x[n * V + j];
                    if (kind == 1) *v = 0.01f * (float)j + 0.001f * *v;
                    if (kind == 2) *v = 8.0e4f + 1.0e3f * *v;
                    if (kind == 3 && j == 1 + n % (valid - 1)) *v = -INFINITY;
                }
            round_bf16_host(x, N * V);   /* the same values for the f32 and the bf16 kernels */
            int64_t *t = halloc((size_t)N * sizeof(int64_t)), count = 0;
            for (int64_t n = 0; n < N; n++) {
                t[n] = none || n % 4 == 3 ? ignore : n % 3 == 0 ? 0 : n % 3 == 1 ? valid - 1 : (valid - 1) / 2;
                if (kind == 3 && t[n] != ignore && t[n] == 1 + n % (valid - 1)) t[n] = 0;
                count += t[n] != ignore;
            }
            double *wl = halloc((size_t)N * sizeof(double)), *wlse = halloc((size_t)N * sizeof(double));
            ce_reference(wl, wlse, x, t, N, V, valid, ignore);
            float *wlf = halloc((size_t)N * sizeof(float)), *wlsef = halloc((size_t)N * sizeof(float));
            for (int64_t n = 0; n < N; n++) wlf[n] = (float)wl[n], wlsef[n] = (float)wlse[n];
            int64_t *dt = dup(t, (size_t)N * sizeof(int64_t));
            float *dxb = dupf(hnan(N * V + 4), N * V + 4), *dx = dxb + off;
            G->copy_from_host(dx, x, (size_t)(N * V) * sizeof(float));
            uint16_t *xb = halloc((size_t)(N * V + 8) * 2);
            for (int64_t k = 0; k < N * V; k++) xb[off + k] = f32_to_bf16(x[k]);
            uint16_t *dxhb = dup(xb, (size_t)(N * V + 8) * 2), *dxh = dxhb + off;
            char name[128];
            const char *kinds[] = {"random", "rising", "huge", "-inf"};
            for (int variant = 0; variant < 4; variant++) {   /* f32, f32 rows, bf16, bf16 rows */
                float *gl = dnan(N), *glse = dnan(N);
                int64_t gcount = count;
                if (variant == 0) gcount = G->cross_entropy_forward_f32(gl, glse, dx, dt, N, V, valid, ignore);
                if (variant == 1) G->cross_entropy_rows_f32(gl, glse, dx, dt, N, V, valid, ignore);
                if (variant == 2) gcount = G->cross_entropy_forward_bf16(gl, glse, dxh, dt, N, V, valid, ignore);
                if (variant == 3) G->cross_entropy_rows_bf16(gl, glse, dxh, dt, N, V, valid, ignore);
                snprintf(name, sizeof name, "cross_entropy %s (%lld, %lld) valid %lld %s off %d",
                         (const char *[]){"forward_f32", "rows_f32", "forward_bf16", "rows_bf16"}[variant],
                         (long long)N, (long long)V, (long long)valid, kinds[kind], off);
                test_check(gcount == count, "%s: count %lld, want %lld", name, (long long)gcount, (long long)count);
                check_f(name, back(gl, N), wlf, N, 1e-5, 1e-5, 1);
                check_f(name, back(glse, N), wlsef, N, 1e-6, 1e-5, 1);
            }
            /* the backward on the reference lse (as f32): g (exp(x - lse) - [j == t]), 0 past valid and on ignored rows */
            int64_t div = count ? count : 1;
            float one = 1.0f, *gone = dupf(&one, 1), *dlse = dupf(wlsef, N);
            float *want = halloc((size_t)(N * V) * sizeof(float));
            for (int64_t n = 0; n < N; n++)
                for (int64_t j = 0; j < V; j++) {
                    double d = 0;
                    if (t[n] != ignore && j < valid)
                        d = (exp((double)x[n * V + j] - (double)wlsef[n]) - (j == t[n])) / (double)div;
                    want[n * V + j] = (float)d;
                }
            float *gdx = dnan(N * V);
            uint16_t *gdxh = dnan16(N * V);
            G->cross_entropy_backward_f32(gdx, dx, dlse, dt, N, V, valid, ignore, gone, count);
            G->cross_entropy_backward_bf16(gdxh, dxh, dlse, dt, N, V, valid, ignore, gone, count);
            snprintf(name, sizeof name, "cross_entropy_backward_f32 (%lld, %lld) valid %lld %s off %d", (long long)N,
                     (long long)V, (long long)valid, kinds[kind], off);
            check_f(name, back(gdx, N * V), want, N * V, 1e-5, 1e-6, 1.0 / (double)div);
            snprintf(name, sizeof name, "cross_entropy_backward_bf16 (%lld, %lld) valid %lld %s off %d", (long long)N,
                     (long long)V, (long long)valid, kinds[kind], off);
            check_f(name, back_bf16(gdxh, N * V), want, N * V, ULP16, 1e-6, 1.0 / (double)div);
            /* the fused kernel: the losses of the forward, dlogits over the logits (in place), against the
             * reference and bit for bit against the rows kernel followed by the backward on its lse */
            for (int bf = 0; bf < 2; bf++) {
                float *fl = dnan(N), *rl = dnan(N), *rlse = dnan(N);
                float *hx = hnan(N * V + 4);
                memcpy(hx + off, x, (size_t)(N * V) * sizeof(float));
                void *fx = bf ? (void *)(dup(xb, (size_t)(N * V + 8) * 2)) : (void *)dupf(hx, N * V + 4);
                void *fxo = bf ? (void *)((uint16_t *)fx + off) : (void *)((float *)fx + off);
                void *bdx = bf ? (void *)dnan16(N * V) : (void *)dnan(N * V);
                if (bf) {
                    G->cross_entropy_fused_bf16(fl, fxo, dt, N, V, valid, ignore, count);
                    G->cross_entropy_rows_bf16(rl, rlse, dxh, dt, N, V, valid, ignore);
                    G->cross_entropy_backward_bf16(bdx, dxh, rlse, dt, N, V, valid, ignore, gone, count);
                } else {
                    G->cross_entropy_fused_f32(fl, fxo, dt, N, V, valid, ignore, count);
                    G->cross_entropy_rows_f32(rl, rlse, dx, dt, N, V, valid, ignore);
                    G->cross_entropy_backward_f32(bdx, dx, rlse, dt, N, V, valid, ignore, gone, count);
                }
                snprintf(name, sizeof name, "cross_entropy_fused_%s (%lld, %lld) valid %lld %s off %d",
                         bf ? "bf16" : "f32", (long long)N, (long long)V, (long long)valid, kinds[kind], off);
                check_f(name, back(fl, N), wlf, N, 1e-5, 1e-5, 1);
                check_bits(name, back(fl, N), back(rl, N), (size_t)N * sizeof(float));
                float *got = bf ? back_bf16(fxo, N * V) : back(fxo, N * V);
                check_f(name, got, want, N * V, bf ? ULP16 : 1e-5, 1e-6, 1.0 / (double)div);
                size_t es = bf ? 2 : 4, bytes = (size_t)(N * V) * es;
                unsigned char *hf = halloc(bytes), *hb = halloc(bytes);
                G->copy_to_host(hf, fxo, bytes);
                G->copy_to_host(hb, bdx, bytes);
                check_bits(name, hf, hb, bytes);
            }
            free_case();
        }
    }
}

/* Attention from a packed bf16 qkv (B, T, 3C) on the tensor cores, against
 * the CPU's f32 attention on the same (bf16) values unpacked to (B, H, T, D).
 * Tolerance: probabilities and dS are rounded to bf16 (2^-9 relative) before
 * their products and every result is rounded to bf16 once, so
 *   out: |err| <= 2^-7 (|want| + max|v|),
 *   dq, dk, dv: |err| <= 2^-6 (|want| + max|want|)
 * (a few roundings of 2^-9 each, with room for their sums; a wrong index,
 * mask or transpose is off by O(1)). */
static void unpack_heads(float *dst, const uint16_t *src, int64_t B, int64_t H, int64_t T, int64_t D, int64_t ld,
                         int64_t col0) {   /* dst (B, H, T, D) from columns col0 + h D of src (B, T, ld) */
    for (int64_t b = 0; b < B; b++)
        for (int64_t h = 0; h < H; h++)
            for (int64_t t = 0; t < T; t++)
                for (int64_t d = 0; d < D; d++)
                    dst[((b * H + h) * T + t) * D + d] = bf16_to_f32(src[(b * T + t) * ld + col0 + h * D + d]);
}

/* The packed attention's results, out (B, T, C) and dqkv (B, T, 3C) bf16
 * on the host, as (B, H, T, D) f32 tensors each */
typedef struct {
    float *o, *dq, *dk, *dv;
} attn_unpacked;

static attn_unpacked unpack_attention(const uint16_t *o16, const uint16_t *dqkv16, int64_t B, int64_t H, int64_t T,
                                      int64_t D) {
    int64_t n = B * H * T * D, C = H * D;
    attn_unpacked u = {halloc((size_t)n * 4), halloc((size_t)n * 4), halloc((size_t)n * 4), halloc((size_t)n * 4)};
    unpack_heads(u.o, o16, B, H, T, D, C, 0);
    unpack_heads(u.dq, dqkv16, B, H, T, D, 3 * C, 0);
    unpack_heads(u.dk, dqkv16, B, H, T, D, 3 * C, C);
    unpack_heads(u.dv, dqkv16, B, H, T, D, 3 * C, 2 * C);
    return u;
}

static uint16_t *bf16_rand(int64_t n) {
    float *x = hrand(n, 1);
    uint16_t *h = halloc((size_t)n * 2);
    for (int64_t i = 0; i < n; i++) h[i] = f32_to_bf16(x[i]);
    return h;
}

static float *back_bf16(const void *d, int64_t n) {
    uint16_t *h = halloc((size_t)(n > 0 ? n : 1) * 2);
    float *f = halloc((size_t)(n > 0 ? n : 1) * sizeof(float));
    if (n > 0) G->copy_to_host(h, d, (size_t)n * 2);
    for (int64_t i = 0; i < n; i++) f[i] = bf16_to_f32(h[i]);
    return f;
}

static void test_attention_qkv(void) {
    test_check(G->attention_qkv_forward_bf16 && G->attention_qkv_backward_bf16, "CUDA has the packed attention");
    if (!G->attention_qkv_forward_bf16 || !G->attention_qkv_backward_bf16) return;
    const fsdp_device_kernels *C_ = C;   /* the CPU table; C below is the width */
    int64_t cs[][4] = {{1, 1, 1, 1}, {2, 3, 17, 8}, {1, 2, 33, 16}, {2, 2, 9, 5}, {1, 1, 40, 3},
                       BIG({2, 4, 257, 64}, {2, 12, 1024, 64})};
    for (size_t i = 0; i < sizeof cs / sizeof cs[0]; i++)
        for (int causal = 0; causal < 2; causal++) {
            int64_t B = cs[i][0], H = cs[i][1], T = cs[i][2], D = cs[i][3], C = H * D, n = B * H * T * D;
            int64_t nqkv = B * T * 3 * C, ntt = B * H * T * T, nl = B * H * T;
            float scale = 1.0f / sqrtf((float)D);
            uint16_t *qkv = bf16_rand(nqkv), *dout16 = bf16_rand(B * T * C);
            float *q = halloc((size_t)n * 4), *k = halloc((size_t)n * 4), *v = halloc((size_t)n * 4);
            float *dout = halloc((size_t)n * 4);
            unpack_heads(q, qkv, B, H, T, D, 3 * C, 0);
            unpack_heads(k, qkv, B, H, T, D, 3 * C, C);
            unpack_heads(v, qkv, B, H, T, D, 3 * C, 2 * C);
            unpack_heads(dout, dout16, B, H, T, D, C, 0);
            float *o = hnan(n), *lse = hnan(nl), *dq = hnan(n), *dk = hnan(n), *dv = hnan(n);
            C_->attention_forward_f32(o, lse, q, k, v, B, H, T, D, causal, scale);
            C_->attention_backward_f32(dq, dk, dv, dout, q, k, v, o, lse, B, H, T, D, causal, scale);
            uint16_t *gqkv = dup(qkv, (size_t)nqkv * 2), *gdout = dup(dout16, (size_t)B * T * C * 2);
            uint16_t *gout = (uint16_t *)dnan(B * T * C), *probs = dalloc((size_t)ntt * 2);
            uint16_t *gdqkv = (uint16_t *)dnan(nqkv), *dscores = dalloc((size_t)ntt * 2);
            float *scores = dnan(ntt), *dprobs = dnan(ntt);
            G->attention_qkv_forward_bf16(gout, probs, scores, gqkv, B, H, T, D, causal, scale);
            G->attention_qkv_backward_bf16(gdqkv, dprobs, dscores, gdout, gqkv, probs, B, H, T, D, causal, scale);
            /* results unpacked the same way: (B, H, T, D) */
            float *got_o = back_bf16(gout, B * T * C), *got_dqkv = back_bf16(gdqkv, nqkv);
            uint16_t *o16 = halloc((size_t)B * T * C * 2), *dqkv16 = halloc((size_t)nqkv * 2);
            for (int64_t j = 0; j < B * T * C; j++) o16[j] = f32_to_bf16(got_o[j]);
            for (int64_t j = 0; j < nqkv; j++) dqkv16[j] = f32_to_bf16(got_dqkv[j]);
            attn_unpacked g = unpack_attention(o16, dqkv16, B, H, T, D);
            float *go = g.o, *gdq = g.dq, *gdk = g.dk, *gdv = g.dv;
            char tag[64], name[128];
            snprintf(tag, sizeof tag, "(%lld, %lld, %lld, %lld)%s", (long long)B, (long long)H, (long long)T,
                     (long long)D, causal ? " causal" : "");
            snprintf(name, sizeof name, "attention_qkv_forward_bf16 out %s", tag);
            check_f(name, go, o, n, 1.0 / 128, 1.0 / 128, 1.0);
            snprintf(name, sizeof name, "attention_qkv_backward_bf16 dq %s", tag);
            check_f(name, gdq, dq, n, 1.0 / 64, 1.0 / 64, -1);
            snprintf(name, sizeof name, "attention_qkv_backward_bf16 dk %s", tag);
            check_f(name, gdk, dk, n, 1.0 / 64, 1.0 / 64, -1);
            snprintf(name, sizeof name, "attention_qkv_backward_bf16 dv %s", tag);
            check_f(name, gdv, dv, n, 1.0 / 64, 1.0 / 64, -1);
            free_case();
        }
}

/* Flash attention (cuda_attention_flash.cu) against attention in double
 * precision on the same bf16 values, and against the GEMM path above.
 * Tolerance (bf16): P is rounded to bf16 (2^-9 relative) before P V and
 * every result once more, so
 *   out:  |err| <= 2^-8 (|want| + max|v|)  (twice the bound: f32 sums)
 *   lse:  |err| <= 2^-8                    (l sums the rounded P: 2^-9)
 *   dq, dk, dv: |err| <= 2^-6 (|want| + max|want|)  (dS rounded to bf16, O
 *   to bf16 in Drow = dO . O, then sums of them; as the GEMM path's bound)
 * A wrong mask, index or transpose is off by O(1). The GEMM path and the
 * flash path agree within the sum of their bounds, and the flash backward
 * repeats bit for bit (no atomics). */
static void ref_attention(double *o, double *lse, double *dq, double *dk, double *dv, const float *q, const float *k,
                          const float *v, const float *dout, int64_t BH, int64_t T, int64_t D, int causal,
                          double scale) {   /* (BH, T, D) each; lse (BH, T) */
    double *p = malloc((size_t)T * sizeof(double)), *dp = malloc((size_t)T * sizeof(double));
    for (int64_t i = 0; i < BH * T * D; i++) dq[i] = dk[i] = dv[i] = 0.0;
    for (int64_t bh = 0; bh < BH; bh++) {
        const float *Q = q + bh * T * D, *K = k + bh * T * D, *V = v + bh * T * D, *dO = dout + bh * T * D;
        double *O = o + bh * T * D, *dQ = dq + bh * T * D, *dK = dk + bh * T * D, *dV = dv + bh * T * D;
        for (int64_t i = 0; i < T; i++) {
            int64_t seen = causal ? i + 1 : T;
            double mx = -INFINITY, sum = 0.0, drow = 0.0;
            for (int64_t j = 0; j < seen; j++) {
                double s = 0.0;
                for (int64_t d = 0; d < D; d++) s += (double)Q[i * D + d] * K[j * D + d];
                p[j] = scale * s;
                if (p[j] > mx) mx = p[j];
            }
            for (int64_t j = 0; j < seen; j++) sum += (p[j] = exp(p[j] - mx));
            lse[bh * T + i] = mx + log(sum);
            for (int64_t d = 0; d < D; d++) {
                double acc = 0.0;
                for (int64_t j = 0; j < seen; j++) acc += p[j] / sum * V[j * D + d];
                O[i * D + d] = acc;
            }
            for (int64_t j = 0; j < seen; j++) {
                p[j] /= sum;
                double x = 0.0;
                for (int64_t d = 0; d < D; d++) x += (double)dO[i * D + d] * V[j * D + d];
                dp[j] = x;
                drow += p[j] * x;
            }
            for (int64_t j = 0; j < seen; j++) {
                double ds = scale * p[j] * (dp[j] - drow);
                for (int64_t d = 0; d < D; d++) {
                    dQ[i * D + d] += ds * K[j * D + d];
                    dK[j * D + d] += ds * Q[i * D + d];
                    dV[j * D + d] += p[j] * dO[i * D + d];
                }
            }
        }
    }
    free(p);
    free(dp);
}

static float *to_f32(const double *x, int64_t n) {
    float *y = halloc((size_t)n * sizeof(float));
    for (int64_t i = 0; i < n; i++) y[i] = (float)x[i];
    return y;
}

static double max_abs(const float *x, int64_t n) {
    double m = 0.0;
    for (int64_t i = 0; i < n; i++) m = fabs(x[i]) > m ? fabs(x[i]) : m;
    return m;
}

static void test_attention_flash(void) {
    test_check(G->attention_flash_forward_bf16 && G->attention_flash_backward_bf16, "CUDA has the flash attention");
    if (!G->attention_flash_forward_bf16 || !G->attention_flash_backward_bf16) return;
    /* shapes: covered and not */
    test_check(attention_flash_covers(1, 1, 1, 16) && attention_flash_covers(3, 5, 1000003, 128) &&
                   attention_flash_covers(1, 1, 17, 80),
               "flash covers D = 16, 80, 128 and any T");
    test_check(!attention_flash_covers(1, 1, 17, 8) && !attention_flash_covers(1, 1, 17, 72) &&
                   !attention_flash_covers(1, 1, 17, 144) && !attention_flash_covers(0, 1, 17, 64) &&
                   !attention_flash_covers(1, 1, 0, 64) && !attention_flash_covers((int64_t)1 << 30, 64, 1 << 12, 64),
               "flash refuses D = 8, 72, 144, an empty batch or sequence, more than 2^31 - 1 blocks");
    /* on a GPU also T = 257 and 1024 (the double reference on the host bounds the sizes) */
    int64_t cs[][4] = {{1, 1, 1, 16}, {1, 3, 17, 16}, {3, 1, 127, 64}, {1, 1, 65, 80}, {1, 2, 33, 128},
                       {1, 1, 200, 16}, BIG({2, 4, 257, 64}, {1, 2, 1024, 64})};
    for (size_t i = 0; i < sizeof cs / sizeof cs[0]; i++)
        for (int causal = 0; causal < 2; causal++) {
            int64_t B = cs[i][0], H = cs[i][1], T = cs[i][2], D = cs[i][3], C = H * D, n = B * H * T * D;
            int64_t nqkv = B * T * 3 * C, nl = B * H * T, ntt = B * H * T * T;
            float scale = 1.0f / sqrtf((float)D);
            uint16_t *qkv = bf16_rand(nqkv), *dout16 = bf16_rand(B * T * C);
            float *q = halloc((size_t)n * 4), *k = halloc((size_t)n * 4), *v = halloc((size_t)n * 4);
            float *dout = halloc((size_t)n * 4);
            unpack_heads(q, qkv, B, H, T, D, 3 * C, 0);
            unpack_heads(k, qkv, B, H, T, D, 3 * C, C);
            unpack_heads(v, qkv, B, H, T, D, 3 * C, 2 * C);
            unpack_heads(dout, dout16, B, H, T, D, C, 0);
            double *o = malloc((size_t)n * 8), *lse = malloc((size_t)nl * 8), *dq = malloc((size_t)n * 8);
            double *dk = malloc((size_t)n * 8), *dv = malloc((size_t)n * 8);
            ref_attention(o, lse, dq, dk, dv, q, k, v, dout, B * H, T, D, causal, scale);
            float *wo = to_f32(o, n), *wlse = to_f32(lse, nl), *wdq = to_f32(dq, n), *wdk = to_f32(dk, n);
            float *wdv = to_f32(dv, n);
            free(o);
            free(lse);
            free(dq);
            free(dk);
            free(dv);
            uint16_t *gqkv = dup(qkv, (size_t)nqkv * 2), *gdout = dup(dout16, (size_t)B * T * C * 2);
            uint16_t *gout = dnan16(B * T * C), *gdqkv = dnan16(nqkv), *gdqkv2 = dnan16(nqkv);
            float *glse = dnan(nl), *drow = dnan(nl);
            G->attention_flash_forward_bf16(gout, glse, gqkv, B, H, T, D, causal, scale);
            G->attention_flash_backward_bf16(gdqkv, drow, gdout, gqkv, gout, glse, B, H, T, D, causal, scale);
            G->attention_flash_backward_bf16(gdqkv2, drow, gdout, gqkv, gout, glse, B, H, T, D, causal, scale);
            uint16_t *o16 = halloc((size_t)B * T * C * 2), *dqkv16 = halloc((size_t)nqkv * 2);
            uint16_t *dqkv16b = halloc((size_t)nqkv * 2);
            G->copy_to_host(o16, gout, (size_t)B * T * C * 2);
            G->copy_to_host(dqkv16, gdqkv, (size_t)nqkv * 2);
            G->copy_to_host(dqkv16b, gdqkv2, (size_t)nqkv * 2);
            attn_unpacked g = unpack_attention(o16, dqkv16, B, H, T, D);
            float *go = g.o, *gdq = g.dq, *gdk = g.dk, *gdv = g.dv;
            char tag[64], name[160];
            snprintf(tag, sizeof tag, "(%lld, %lld, %lld, %lld)%s", (long long)B, (long long)H, (long long)T,
                     (long long)D, causal ? " causal" : "");
            snprintf(name, sizeof name, "attention_flash_forward_bf16 out %s", tag);
            check_f(name, go, wo, n, 1.0 / 256, 1.0 / 256, max_abs(v, n));
            snprintf(name, sizeof name, "attention_flash_forward_bf16 lse %s", tag);
            check_f(name, back(glse, nl), wlse, nl, 0.0, 1.0 / 256, 1.0);
            snprintf(name, sizeof name, "attention_flash_backward_bf16 dq %s", tag);
            check_f(name, gdq, wdq, n, 1.0 / 64, 1.0 / 64, -1);
            snprintf(name, sizeof name, "attention_flash_backward_bf16 dk %s", tag);
            check_f(name, gdk, wdk, n, 1.0 / 64, 1.0 / 64, -1);
            snprintf(name, sizeof name, "attention_flash_backward_bf16 dv %s", tag);
            check_f(name, gdv, wdv, n, 1.0 / 64, 1.0 / 64, -1);
            snprintf(name, sizeof name, "attention_flash_backward_bf16 %s repeats bit for bit", tag);
            check_bits(name, dqkv16b, dqkv16, (size_t)nqkv * 2);
            /* the GEMM path on the same inputs: within both bounds of each other */
            if (G->attention_qkv_forward_bf16 && G->attention_qkv_backward_bf16) {
                uint16_t *mout = dnan16(B * T * C), *probs = dalloc((size_t)ntt * 2), *dscores = dalloc((size_t)ntt * 2);
                uint16_t *mdqkv = dnan16(nqkv);
                float *scores = dnan(ntt), *dprobs = dnan(ntt);
                G->attention_qkv_forward_bf16(mout, probs, scores, gqkv, B, H, T, D, causal, scale);
                G->attention_qkv_backward_bf16(mdqkv, dprobs, dscores, gdout, gqkv, probs, B, H, T, D, causal, scale);
                float *mo = back_bf16(mout, B * T * C), *md = back_bf16(mdqkv, nqkv);
                float *fo = back_bf16(gout, B * T * C), *fd = back_bf16(gdqkv, nqkv);
                snprintf(name, sizeof name, "flash vs GEMM attention out %s", tag);
                check_f(name, fo, mo, B * T * C, 1.0 / 128 + 1.0 / 256, 1.0 / 128 + 1.0 / 256, max_abs(v, n));
                snprintf(name, sizeof name, "flash vs GEMM attention dqkv %s", tag);
                check_f(name, fd, md, nqkv, 1.0 / 32, 1.0 / 32, -1);
            }
            free_case();
        }
}

/* ---- random ---- */

static void test_random(void) {
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

/* ---- optimizers ---- */

/* adamw_many_f32: 70 tensors (more than a launch's group of 56; empty ones,
 * one element, odd and prime sizes, some over a block of 2048, several
 * slices of one buffer as a unit's shard gives them), each with its own
 * decay, step size and bias correction, against the CPU's adamw_f32 per
 * tensor: rtol 1e-6 as adamw_f32. Every tensor but each third writes its
 * bf16 copy too: bit for bit the device's cast_any of its new p (the cast
 * a gather makes), the others' copies untouched. */
static void test_adamw_many(void) {
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
    uint16_t *dpb = dup(sentinel, (size_t)total * sizeof(uint16_t));
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

static void test_optim(void) {
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

/* ---- ops end to end through the public API, CUDA tensors vs CPU tensors ---- */

static fsdp_tensor *tensor(int device, int ndim, const int64_t *shape, const float *data, int64_t n) {
    fsdp_tensor *t = NULL;
    if (fsdp_tensor_from_data(&t, FSDP_F32, ndim, shape, data, n * (int64_t)sizeof(float), device, FSDP_TAG_OTHER) !=
        FSDP_OK) {
        fprintf(stderr, "fsdp_tensor_from_data: %s\n", fsdp_last_error());
        exit(1);
    }
    return t;
}

/* y = layernorm(gelu(x @ w)) with its mean, on one device; the values of y and sum(y) */
static int run_model(int device, const float *x, const float *w, float *y, double *sum) {
    int64_t xs[2] = {5, 17}, ws[2] = {17, 9};
    fsdp_tensor *tx = tensor(device, 2, xs, x, 85), *tw = tensor(device, 2, ws, w, 153), *h = NULL, *a = NULL,
                *r = NULL, *s = NULL;
    int ok = fsdp_matmul(&h, tx, tw, 0, 0) == FSDP_OK && fsdp_gelu(&a, h) == FSDP_OK &&
             fsdp_layernorm(&r, a, NULL, NULL, 1e-5) == FSDP_OK && fsdp_sum(&s, r, 0, NULL, 0) == FSDP_OK &&
             fsdp_tensor_to_data(r, y, 45 * (int64_t)sizeof(float)) == FSDP_OK && fsdp_tensor_item(s, sum) == FSDP_OK;
    if (!ok) fprintf(stderr, "op on %s failed: %s\n", device ? "cuda" : "cpu", fsdp_last_error());
    fsdp_tensor *all[] = {tx, tw, h, a, r, s};
    for (int i = 0; i < 6; i++)
        if (all[i]) fsdp_tensor_release(all[i]);
    return ok;
}

static void test_ops_end_to_end(void) {
    float *x = hrand(85, 1), *w = hrand(153, 1), yc[45], yg[45];
    double sc = 0, sg = 0;
    int okc = run_model(FSDP_DEVICE_CPU, x, w, yc, &sc), okg = run_model(FSDP_DEVICE_CUDA, x, w, yg, &sg);
    test_check(okc && okg, "matmul -> gelu -> layernorm -> sum through the public API on both devices");
    if (okc && okg) {
        check_f("ops end to end: layernorm(gelu(x @ w))", yg, yc, 45, 1e-5, 1e-5, -1);
        test_check(fabs(sg - sc) <= 1e-4, "ops end to end: sum %.9g on cuda, %.9g on cpu", sg, sc);
    }
    free_case();
}

/* ---- start-up ---- */

/* ---- --bench: time per call at GPT-2 small sizes (B 8, T 1024, C 768, H 12) ---- */

static double now_s(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + (double)t.tv_nsec * 1e-9;
}

#define BENCH(label, work, unit, CALL)                                                                  \
    do {                                                                                                \
        CALL;                                                                                           \
        G->synchronize();                                                                               \
        double t0_ = now_s();                                                                           \
        for (int r_ = 0; r_ < 10; r_++) CALL;                                                           \
        G->synchronize();                                                                               \
        double ms_ = (now_s() - t0_) * 100.0;                                                           \
        printf("  %-44s %9.3f ms  %8.1f %s\n", label, ms_, (work) / (ms_ * 1e-3) * 1e-9, unit);         \
    } while (0)

static float *dev_uniform(int64_t n) {
    float *d = dalloc((size_t)n * sizeof(float));
    G->init_uniform_f32(d, n, -1.0f, 1.0f, 1, 1, 0);
    return d;
}

static int bench(int tiny) {   /* tiny: toy sizes, to run the code in the emulation */
    const int64_t B = tiny ? 2 : 8, T = tiny ? 32 : 1024, Cd = tiny ? 48 : 768, H = tiny ? 3 : 12, D = 16 * (H == 3) + 64 * (H == 12);
    const int64_t V = tiny ? 97 : 50257, Vp = tiny ? 128 : 50304, N = B * T, P = tiny ? 1000 : 124000000;
    printf("time per call, mean of 10 after one warm-up (GB/s counts the bytes read and written once):\n");
    float *x = dev_uniform(N * 4 * Cd), *w = dev_uniform(4 * Cd * Cd), *y = dev_uniform(N * 4 * Cd);
    BENCH("matmul (8192x768) @ (768x3072)", 2.0 * N * Cd * 4 * Cd, "GFLOP/s",
          G->matmul_f32(y, x, w, 1, N, 4 * Cd, Cd, 0, 0, 1.0f, 0.0f, 0, 0, 0));
    BENCH("matmul (8192x3072) @ (768x3072)^T", 2.0 * N * Cd * 4 * Cd, "GFLOP/s",
          G->matmul_f32(x, y, w, 1, N, Cd, 4 * Cd, 0, 1, 1.0f, 0.0f, 0, 0, 0));
    float *q = dev_uniform(N * Cd), *k = dev_uniform(N * Cd), *v = dev_uniform(N * Cd), *o = dev_uniform(N * Cd);
    float *lse = dev_uniform(B * H * T), *dq = dev_uniform(N * Cd), *dk = dev_uniform(N * Cd), *dv = dev_uniform(N * Cd);
    double att = 4.0 * B * H * T * T * D / 2;   /* causal: half the scores */
    BENCH("attention forward (8,12,1024,64) causal", att, "GFLOP/s",
          G->attention_forward_f32(o, lse, q, k, v, B, H, T, D, 1, 0.125f));
    BENCH("attention backward (8,12,1024,64) causal", 2.5 * att, "GFLOP/s",
          G->attention_backward_f32(dq, dk, dv, o, q, k, v, o, lse, B, H, T, D, 1, 0.125f));
    /* bf16 attention from a packed qkv, in the same run: the flash kernels and the GEMM path (model
     * FLOPs: the backward counts twice the forward's products, whatever it recomputes) */
    uint16_t *qkv16 = dalloc((size_t)N * 3 * Cd * 2), *o16 = dalloc((size_t)N * Cd * 2);
    uint16_t *do16 = dalloc((size_t)N * Cd * 2), *dqkv16 = dalloc((size_t)N * 3 * Cd * 2);
    G->cast_any(qkv16, FSDP_BF16, x, FSDP_F32, N * 3 * Cd);
    G->cast_any(do16, FSDP_BF16, y, FSDP_F32, N * Cd);
    float *lse16 = dev_uniform(B * H * T), *drow16 = dev_uniform(B * H * T);
    if (G->attention_flash_forward_bf16 && G->attention_flash_backward_bf16) {
        BENCH("flash attention forward bf16 (8,12,1024,64) causal", att, "GFLOP/s",
              G->attention_flash_forward_bf16(o16, lse16, qkv16, B, H, T, D, 1, 0.125f));
        BENCH("flash attention backward bf16 (8,12,1024,64) causal", 2 * att, "GFLOP/s",
              G->attention_flash_backward_bf16(dqkv16, drow16, do16, qkv16, o16, lse16, B, H, T, D, 1, 0.125f));
    }
    if (G->attention_qkv_forward_bf16 && G->attention_qkv_backward_bf16) {
        uint16_t *probs = dalloc((size_t)B * H * T * T * 2), *dscores = dalloc((size_t)B * H * T * T * 2);
        float *scores = dalloc((size_t)B * H * T * T * 4);
        BENCH("GEMM attention forward bf16 (8,12,1024,64) causal", att, "GFLOP/s",
              G->attention_qkv_forward_bf16(o16, probs, scores, qkv16, B, H, T, D, 1, 0.125f));
        BENCH("GEMM attention backward bf16 (8,12,1024,64) causal", 2 * att, "GFLOP/s",
              G->attention_qkv_backward_bf16(dqkv16, scores, dscores, do16, qkv16, probs, B, H, T, D, 1, 0.125f));
    }
    float *mean = dev_uniform(N), *rstd = dev_uniform(N), *g = dev_uniform(Cd), *bb = dev_uniform(Cd);
    BENCH("layernorm forward (8192, 768)", 8.0 * N * Cd, "GB/s",
          G->layernorm_forward_f32(y, mean, rstd, x, g, bb, N, Cd, 1e-5f));
    BENCH("layernorm backward (8192, 768)", 12.0 * N * Cd, "GB/s",
          G->layernorm_backward_f32(y, dq, dk, q, x, g, mean, rstd, N, Cd));
    BENCH("gelu forward (8192 x 3072)", 8.0 * N * 4 * Cd, "GB/s", G->gelu_forward_f32(y, x, N * 4 * Cd));
    BENCH("gelu backward (8192 x 3072)", 12.0 * N * 4 * Cd, "GB/s", G->gelu_backward_f32(y, x, y, N * 4 * Cd));
    BENCH("softmax forward (8192, 1024)", 8.0 * N * T, "GB/s", G->softmax_forward_f32(y, x, N, T));
    BENCH("sum_dim bias grad (8192, 3072) -> 3072", 4.0 * N * 4 * Cd, "GB/s",
          G->sum_dim_f32(y, x, 1, N, 4 * Cd));
    BENCH("copy_strided (8,1024,12,64) -> (8,12,1024,64)", 8.0 * N * Cd, "GB/s",
          G->copy_strided(y, (const int64_t[]){H * T * D, D, T * D, 1}, x, (const int64_t[]){T * Cd, Cd, D, 1}, 4,
                          (const int64_t[]){B, T, H, D}, sizeof(float)));
    float *logits = dev_uniform(N * Vp), *losses = dev_uniform(N);
    int64_t *ids = halloc((size_t)N * sizeof(int64_t));
    for (int64_t i = 0; i < N; i++) ids[i] = (i * 7919) % V;
    int64_t *dids = dup(ids, (size_t)N * sizeof(int64_t));
    BENCH("cross_entropy forward (8192, 50304)", 8.0 * N * Vp, "GB/s",
          G->cross_entropy_forward_f32(losses, lse, logits, dids, N, Vp, V, -100));
    float one = 1.0f, *gone = dupf(&one, 1);
    BENCH("cross_entropy backward (8192, 50304)", 8.0 * N * Vp, "GB/s",
          G->cross_entropy_backward_f32(logits, logits, lse, dids, N, Vp, V, -100, gone, N));
    float *table = dev_uniform(Vp * Cd);
    BENCH("embedding forward (8192 ids, 768)", 8.0 * N * Cd, "GB/s", G->embedding_forward_f32(y, dids, N, table, Cd));
    BENCH("embedding backward (50257 x 768, 8192 ids)", 4.0 * (V + 2 * N) * Cd, "GB/s",
          G->embedding_backward_f32(table, V, dids, N, y, Cd));
    float *p = dev_uniform(P), *pg = dev_uniform(P), *m1 = dev_uniform(P), *m2 = dev_uniform(P);
    G->scale_f32(m2, m2, 0.0f, P);
    BENCH("adamw (124M parameters)", 28.0 * P, "GB/s",
          G->adamw_f32(p, pg, m1, m2, P, 0.9f, 0.999f, 1e-8f, 0.9999f, 1e-4f, 1.0f, 1.0f));
    BENCH("sumsq (124M)", 4.0 * P, "GB/s", (void)G->sumsq_f32(pg, P));
    BENCH("init_normal (124M)", 4.0 * P, "GB/s", G->init_normal_f32(p, P, 0.0f, 0.02f, 1, 2, 0));
    free_case();
    fsdp_status last = cuda_last_status();
    return last == FSDP_OK ? 0 : 1;
}

/* --flash B H T D: the flash attention forward and backward (causal, bf16)
 * once each at one shape, nothing else, for a profiler to measure (ncu's
 * DRAM bytes per kernel, tools/gpu-check's flash-dram stage) */
static int flash_once(int argc, char **argv) {
    int64_t s[4];
    for (int i = 0; i < 4; i++) s[i] = 2 + i < argc ? strtoll(argv[2 + i], NULL, 10) : 0;
    const int64_t B = s[0], H = s[1], T = s[2], D = s[3], C3 = 3 * H * D;
    if (!G->attention_flash_forward_bf16 || !attention_flash_covers(B, H, T, D)) {
        printf("FAILED: --flash B H T D: (%lld, %lld, %lld, %lld) is not a shape the flash kernels cover\n",
               (long long)B, (long long)H, (long long)T, (long long)D);
        return 1;
    }
    float *x = dev_uniform(B * T * C3);
    uint16_t *qkv = dalloc((size_t)(B * T * C3) * 2), *dqkv = dalloc((size_t)(B * T * C3) * 2);
    uint16_t *o = dalloc((size_t)(B * T * H * D) * 2), *dout = dalloc((size_t)(B * T * H * D) * 2);
    float *lse = dalloc((size_t)(B * H * T) * 4), *drow = dalloc((size_t)(B * H * T) * 4);
    G->cast_any(qkv, FSDP_BF16, x, FSDP_F32, B * T * C3);
    G->cast_any(dout, FSDP_BF16, x, FSDP_F32, B * T * H * D);
    const float scale = 1.0f / sqrtf((float)D);
    G->attention_flash_forward_bf16(o, lse, qkv, B, H, T, D, 1, scale);
    G->attention_flash_backward_bf16(dqkv, drow, dout, qkv, o, lse, B, H, T, D, 1, scale);
    G->synchronize();
    fsdp_status last = cuda_last_status();
    printf("flash attention forward and backward, bf16, causal, (B %lld, H %lld, T %lld, D %lld): %s\n",
           (long long)B, (long long)H, (long long)T, (long long)D, last == FSDP_OK ? "ran" : "FAILED");
    free_case();
    return last == FSDP_OK ? 0 : 1;
}

/* A CUDA failure inside a table entry ends the process with a message
 * naming the device and the op (here: a matmul too large for cuBLAS). */
static int fault(void) {
    float *c = dalloc(sizeof(float)), *a = dalloc(sizeof(float)), *b = dalloc(sizeof(float));
    G->matmul_f32(c, a, b, 1, (int64_t)1 << 32, 1, 1, 0, 0, 1.0f, 0.0f, 0, 0, 0);
    printf("still alive after a fatal error\n");
    return 1;
}

/* no arguments: everything; --init-only: start-up checks only; --fault: see
 * fault(); --bench: time the kernels at GPT-2 sizes (on a GPU); --flash B H
 * T D: see flash_once */
int main(int argc, char **argv) {
    const char *arg = argc > 1 ? argv[1] : "";
    int init_only = strcmp(arg, "--init-only") == 0, do_fault = strcmp(arg, "--fault") == 0;
    int do_bench = strcmp(arg, "--bench") == 0, do_flash = strcmp(arg, "--flash") == 0;
    C = device_kernels(FSDP_DEVICE_CPU);
    cpu_threads_set(1);
    test_rng_seed(&rng, 20240611);
#ifdef FSDP_CUDA_EMU
    /* no device at all: nothing registered, a reason, FSDP_OK */
    emu_set_device_count(0);
    fsdp_status st0 = cuda_backend_init(0);
    const char *why = cuda_unavailable_reason();
    test_check(st0 == FSDP_OK && why && strncmp(why, "no GPU: cudaGetDeviceCount: ", 28) == 0,
               "no GPU: status %d, reason \"%s\"", (int)st0, why ? why : "(null)");
    int avail0 = -1;
    char desc0[256] = "";
    fsdp_status sti = cuda_device_info(&avail0, desc0, sizeof desc0);
    test_check(sti == FSDP_OK && avail0 == 0 && strcmp(desc0, why ? why : "") == 0, "no GPU: device info %d \"%s\"",
               avail0, desc0);
    test_check(device_kernels(FSDP_DEVICE_CUDA) == NULL, "no GPU: nothing registered");
    emu_set_device_count(2);
#endif
    /* a local rank beyond the node's GPUs is an error naming both */
    fsdp_status st = cuda_backend_init(1000);
    const char *reason = cuda_unavailable_reason();
    if (st == FSDP_OK && reason) {
        printf("SKIPPED: %s\n", reason);
        return 77;
    }
    test_check(st == FSDP_ERR_DEVICE && strstr(fsdp_last_error(), "rank with local rank 1000 has no GPU: this node has"),
               "local rank 1000: status %d, message \"%s\"", (int)st, fsdp_last_error());
#ifdef FSDP_CUDA_EMU
    st = cuda_backend_init(1);
#else
    st = cuda_backend_init(0);
#endif
    if (st != FSDP_OK || cuda_unavailable_reason()) {
        printf("FAILED: cuda_backend_init: %s\n", st != FSDP_OK ? fsdp_last_error() : cuda_unavailable_reason());
        return 1;
    }
    G = device_kernels(FSDP_DEVICE_CUDA);
    test_check(G != NULL, "the CUDA table is registered");
    if (!G) return test_summary();
    int avail = 0, def = -1;
    char desc[256] = "";
    cuda_device_info(&avail, desc, sizeof desc);
#ifndef FSDP_CUDA_EMU
    int pub_avail = 0;
    char pub_desc[256] = "";
    fsdp_device_info(FSDP_DEVICE_CUDA, &pub_avail, pub_desc, sizeof pub_desc);
    test_check(pub_avail == 1 && strcmp(pub_desc, desc) == 0, "fsdp_device_info(cuda): %d \"%s\"", pub_avail, pub_desc);
#endif
    fsdp_default_device(&def);
    const char *want_dev = getenv("FSDP_DEVICE");
    int want_def = want_dev && strcmp(want_dev, "cpu") == 0 ? FSDP_DEVICE_CPU : FSDP_DEVICE_CUDA;
    test_check(avail == 1 && strncmp(desc, "cuda:", 5) == 0, "device info: %d \"%s\"", avail, desc);
    test_check(def == want_def, "default device %d, want %d", def, want_def);
    printf("%s: %s\n", MODE, desc);
    if (do_fault) return fault();
    if (do_flash) return flash_once(argc, argv);
#ifdef FSDP_CUDA_EMU
    if (do_bench) return bench(1);   /* the emulation's times mean nothing: toy sizes, to run the code */
#else
    if (do_bench) return bench(0);
#endif
#ifdef FSDP_CUDA_EMU
    {   /* the flash entries are there only where a block can have their shared memory */
        const char *optin = getenv("FSDP_EMU_SMEM_OPTIN");
        int small = optin && *optin && (size_t)strtoull(optin, NULL, 10) < cuda_attention_flash_smem_max();
        test_check((G->attention_flash_forward_bf16 == NULL) == small && (G->attention_flash_backward_bf16 == NULL) == small,
                   "flash entries with %s bytes of opt-in shared memory (the kernels need %zu): %s", optin ? optin : "the default",
                   cuda_attention_flash_smem_max(), G->attention_flash_forward_bf16 ? "registered" : "absent");
    }
#endif
    if (init_only) return test_summary();

    test_memory();
    test_cast();
    test_copy_strided();
    test_fill();
    test_matmul();
    test_binary();
    test_scalar_ops();
    test_sum_dim();
    test_sum_all();
    test_sumsq_many();
    test_activations();
    test_softmax();
    test_norms();
    test_embedding();
    test_cross_entropy();
    test_cross_entropy_online();
    test_classifier();
    test_attention();
    test_attention_qkv();
    test_attention_flash();
    test_bf16_elementwise();
    test_bf16_nn();
    test_fused();
    test_random();
    test_optim();
    test_adamw_many();
    test_ops_end_to_end();
    G->synchronize();
    fsdp_status last = cuda_last_status();
    test_check(last == FSDP_OK, "no CUDA error recorded: %s", last == FSDP_OK ? "" : fsdp_last_error());
    return test_summary();
}
