/* softmax.c: softmax and log-softmax over the last dim of (rows, cols),
 * forward and backward. Rows are independent, so threads split rows. Row
 * reductions accumulate in double: a row can be a 50k-wide vocabulary. */
#include "cpu_kernels.h"
#include <math.h>

typedef struct {
    float *out;
    const float *a, *b;   /* forward: a = x; backward: a = y, b = dy */
    int64_t cols;
} sm_ctx;

/* rows per chunk so a chunk holds some 16k elements */
static int64_t row_grain(int64_t cols) { return cols >= 16384 ? 1 : 16384 / (cols > 0 ? cols : 1); }

/* Subtracting the row max keeps exp from overflowing on large logits. */
static float row_max(const float *x, int64_t cols) {
    float m = -INFINITY;
    for (int64_t j = 0; j < cols; j++) m = fmaxf(m, x[j]);
    return m;
}

static void softmax_fwd_range(void *p, int64_t begin, int64_t end) {
    sm_ctx *c = p;
    for (int64_t r = begin; r < end; r++) {
        const float *x = c->a + r * c->cols;
        float *y = c->out + r * c->cols;
        float m = row_max(x, c->cols);
        double sum = 0;
        for (int64_t j = 0; j < c->cols; j++) {
            y[j] = expf(x[j] - m);
            sum += y[j];
        }
        float inv = (float)(1.0 / sum);
        for (int64_t j = 0; j < c->cols; j++) y[j] *= inv;
    }
}

/* log softmax = x - lse = (x - max) - log sum exp(x - max); subtracting in
 * that order keeps precision when the logits are large. */
static void log_softmax_fwd_range(void *p, int64_t begin, int64_t end) {
    sm_ctx *c = p;
    for (int64_t r = begin; r < end; r++) {
        const float *x = c->a + r * c->cols;
        float *y = c->out + r * c->cols;
        float m = row_max(x, c->cols);
        double sum = 0;
        for (int64_t j = 0; j < c->cols; j++) sum += expf(x[j] - m);
        float logsum = (float)log(sum);
        for (int64_t j = 0; j < c->cols; j++) y[j] = (x[j] - m) - logsum;
    }
}

/* dx = y * (dy - sum_j dy_j y_j) */
static void softmax_bwd_range(void *p, int64_t begin, int64_t end) {
    sm_ctx *c = p;
    for (int64_t r = begin; r < end; r++) {
        const float *y = c->a + r * c->cols, *dy = c->b + r * c->cols;
        float *dx = c->out + r * c->cols;
        double dot = 0;
        for (int64_t j = 0; j < c->cols; j++) dot += (double)dy[j] * y[j];
        for (int64_t j = 0; j < c->cols; j++) dx[j] = y[j] * (dy[j] - (float)dot);
    }
}

/* y = log softmax: dx = dy - exp(y) * sum_j dy_j */
static void log_softmax_bwd_range(void *p, int64_t begin, int64_t end) {
    sm_ctx *c = p;
    for (int64_t r = begin; r < end; r++) {
        const float *y = c->a + r * c->cols, *dy = c->b + r * c->cols;
        float *dx = c->out + r * c->cols;
        double sum = 0;
        for (int64_t j = 0; j < c->cols; j++) sum += dy[j];
        for (int64_t j = 0; j < c->cols; j++) dx[j] = dy[j] - expf(y[j]) * (float)sum;
    }
}

void cpu_softmax_forward_f32(float *out, const float *x, int64_t rows, int64_t cols) {
    sm_ctx c = {out, x, NULL, cols};
    cpu_parallel_for(rows, row_grain(cols), softmax_fwd_range, &c);
}

void cpu_softmax_backward_f32(float *dx, const float *y, const float *dy, int64_t rows, int64_t cols) {
    sm_ctx c = {dx, y, dy, cols};
    cpu_parallel_for(rows, row_grain(cols), softmax_bwd_range, &c);
}

void cpu_log_softmax_forward_f32(float *out, const float *x, int64_t rows, int64_t cols) {
    sm_ctx c = {out, x, NULL, cols};
    cpu_parallel_for(rows, row_grain(cols), log_softmax_fwd_range, &c);
}

void cpu_log_softmax_backward_f32(float *dx, const float *y, const float *dy, int64_t rows, int64_t cols) {
    sm_ctx c = {dx, y, dy, cols};
    cpu_parallel_for(rows, row_grain(cols), log_softmax_bwd_range, &c);
}
