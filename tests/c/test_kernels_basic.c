/* test_kernels_basic.c: cast, copy, fill, matmul, elementwise, reductions and
 * random kernels against the double-precision references in ref_basic.c, at
 * awkward sizes (1, odd, prime), with 1 and 3 threads.
 *
 * Tolerances are bounds, not guesses:
 * - one f32 rounding of an exact result: |err| <= 2^-24 |want| (we allow 2^-23);
 * - a K-term f32 dot product: |err| <= K * 2^-24 * sum_k |a_ik b_kj|, the
 *   classic gamma_K bound, computed per element from |A| @ |B|;
 * - bf16 outputs: the f32 result rounded once more to 8 significant bits,
 *   so rtol 2^-8 on top of the f32 bound;
 * - sums accumulate in double and round once to float: 2^-23 relative plus a
 *   double-accumulation term far below it. */
#include "cpu_kernels.h"
#include "fsdp.h"
#include "ref_basic.h"
#include "testutil.h"
#include <math.h>
#include <stdlib.h>
#include <string.h>

static test_rng rng;
static int nthreads;   /* for check names */

#define EPS_F32 (1.0 / 16777216.0)   /* 2^-24, unit roundoff of f32 */
#define RTOL_BF16 (1.0 / 256.0)      /* 2^-8: one bf16 rounding is at most 2^-9 relative */

static float *fmalloc(int64_t n) { return malloc((size_t)(n > 0 ? n : 1) * sizeof(float)); }
static double *dmalloc(int64_t n) { return malloc((size_t)(n > 0 ? n : 1) * sizeof(double)); }

static uint32_t rng_u32(void) { return (uint32_t)(test_rng_uniform(&rng) * 4294967296.0); }

/* Counts |got - want| > bound[i] (NaN fails); one check. */
static void check_bound(const char *name, const float *got, const double *want, const double *bound, int64_t n) {
    int64_t wrong = 0;
    for (int64_t i = 0; i < n; i++) {
        double err = fabs((double)got[i] - want[i]);
        if (!(err <= bound[i])) {
            if (wrong < 5)
                fprintf(stderr, "  %s[%lld]: got %.9g want %.9g (err %.3g, bound %.3g)\n", name, (long long)i,
                        (double)got[i], want[i], err, bound[i]);
            wrong++;
        }
    }
    test_check(wrong == 0, "%s [threads %d]: %lld of %lld values out of bound", name, nthreads, (long long)wrong,
               (long long)n);
}

/* Rounds x to bf16 through the cast kernels, as the op layer would. */
static void round_bf16_inplace(float *x, int64_t n) {
    uint16_t *h = malloc((size_t)(n > 0 ? n : 1) * sizeof(uint16_t));
    cpu_cast_f32_to_bf16(h, x, n);
    cpu_cast_bf16_to_f32(x, h, n);
    free(h);
}

/* ------------------------------------------------------------------ cast */

static void test_cast_bf16(void) {
    /* random bit patterns cover every exponent, subnormals, inf and NaN */
    const int64_t n = 200003;
    float *x = fmalloc(n);
    uint16_t *h = malloc(n * sizeof(uint16_t));
    static const uint32_t edge[] = {
        0x00000000, 0x80000000, 0x3f800000, 0x3f808000 /* tie -> even 3f80 */, 0x3f818000 /* tie -> 3f82 */,
        0x3f808001, 0x3f807fff, 0x7f7fffff /* -> inf */, 0x7f7f7fff, 0x7f7f8000 /* tie, odd -> inf */,
        0x00000001, 0x00008000 /* subnormal tie -> 0 */, 0x00018000, 0x007fffff, 0x00800000, 0xff800000,
        0x7f800000, 0xbf7fffff, 0x33800000};
    int nedge = (int)(sizeof edge / sizeof edge[0]);
    for (int64_t i = 0; i < n; i++) {
        uint32_t u = i < nedge ? edge[i] : rng_u32();
        memcpy(&x[i], &u, 4);
    }
    cpu_cast_f32_to_bf16(h, x, n);
    int64_t wrong = 0, nan_wrong = 0;
    for (int64_t i = 0; i < n; i++) {
        if (isnan(x[i])) {   /* NaN stays NaN with its sign */
            float back = bf16_to_f32(h[i]);
            if (!isnan(back) || signbit(back) != signbit(x[i])) nan_wrong++;
            continue;
        }
        uint16_t want = ref_bf16_bits(ref_bf16_round(x[i]));
        if (h[i] != want) {
            uint32_t u;
            memcpy(&u, &x[i], 4);
            if (wrong < 5) fprintf(stderr, "  f32->bf16 %08x: got %04x want %04x\n", u, h[i], want);
            wrong++;
        }
    }
    test_check(wrong == 0, "cast f32->bf16 [threads %d]: %lld of %lld wrong (round to nearest even)", nthreads,
               (long long)wrong, (long long)n);
    test_check(nan_wrong == 0, "cast f32->bf16 [threads %d]: %lld NaN not kept", nthreads, (long long)nan_wrong);

    /* every bf16 pattern back to f32: the value must carry exactly those bits */
    uint16_t *all = malloc(65536 * sizeof(uint16_t));
    float *f = fmalloc(65536);
    for (int i = 0; i < 65536; i++) all[i] = (uint16_t)i;
    cpu_cast_bf16_to_f32(f, all, 65536);
    wrong = 0;
    for (int i = 0; i < 65536; i++) {
        int is_nan = (i & 0x7f80) == 0x7f80 && (i & 0x7f);
        int ok = is_nan ? isnan(f[i]) : ref_bf16_bits(f[i]) == i;
        if (!ok) wrong++;
    }
    test_check(wrong == 0, "cast bf16->f32 [threads %d]: %lld of 65536 patterns wrong", nthreads, (long long)wrong);
    free(all); free(f); free(x); free(h);
}

