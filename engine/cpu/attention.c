/* attention.c: scaled dot-product attention over (B, H, T, D) with an
 * optional causal mask, flash-style.
 *
 * Queries go in blocks of QB rows and keys in tiles of KB, so a thread's
 * scratch is a few fixed tiles on its stack, whatever T is. The forward keeps
 * a running max and sum per query row (online softmax) and saves
 * lse = log sum_j exp(s_ij); the backward recomputes P = exp(S - lse) tile by
 * tile rather than keeping a (T, T) matrix. Threads split the B*H heads, and
 * each head's outputs (dK and dV included) belong to one thread, so results
 * do not depend on the thread count.
 *
 * The tile products run on a small register-blocked kernel of our own rather
 * than OpenBLAS: sgemm called from every pool thread at once would start
 * OpenBLAS's own threads inside ours, and its per-call cost is large next to
 * a 64 x 128 x 64 tile. The exps use a polynomial that vectorizes; libm's
 * expf does not, and there are T^2 of them per head. */
#include "cpu_kernels.h"
#include <math.h>
#include <string.h>

#define QB 64    /* query rows per block */
#define KB 128   /* keys per tile */
#define DC 64    /* head-dim slice per transposed tile, bounding the scratch for any D */

/* ---- tile matmul ---- */

#define MR 8     /* rows of C per register block */
#define NR 16    /* columns of C per register block: two 8-float vectors */

/* 8 floats, a GCC/Clang vector extension; memcpy is its unaligned load and
 * store (no helpers taking v8 by value: that draws -Wpsabi without AVX) */
typedef float v8 __attribute__((vector_size(32)));

/* C (M, N) += A (M, K) @ B (K, N). A(i, k) = a[i * a_i + k * a_k], so A^T is a
 * swap of strides; B and C are row-major with leading dims ldb and ldc. */
static void gemm_acc(float *c, int64_t ldc, const float *a, int64_t a_i, int64_t a_k,
                     const float *b, int64_t ldb, int64_t M, int64_t N, int64_t K) {
    int64_t Mb = M - M % MR, Nb = N - N % NR;   /* the part whole register blocks cover */
    for (int64_t i0 = 0; i0 < Mb; i0 += MR)
        for (int64_t j0 = 0; j0 < Nb; j0 += NR) {
            v8 acc[MR][2] = {{{0}}};
            for (int64_t k = 0; k < K; k++) {
                v8 b0, b1;
                memcpy(&b0, b + k * ldb + j0, sizeof b0);
                memcpy(&b1, b + k * ldb + j0 + 8, sizeof b1);
                for (int i = 0; i < MR; i++) {
                    float aik = a[(i0 + i) * a_i + k * a_k];
                    acc[i][0] += aik * b0;
                    acc[i][1] += aik * b1;
                }
            }
            for (int i = 0; i < MR; i++)
                for (int h = 0; h < 2; h++) {
                    float *ci = c + (i0 + i) * ldc + j0 + 8 * h;
                    v8 cv;
                    memcpy(&cv, ci, sizeof cv);
                    cv += acc[i][h];
                    memcpy(ci, &cv, sizeof cv);
                }
        }
    /* the edges: columns [Nb, N) of the block rows, then the rows past Mb */
    for (int64_t i = 0; i < M; i++)
        for (int64_t k = 0; k < K; k++) {
            float aik = a[i * a_i + k * a_k];
            for (int64_t j = i < Mb ? Nb : 0; j < N; j++) c[i * ldc + j] += aik * b[k * ldb + j];
        }
}

/* dst (d, n) = src (n, d) rows of length ld, columns [d0, d0 + d) */
static void transpose(float *dst, const float *src, int64_t ld, int64_t n, int64_t d0, int64_t d) {
    for (int64_t j = 0; j < n; j++)
        for (int64_t t = 0; t < d; t++) dst[t * n + j] = src[j * ld + d0 + t];
}

/* S (m, n) = A (m, D) @ Bm (n, D)^T, through transposed slices of Bm */
static void gemm_abt(float *s, const float *a, const float *bm, int64_t m, int64_t n, int64_t D) {
    float bt[DC * KB];   // (DC, n)
    memset(s, 0, (size_t)(m * n) * sizeof(float));
    for (int64_t d0 = 0; d0 < D; d0 += DC) {
        int64_t d = D - d0 < DC ? D - d0 : DC;
        transpose(bt, bm, D, n, d0, d);
        gemm_acc(s, n, a + d0, D, 1, bt, n, m, n, d);
    }
}

/* ---- exp ---- */

