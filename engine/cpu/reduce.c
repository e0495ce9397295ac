/* reduce.c: sums. Everything accumulates in double: a float running sum of
 * 1e6 values loses ~3 digits, a double one none that matter once the result
 * is rounded back to float. Work is split into blocks whose boundaries depend
 * only on the sizes, and partial sums are combined in a fixed order, so the
 * result is the same bit for bit whatever the thread count. */
#include "cpu_kernels.h"
#include <stdlib.h>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#define LANES 16   /* independent accumulators, so the loop vectorizes without reassociation */

static double sum_contig(const float *x, int64_t n) {
    double acc[LANES] = {0};
    int64_t i = 0;
    for (; i + LANES <= n; i += LANES)
        for (int j = 0; j < LANES; j++) acc[j] += (double)x[i + j];
    double s = 0;
    for (; i < n; i++) s += (double)x[i];
    for (int j = 0; j < LANES; j++) s += acc[j];
    return s;
}

/* the portable loop (and the reference of the one below) */
static double sumsq_lanes(const float *x, int64_t n) {
    double acc[LANES] = {0};
    int64_t i = 0;
    for (; i + LANES <= n; i += LANES)
        for (int j = 0; j < LANES; j++) { double v = x[i + j]; acc[j] += v * v; }
    double s = 0;
    for (; i < n; i++) { double v = x[i]; s += v * v; }
    for (int j = 0; j < LANES; j++) s += acc[j];
    return s;
}

#if defined(__AVX512F__) && defined(__AVX512DQ__)
/* The gradient norm's pass: a read-only stream, which one core here fills
 * at under half the rate of a pass that reads several arrays (AdamW's four)
 * whatever the arithmetic. So the block is read as four quarters side by
 * side, 16 floats of each per iteration (widened to double, squared and
 * added in registers): 1.5x the rate of one stream (tools/bench_kernels).
 * The order depends only on n, as the blocks do. */
#define SUMSQ_STREAMS 4
static double sumsq_contig(const float *x, int64_t n) {
    if (n < SUMSQ_STREAMS * 16) return sumsq_lanes(x, n);
    int64_t len = n / SUMSQ_STREAMS / 16 * 16;   /* floats per quarter */
    __m512d lo[SUMSQ_STREAMS], hi[SUMSQ_STREAMS];
    for (int s = 0; s < SUMSQ_STREAMS; s++) lo[s] = hi[s] = _mm512_setzero_pd();
    for (int64_t i = 0; i < len; i += 16)
        for (int s = 0; s < SUMSQ_STREAMS; s++) {
            __m512 f = _mm512_loadu_ps(x + s * len + i);
            __m512d a = _mm512_cvtps_pd(_mm512_castps512_ps256(f)), b = _mm512_cvtps_pd(_mm512_extractf32x8_ps(f, 1));
            lo[s] = _mm512_fmadd_pd(a, a, lo[s]);
            hi[s] = _mm512_fmadd_pd(b, b, hi[s]);
        }
    double total = 0;
    for (int s = 0; s < SUMSQ_STREAMS; s++) total += _mm512_reduce_add_pd(_mm512_add_pd(lo[s], hi[s]));
    return total + sumsq_lanes(x + SUMSQ_STREAMS * len, n - SUMSQ_STREAMS * len);
}
#else
#define sumsq_contig sumsq_lanes
#endif

/* ---- sum_all, sumsq: blocks of the flat array, one double partial each ---- */
#define MAX_BLOCKS 4096
#define MIN_BLOCK (1 << 16)

typedef struct {
    const float *in;
    int64_t n, block;
    double (*fn)(const float *, int64_t);
    double partial[MAX_BLOCKS];
} flat_ctx;

static void flat_blocks(void *p, int64_t begin, int64_t end) {
    flat_ctx *c = p;
    for (int64_t k = begin; k < end; k++) {
        int64_t lo = k * c->block, hi = lo + c->block < c->n ? lo + c->block : c->n;
        c->partial[k] = c->fn(c->in + lo, hi - lo);
    }
}