static void put(void *p, int dt, int64_t i, double v) {
    switch (dt) {
    case FSDP_F32: ((float *)p)[i] = (float)v; break;
    case FSDP_BF16: ((uint16_t *)p)[i] = ref_bf16_bits(v); break;   /* v is bf16-exact here */
    case FSDP_I32: ((int32_t *)p)[i] = (int32_t)v; break;
    case FSDP_I64: ((int64_t *)p)[i] = (int64_t)v; break;
    default: ((uint16_t *)p)[i] = (uint16_t)v; break;
    }
}

static double get(const void *p, int dt, int64_t i) {
    switch (dt) {
    case FSDP_F32: return ((const float *)p)[i];
    case FSDP_BF16: { float f; uint32_t u = (uint32_t)((const uint16_t *)p)[i] << 16; memcpy(&f, &u, 4); return f; }
    case FSDP_I32: return ((const int32_t *)p)[i];
    case FSDP_I64: return (double)((const int64_t *)p)[i];
    default: return ((const uint16_t *)p)[i];
    }
}

static void test_cast_any(void) {
    /* values exact in every float dtype (<= 8 significant bits); negatives
     * only where neither side is u16 */
    static const double vals[] = {0, 1, 2.75, 100.5, 255, 0.25, 7.5, 192, 3.125, -1, -2.75, -100.5, -256, -0.75};
    const int nv = (int)(sizeof vals / sizeof vals[0]);
    const int64_t n = 70001;   /* over the grain: the parallel path */
    int bad_pairs = 0;
    for (int in_dt = 0; in_dt < FSDP_DTYPE_COUNT; in_dt++)
        for (int out_dt = 0; out_dt < FSDP_DTYPE_COUNT; out_dt++) {
            int in_float = in_dt == FSDP_F32 || in_dt == FSDP_BF16, out_float = out_dt == FSDP_F32 || out_dt == FSDP_BF16;
            int unsigned_side = in_dt == FSDP_U16 || out_dt == FSDP_U16;
            void *in = malloc(n * 8), *out = malloc(n * 8);
            double *src = dmalloc(n);
            for (int64_t i = 0; i < n; i++) {
                double v = vals[(i * 7 + (i >> 3)) % nv];
                if (unsigned_side) v = fabs(v);
                if (!in_float) v = trunc(v);
                src[i] = v;
                put(in, in_dt, i, v);
            }
            cpu_cast_any(out, out_dt, in, in_dt, n);
            int64_t wrong = 0;
            for (int64_t i = 0; i < n; i++) {
                double want = out_float ? src[i] : trunc(src[i]);   /* float -> int truncates toward zero */
                if (get(out, out_dt, i) != want) wrong++;
            }
            if (wrong) {
                fprintf(stderr, "  cast %d->%d: %lld wrong\n", in_dt, out_dt, (long long)wrong);
                bad_pairs++;
            }
            free(in); free(out); free(src);
        }
    test_check(bad_pairs == 0, "cast_any [threads %d]: %d of 25 dtype pairs wrong", nthreads, bad_pairs);

    /* the corners: C truncation, u16 wrap from ints, saturation from floats */
    float fin[6] = {2.9f, -2.9f, -0.5f, 1e20f, -1e20f, NAN};
    int32_t i32[6];
    cpu_cast_any(i32, FSDP_I32, fin, FSDP_F32, 6);
    test_check(i32[0] == 2 && i32[1] == -2 && i32[2] == 0 && i32[3] == INT32_MAX && i32[4] == INT32_MIN && i32[5] == 0,
               "cast f32->i32 truncates toward zero and saturates: %d %d %d %d %d %d", i32[0], i32[1], i32[2], i32[3],
               i32[4], i32[5]);
    int64_t big[2] = {-1, 65537};
    uint16_t u16[2];
    cpu_cast_any(u16, FSDP_U16, big, FSDP_I64, 2);
    test_check(u16[0] == 65535 && u16[1] == 1, "cast i64->u16 wraps like C: %u %u", u16[0], u16[1]);
    int64_t i64v[2] = {16777217, -(1LL << 40)};
    float f2[2];
    cpu_cast_any(f2, FSDP_F32, i64v, FSDP_I64, 2);
    test_check(f2[0] == 16777216.0f && f2[1] == -1099511627776.0f, "cast i64->f32 rounds to nearest: %.1f %.1f",
               (double)f2[0], (double)f2[1]);
}

/* ------------------------------------------------------------------ copy */

typedef struct {
    const char *name;
    int ndim;
    int64_t shape[6];
    int64_t dst_strides[6], src_strides[6];
    int64_t dst_off, src_off;      /* element offsets of the view's origin */
} copy_case;

static int64_t span(int ndim, const int64_t *shape, const int64_t *strides, int64_t off) {
    int64_t hi = off, lo = off;   /* extent of the view, negative strides included */
    for (int k = 0; k < ndim; k++) {
        if (shape[k] == 0) return off + 1;
        int64_t d = (shape[k] - 1) * strides[k];
        if (d > 0) hi += d; else lo += d;
    }
    (void)lo;
    return hi + 1;
}