/* exp(x) for x <= 0 (scores minus their max or lse; a rounding's worth above
 * 0 is fine), within 3e-7 relative: x = k ln2 + r, |r| <= ln2 / 2, exp(r) by
 * its degree-6 Taylor polynomial, 2^k by building the exponent bits. Below
 * -87, 2^k leaves the normal range, and exp(x) < 2e-38 is returned as 0. */
static inline float exp_neg(float x) {
    float xc = x >= -87.0f ? x : -87.0f;   /* NaN too, so the int conversion below is defined */
    float k = (xc * 1.44269504f + 12582912.0f) - 12582912.0f;   /* round(x / ln2): 1.5 * 2^23 trick */
    float r = (xc - k * 0.693145752f) - k * 1.42860677e-6f;     /* ln2 split in two for precision */
    float p = 1.0f + r * (1.0f + r * (1.0f / 2 + r * (1.0f / 6 + r * (1.0f / 24 + r * (1.0f / 120 + r * (1.0f / 720))))));
    int32_t bits = ((int32_t)k + 127) << 23;
    float two_k;
    memcpy(&two_k, &bits, sizeof two_k);
    return x >= -87.0f ? p * two_k : x < -87.0f ? 0.0f : x;   /* NaN stays NaN */
}

/* Max and sum of x[0, n) through 16 partial results, so that the loops
 * vectorize (a single running float would be one long dependency chain). */
static float row_max(const float *x, int64_t n) {
    float part[16], m = -INFINITY;
    for (int t = 0; t < 16; t++) part[t] = -INFINITY;
    int64_t j = 0;
    for (; j + 16 <= n; j += 16)
        for (int t = 0; t < 16; t++) part[t] = part[t] > x[j + t] ? part[t] : x[j + t];
    for (; j < n; j++) m = fmaxf(m, x[j]);
    for (int t = 0; t < 16; t++) m = fmaxf(m, part[t]);
    return m;
}

static float row_sum(const float *x, int64_t n) {
    float part[16] = {0}, s = 0.0f;
    int64_t j = 0;
    for (; j + 16 <= n; j += 16)
        for (int t = 0; t < 16; t++) part[t] += x[j + t];
    for (; j < n; j++) s += x[j];
    for (int t = 0; t < 16; t++) s += part[t];
    return s;
}

/* ---- attention ---- */

typedef struct {
    float *out, *lse, *dq, *dk, *dv;
    const float *q, *k, *v, *o, *dout, *lse_in;
    int64_t T, D;
    int causal;
    float scale;
} attn_ctx;

static int64_t min64(int64_t a, int64_t b) { return a < b ? a : b; }

/* keys [0, n) of a tile starting at key j0 that query row i may see */
static int64_t visible(const attn_ctx *c, int64_t i, int64_t j0, int64_t n) {
    if (!c->causal) return n;
    int64_t nv = i + 1 - j0;
    return nv < 0 ? 0 : nv < n ? nv : n;
}

static void attn_fwd_range(void *p, int64_t begin, int64_t end) {
    attn_ctx *c = p;
    int64_t T = c->T, D = c->D;
    float s[QB * KB];             // (m, n) scores, then unnormalized probabilities
    float rmax[QB], rsum[QB];     // running max and sum of exp per query row
    for (int64_t bh = begin; bh < end; bh++) {
        const float *q = c->q + bh * T * D, *k = c->k + bh * T * D, *v = c->v + bh * T * D;   // (T, D)
        float *o = c->out + bh * T * D, *lse = c->lse + bh * T;
        for (int64_t i0 = 0; i0 < T; i0 += QB) {
            int64_t m = min64(QB, T - i0);
            int64_t kn = c->causal ? i0 + m : T;   /* keys any row of the block sees */
            float *ob = o + i0 * D;                // (m, D) accumulates P V, normalized at the end
            memset(ob, 0, (size_t)(m * D) * sizeof(float));
            for (int64_t r = 0; r < m; r++) rmax[r] = -INFINITY, rsum[r] = 0.0f;
            for (int64_t j0 = 0; j0 < kn; j0 += KB) {
                int64_t n = min64(KB, kn - j0);
                gemm_abt(s, q + i0 * D, k + j0 * D, m, n, D);
                for (int64_t r = 0; r < m; r++) {
                    float *row = s + r * n;
                    int64_t nv = visible(c, i0 + r, j0, n);
                    for (int64_t j = nv; j < n; j++) row[j] = 0.0f;
                    if (nv == 0) continue;
                    for (int64_t j = 0; j < nv; j++) row[j] *= c->scale;
                    float mx = fmaxf(rmax[r], row_max(row, nv));
                    for (int64_t j = 0; j < nv; j++) row[j] = exp_neg(row[j] - mx);
                    float sum = row_sum(row, nv);
                    /* a new max rescales what was summed under the old one */
                    float alpha = exp_neg(rmax[r] - mx);
                    rsum[r] = rsum[r] * alpha + sum;
                    rmax[r] = mx;
                    if (alpha != 1.0f)
                        for (int64_t d = 0; d < D; d++) ob[r * D + d] *= alpha;
                }
                gemm_acc(ob, D, s, n, 1, v + j0 * D, D, m, D, n);
            }
            for (int64_t r = 0; r < m; r++) {
                float inv = 1.0f / rsum[r];
                for (int64_t d = 0; d < D; d++) ob[r * D + d] *= inv;
                lse[i0 + r] = rmax[r] + logf(rsum[r]);
            }
        }
    }
}

