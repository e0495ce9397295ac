/* test_cuda_kernels_elementwise.c: binary ops with broadcasting and
 * strides, scale, add_scalar, axpy, and the reductions (sum over a dim, sum
 * of all, sum of squares of one or many tensors), in f32 and bf16.
 * Tolerances: binary ops, scale, add_scalar bit for bit (f32 and bf16: one
 * op, one rounding); axpy rtol 1e-6 (contraction into FMAs may differ);
 * sum_dim 1e-6 x the sum of |x| over the reduced elements (bf16: one ulp of
 * it); sum_all, sumsq 1e-10 relative to sum |x| (both accumulate in
 * double). */
#include "cuda_kernels_check.h"

/* ---- elementwise ---- */

typedef struct {
    const char *name;
    int ndim;
    int64_t shape[4], sa[4], sb[4];
    int64_t na, nb;   /* elements a and b hold */
} bin_case;

void test_binary(void) {
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

void test_scalar_ops(void) {
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

void test_sum_dim(void) {
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

void test_sum_all(void) {
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
void test_sumsq_many(void) {
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

static uint16_t *da_host16(const float *h, int64_t n) {   /* h holds bf16 values: their bits, on the host */
    uint16_t *t = halloc((size_t)(n > 0 ? n : 1) * 2);
    for (int64_t i = 0; i < n; i++) t[i] = f32_to_bf16(h[i]);
    return t;
}

void test_bf16_elementwise(void) {
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
