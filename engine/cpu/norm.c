/* norm.c: layernorm and RMSNorm over the last dim of (rows, cols).
 *
 * Row statistics accumulate in double. The weight and bias gradients are sums
 * over rows; rather than per-thread partials, threads split the columns, so
 * each column is summed by one thread in row order: the result is the same
 * for any thread count. */
#include "cpu_kernels.h"
#include <math.h>

typedef struct {
    float *out, *mean, *rstd;          /* forward outputs; backward: out = dx */
    float *dweight, *dbias;
    const float *x, *dout, *weight, *bias;
    const float *mean_in, *rstd_in;    /* saved by forward */
    int64_t cols;
    float eps;
} norm_ctx;

static int64_t row_grain(int64_t cols) { return cols >= 8192 ? 1 : 8192 / (cols > 0 ? cols : 1); }

/* ---- layernorm: out = (x - mean) * rstd * w + b ---- */

static void ln_fwd_range(void *p, int64_t begin, int64_t end) {
    norm_ctx *c = p;
    int64_t C = c->cols;
    for (int64_t r = begin; r < end; r++) {
        const float *x = c->x + r * C;
        float *out = c->out + r * C;
        double sum = 0;
        for (int64_t j = 0; j < C; j++) sum += x[j];
        double m = sum / C, var = 0;
        for (int64_t j = 0; j < C; j++) var += (x[j] - m) * (x[j] - m);   /* two passes: no cancellation */
        float mean = (float)m, rstd = (float)(1.0 / sqrt(var / C + c->eps));
        for (int64_t j = 0; j < C; j++) {
            float y = (x[j] - mean) * rstd;
            if (c->weight) y *= c->weight[j];
            if (c->bias) y += c->bias[j];
            out[j] = y;
        }
        c->mean[r] = mean;
        c->rstd[r] = rstd;
    }
}

/* With xhat = (x - mean) rstd and g = dout * w:
 * dx = rstd (g - mean(g) - xhat mean(g xhat)) */
static void ln_bwd_dx_range(void *p, int64_t begin, int64_t end) {
    norm_ctx *c = p;
    int64_t C = c->cols;
    for (int64_t r = begin; r < end; r++) {
        const float *x = c->x + r * C, *dout = c->dout + r * C;
        float *dx = c->out + r * C;
        float mean = c->mean_in[r], rstd = c->rstd_in[r];
        double sg = 0, sgx = 0;
        for (int64_t j = 0; j < C; j++) {
            float g = c->weight ? dout[j] * c->weight[j] : dout[j];
            sg += g;
            sgx += g * ((x[j] - mean) * rstd);
        }
        float mg = (float)(sg / C), mgx = (float)(sgx / C);
        for (int64_t j = 0; j < C; j++) {
            float g = c->weight ? dout[j] * c->weight[j] : dout[j];
            float xhat = (x[j] - mean) * rstd;
            dx[j] = rstd * (g - mg - xhat * mgx);
        }
    }
}

/* Columns [begin, end) of dweight = sum_r dout xhat and dbias = sum_r dout,
 * a block of columns at a time so the accumulators stay on the stack. */
typedef struct {
    norm_ctx *n;
    int64_t rows;
    int rms;   /* xhat = x rstd (no mean) */
} col_ctx;

#define COL_BLOCK 64

static void wgrad_range(void *p, int64_t begin, int64_t end) {
    col_ctx *cc = p;
    norm_ctx *c = cc->n;
    int64_t C = c->cols;
    for (int64_t j0 = begin; j0 < end; j0 += COL_BLOCK) {
        int64_t w = end - j0 < COL_BLOCK ? end - j0 : COL_BLOCK;
        double accw[COL_BLOCK] = {0}, accb[COL_BLOCK] = {0};
        for (int64_t r = 0; r < cc->rows; r++) {
            const float *x = c->x + r * C + j0, *dout = c->dout + r * C + j0;
            float mean = cc->rms ? 0.0f : c->mean_in[r], rstd = c->rstd_in[r];
            for (int64_t j = 0; j < w; j++) {
                accw[j] += dout[j] * ((x[j] - mean) * rstd);
                accb[j] += dout[j];
            }
        }
        for (int64_t j = 0; j < w; j++) {
            if (c->dweight) c->dweight[j0 + j] = (float)accw[j];
            if (c->dbias) c->dbias[j0 + j] = (float)accb[j];
        }
    }
}

