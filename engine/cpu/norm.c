/* norm.c: layernorm and RMSNorm over the last dim of (rows, cols), on f32 or
 * bf16 tensors.
 *
 * Row statistics accumulate in double. The weight and bias gradients are sums
 * over rows; rather than per-thread partials, threads split the columns, so
 * each column is summed by one thread in row order: the result is the same
 * for any thread count.
 *
 * Each kernel has one body over the element type: cpu_ld() widens an element to
 * f32 as it is loaded, cpu_st() rounds it once as it is stored (bf16: round to
 * nearest even), and mean and rstd stay f32 for both (cpu_kernels.h). The
 * bodies are inlined into an f32 and a bf16 entry with the type a constant,
 * so each compiles to its own loop with no per-element test. */
#include "cpu_kernels.h"
#include <math.h>

typedef struct {
    void *out, *dweight, *dbias;         /* forward: out; backward: out = dx */
    float *mean, *rstd;                  /* forward outputs */
    const void *x, *dout, *weight, *bias;
    const float *mean_in, *rstd_in;      /* saved by forward */
    int64_t rows, cols;
    float eps;
    int rms;                             /* weight gradient: xhat = x rstd (no mean) */
} norm_ctx;

enum { F32 = 0, BF16 = 1 };

static int64_t row_grain(int64_t cols) { return cols >= 8192 ? 1 : 8192 / (cols > 0 ? cols : 1); }

/* ---- row statistics ----
 * Sums over a row in double, ROW_LANES independent partial sums added at
 * the end: one chain of double adds waits on each add's latency (a row of
 * 768: some 3000 cycles a pass, most of a layernorm's time at GPT-2's
 * widths), independent lanes let the loop vectorize. The order depends only
 * on cols, so results stay the same for any thread count. */
#define ROW_LANES 16

/* sum_j x[j] */
CPU_INLINE double row_sum(const void *x, int64_t C, int bf16) {
    double acc[ROW_LANES] = {0}, s = 0;
    int64_t j = 0;
    for (; j + ROW_LANES <= C; j += ROW_LANES)
        for (int l = 0; l < ROW_LANES; l++) acc[l] += cpu_ld(x, j + l, bf16);
    for (; j < C; j++) s += cpu_ld(x, j, bf16);
    for (int l = 0; l < ROW_LANES; l++) s += acc[l];
    return s;
}

/* sum_j (x[j] - m)^2 */
CPU_INLINE double row_sq_dev(const void *x, int64_t C, double m, int bf16) {
    double acc[ROW_LANES] = {0}, s = 0;
    int64_t j = 0;
    for (; j + ROW_LANES <= C; j += ROW_LANES)
        for (int l = 0; l < ROW_LANES; l++) {
            double d = cpu_ld(x, j + l, bf16) - m;
            acc[l] += d * d;
        }
    for (; j < C; j++) {
        double d = cpu_ld(x, j, bf16) - m;
        s += d * d;
    }
    for (int l = 0; l < ROW_LANES; l++) s += acc[l];
    return s;
}

/* ---- layernorm: out = (x - mean) * rstd * w + b ---- */

CPU_INLINE void ln_fwd(norm_ctx *c, int64_t begin, int64_t end, int bf16) {
    int64_t C = c->cols;
    const void *weight = c->weight, *bias = c->bias;
    for (int64_t r = begin; r < end; r++) {
        const void *x = cpu_at(c->x, r * C, bf16);
        void *out = cpu_at_w(c->out, r * C, bf16);
        double m = row_sum(x, C, bf16) / C;
        double var = row_sq_dev(x, C, m, bf16);   /* two passes: no cancellation */
        float mean = (float)m, rstd = (float)(1.0 / sqrt(var / C + c->eps));
        for (int64_t j = 0; j < C; j++) {
            float y = (cpu_ld(x, j, bf16) - mean) * rstd;
            if (weight) y *= cpu_ld(weight, j, bf16);
            if (bias) y += cpu_ld(bias, j, bf16);
            cpu_st(out, j, y, bf16);
        }
        c->mean[r] = mean;
        c->rstd[r] = rstd;
    }
}

/* With xhat = (x - mean) rstd and g = dout * w:
 * dx = rstd (g - mean(g) - xhat mean(g xhat)) */