static double flat_reduce(const float *in, int64_t n, double (*fn)(const float *, int64_t)) {
    if (n <= 0) return 0.0;
    if (n <= MIN_BLOCK) return fn(in, n);
    flat_ctx *c = malloc(sizeof *c);
    if (!c) return fn(in, n);
    int64_t block = (n + MAX_BLOCKS - 1) / MAX_BLOCKS;
    if (block < MIN_BLOCK) block = MIN_BLOCK;
    int64_t nblocks = (n + block - 1) / block;
    c->in = in;
    c->n = n;
    c->block = block;
    c->fn = fn;
    cpu_parallel_for(nblocks, 1, flat_blocks, c);
    double s = 0;
    for (int64_t k = 0; k < nblocks; k++) s += c->partial[k];
    free(c);
    return s;
}

double cpu_sum_all_f32(const float *in, int64_t n) { return flat_reduce(in, n, sum_contig); }
double cpu_sumsq_f32(const float *in, int64_t n) { return flat_reduce(in, n, sumsq_contig); }

/* ---- sum_dim: (outer, red, inner) -> (outer, inner) ----
 * inner == 1: each output is a contiguous sum. inner > 1: add rows of a
 * tile of inner into a double accumulator, walking red. When outer * tiles
 * alone gives too few work items (e.g. a bias gradient, outer = 1), red is
 * also cut into slices whose partials are added afterwards in order. */
#define TILE 256
#define RED_SLICE 1024   /* rows per slice when red is split */

typedef struct {
    float *out;
    const float *in;
    int64_t outer, red, inner, tiles, slices, slice_len;
    double *partial;     /* (slices, outer, inner) when slices > 1 */
} dim_ctx;

/* Sums rows [r0, r1) of the (red, inner) slab at tile t into acc. */
static void sum_tile(double *acc, const float *slab, int64_t inner, int64_t j0, int64_t len, int64_t r0, int64_t r1) {
    for (int64_t j = 0; j < len; j++) acc[j] = 0;
    for (int64_t r = r0; r < r1; r++) {
        const float *row = slab + r * inner + j0;
        for (int64_t j = 0; j < len; j++) acc[j] += (double)row[j];
    }
}

static void dim_items(void *p, int64_t begin, int64_t end) {
    dim_ctx *c = p;
    double acc[TILE];
    for (int64_t item = begin; item < end; item++) {
        int64_t s = item / (c->outer * c->tiles);   /* slice of red */
        int64_t rest = item % (c->outer * c->tiles);
        int64_t o = rest / c->tiles, t = rest % c->tiles;
        int64_t r0 = s * c->slice_len, r1 = r0 + c->slice_len < c->red ? r0 + c->slice_len : c->red;
        const float *slab = c->in + o * c->red * c->inner;   /* (red, inner) */
        if (c->inner == 1) {
            double v = sum_contig(slab + r0, r1 - r0);
            if (c->slices > 1) c->partial[s * c->outer + o] = v;
            else c->out[o] = (float)v;
            continue;
        }
        int64_t j0 = t * TILE, len = j0 + TILE < c->inner ? TILE : c->inner - j0;
        sum_tile(acc, slab, c->inner, j0, len, r0, r1);
        if (c->slices > 1) {
            double *dst = c->partial + (s * c->outer + o) * c->inner + j0;
            for (int64_t j = 0; j < len; j++) dst[j] = acc[j];
        } else {
            float *dst = c->out + o * c->inner + j0;
            for (int64_t j = 0; j < len; j++) dst[j] = (float)acc[j];
        }
    }
}

