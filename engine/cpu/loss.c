/* loss.c: fused softmax cross-entropy over logits (N, V), of which only the
 * first valid_v columns are real (the rest is padding of the vocabulary).
 *
 * loss_n = lse_n - x[n, t_n], lse_n = log sum_{j < valid_v} exp(x[n, j]).
 * The backward recomputes softmax from the saved lse instead of keeping an
 * (N, V) probability buffer. */
#include "cpu_kernels.h"
#include <math.h>

typedef struct {
    float *losses, *lse, *dlogits;
    const float *logits, *lse_in;
    const int64_t *targets;
    int64_t V, valid_v, ignore_index;
    float dloss;
} ce_ctx;

static int64_t row_grain(int64_t V) { return V >= 16384 ? 1 : 16384 / (V > 0 ? V : 1); }

static void ce_fwd_range(void *p, int64_t begin, int64_t end) {
    ce_ctx *c = p;
    for (int64_t n = begin; n < end; n++) {
        const float *x = c->logits + n * c->V;   // (V)
        float m = -INFINITY;
        for (int64_t j = 0; j < c->valid_v; j++) m = fmaxf(m, x[j]);
        double sum = 0;   /* max subtracted: large logits do not overflow */
        for (int64_t j = 0; j < c->valid_v; j++) sum += expf(x[j] - m);
        float logsum = (float)log(sum);
        c->lse[n] = m + logsum;
        int64_t t = c->targets[n];
        /* (m - x_t) + logsum rather than lse - x_t: exact-ish for large logits */
        c->losses[n] = t == c->ignore_index ? 0.0f : (m - x[t]) + logsum;
    }
}

/* dlogits[n, j] = dloss (softmax_j - [j == t]) for j < valid_v */
static void ce_bwd_range(void *p, int64_t begin, int64_t end) {
    ce_ctx *c = p;
    for (int64_t n = begin; n < end; n++) {
        const float *x = c->logits + n * c->V;
        float *dx = c->dlogits + n * c->V;
        int64_t t = c->targets[n], j = 0;
        if (t != c->ignore_index) {
            float lse = c->lse_in[n];
            for (; j < c->valid_v; j++) dx[j] = c->dloss * expf(x[j] - lse);
            dx[t] -= c->dloss;
        }
        for (; j < c->V; j++) dx[j] = 0.0f;   /* padded columns, or the whole ignored row */
    }
}

int64_t cpu_cross_entropy_forward_f32(float *losses, float *lse, const float *logits, const int64_t *targets,
                                      int64_t N, int64_t V, int64_t valid_v, int64_t ignore_index) {
    ce_ctx c = {.losses = losses, .lse = lse, .logits = logits, .targets = targets,
                .V = V, .valid_v = valid_v, .ignore_index = ignore_index};
    cpu_parallel_for(N, row_grain(V), ce_fwd_range, &c);
    int64_t count = 0;
    for (int64_t n = 0; n < N; n++) count += targets[n] != ignore_index;
    return count;
}

void cpu_cross_entropy_backward_f32(float *dlogits, const float *logits, const float *lse, const int64_t *targets,
                                    int64_t N, int64_t V, int64_t valid_v, int64_t ignore_index, const float *dloss,
                                    int64_t count) {
    float g = count ? dloss[0] / (float)count : 0.0f;
    ce_ctx c = {.lse_in = lse, .dlogits = dlogits, .logits = logits, .targets = targets,
                .V = V, .valid_v = valid_v, .ignore_index = ignore_index, .dloss = g};
    cpu_parallel_for(N, row_grain(V), ce_bwd_range, &c);
}

/* ---- bf16 logits: the same, each logit widened as it is read ---- */

typedef struct {
    float *losses, *lse;
    uint16_t *dlogits;
    const uint16_t *logits;
    const float *lse_in;
    const int64_t *targets;
    int64_t V, valid_v, ignore_index;
    float dloss;
} ce16_ctx;

static void ce_fwd16_range(void *p, int64_t begin, int64_t end) {
    ce16_ctx *c = p;
    for (int64_t n = begin; n < end; n++) {
        const uint16_t *x = c->logits + n * c->V;   // (V)
        float m = -INFINITY;
        for (int64_t j = 0; j < c->valid_v; j++) m = fmaxf(m, bf16_to_f32(x[j]));
        double sum = 0;
        for (int64_t j = 0; j < c->valid_v; j++) sum += expf(bf16_to_f32(x[j]) - m);
        float logsum = (float)log(sum);
        c->lse[n] = m + logsum;
        int64_t t = c->targets[n];
        c->losses[n] = t == c->ignore_index ? 0.0f : (m - bf16_to_f32(x[t])) + logsum;
    }
}

static void ce_bwd16_range(void *p, int64_t begin, int64_t end) {
    ce16_ctx *c = p;
    for (int64_t n = begin; n < end; n++) {
        const uint16_t *x = c->logits + n * c->V;
        uint16_t *dx = c->dlogits + n * c->V;
        int64_t t = c->targets[n], j = 0;
        if (t != c->ignore_index) {
            float lse = c->lse_in[n];
            for (; j < c->valid_v; j++) {
                float d = c->dloss * expf(bf16_to_f32(x[j]) - lse);
                dx[j] = f32_to_bf16(j == t ? d - c->dloss : d);   /* one rounding, the target's too */
            }
        }
        for (; j < c->V; j++) dx[j] = 0;   /* bf16 +0 */
    }
}

int64_t cpu_cross_entropy_forward_bf16(float *losses, float *lse, const uint16_t *logits, const int64_t *targets,
                                       int64_t N, int64_t V, int64_t valid_v, int64_t ignore_index) {
    ce16_ctx c = {.losses = losses, .lse = lse, .logits = logits, .targets = targets,
                  .V = V, .valid_v = valid_v, .ignore_index = ignore_index};
    cpu_parallel_for(N, row_grain(V), ce_fwd16_range, &c);
    int64_t count = 0;
    for (int64_t n = 0; n < N; n++) count += targets[n] != ignore_index;
    return count;
}

void cpu_cross_entropy_backward_bf16(uint16_t *dlogits, const uint16_t *logits, const float *lse,
                                     const int64_t *targets, int64_t N, int64_t V, int64_t valid_v,
                                     int64_t ignore_index, const float *dloss, int64_t count) {
    float g = count ? dloss[0] / (float)count : 0.0f;
    ce16_ctx c = {.lse_in = lse, .dlogits = dlogits, .logits = logits, .targets = targets,
                  .V = V, .valid_v = valid_v, .ignore_index = ignore_index, .dloss = g};
    cpu_parallel_for(N, row_grain(V), ce_bwd16_range, &c);
}