static void run_copy_case(const copy_case *cc, size_t elem) {
    int64_t dn = span(cc->ndim, cc->shape, cc->dst_strides, cc->dst_off);
    int64_t sn = span(cc->ndim, cc->shape, cc->src_strides, cc->src_off);
    char *src = malloc((size_t)sn * elem), *d1 = malloc((size_t)dn * elem), *d2 = malloc((size_t)dn * elem);
    for (int64_t i = 0; i < sn * (int64_t)elem; i++) src[i] = (char)(rng_u32() | 1);
    memset(d1, 0xab, (size_t)dn * elem);   /* untouched bytes must stay as they were */
    memset(d2, 0xab, (size_t)dn * elem);
    cpu_copy_strided(d1 + cc->dst_off * elem, cc->dst_strides, src + cc->src_off * elem, cc->src_strides, cc->ndim,
                     cc->shape, elem);
    ref_copy_strided(d2 + cc->dst_off * elem, cc->dst_strides, src + cc->src_off * elem, cc->src_strides, cc->ndim,
                     cc->shape, elem);
    test_check(memcmp(d1, d2, (size_t)dn * elem) == 0, "copy %s elem %zu [threads %d]", cc->name, elem, nthreads);
    free(src); free(d1); free(d2);
}

static void test_copy(void) {
    const copy_case cases[] = {
        {"contiguous 3d", 3, {7, 13, 31}, {403, 31, 1}, {403, 31, 1}, 0, 0},
        {"transpose", 2, {31, 13}, {13, 1}, {1, 31}, 0, 0},
        {"permute 4d", 4, {7, 3, 11, 5}, {165, 55, 5, 1}, {11, 385, 1, 77}, 0, 0},
        {"broadcast row", 2, {5, 97}, {97, 1}, {0, 1}, 0, 0},
        {"broadcast column", 2, {97, 5}, {5, 1}, {1, 0}, 0, 0},
        {"slice step 2", 2, {14, 16}, {16, 1}, {40, 2}, 0, 3 * 40 + 5},
        {"into a slice", 2, {13, 7}, {20, 1}, {7, 1}, 2 * 20 + 3, 0},
        {"ndim 0", 0, {0}, {0}, {0}, 0, 0},
        {"size-1 dims", 4, {1, 7, 1, 13}, {91, 13, 13, 1}, {5, 3, 1000, 29}, 0, 0},
        {"negative stride", 1, {31}, {1}, {-1}, 0, 30},
        {"partly mergeable", 3, {5, 7, 3}, {21, 3, 1}, {30, 3, 1}, 0, 0},
        {"both strided", 3, {3, 5, 7}, {1, 3, 15}, {70, 14, 2}, 0, 0},
        {"empty", 2, {0, 5}, {5, 1}, {5, 1}, 0, 0},
        {"big contiguous", 1, {1000003}, {1}, {1}, 0, 0},
        {"big transpose", 2, {513, 1000}, {1000, 1}, {1, 513}, 0, 0},
        {"big strided row", 1, {300001}, {1}, {3}, 0, 0},
        {"tiled transpose 3d", 3, {3, 45, 70}, {3150, 70, 1}, {3150, 1, 45}, 0, 0},
        {"tiled transpose, strided dst", 2, {33, 97}, {200, 2}, {1, 40}, 7, 3},
        {"big permute 3d", 3, {61, 67, 71}, {67 * 71, 71, 1}, {71, 61 * 71, 1}, 0, 0},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) run_copy_case(&cases[i], 4);
    static const size_t elems[] = {1, 2, 8, 12};
    for (int e = 0; e < 4; e++) {
        run_copy_case(&cases[1], elems[e]);
        run_copy_case(&cases[2], elems[e]);
        run_copy_case(&cases[5], elems[e]);
        run_copy_case(&cases[7], elems[e]);
        run_copy_case(&cases[16], elems[e]);
        run_copy_case(&cases[17], elems[e]);
    }
}

/* fill and zero, small (plain stores) and past 4 MiB (streaming stores over
 * the pool), at a start off the 64-byte line: every element written, the
 * neighbours on both sides untouched */
static void test_fill(void) {
    static const int64_t ns[] = {1, 7, 100003, (1 << 20) + 37};
    for (int t = 0; t < 4; t++) {
        float *buf = fmalloc(ns[t] + 5), *x = buf + 3;
        buf[0] = buf[1] = buf[2] = 9.0f;
        x[ns[t]] = 7.0f;
        x[ns[t] + 1] = 7.0f;
        cpu_fill_f32(x, -1.25f, ns[t]);
        int64_t wrong = 0;
        for (int64_t i = 0; i < ns[t]; i++) wrong += x[i] != -1.25f;
        test_check(wrong == 0 && x[ns[t]] == 7.0f && x[ns[t] + 1] == 7.0f && buf[0] == 9.0f && buf[2] == 9.0f,
                   "fill n=%lld at an offset of 12 bytes [threads %d] (%lld wrong)", (long long)ns[t], nthreads,
                   (long long)wrong);
        free(buf);
    }
    static const size_t bytes[] = {0, 1, 63, 100003, ((size_t)4 << 20) + 13};
    for (int t = 0; t < 5; t++) {
        size_t n = bytes[t];
        unsigned char *buf = malloc(n + 16), *z = buf + 5;
        memset(buf, 0xab, n + 16);
        cpu_zero(z, n);
        size_t wrong = 0;
        for (size_t i = 0; i < n; i++) wrong += z[i] != 0;
        int around = 1;
        for (int i = 0; i < 5; i++) around &= buf[i] == 0xab;
        for (size_t i = 5 + n; i < n + 16; i++) around &= buf[i] == 0xab;
        test_check(wrong == 0 && around, "zero %zu bytes at an offset of 5 [threads %d] (%zu wrong, neighbours %s)", n,
                   nthreads, wrong, around ? "untouched" : "written");
        free(buf);
    }
}

/* ---------------------------------------------------------------- matmul */