static void weight_grads(norm_ctx *c, int64_t rows, int rms) {
    if (!c->dweight && !c->dbias) return;
    col_ctx cc = {c, rows, rms};
    cpu_parallel_for(c->cols, COL_BLOCK, wgrad_range, &cc);
}

void cpu_layernorm_forward_f32(float *out, float *mean, float *rstd, const float *x,
                               const float *weight, const float *bias, int64_t rows, int64_t cols, float eps) {
    norm_ctx c = {.out = out, .mean = mean, .rstd = rstd, .x = x, .weight = weight, .bias = bias,
                  .cols = cols, .eps = eps};
    cpu_parallel_for(rows, row_grain(cols), ln_fwd_range, &c);
}

void cpu_layernorm_backward_f32(float *dx, float *dweight, float *dbias, const float *dout, const float *x,
                                const float *weight, const float *mean, const float *rstd,
                                int64_t rows, int64_t cols) {
    norm_ctx c = {.out = dx, .dweight = dweight, .dbias = dbias, .x = x, .dout = dout, .weight = weight,
                  .mean_in = mean, .rstd_in = rstd, .cols = cols};
    cpu_parallel_for(rows, row_grain(cols), ln_bwd_dx_range, &c);
    weight_grads(&c, rows, 0);
}

/* ---- RMSNorm: out = x * rstd * w, rstd = 1 / sqrt(mean(x^2) + eps) ---- */

static void rms_fwd_range(void *p, int64_t begin, int64_t end) {
    norm_ctx *c = p;
    int64_t C = c->cols;
    for (int64_t r = begin; r < end; r++) {
        const float *x = c->x + r * C;
        float *out = c->out + r * C;
        double ss = 0;
        for (int64_t j = 0; j < C; j++) ss += (double)x[j] * x[j];
        float rstd = (float)(1.0 / sqrt(ss / C + c->eps));
        for (int64_t j = 0; j < C; j++) out[j] = c->weight ? x[j] * rstd * c->weight[j] : x[j] * rstd;
        c->rstd[r] = rstd;
    }
}

/* With xhat = x rstd and g = dout * w: dx = rstd (g - xhat mean(g xhat)) */
static void rms_bwd_dx_range(void *p, int64_t begin, int64_t end) {
    norm_ctx *c = p;
    int64_t C = c->cols;
    for (int64_t r = begin; r < end; r++) {
        const float *x = c->x + r * C, *dout = c->dout + r * C;
        float *dx = c->out + r * C;
        float rstd = c->rstd_in[r];
        double sgx = 0;
        for (int64_t j = 0; j < C; j++) {
            float g = c->weight ? dout[j] * c->weight[j] : dout[j];
            sgx += g * (x[j] * rstd);
        }
        float mgx = (float)(sgx / C);
        for (int64_t j = 0; j < C; j++) {
            float g = c->weight ? dout[j] * c->weight[j] : dout[j];
            dx[j] = rstd * (g - x[j] * rstd * mgx);
        }
    }
}

void cpu_rmsnorm_forward_f32(float *out, float *rstd, const float *x, const float *weight,
                             int64_t rows, int64_t cols, float eps) {
    norm_ctx c = {.out = out, .rstd = rstd, .x = x, .weight = weight, .cols = cols, .eps = eps};
    cpu_parallel_for(rows, row_grain(cols), rms_fwd_range, &c);
}

void cpu_rmsnorm_backward_f32(float *dx, float *dweight, const float *dout, const float *x,
                              const float *weight, const float *rstd, int64_t rows, int64_t cols) {
    norm_ctx c = {.out = dx, .dweight = dweight, .x = x, .dout = dout, .weight = weight,
                  .rstd_in = rstd, .cols = cols};
    cpu_parallel_for(rows, row_grain(cols), rms_bwd_dx_range, &c);
    weight_grads(&c, rows, 1);
}

/* ---- layernorm on bf16: the same math, each element widened as it is
 * loaded and rounded once as it is stored; mean and rstd stay f32 ---- */

typedef struct {
    uint16_t *out, *dweight, *dbias;
    float *mean, *rstd;
    const uint16_t *x, *dout, *weight, *bias;
    const float *mean_in, *rstd_in;
    int64_t cols, rows;
    float eps;
} norm16_ctx;

#define LD(p, j) bf16_to_f32((p)[j])

