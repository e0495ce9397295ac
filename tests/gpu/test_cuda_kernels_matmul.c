/* test_cuda_kernels_matmul.c: the batched GEMMs (cuBLAS), f32 and bf16,
 * every transpose, alpha and beta, a shared B, K = 0, against the product
 * in double.
 * Tolerance: matmul_f32 1e-5 x (|alpha| sum_k |a_ik||b_kj| + |beta||c_ij|)
 * per element; matmul_bf16 2^-8 of the same bound. */
#include "cuda_kernels_check.h"

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
    uint16_t *da = dup_bytes(ah, (size_t)na * 2), *db = dup_bytes(bh, (size_t)nb * 2), *dc = dup_bytes(ch, (size_t)nc * 2);
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

void test_matmul(void) {
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
