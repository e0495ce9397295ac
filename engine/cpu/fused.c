/* fused.c: a Linear's bias with the op that follows it, in one pass (after
 * llm.c): bias + GELU (GPT-2's MLP), and bias + the residual add (the
 * attention's and the MLP's output projections).
 *
 * x (rows, cols) is the matmul's output without its bias, bias (cols) is
 * broadcast over the rows. The sums x + bias stay in f32 (the unfused ops
 * round them to the dtype first: the same values in f32, within one bf16
 * rounding in bf16). The bias gradient of bias + GELU is the column sum of
 * dx as stored (rounded to the dtype), in double in row order, rounded
 * to f32 and then to the dtype (bf16: two roundings, as sum_dim_bf16 and
 * CUDA do): what summing the unfused GELU backward's output gives. */
#include "cpu_kernels.h"
#include "gelu.h"
#include "vec512.h"
#include <math.h>

#define ROW_GRAIN 16384               /* elements per chunk (an exp costs a few ns) */
#define COL_TILE 64                   /* columns per double accumulator block */

typedef struct {
    void *out, *dbias;
    const void *x, *bias, *other;   /* other: dout (GELU backward) or res (residual) */
    int64_t rows, cols;
    int bf16, acc;
} fused_ctx;

/* ---- bias + GELU ---- */

/* (AVX-512: 16 lanes through activation.c's vector GELU, v16_gelu, so the
 * fused and unfused kernels stay equal bit for bit; else one element at a
 * time through the scalar gelu above) */
CPU_INLINE void gelu_fwd_rows(fused_ctx *c, int64_t r0, int64_t r1, int bf16) {
#ifdef FSDP_VEC512
    for (int64_t r = r0; r < r1; r++) {
        const void *xr = cpu_at(c->x, r * c->cols, bf16);   // (cols)
        void *yr = cpu_at_w(c->out, r * c->cols, bf16);
        for (int64_t j = 0; j < c->cols; j += 16) {
            __mmask16 k = v16_mask(c->cols - j);
            __m512 v = _mm512_add_ps(v16_load_as(xr, j, k, bf16), v16_load_as(c->bias, j, k, bf16));
            v16_store_as(yr, j, k, v16_gelu(v), bf16);
        }
    }
    return;
#endif
    for (int64_t r = r0; r < r1; r++) {
        const void *xr = cpu_at(c->x, r * c->cols, bf16);   // (cols)
        void *yr = cpu_at_w(c->out, r * c->cols, bf16);
        for (int64_t j = 0; j < c->cols; j++)
            cpu_st(yr, j, gelu(cpu_ld(xr, j, bf16) + cpu_ld(c->bias, j, bf16)), bf16);
    }
}
static void gelu_fwd_f32(void *p, int64_t r0, int64_t r1) { gelu_fwd_rows(p, r0, r1, 0); }
static void gelu_fwd_bf16(void *p, int64_t r0, int64_t r1) { gelu_fwd_rows(p, r0, r1, 1); }

CPU_INLINE void gelu_bwd_rows(fused_ctx *c, int64_t r0, int64_t r1, int bf16) {
#ifdef FSDP_VEC512
    for (int64_t r = r0; r < r1; r++) {
        const void *xr = cpu_at(c->x, r * c->cols, bf16), *gr = cpu_at(c->other, r * c->cols, bf16);   // (cols)
        void *dr = cpu_at_w(c->out, r * c->cols, bf16);
        for (int64_t j = 0; j < c->cols; j += 16) {
            __mmask16 k = v16_mask(c->cols - j);
            __m512 v = _mm512_add_ps(v16_load_as(xr, j, k, bf16), v16_load_as(c->bias, j, k, bf16));
            v16_store_as(dr, j, k, _mm512_mul_ps(v16_load_as(gr, j, k, bf16), v16_gelu_grad(v)), bf16);
        }
    }
    return;
#endif
    for (int64_t r = r0; r < r1; r++) {
        const void *xr = cpu_at(c->x, r * c->cols, bf16), *gr = cpu_at(c->other, r * c->cols, bf16);   // (cols)
        void *dr = cpu_at_w(c->out, r * c->cols, bf16);
        for (int64_t j = 0; j < c->cols; j++)
            cpu_st(dr, j, cpu_ld(gr, j, bf16) * gelu_grad(cpu_ld(xr, j, bf16) + cpu_ld(c->bias, j, bf16)), bf16);
    }
}
static void gelu_bwd_f32(void *p, int64_t r0, int64_t r1) { gelu_bwd_rows(p, r0, r1, 0); }
static void gelu_bwd_bf16(void *p, int64_t r0, int64_t r1) { gelu_bwd_rows(p, r0, r1, 1); }

/* dbias[j] (+)= sum over rows of dx[r, j]: a tile of columns per item,
 * rows in order, so the result does not depend on the thread count */