static void ln_fwd16_range(void *p, int64_t begin, int64_t end) {
    norm16_ctx *c = p;
    int64_t C = c->cols;
    for (int64_t r = begin; r < end; r++) {
        const uint16_t *x = c->x + r * C;
        uint16_t *out = c->out + r * C;
        double sum = 0;
        for (int64_t j = 0; j < C; j++) sum += LD(x, j);
        double m = sum / C, var = 0;
        for (int64_t j = 0; j < C; j++) var += (LD(x, j) - m) * (LD(x, j) - m);
        float mean = (float)m, rstd = (float)(1.0 / sqrt(var / C + c->eps));
        for (int64_t j = 0; j < C; j++) {
            float y = (LD(x, j) - mean) * rstd;
            if (c->weight) y *= LD(c->weight, j);
            if (c->bias) y += LD(c->bias, j);
            out[j] = f32_to_bf16(y);
        }
        c->mean[r] = mean;
        c->rstd[r] = rstd;
    }
}

static void ln_bwd_dx16_range(void *p, int64_t begin, int64_t end) {
    norm16_ctx *c = p;
    int64_t C = c->cols;
    for (int64_t r = begin; r < end; r++) {
        const uint16_t *x = c->x + r * C, *dout = c->dout + r * C;
        uint16_t *dx = c->out + r * C;
        float mean = c->mean_in[r], rstd = c->rstd_in[r];
        double sg = 0, sgx = 0;
        for (int64_t j = 0; j < C; j++) {
            float g = c->weight ? LD(dout, j) * LD(c->weight, j) : LD(dout, j);
            sg += g;
            sgx += g * ((LD(x, j) - mean) * rstd);
        }
        float mg = (float)(sg / C), mgx = (float)(sgx / C);
        for (int64_t j = 0; j < C; j++) {
            float g = c->weight ? LD(dout, j) * LD(c->weight, j) : LD(dout, j);
            float xhat = (LD(x, j) - mean) * rstd;
            dx[j] = f32_to_bf16(rstd * (g - mg - xhat * mgx));
        }
    }
}

static void wgrad16_range(void *p, int64_t begin, int64_t end) {
    norm16_ctx *c = p;
    int64_t C = c->cols;
    for (int64_t j0 = begin; j0 < end; j0 += COL_BLOCK) {
        int64_t w = end - j0 < COL_BLOCK ? end - j0 : COL_BLOCK;
        double accw[COL_BLOCK] = {0}, accb[COL_BLOCK] = {0};
        for (int64_t r = 0; r < c->rows; r++) {
            const uint16_t *x = c->x + r * C + j0, *dout = c->dout + r * C + j0;
            float mean = c->mean_in[r], rstd = c->rstd_in[r];
            for (int64_t j = 0; j < w; j++) {
                accw[j] += LD(dout, j) * ((LD(x, j) - mean) * rstd);
                accb[j] += LD(dout, j);
            }
        }
        for (int64_t j = 0; j < w; j++) {
            if (c->dweight) c->dweight[j0 + j] = f32_to_bf16((float)accw[j]);
            if (c->dbias) c->dbias[j0 + j] = f32_to_bf16((float)accb[j]);
        }
    }
}

#undef LD

void cpu_layernorm_forward_bf16(uint16_t *out, float *mean, float *rstd, const uint16_t *x, const uint16_t *weight,
                                const uint16_t *bias, int64_t rows, int64_t cols, float eps) {
    norm16_ctx c = {.out = out, .mean = mean, .rstd = rstd, .x = x, .weight = weight, .bias = bias,
                    .cols = cols, .eps = eps};
    cpu_parallel_for(rows, row_grain(cols), ln_fwd16_range, &c);
}

void cpu_layernorm_backward_bf16(uint16_t *dx, uint16_t *dweight, uint16_t *dbias, const uint16_t *dout,
                                 const uint16_t *x, const uint16_t *weight, const float *mean, const float *rstd,
                                 int64_t rows, int64_t cols) {
    norm16_ctx c = {.out = dx, .dweight = dweight, .dbias = dbias, .x = x, .dout = dout, .weight = weight,
                    .mean_in = mean, .rstd_in = rstd, .cols = cols, .rows = rows};
    cpu_parallel_for(rows, row_grain(cols), ln_bwd_dx16_range, &c);
    if (dweight || dbias) cpu_parallel_for(cols, COL_BLOCK, wgrad16_range, &c);
}