/* Per head, with S = scale Q K^T, P = exp(S - lse) and Drow_i = dO_i . O_i:
 * dV = P^T dO, dP = dO V^T, dS = P (dP - Drow), dQ = scale dS K, dK = scale dS^T Q.
 * Query blocks outside, key tiles inside: dQ of a block is done in one go
 * and dK, dV (T, D) accumulate across blocks. */
static void attn_bwd_range(void *p, int64_t begin, int64_t end) {
    attn_ctx *c = p;
    int64_t T = c->T, D = c->D;
    float pt[QB * KB], ds[QB * KB];   // (m, n) probabilities, then dP and scale * dS
    float drow[QB];
    for (int64_t bh = begin; bh < end; bh++) {
        size_t off = (size_t)(bh * T * D);
        const float *q = c->q + off, *k = c->k + off, *v = c->v + off;   // (T, D)
        const float *o = c->o + off, *dout = c->dout + off, *lse = c->lse_in + bh * T;
        float *dq = c->dq + off, *dk = c->dk + off, *dv = c->dv + off;
        memset(dq, 0, (size_t)(T * D) * sizeof(float));
        memset(dk, 0, (size_t)(T * D) * sizeof(float));
        memset(dv, 0, (size_t)(T * D) * sizeof(float));
        for (int64_t i0 = 0; i0 < T; i0 += QB) {
            int64_t m = min64(QB, T - i0);
            int64_t kn = c->causal ? i0 + m : T;
            const float *qb = q + i0 * D, *dob = dout + i0 * D;   // (m, D)
            for (int64_t r = 0; r < m; r++) {
                float acc = 0.0f;
                for (int64_t d = 0; d < D; d++) acc += dob[r * D + d] * o[(i0 + r) * D + d];
                drow[r] = acc;
            }
            for (int64_t j0 = 0; j0 < kn; j0 += KB) {
                int64_t n = min64(KB, kn - j0);
                gemm_abt(pt, qb, k + j0 * D, m, n, D);
                for (int64_t r = 0; r < m; r++) {
                    float *row = pt + r * n, l = lse[i0 + r];
                    int64_t nv = visible(c, i0 + r, j0, n);
                    for (int64_t j = 0; j < nv; j++) row[j] = exp_neg(c->scale * row[j] - l);
                    for (int64_t j = nv; j < n; j++) row[j] = 0.0f;
                }
                gemm_acc(dv + j0 * D, D, pt, 1, n, dob, D, n, D, m);   /* dV += P^T dO */
                gemm_abt(ds, dob, v + j0 * D, m, n, D);                /* dP = dO V^T */
                for (int64_t r = 0; r < m; r++)
                    for (int64_t j = 0; j < n; j++)
                        ds[r * n + j] = c->scale * pt[r * n + j] * (ds[r * n + j] - drow[r]);
                gemm_acc(dq + i0 * D, D, ds, n, 1, k + j0 * D, D, m, D, n);   /* dQ += scale dS K */
                gemm_acc(dk + j0 * D, D, ds, 1, n, qb, D, n, D, m);           /* dK += scale dS^T Q */
            }
        }
    }
}

void cpu_attention_forward_f32(float *out, float *lse, const float *q, const float *k, const float *v,
                               int64_t B, int64_t H, int64_t T, int64_t D, int causal, float scale) {
    attn_ctx c = {.out = out, .lse = lse, .q = q, .k = k, .v = v, .T = T, .D = D, .causal = causal, .scale = scale};
    cpu_parallel_for(B * H, 1, attn_fwd_range, &c);
}

void cpu_attention_backward_f32(float *dq, float *dk, float *dv, const float *dout, const float *q,
                                const float *k, const float *v, const float *out, const float *lse,
                                int64_t B, int64_t H, int64_t T, int64_t D, int causal, float scale) {
    attn_ctx c = {.dq = dq, .dk = dk, .dv = dv, .q = q, .k = k, .v = v, .o = out, .dout = dout, .lse_in = lse,
                  .T = T, .D = D, .causal = causal, .scale = scale};
    cpu_parallel_for(B * H, 1, attn_bwd_range, &c);
}