CPU_INLINE void ln_bwd_dx(norm_ctx *c, int64_t begin, int64_t end, int bf16) {
    int64_t C = c->cols;
    const void *weight = c->weight;
    for (int64_t r = begin; r < end; r++) {
        const void *x = cpu_at(c->x, r * C, bf16), *dout = cpu_at(c->dout, r * C, bf16);
        void *dx = cpu_at_w(c->out, r * C, bf16);
        float mean = c->mean_in[r], rstd = c->rstd_in[r];
        /* sum_j g and sum_j g xhat, in lanes as row_sum */
        double ag[ROW_LANES] = {0}, agx[ROW_LANES] = {0}, sg = 0, sgx = 0;
        int64_t k = 0;
        for (; k + ROW_LANES <= C; k += ROW_LANES)
            for (int l = 0; l < ROW_LANES; l++) {
                float g = weight ? cpu_ld(dout, k + l, bf16) * cpu_ld(weight, k + l, bf16) : cpu_ld(dout, k + l, bf16);
                ag[l] += g;
                agx[l] += g * ((cpu_ld(x, k + l, bf16) - mean) * rstd);
            }
        for (; k < C; k++) {
            float g = weight ? cpu_ld(dout, k, bf16) * cpu_ld(weight, k, bf16) : cpu_ld(dout, k, bf16);
            sg += g;
            sgx += g * ((cpu_ld(x, k, bf16) - mean) * rstd);
        }
        for (int l = 0; l < ROW_LANES; l++) sg += ag[l], sgx += agx[l];
        float mg = (float)(sg / C), mgx = (float)(sgx / C);
        for (int64_t j = 0; j < C; j++) {
            float g = weight ? cpu_ld(dout, j, bf16) * cpu_ld(weight, j, bf16) : cpu_ld(dout, j, bf16);
            float xhat = (cpu_ld(x, j, bf16) - mean) * rstd;
            cpu_st(dx, j, rstd * (g - mg - xhat * mgx), bf16);
        }
    }
}

/* Columns [begin, end) of dweight = sum_r dout xhat and dbias = sum_r dout,
 * a block of columns at a time so the accumulators stay on the stack. */
#define COL_BLOCK 64

CPU_INLINE void wgrad(norm_ctx *c, int64_t begin, int64_t end, int bf16) {
    int64_t C = c->cols, rows = c->rows;
    /* RMSNorm: xhat has no mean; a stride of 0 over one zero keeps the loop
     * free of branches */
    static const float zero = 0.0f;
    const float *mean_in = c->rms ? &zero : c->mean_in, *rstd_in = c->rstd_in;
    int64_t mean_step = c->rms ? 0 : 1;
    void *dweight = c->dweight, *dbias = c->dbias;
    for (int64_t j0 = begin; j0 < end; j0 += COL_BLOCK) {
        int64_t w = end - j0 < COL_BLOCK ? end - j0 : COL_BLOCK;
        double accw[COL_BLOCK] = {0}, accb[COL_BLOCK] = {0};
        for (int64_t r = 0; r < rows; r++) {
            const void *x = cpu_at(c->x, r * C + j0, bf16), *dout = cpu_at(c->dout, r * C + j0, bf16);
            float mean = mean_in[r * mean_step], rstd = rstd_in[r];
            for (int64_t j = 0; j < w; j++) {
                accw[j] += cpu_ld(dout, j, bf16) * ((cpu_ld(x, j, bf16) - mean) * rstd);
                accb[j] += cpu_ld(dout, j, bf16);
            }
        }
        for (int64_t j = 0; j < w; j++) {
            if (dweight) cpu_st(dweight, j0 + j, (float)accw[j], bf16);
            if (dbias) cpu_st(dbias, j0 + j, (float)accb[j], bf16);
        }
    }
}

static void ln_fwd_f32(void *p, int64_t b, int64_t e) { ln_fwd(p, b, e, F32); }
static void ln_fwd_bf16(void *p, int64_t b, int64_t e) { ln_fwd(p, b, e, BF16); }
static void ln_bwd_dx_f32(void *p, int64_t b, int64_t e) { ln_bwd_dx(p, b, e, F32); }
static void ln_bwd_dx_bf16(void *p, int64_t b, int64_t e) { ln_bwd_dx(p, b, e, BF16); }
static void wgrad_f32(void *p, int64_t b, int64_t e) { wgrad(p, b, e, F32); }
static void wgrad_bf16(void *p, int64_t b, int64_t e) { wgrad(p, b, e, BF16); }

static void layernorm_backward(norm_ctx *c, int bf16) {
    cpu_parallel_for(c->rows, row_grain(c->cols), bf16 ? ln_bwd_dx_bf16 : ln_bwd_dx_f32, c);
    if (c->dweight || c->dbias) cpu_parallel_for(c->cols, COL_BLOCK, bf16 ? wgrad_bf16 : wgrad_f32, c);
}

void cpu_layernorm_forward_f32(float *out, float *mean, float *rstd, const float *x,
                               const float *weight, const float *bias, int64_t rows, int64_t cols, float eps) {
    norm_ctx c = {.out = out, .mean = mean, .rstd = rstd, .x = x, .weight = weight, .bias = bias,
                  .rows = rows, .cols = cols, .eps = eps};
    cpu_parallel_for(rows, row_grain(cols), ln_fwd_f32, &c);
}