CPU_INLINE void colsum_tiles(fused_ctx *c, int64_t t0, int64_t t1, int bf16) {
    double s[COL_TILE];
    const void *dx = c->out;
    for (int64_t t = t0; t < t1; t++) {
        int64_t j0 = t * COL_TILE, len = j0 + COL_TILE < c->cols ? COL_TILE : c->cols - j0;
        for (int64_t j = 0; j < len; j++) s[j] = c->acc ? (double)cpu_ld(c->dbias, j0 + j, bf16) : 0.0;
        for (int64_t r = 0; r < c->rows; r++) {
            const void *dr = cpu_at(dx, r * c->cols + j0, bf16);
            for (int64_t j = 0; j < len; j++) s[j] += (double)cpu_ld(dr, j, bf16);
        }
        for (int64_t j = 0; j < len; j++) cpu_st(c->dbias, j0 + j, (float)s[j], bf16);
    }
}
static void colsum_f32(void *p, int64_t t0, int64_t t1) { colsum_tiles(p, t0, t1, 0); }
static void colsum_bf16(void *p, int64_t t0, int64_t t1) { colsum_tiles(p, t0, t1, 1); }

static int64_t row_grain(int64_t cols) { return cols >= ROW_GRAIN ? 1 : ROW_GRAIN / (cols + 1) + 1; }

static void bias_gelu_backward(fused_ctx *c) {
    if (c->rows <= 0 || c->cols <= 0) {
        if (c->dbias && !c->acc)
            for (int64_t j = 0; j < c->cols; j++) cpu_st(c->dbias, j, 0.0f, c->bf16);
        return;
    }
    cpu_parallel_for(c->rows, row_grain(c->cols), c->bf16 ? gelu_bwd_bf16 : gelu_bwd_f32, c);
    if (!c->dbias) return;
    int64_t tiles = (c->cols + COL_TILE - 1) / COL_TILE, per_tile = c->rows * COL_TILE;
    cpu_parallel_for(tiles, per_tile >= 65536 ? 1 : 65536 / per_tile + 1, c->bf16 ? colsum_bf16 : colsum_f32, c);
}

void cpu_bias_gelu_forward_f32(float *out, const float *x, const float *bias, int64_t rows, int64_t cols) {
    if (rows <= 0 || cols <= 0) return;
    fused_ctx c = {.out = out, .x = x, .bias = bias, .rows = rows, .cols = cols};
    cpu_parallel_for(rows, row_grain(cols), gelu_fwd_f32, &c);
}

void cpu_bias_gelu_forward_bf16(uint16_t *out, const uint16_t *x, const uint16_t *bias, int64_t rows,
                                int64_t cols) {
    if (rows <= 0 || cols <= 0) return;
    fused_ctx c = {.out = out, .x = x, .bias = bias, .rows = rows, .cols = cols, .bf16 = 1};
    cpu_parallel_for(rows, row_grain(cols), gelu_fwd_bf16, &c);
}

void cpu_bias_gelu_backward_f32(float *dx, float *dbias, const float *dout, const float *x, const float *bias,
                                int64_t rows, int64_t cols, int acc) {
    fused_ctx c = {.out = dx, .dbias = dbias, .x = x, .bias = bias, .other = dout, .rows = rows, .cols = cols,
                   .acc = acc};
    bias_gelu_backward(&c);
}

void cpu_bias_gelu_backward_bf16(uint16_t *dx, uint16_t *dbias, const uint16_t *dout, const uint16_t *x,
                                 const uint16_t *bias, int64_t rows, int64_t cols, int acc) {
    fused_ctx c = {.out = dx, .dbias = dbias, .x = x, .bias = bias, .other = dout, .rows = rows, .cols = cols,
                   .bf16 = 1, .acc = acc};
    bias_gelu_backward(&c);
}

/* ---- bias + residual ---- */

CPU_INLINE void residual_rows(fused_ctx *c, int64_t r0, int64_t r1, int bf16) {
    for (int64_t r = r0; r < r1; r++) {
        const void *xr = cpu_at(c->x, r * c->cols, bf16), *rr = cpu_at(c->other, r * c->cols, bf16);   // (cols)
        void *yr = cpu_at_w(c->out, r * c->cols, bf16);
        for (int64_t j = 0; j < c->cols; j++)
            cpu_st(yr, j, cpu_ld(rr, j, bf16) + (cpu_ld(xr, j, bf16) + cpu_ld(c->bias, j, bf16)), bf16);
    }
}
static void residual_f32(void *p, int64_t r0, int64_t r1) { residual_rows(p, r0, r1, 0); }
static void residual_bf16(void *p, int64_t r0, int64_t r1) { residual_rows(p, r0, r1, 1); }

void cpu_bias_residual_f32(float *out, const float *x, const float *bias, const float *res, int64_t rows,
                           int64_t cols) {
    if (rows <= 0 || cols <= 0) return;
    fused_ctx c = {.out = out, .x = x, .bias = bias, .other = res, .rows = rows, .cols = cols};
    cpu_parallel_for(rows, 4 * row_grain(cols), residual_f32, &c);
}

void cpu_bias_residual_bf16(uint16_t *out, const uint16_t *x, const uint16_t *bias, const uint16_t *res,
                            int64_t rows, int64_t cols) {
    if (rows <= 0 || cols <= 0) return;
    fused_ctx c = {.out = out, .x = x, .bias = bias, .other = res, .rows = rows, .cols = cols, .bf16 = 1};
    cpu_parallel_for(rows, 4 * row_grain(cols), residual_bf16, &c);
}
