/* loss.c: fused softmax cross-entropy over logits (N, V), of which only the
 * first valid_v columns are real (the rest is padding of the vocabulary),
 * f32 or bf16 logits.
 *
 * loss_n = lse_n - x[n, t_n], lse_n = log sum_{j < valid_v} exp(x[n, j]).
 * The backward recomputes softmax from the saved lse instead of keeping an
 * (N, V) probability buffer; the fused kernel runs both on each row in
 * turn, writing dlogits over the logits. One body per kernel over the logits' type
 * (cpu_ld widens a logit as it is read, cpu_st rounds a gradient once as it
 * is stored); losses and lse are f32 for both. */
#include "cpu_kernels.h"
#include "vec512.h"
#include <math.h>

typedef struct {
    float *losses, *lse;
    void *dlogits;
    const void *logits;
    const float *lse_in;
    const int64_t *targets;
    int64_t V, valid_v, ignore_index;
    float dloss;
} ce_ctx;

enum { F32 = 0, BF16 = 1 };

static int64_t row_grain(int64_t V) { return V >= 16384 ? 1 : 16384 / (V > 0 ? V : 1); }

#ifdef FSDP_VEC512
/* max_j x[j] (NaNs skipped, as fmaxf does) and sum_j exp(x[j] - max) in
 * double, over j < valid_v: one pass of 16 lanes each, the exps added in
 * two 8-lane double accumulators (a scalar libm expf per logit bound this
 * kernel before) */
CPU_INLINE void ce_row_sum16(const void *x, int64_t valid_v, int bf16, float *max_out, double *sum_out) {
    __m512 mv = _mm512_set1_ps(-INFINITY);
    for (int64_t j = 0; j < valid_v; j += 16) {
        __mmask16 k = v16_mask(valid_v - j);
        mv = _mm512_mask_max_ps(mv, k, v16_load_as(x, j, k, bf16), mv);   /* a NaN lane keeps mv */
    }
    float m = _mm512_reduce_max_ps(mv);
    __m512 mb = _mm512_set1_ps(m);
    __m512d lo = _mm512_setzero_pd(), hi = _mm512_setzero_pd();
    for (int64_t j = 0; j < valid_v; j += 16) {
        __mmask16 k = v16_mask(valid_v - j);
        __m512 e = _mm512_maskz_mov_ps(k, v16_exp(_mm512_sub_ps(v16_load_as(x, j, k, bf16), mb)));
        lo = _mm512_add_pd(lo, _mm512_cvtps_pd(_mm512_castps512_ps256(e)));
        hi = _mm512_add_pd(hi, _mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(e), 1))));
    }
    *max_out = m;
    *sum_out = _mm512_reduce_add_pd(_mm512_add_pd(lo, hi));
}
#endif

/* Row n's loss into losses[n]; returns its lse. */
CPU_INLINE float ce_fwd_row(ce_ctx *c, int64_t n, int bf16) {
    const int64_t V = c->V, valid_v = c->valid_v;
    const void *x = cpu_at(c->logits, n * V, bf16);   // (V)
    float m = -INFINITY;
    double sum = 0;   /* max subtracted: large logits do not overflow */
#ifdef FSDP_VEC512
    ce_row_sum16(x, valid_v, bf16, &m, &sum);
#else
    for (int64_t j = 0; j < valid_v; j++) m = fmaxf(m, cpu_ld(x, j, bf16));
    for (int64_t j = 0; j < valid_v; j++) sum += expf(cpu_ld(x, j, bf16) - m);
#endif
    float logsum = (float)log(sum);
    int64_t t = c->targets[n];
    /* (m - x_t) + logsum rather than lse - x_t: exact-ish for large logits */
    c->losses[n] = t == c->ignore_index ? 0.0f : (m - cpu_ld(x, t, bf16)) + logsum;
    return m + logsum;
}

/* dlogits[n, j] = dloss (softmax_j - [j == t]) for j < valid_v, from the
 * row's lse; dlogits may be the logits (each 16 read before they are written) */
CPU_INLINE void ce_bwd_row(ce_ctx *c, int64_t n, float lse, int bf16) {
    const int64_t V = c->V, valid_v = c->valid_v;
    const float dloss = c->dloss;
    const void *x = cpu_at(c->logits, n * V, bf16);
    void *dx = cpu_at_w(c->dlogits, n * V, bf16);
    int64_t t = c->targets[n], j = 0;
    if (t != c->ignore_index) {
#ifdef FSDP_VEC512
        const __m512 lb = _mm512_set1_ps(lse), db = _mm512_set1_ps(dloss);
        for (; j < valid_v; j += 16) {
            __mmask16 k = v16_mask(valid_v - j);
            __m512 d = _mm512_mul_ps(db, v16_exp(_mm512_sub_ps(v16_load_as(x, j, k, bf16), lb)));
            if (t >= j && t < j + 16) d = _mm512_mask_sub_ps(d, (__mmask16)(1u << (t - j)), d, db);
            v16_store_as(dx, j, k, d, bf16);   /* one rounding, the target's too */
        }
        j = valid_v;
#endif
        for (; j < valid_v; j++) {
            float d = dloss * expf(cpu_ld(x, j, bf16) - lse);
            cpu_st(dx, j, j == t ? d - dloss : d, bf16);   /* one rounding, the target's too */
        }
    }
    for (; j < V; j++) cpu_st(dx, j, 0.0f, bf16);   /* padded columns, or the whole ignored row */
}