void cpu_layernorm_backward_f32(float *dx, float *dweight, float *dbias, const float *dout, const float *x,
                                const float *weight, const float *mean, const float *rstd,
                                int64_t rows, int64_t cols) {
    norm_ctx c = {.out = dx, .dweight = dweight, .dbias = dbias, .x = x, .dout = dout, .weight = weight,
                  .mean_in = mean, .rstd_in = rstd, .rows = rows, .cols = cols};
    layernorm_backward(&c, F32);
}

void cpu_layernorm_forward_bf16(uint16_t *out, float *mean, float *rstd, const uint16_t *x, const uint16_t *weight,
                                const uint16_t *bias, int64_t rows, int64_t cols, float eps) {
    norm_ctx c = {.out = out, .mean = mean, .rstd = rstd, .x = x, .weight = weight, .bias = bias,
                  .rows = rows, .cols = cols, .eps = eps};
    cpu_parallel_for(rows, row_grain(cols), ln_fwd_bf16, &c);
}

void cpu_layernorm_backward_bf16(uint16_t *dx, uint16_t *dweight, uint16_t *dbias, const uint16_t *dout,
                                 const uint16_t *x, const uint16_t *weight, const float *mean, const float *rstd,
                                 int64_t rows, int64_t cols) {
    norm_ctx c = {.out = dx, .dweight = dweight, .dbias = dbias, .x = x, .dout = dout, .weight = weight,
                  .mean_in = mean, .rstd_in = rstd, .rows = rows, .cols = cols};
    layernorm_backward(&c, BF16);
}

/* ---- RMSNorm (f32): out = x * rstd * w, rstd = 1 / sqrt(mean(x^2) + eps) ---- */

static void rms_fwd_range(void *p, int64_t begin, int64_t end) {
    norm_ctx *c = p;
    int64_t C = c->cols;
    const float *weight = c->weight;
    for (int64_t r = begin; r < end; r++) {
        const float *x = (const float *)c->x + r * C;
        float *out = (float *)c->out + r * C;
        double ss = row_sq_dev(x, C, 0.0, F32);   /* sum x^2 */
        float rstd = (float)(1.0 / sqrt(ss / C + c->eps));
        for (int64_t j = 0; j < C; j++) out[j] = weight ? x[j] * rstd * weight[j] : x[j] * rstd;
        c->rstd[r] = rstd;
    }
}

/* With xhat = x rstd and g = dout * w: dx = rstd (g - xhat mean(g xhat)) */
static void rms_bwd_dx_range(void *p, int64_t begin, int64_t end) {
    norm_ctx *c = p;
    int64_t C = c->cols;
    const float *weight = c->weight;
    for (int64_t r = begin; r < end; r++) {
        const float *x = (const float *)c->x + r * C, *dout = (const float *)c->dout + r * C;
        float *dx = (float *)c->out + r * C;
        float rstd = c->rstd_in[r];
        double agx[ROW_LANES] = {0}, sgx = 0;   /* sum_j g xhat, in lanes as row_sum */
        int64_t k = 0;
        for (; k + ROW_LANES <= C; k += ROW_LANES)
            for (int l = 0; l < ROW_LANES; l++) {
                float g = weight ? dout[k + l] * weight[k + l] : dout[k + l];
                agx[l] += g * (x[k + l] * rstd);
            }
        for (; k < C; k++) {
            float g = weight ? dout[k] * weight[k] : dout[k];
            sgx += g * (x[k] * rstd);
        }
        for (int l = 0; l < ROW_LANES; l++) sgx += agx[l];
        float mgx = (float)(sgx / C);
        for (int64_t j = 0; j < C; j++) {
            float g = weight ? dout[j] * weight[j] : dout[j];
            dx[j] = rstd * (g - x[j] * rstd * mgx);
        }
    }
}

void cpu_rmsnorm_forward_f32(float *out, float *rstd, const float *x, const float *weight,
                             int64_t rows, int64_t cols, float eps) {
    norm_ctx c = {.out = out, .rstd = rstd, .x = x, .weight = weight, .rows = rows, .cols = cols, .eps = eps};
    cpu_parallel_for(rows, row_grain(cols), rms_fwd_range, &c);
}

void cpu_rmsnorm_backward_f32(float *dx, float *dweight, const float *dout, const float *x,
                              const float *weight, const float *rstd, int64_t rows, int64_t cols) {
    norm_ctx c = {.out = dx, .dweight = dweight, .x = x, .dout = dout, .weight = weight,
                  .rstd_in = rstd, .rows = rows, .cols = cols, .rms = 1};
    cpu_parallel_for(rows, row_grain(cols), rms_bwd_dx_range, &c);
    if (dweight) cpu_parallel_for(cols, COL_BLOCK, wgrad_f32, &c);
}