/* One batched matmul checked against ref_matmul with the gamma_K bound;
 * bf16: inputs and output rounded to bf16 through the cast kernels. */
static void run_matmul(const char *tag, int64_t batch, int64_t M, int64_t N, int64_t K, int ta, int tb,
                       float alpha, float beta, int64_t sa, int64_t sb, int64_t sc, int bf16) {
    int64_t na = (batch - 1) * sa + M * K, nb = (batch - 1) * sb + K * N, nc = (batch - 1) * sc + M * N;
    float *a = fmalloc(na), *b = fmalloc(nb), *c = fmalloc(nc);
    double *da = dmalloc(na), *db = dmalloc(nb), *dc = dmalloc(nc), *bound = dmalloc(nc);
    test_fill_nonzero(&rng, a, na, 1.0f);
    test_fill_nonzero(&rng, b, nb, 1.0f);
    test_fill_nonzero(&rng, c, nc, 1.0f);
    if (bf16) { round_bf16_inplace(a, na); round_bf16_inplace(b, nb); round_bf16_inplace(c, nc); }
    if (beta == 0.0f) for (int64_t i = 0; i < nc; i++) c[i] = NAN;   /* beta = 0 must overwrite, NaN included */
    ref_to_double(da, a, na);
    ref_to_double(db, b, nb);
    ref_to_double(dc, c, nc);
    /* bound = K * eps * (|alpha| |A| @ |B| + |beta C|), plus the bf16 output rounding */
    for (int64_t i = 0; i < na; i++) da[i] = fabs(da[i]);
    for (int64_t i = 0; i < nb; i++) db[i] = fabs(db[i]);
    for (int64_t i = 0; i < nc; i++) bound[i] = beta == 0.0f ? 0.0 : fabs(dc[i]);
    ref_matmul(bound, da, db, batch, M, N, K, ta, tb, fabs(alpha), fabs(beta), sa, sb, sc);
    ref_to_double(da, a, na);
    ref_to_double(db, b, nb);
    ref_matmul(dc, da, db, batch, M, N, K, ta, tb, alpha, beta, sa, sb, sc);
    for (int64_t i = 0; i < nc; i++) bound[i] = (double)(K + 2) * EPS_F32 * bound[i] + (bf16 ? RTOL_BF16 * fabs(dc[i]) : 0);

    cpu_matmul_f32(c, a, b, batch, M, N, K, ta, tb, alpha, beta, sa, sb, sc);
    if (bf16) round_bf16_inplace(c, nc);
    /* only the batch's C blocks are defined (gaps between them stay NaN) */
    int64_t wrong = 0;
    for (int64_t bi = 0; bi < batch; bi++)
        for (int64_t i = 0; i < M * N; i++) {
            int64_t j = bi * sc + i;
            double err = fabs((double)c[j] - dc[j]);
            if (!(err <= bound[j])) {
                if (wrong < 3)
                    fprintf(stderr, "  %s b%lld [%lld]: got %.9g want %.9g bound %.3g\n", tag, (long long)bi,
                            (long long)i, (double)c[j], dc[j], bound[j]);
                wrong++;
            }
        }
    test_check(wrong == 0,
               "matmul %s%s batch %lld M %lld N %lld K %lld ta %d tb %d alpha %g beta %g strides %lld %lld %lld "
               "[threads %d]: %lld wrong",
               tag, bf16 ? " bf16" : "", (long long)batch, (long long)M, (long long)N, (long long)K, ta, tb,
               (double)alpha, (double)beta, (long long)sa, (long long)sb, (long long)sc, nthreads, (long long)wrong);
    free(a); free(b); free(c); free(da); free(db); free(dc); free(bound);
}

static void test_matmul(void) {
    static const int64_t sizes[] = {1, 7, 13, 31, 64, 97};
    /* every (M, N, K) and transpose combination, one check per transpose combo */
    for (int t = 0; t < 4; t++) {
        int ta = t >> 1, tb = t & 1;
        for (int i = 0; i < 6; i++)
            for (int j = 0; j < 6; j++)
                for (int k = 0; k < 6; k++) {
                    int odd = (i + j + k) & 1;   /* alternate plain and alpha/beta */
                    run_matmul("grid", 1, sizes[i], sizes[j], sizes[k], ta, tb, odd ? 0.5f : 1.0f, odd ? -0.75f : 0.0f,
                               0, 0, 0, 0);
                }
    }
    /* batched: packed, shared B (the folded path when A is not transposed),
     * shared A, gaps between batches */
    static const int64_t shp[][3] = {{7, 13, 31}, {64, 97, 13}, {1, 31, 7}, {13, 1, 97}};
    for (int s = 0; s < 4; s++) {
        int64_t M = shp[s][0], N = shp[s][1], K = shp[s][2];
        for (int t = 0; t < 4; t++) {
            int ta = t >> 1, tb = t & 1;
            run_matmul("batched", 3, M, N, K, ta, tb, 1.0f, 0.0f, M * K, K * N, M * N, 0);
            run_matmul("shared B", 5, M, N, K, ta, tb, 1.0f, 0.0f, M * K, 0, M * N, 0);
            run_matmul("shared B a/b", 3, M, N, K, ta, tb, 0.5f, 1.0f, M * K, 0, M * N, 0);
            run_matmul("shared A", 3, M, N, K, ta, tb, 1.0f, 0.0f, 0, K * N, M * N, 0);
            run_matmul("gaps", 3, M, N, K, ta, tb, 1.0f, 0.5f, M * K + 5, K * N + 3, M * N + 7, 0);
            run_matmul("shared B gaps", 3, M, N, K, ta, tb, 1.0f, 0.0f, M * K + 1, 0, M * N, 0);
        }
    }
    run_matmul("K=0", 2, 7, 13, 0, 0, 0, 1.0f, 0.5f, 0, 0, 7 * 13, 0);
    run_matmul("K=0 beta 0", 1, 7, 13, 0, 1, 1, 1.0f, 0.0f, 0, 0, 0, 0);
    /* bf16 through the casts */
    for (int t = 0; t < 4; t++) {
        run_matmul("grid", 1, 31, 97, 64, t >> 1, t & 1, 1.0f, 0.0f, 0, 0, 0, 1);
        run_matmul("shared B", 4, 13, 7, 97, t >> 1, t & 1, 1.0f, 0.0f, 13 * 97, 0, 13 * 7, 1);
    }
    /* a GPT-2-like shape big enough for OpenBLAS to use its threads */
    run_matmul("big", 2, 64, 257, 768, 0, 1, 1.0f, 0.0f, 64 * 768, 0, 64 * 257, 0);
}