void cpu_sum_dim_f32(float *out, const float *in, int64_t outer, int64_t red, int64_t inner) {
    if (outer <= 0 || inner <= 0) return;
    if (red <= 0) {
        for (int64_t i = 0; i < outer * inner; i++) out[i] = 0.0f;
        return;
    }
    dim_ctx c = {.out = out, .in = in, .outer = outer, .red = red, .inner = inner};
    c.tiles = inner == 1 ? 1 : (inner + TILE - 1) / TILE;
    c.slices = 1;
    c.slice_len = red;
    /* Few independent outputs but a long red: split red (sizes alone decide,
     * not the thread count, so results do not depend on it). */
    int64_t items = outer * c.tiles;
    if (items < 16 && red >= 2 * RED_SLICE && outer * red * inner >= (1 << 16)) {
        int64_t want = (16 + items - 1) / items;            /* slices to reach ~16 items */
        int64_t most = red / RED_SLICE;
        c.slices = want < most ? want : most;
        c.slice_len = (red + c.slices - 1) / c.slices;
        c.slices = (red + c.slice_len - 1) / c.slice_len;
        c.partial = malloc((size_t)(c.slices * outer * inner) * sizeof(double));
        if (!c.partial) { c.slices = 1; c.slice_len = red; }
    }
    int64_t per_item = c.slice_len * (inner == 1 ? 1 : (inner < TILE ? inner : TILE));
    cpu_parallel_for(c.slices * items, (1 << 15) / per_item + 1, dim_items, &c);
    if (c.slices > 1) {
        for (int64_t i = 0; i < outer * inner; i++) {
            double s = 0;
            for (int64_t k = 0; k < c.slices; k++) s += c.partial[k * outer * inner + i];
            out[i] = (float)s;
        }
        free(c.partial);
    }
}

/* ---- sum_dim on bf16: (outer, red, inner) -> (outer, inner), each output
 * summed in double in row order by one thread and rounded once; _acc adds
 * the sum to what out holds (a bias gradient into its .grad) ---- */

typedef struct {
    uint16_t *out;
    const uint16_t *in;
    int64_t outer, red, inner, tiles;
    int acc;
} dim16_ctx;

static void dim16_items(void *p, int64_t begin, int64_t end) {
    dim16_ctx *c = p;
    double acc[TILE];
    for (int64_t item = begin; item < end; item++) {
        int64_t o = item / c->tiles, j0 = (item % c->tiles) * TILE;
        int64_t len = j0 + TILE < c->inner ? TILE : c->inner - j0;
        const uint16_t *slab = c->in + o * c->red * c->inner + j0;   /* (red, inner) from column j0 */
        uint16_t *dst = c->out + o * c->inner + j0;
        for (int64_t j = 0; j < len; j++) acc[j] = c->acc ? (double)bf16_to_f32(dst[j]) : 0.0;
        for (int64_t r = 0; r < c->red; r++)
            for (int64_t j = 0; j < len; j++) acc[j] += (double)bf16_to_f32(slab[r * c->inner + j]);
        for (int64_t j = 0; j < len; j++) dst[j] = f32_to_bf16((float)acc[j]);
    }
}

static void sum_dim16(uint16_t *out, const uint16_t *in, int64_t outer, int64_t red, int64_t inner, int acc) {
    if (outer <= 0 || inner <= 0) return;
    dim16_ctx c = {out, in, outer, red > 0 ? red : 0, inner, (inner + TILE - 1) / TILE, acc};
    /* an item reads red x TILE elements: enough of them per thread */
    int64_t per_item = c.red * (inner < TILE ? inner : TILE);
    cpu_parallel_for(outer * c.tiles, per_item >= 65536 ? 1 : 65536 / (per_item + 1) + 1, dim16_items, &c);
}

void cpu_sum_dim_bf16(uint16_t *out, const uint16_t *in, int64_t outer, int64_t red, int64_t inner) {
    sum_dim16(out, in, outer, red, inner, 0);
}

void cpu_sum_dim_acc_bf16(uint16_t *out, const uint16_t *in, int64_t outer, int64_t red, int64_t inner) {
    sum_dim16(out, in, outer, red, inner, 1);
}