CPU_INLINE void ce_fwd(ce_ctx *c, int64_t begin, int64_t end, int bf16) {
    for (int64_t n = begin; n < end; n++) c->lse[n] = ce_fwd_row(c, n, bf16);
}

CPU_INLINE void ce_bwd(ce_ctx *c, int64_t begin, int64_t end, int bf16) {
    for (int64_t n = begin; n < end; n++) ce_bwd_row(c, n, c->lse_in[n], bf16);
}

/* both on each row in turn: the row is still in cache for the second pass */
CPU_INLINE void ce_fused(ce_ctx *c, int64_t begin, int64_t end, int bf16) {
    for (int64_t n = begin; n < end; n++) ce_bwd_row(c, n, ce_fwd_row(c, n, bf16), bf16);
}

static void ce_fwd_f32(void *p, int64_t b, int64_t e) { ce_fwd(p, b, e, F32); }
static void ce_fwd_bf16(void *p, int64_t b, int64_t e) { ce_fwd(p, b, e, BF16); }
static void ce_bwd_f32(void *p, int64_t b, int64_t e) { ce_bwd(p, b, e, F32); }
static void ce_bwd_bf16(void *p, int64_t b, int64_t e) { ce_bwd(p, b, e, BF16); }
static void ce_fused_f32(void *p, int64_t b, int64_t e) { ce_fused(p, b, e, F32); }
static void ce_fused_bf16(void *p, int64_t b, int64_t e) { ce_fused(p, b, e, BF16); }

static int64_t ce_forward(const void *logits, float *losses, float *lse, const int64_t *targets, int64_t N,
                          int64_t V, int64_t valid_v, int64_t ignore_index, int bf16) {
    ce_ctx c = {.losses = losses, .lse = lse, .logits = logits, .targets = targets,
                .V = V, .valid_v = valid_v, .ignore_index = ignore_index};
    cpu_parallel_for(N, row_grain(V), bf16 ? ce_fwd_bf16 : ce_fwd_f32, &c);
    int64_t count = 0;
    for (int64_t n = 0; n < N; n++) count += targets[n] != ignore_index;
    return count;
}

static void ce_backward(void *dlogits, const void *logits, const float *lse, const int64_t *targets, int64_t N,
                        int64_t V, int64_t valid_v, int64_t ignore_index, const float *dloss, int64_t count,
                        int bf16) {
    float g = count ? dloss[0] / (float)count : 0.0f;
    ce_ctx c = {.lse_in = lse, .dlogits = dlogits, .logits = logits, .targets = targets,
                .V = V, .valid_v = valid_v, .ignore_index = ignore_index, .dloss = g};
    cpu_parallel_for(N, row_grain(V), bf16 ? ce_bwd_bf16 : ce_bwd_f32, &c);
}

int64_t cpu_cross_entropy_forward_f32(float *losses, float *lse, const float *logits, const int64_t *targets,
                                      int64_t N, int64_t V, int64_t valid_v, int64_t ignore_index) {
    return ce_forward(logits, losses, lse, targets, N, V, valid_v, ignore_index, F32);
}

void cpu_cross_entropy_backward_f32(float *dlogits, const float *logits, const float *lse, const int64_t *targets,
                                    int64_t N, int64_t V, int64_t valid_v, int64_t ignore_index, const float *dloss,
                                    int64_t count) {
    ce_backward(dlogits, logits, lse, targets, N, V, valid_v, ignore_index, dloss, count, F32);
}

int64_t cpu_cross_entropy_forward_bf16(float *losses, float *lse, const uint16_t *logits, const int64_t *targets,
                                       int64_t N, int64_t V, int64_t valid_v, int64_t ignore_index) {
    return ce_forward(logits, losses, lse, targets, N, V, valid_v, ignore_index, BF16);
}

void cpu_cross_entropy_backward_bf16(uint16_t *dlogits, const uint16_t *logits, const float *lse,
                                     const int64_t *targets, int64_t N, int64_t V, int64_t valid_v,
                                     int64_t ignore_index, const float *dloss, int64_t count) {
    ce_backward(dlogits, logits, lse, targets, N, V, valid_v, ignore_index, dloss, count, BF16);
}

/* g as ce_backward computes it from dloss[0] = 1 */
static void ce_fused_rows(float *losses, void *logits, const int64_t *targets, int64_t N, int64_t V, int64_t valid_v,
                          int64_t ignore_index, int64_t count, int bf16) {
    const float one = 1.0f, g = count ? one / (float)count : 0.0f;
    ce_ctx c = {.losses = losses, .logits = logits, .dlogits = logits, .targets = targets,
                .V = V, .valid_v = valid_v, .ignore_index = ignore_index, .dloss = g};
    cpu_parallel_for(N, row_grain(V), bf16 ? ce_fused_bf16 : ce_fused_f32, &c);
}

void cpu_cross_entropy_fused_f32(float *losses, float *logits, const int64_t *targets, int64_t N, int64_t V,
                                 int64_t valid_v, int64_t ignore_index, int64_t count) {
    ce_fused_rows(losses, logits, targets, N, V, valid_v, ignore_index, count, F32);
}

void cpu_cross_entropy_fused_bf16(float *losses, uint16_t *logits, const int64_t *targets, int64_t N, int64_t V,
                                  int64_t valid_v, int64_t ignore_index, int64_t count) {
    ce_fused_rows(losses, logits, targets, N, V, valid_v, ignore_index, count, BF16);
}