/* ----------------------------------------------------------- elementwise */

typedef struct {
    const char *name;
    int ndim;
    int64_t shape[5];
    int64_t sa[5], sb[5];
} bin_case;

static const char *OP_NAMES[4] = {"add", "sub", "mul", "div"};

static void run_binary(const bin_case *bc, int op, int bf16, int inplace) {
    int64_t n = 1;
    for (int k = 0; k < bc->ndim; k++) n *= bc->shape[k];
    int64_t na = span(bc->ndim, bc->shape, bc->sa, 0), nb = span(bc->ndim, bc->shape, bc->sb, 0);
    if (inplace && na < n) return;
    float *a = fmalloc(na), *b = fmalloc(nb), *out = inplace ? a : fmalloc(n);
    double *da = dmalloc(na), *db = dmalloc(nb), *want = dmalloc(n), *bound = dmalloc(n);
    test_fill_nonzero(&rng, a, na, 2.0f);
    test_fill_nonzero(&rng, b, nb, 2.0f);
    if (bf16) { round_bf16_inplace(a, na); round_bf16_inplace(b, nb); }
    ref_to_double(da, a, na);
    ref_to_double(db, b, nb);
    ref_binary(op, want, da, bc->sa, db, bc->sb, bc->ndim, bc->shape);
    /* one correctly rounded op: <= 2^-24 relative (the 1.0001 absorbs the reference's own rounding) */
    for (int64_t i = 0; i < n; i++) bound[i] = (1.0001 * EPS_F32 + (bf16 ? RTOL_BF16 : 0)) * fabs(want[i]);
    cpu_binary_f32(op, out, a, bc->sa, b, bc->sb, bc->ndim, bc->shape);
    if (bf16) round_bf16_inplace(out, n);
    char name[160];
    snprintf(name, sizeof name, "binary %s %s%s%s", OP_NAMES[op], bc->name, bf16 ? " bf16" : "",
             inplace ? " in place" : "");
    check_bound(name, out, want, bound, n);
    if (!inplace) free(out);
    free(a); free(b); free(da); free(db); free(want); free(bound);
}

static void test_binary(void) {
    const bin_case cases[] = {
        {"same shape 3d", 3, {7, 13, 31}, {403, 31, 1}, {403, 31, 1}},
        {"1d prime", 1, {100003}, {1}, {1}},
        {"one element", 1, {1}, {1}, {1}},
        {"ndim 0", 0, {0}, {0}, {0}},
        {"b scalar", 2, {13, 97}, {97, 1}, {0, 0}},
        {"a scalar", 2, {13, 97}, {0, 0}, {97, 1}},
        {"row (bias)", 2, {31, 64}, {64, 1}, {0, 1}},
        {"row (bias) big", 3, {4, 250, 97}, {250 * 97, 97, 1}, {0, 0, 1}},
        {"column", 2, {97, 31}, {31, 1}, {1, 0}},
        {"middle dim", 3, {5, 7, 13}, {91, 13, 1}, {13, 0, 1}},
        {"both sides", 2, {31, 13}, {1, 0}, {0, 1}},
        {"transposed a", 2, {13, 31}, {1, 13}, {31, 1}},
        {"4d size-1 dims", 4, {3, 1, 5, 7}, {35, 0, 7, 1}, {0, 0, 1, 0}},
        {"4d (1,3,1,7)", 4, {2, 3, 5, 7}, {105, 35, 7, 1}, {0, 7, 0, 1}},
        {"big general", 2, {300, 211}, {1, 300}, {0, 1}},
        {"big column", 2, {1001, 97}, {97, 1}, {1, 0}},
        {"empty", 2, {0, 5}, {5, 1}, {0, 1}},
    };
    int nc = (int)(sizeof cases / sizeof cases[0]);
    for (int i = 0; i < nc; i++)
        for (int op = 0; op < 4; op++) run_binary(&cases[i], op, 0, 0);
    for (int op = 0; op < 4; op++) {
        run_binary(&cases[0], op, 0, 1);   /* out == a */
        run_binary(&cases[7], op, 0, 1);   /* out == a, b broadcast */
        run_binary(&cases[1], op, 1, 0);
        run_binary(&cases[7], op, 1, 0);
        run_binary(&cases[10], op, 1, 0);
    }
}

static void test_scalar_ops(void) {
    static const int64_t ns[] = {1, 7, 100003};
    for (int t = 0; t < 3; t++) {
        int64_t n = ns[t];
        float *x = fmalloc(n), *y = fmalloc(n), *out = fmalloc(n);
        double *want = dmalloc(n), *bound = dmalloc(n);
        test_fill_nonzero(&rng, x, n, 3.0f);
        test_fill_nonzero(&rng, y, n, 3.0f);
        char name[96];

        cpu_scale_f32(out, x, -0.37f, n);
        for (int64_t i = 0; i < n; i++) { want[i] = (double)x[i] * -0.37f; bound[i] = 2 * EPS_F32 * fabs(want[i]); }
        snprintf(name, sizeof name, "scale n=%lld", (long long)n);
        check_bound(name, out, want, bound, n);

        cpu_add_scalar_f32(out, x, 1.5f, n);
        for (int64_t i = 0; i < n; i++) { want[i] = (double)x[i] + 1.5; bound[i] = 2 * EPS_F32 * fabs(want[i]); }
        snprintf(name, sizeof name, "add_scalar n=%lld", (long long)n);
        check_bound(name, out, want, bound, n);

        /* y += alpha x: at most two roundings (one with FMA) */
        for (int64_t i = 0; i < n; i++) {
            double ax = 0.7f * (double)x[i];
            want[i] = y[i] + ax;
            bound[i] = 2 * EPS_F32 * (fabs(ax) + fabs(want[i]));
        }
        memcpy(out, y, n * sizeof(float));
        cpu_axpy_f32(out, x, 0.7f, n);
        snprintf(name, sizeof name, "axpy n=%lld", (long long)n);
        check_bound(name, out, want, bound, n);
        free(x); free(y); free(out); free(want); free(bound);
    }
}

/* ------------------------------------------------------------- reductions */

static void test_sum_dim(void) {
    static const int64_t shapes[][3] = {
        {1, 1, 1}, {7, 13, 1}, {1, 97, 31}, {13, 7, 97}, {3, 1, 5}, {1000, 7, 1}, {5, 1000, 300},
        {1, 5003, 768} /* bias-gradient shape: red gets split */, {4, 3001, 3}, {2, 100003, 1}, {1, 2049, 1},
    };
    for (size_t s = 0; s < sizeof shapes / sizeof shapes[0]; s++) {
        int64_t O = shapes[s][0], R = shapes[s][1], I = shapes[s][2];
        float *x = fmalloc(O * R * I), *out = fmalloc(O * I);
        double *dx = dmalloc(O * R * I), *want = dmalloc(O * I), *bound = dmalloc(O * I);
        test_fill_nonzero(&rng, x, O * R * I, 1.0f);
        ref_to_double(dx, x, O * R * I);
        ref_sum_dim(want, dx, O, R, I);
        for (int64_t i = 0; i < O * R * I; i++) dx[i] = fabs(dx[i]);
        ref_sum_dim(bound, dx, O, R, I);   /* sum |x|, for the double accumulation term */
        for (int64_t i = 0; i < O * I; i++) bound[i] = 2 * EPS_F32 * fabs(want[i]) + 1e-13 * bound[i];
        cpu_sum_dim_f32(out, x, O, R, I);
        char name[96];
        snprintf(name, sizeof name, "sum_dim (%lld, %lld, %lld)", (long long)O, (long long)R, (long long)I);
        check_bound(name, out, want, bound, O * I);
        free(x); free(out); free(dx); free(want); free(bound);
    }

    /* accuracy: 1e6 positive values, where a float running sum is off by ~1e-4 */
    const int64_t n = 1000000;
    float *x = fmalloc(n), out;
    for (int64_t i = 0; i < n; i++) x[i] = (float)(0.1 + 0.9 * test_rng_uniform(&rng));
    double exact = 0;
    for (int64_t i = 0; i < n; i++) exact += x[i];
    cpu_sum_dim_f32(&out, x, 1, n, 1);
    test_check(fabs(out - exact) <= 1e-6 * exact, "sum_dim of 1e6 [threads %d]: rel err %.3g", nthreads,
               fabs(out - exact) / exact);
    double s = cpu_sum_all_f32(x, n);
    test_check(fabs(s - exact) <= 1e-12 * exact, "sum_all of 1e6 [threads %d]: rel err %.3g", nthreads,
               fabs(s - exact) / exact);
    free(x);
}

static void test_sum_all(void) {
    /* 63, 64, 1031: below, at and past the four 16-float streams of sumsq's vector loop, with a tail */
    static const int64_t ns[] = {1, 7, 63, 64, 97, 1031, 65537, 1000003};
    for (int t = 0; t < 8; t++) {
        int64_t n = ns[t];
        float *x = fmalloc(n);
        test_fill_nonzero(&rng, x, n, 2.0f);
        double s = 0, sa = 0, sq = 0;
        for (int64_t i = 0; i < n; i++) { s += x[i]; sa += fabs((double)x[i]); sq += (double)x[i] * x[i]; }
        double got = cpu_sum_all_f32(x, n), gotsq = cpu_sumsq_f32(x, n);
        /* double accumulation: error ~ n * 2^-53 * sum |x| */
        test_check(fabs(got - s) <= 1e-15 * n * sa + 1e-300, "sum_all n=%lld [threads %d]: %.17g vs %.17g",
                   (long long)n, nthreads, got, s);
        test_check(fabs(gotsq - sq) <= 1e-15 * n * sq, "sumsq n=%lld [threads %d]: %.17g vs %.17g", (long long)n,
                   nthreads, gotsq, sq);
        free(x);
    }
    test_check(cpu_sum_all_f32(NULL, 0) == 0.0 && cpu_sumsq_f32(NULL, 0) == 0.0, "sum of nothing is 0");
}

/* Results must not depend on the thread count, bit for bit. */
static void test_reduce_deterministic(void) {
    const int64_t O = 1, R = 20011, I = 769, n = O * R * I;
    float *x = fmalloc(n), *o1 = fmalloc(O * I), *o3 = fmalloc(O * I);
    test_fill_nonzero(&rng, x, n, 1.0f);
    cpu_threads_set(1);
    cpu_sum_dim_f32(o1, x, O, R, I);
    double s1 = cpu_sum_all_f32(x, n), q1 = cpu_sumsq_f32(x, n);
    cpu_threads_set(3);
    cpu_sum_dim_f32(o3, x, O, R, I);
    double s3 = cpu_sum_all_f32(x, n), q3 = cpu_sumsq_f32(x, n);
    test_check(memcmp(o1, o3, O * I * sizeof(float)) == 0 && s1 == s3 && q1 == q3,
               "reductions are bitwise equal on 1 and 3 threads");
    free(x); free(o1); free(o3);
}

/* ---------------------------------------------------------------- random */

static void test_philox_kat(void) {
    /* Random123 known-answer vectors for philox4x32_10 */
    static const struct { uint32_t ctr[4], key[2], out[4]; } kat[] = {
        {{0, 0, 0, 0}, {0, 0}, {0x6627e8d5, 0xe169c58d, 0xbc57ac4c, 0x9b00dbd8}},
        {{0xffffffff, 0xffffffff, 0xffffffff, 0xffffffff}, {0xffffffff, 0xffffffff},
         {0x408f276d, 0x41c83b0e, 0xa20bc7c6, 0x6d5451fd}},
        {{0x243f6a88, 0x85a308d3, 0x13198a2e, 0x03707344}, {0xa4093822, 0x299f31d0},
         {0xd16cfe09, 0x94fdcceb, 0x5001e420, 0x24126ea1}},
    };
    for (int t = 0; t < 3; t++) {
        uint64_t seed = kat[t].key[0] | (uint64_t)kat[t].key[1] << 32;
        uint64_t counter = kat[t].ctr[0] | (uint64_t)kat[t].ctr[1] << 32;
        uint64_t stream = kat[t].ctr[2] | (uint64_t)kat[t].ctr[3] << 32;
        uint32_t out[4];
        cpu_philox4x32(seed, stream, counter, out);
        test_check(memcmp(out, kat[t].out, sizeof out) == 0, "philox4x32-10 KAT %d: got %08x %08x %08x %08x", t,
                   out[0], out[1], out[2], out[3]);
    }
}

/* The bulk kernels draw from the same words as the KAT-checked
 * cpu_philox4x32, including across the carry into the counter's high word. */
static void test_rng_words(void) {
    const uint64_t seed = 0x123456789abcdefull, stream = 77;
    const int64_t offset = 0xfffffff0ll, n = 40;   /* crosses 2^32 */
    float u[40], z[40];
    cpu_init_uniform_f32(u, n, 0.0f, 1.0f, seed, stream, offset);
    cpu_init_normal_f32(z, n, 0.0f, 1.0f, seed, stream, offset);
    int bad_u = 0, bad_z = 0;
    for (int64_t i = 0; i < n; i++) {
        uint32_t w[4];
        cpu_philox4x32(seed, stream, (uint64_t)(offset + i), w);
        bad_u += u[i] != (float)((w[0] >> 8) / 16777216.0);
        /* Box-Muller from the first two words, in double: the kernel's float math is within ~1e-5 */
        double u1 = (w[0] + 1.0) / 4294967296.0, u2 = (w[1] >> 8) / 16777216.0;
        double want = sqrt(-2 * log(u1)) * cos(6.283185307179586 * u2);
        bad_z += !(fabs(z[i] - want) <= 1e-5 * (1 + fabs(want)));
    }
    test_check(bad_u == 0, "init_uniform uses the top 24 bits of word 0 [threads %d]: %d wrong", nthreads, bad_u);
    test_check(bad_z == 0, "init_normal is Box-Muller of words 0 and 1 [threads %d]: %d wrong", nthreads, bad_z);
}

static void test_init_normal(void) {
    const int64_t n = 100000;
    const double mean = 0.5, std = 2.0;
    float *x = fmalloc(n);
    cpu_init_normal_f32(x, n, (float)mean, (float)std, 1234, 7, 0);
    double s = 0, s2 = 0;
    int64_t within1 = 0;
    for (int64_t i = 0; i < n; i++) {
        s += x[i];
        within1 += fabs(x[i] - mean) < std;
    }
    double m = s / n;
    for (int64_t i = 0; i < n; i++) s2 += (x[i] - m) * (x[i] - m);
    double sd = sqrt(s2 / (n - 1));
    /* 3 sigma: the mean's sd is std/sqrt(n); the sample sd's is about std/sqrt(2n) */
    test_check(fabs(m - mean) < 3 * std / sqrt((double)n), "init_normal mean %.5f [threads %d]", m, nthreads);
    test_check(fabs(sd - std) < 3 * std / sqrt(2.0 * n), "init_normal std %.5f [threads %d]", sd, nthreads);
    double p1 = 0.6826894921370859, f1 = (double)within1 / n;
    test_check(fabs(f1 - p1) < 3 * sqrt(p1 * (1 - p1) / n), "init_normal P(|z|<1) %.5f [threads %d]", f1, nthreads);

    /* the slice [offset, offset+k) equals the same slice of the full init, bit for bit */
    static const int64_t offs[][2] = {{0, 1}, {1, 1}, {12345, 333}, {777, 50001}, {99999, 1}, {4095, 4098}};
    int bad = 0;
    for (int t = 0; t < 6; t++) {
        float *y = fmalloc(offs[t][1]);
        cpu_init_normal_f32(y, offs[t][1], (float)mean, (float)std, 1234, 7, offs[t][0]);
        bad += memcmp(y, x + offs[t][0], offs[t][1] * sizeof(float)) != 0;
        free(y);
    }
    test_check(bad == 0, "init_normal slices equal the full init bit for bit [threads %d]", nthreads);

    /* other seeds and streams give other numbers */
    float *y = fmalloc(1000);
    cpu_init_normal_f32(y, 1000, (float)mean, (float)std, 1234, 8, 0);
    int same = 0;
    for (int i = 0; i < 1000; i++) same += y[i] == x[i];
    cpu_init_normal_f32(y, 1000, (float)mean, (float)std, 1235, 7, 0);
    for (int i = 0; i < 1000; i++) same += y[i] == x[i];
    test_check(same < 5, "init_normal differs across seeds and streams (%d equal)", same);
    free(y); free(x);
}

static void test_init_uniform(void) {
    const int64_t n = 100000;
    const float lo = -0.25f, hi = 0.75f;
    float *x = fmalloc(n);
    cpu_init_uniform_f32(x, n, lo, hi, 99, 3, 1000);
    int64_t out_of_range = 0;
    double s = 0;
    for (int64_t i = 0; i < n; i++) {
        out_of_range += !(x[i] >= lo && x[i] < hi);
        s += x[i];
    }
    double m = s / n, sd = (hi - lo) / sqrt(12.0);
    test_check(out_of_range == 0, "init_uniform in [low, high) [threads %d]: %lld outside", nthreads,
               (long long)out_of_range);
    test_check(fabs(m - 0.25) < 3 * sd / sqrt((double)n), "init_uniform mean %.5f [threads %d]", m, nthreads);
    float *y = fmalloc(777);
    cpu_init_uniform_f32(y, 777, lo, hi, 99, 3, 1000 + 5000);
    test_check(memcmp(y, x + 5000, 777 * sizeof(float)) == 0, "init_uniform slice equals the full init [threads %d]",
               nthreads);
    free(x); free(y);
}

static void test_dropout(void) {
    const int64_t n = 100003;
    float *x = fmalloc(n), *y = fmalloc(n), *y2 = fmalloc(n), *u = fmalloc(n);
    test_fill_nonzero(&rng, x, n, 1.0f);
    static const float ps[] = {0.1f, 0.5f, 0.9f};
    for (int t = 0; t < 3; t++) {
        float p = ps[t];
        cpu_dropout_f32(y, x, n, p, 42, 500);
        int64_t kept = 0, bad_scale = 0;
        for (int64_t i = 0; i < n; i++) {
            if (y[i] == 0.0f) continue;
            kept++;
            double want = (double)x[i] / (1.0 - (double)p);
            if (!(fabs(y[i] - want) <= 4 * EPS_F32 * fabs(want))) bad_scale++;
        }
        double f = (double)kept / n, q = 1.0 - p;
        test_check(fabs(f - q) < 3 * sqrt(q * p / n), "dropout p=%.1f keeps %.5f [threads %d]", (double)p, f, nthreads);
        test_check(bad_scale == 0, "dropout p=%.1f kept values are x/(1-p) [threads %d]: %lld wrong", (double)p,
                   nthreads, (long long)bad_scale);
        /* the mask is u >= p for u the uniform draw of stream 0xd50 */
        cpu_init_uniform_f32(u, n, 0.0f, 1.0f, 42, 0xd50, 500);
        int64_t mism = 0;
        for (int64_t i = 0; i < n; i++) mism += (y[i] != 0.0f) != (u[i] >= p);
        test_check(mism == 0, "dropout p=%.1f mask is uniform(seed, 0xd50, offset+i) >= p [threads %d]", (double)p,
                   nthreads);
        /* deterministic, and a slice at an offset matches */
        cpu_dropout_f32(y2, x, n, p, 42, 500);
        test_check(memcmp(y, y2, n * sizeof(float)) == 0, "dropout p=%.1f is deterministic [threads %d]", (double)p,
                   nthreads);
        cpu_dropout_f32(y2, x + 3001, 999, p, 42, 500 + 3001);
        test_check(memcmp(y + 3001, y2, 999 * sizeof(float)) == 0, "dropout p=%.1f slice matches [threads %d]",
                   (double)p, nthreads);
    }
    cpu_dropout_f32(y, x, n, 0.0f, 42, 0);
    test_check(memcmp(x, y, n * sizeof(float)) == 0, "dropout p=0 copies [threads %d]", nthreads);
    /* another seed gives an independent mask: about half the decisions agree */
    cpu_dropout_f32(y, x, n, 0.5f, 42, 0);
    cpu_dropout_f32(y2, x, n, 0.5f, 43, 0);
    int64_t agree = 0;
    for (int64_t i = 0; i < n; i++) agree += (y[i] != 0.0f) == (y2[i] != 0.0f);
    test_check(fabs((double)agree / n - 0.5) < 3 * 0.5 / sqrt((double)n), "dropout masks of two seeds agree on %.4f",
               (double)agree / n);
    free(x); free(y); free(y2); free(u);
}

int main(void) {
    test_rng_seed(&rng, 20240531);
    test_philox_kat();
    static const int thread_counts[] = {1, 3};
    for (int t = 0; t < 2; t++) {
        nthreads = thread_counts[t];
        cpu_threads_set(nthreads);
        test_cast_bf16();
        test_cast_any();
        test_copy();
        test_fill();
        test_matmul();
        test_binary();
        test_scalar_ops();
        test_sum_dim();
        test_sum_all();
        test_rng_words();
        test_init_normal();
        test_init_uniform();
        test_dropout();
    }
    test_reduce_deterministic();
    return test_summary();
}
