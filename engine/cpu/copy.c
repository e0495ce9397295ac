/* copy.c: strided N-d copy and fill.
 * The copy first drops size-1 dims and merges dims that are contiguous in
 * both dst and src, so a contiguous copy becomes one memcpy and most views
 * become a few long rows. The remaining outer dims are walked with an index
 * counter, in parallel over outer rows for big tensors. */
#include "cpu_kernels.h"
#include <string.h>

#define COPY_GRAIN (1 << 15)   /* elements per thread chunk */
#define MAXD 16

typedef struct {
    char *dst;
    const char *src;
    int ndim;                     /* after merging; >= 1 */
    int64_t shape[MAXD];
    int64_t dst_strides[MAXD];    /* bytes */
    int64_t src_strides[MAXD];    /* bytes */
    size_t elem;
} copy_plan;

/* Copies one row (the last dim) of n elements. */
static void copy_row(char *d, int64_t ds, const char *s, int64_t ss, int64_t n, size_t elem) {
    if (ds == (int64_t)elem && ss == (int64_t)elem) { memcpy(d, s, (size_t)n * elem); return; }
    switch (elem) {   /* typed loops so the compiler emits plain loads and stores */
#define ROW(T) for (int64_t i = 0; i < n; i++) *(T *)(d + i * ds) = *(const T *)(s + i * ss); return
    case 1: ROW(uint8_t);
    case 2: ROW(uint16_t);
    case 4: ROW(uint32_t);
    case 8: ROW(uint64_t);
#undef ROW
    default:
        for (int64_t i = 0; i < n; i++) memcpy(d + i * ds, s + i * ss, elem);
    }
}

/* Rows [begin, end) of the outer dims (all but the last). */
static void copy_rows(void *p, int64_t begin, int64_t end) {
    const copy_plan *c = p;
    int outer = c->ndim - 1;
    int64_t idx[MAXD];
    int64_t rem = begin;
    const char *s = c->src;
    char *d = c->dst;
    for (int k = outer - 1; k >= 0; k--) {   /* unravel begin into an index */
        idx[k] = rem % c->shape[k];
        rem /= c->shape[k];
        s += idx[k] * c->src_strides[k];
        d += idx[k] * c->dst_strides[k];
    }
    int64_t n = c->shape[outer];
    for (int64_t r = begin; r < end; r++) {
        copy_row(d, c->dst_strides[outer], s, c->src_strides[outer], n, c->elem);
        for (int k = outer - 1; k >= 0; k--) {   /* odometer step */
            s += c->src_strides[k];
            d += c->dst_strides[k];
            if (++idx[k] < c->shape[k]) break;
            s -= idx[k] * c->src_strides[k];
            d -= idx[k] * c->dst_strides[k];
            idx[k] = 0;
        }
    }
}

/* Transposing copies (src contiguous along the second-last dim, dst along
 * the last) walk 32x32 tiles, so the strided side of each tile stays in L1
 * instead of touching a new cache line per element. Items are (outer row,
 * band of TILE along the second-last dim). */
#define TILE 32

static void copy_tiles(void *p, int64_t begin, int64_t end) {
    const copy_plan *c = p;
    int i = c->ndim - 1, k = c->ndim - 2;
    int64_t bands = (c->shape[k] + TILE - 1) / TILE;
    for (int64_t item = begin; item < end; item++) {
        int64_t o = item / bands, band = item % bands;
        const char *s = c->src;
        char *d = c->dst;
        for (int q = k - 1; q >= 0; q--) {   /* unravel the outer index */
            int64_t iq = o % c->shape[q];
            o /= c->shape[q];
            s += iq * c->src_strides[q];
            d += iq * c->dst_strides[q];
        }
        int64_t a0 = band * TILE, a1 = a0 + TILE < c->shape[k] ? a0 + TILE : c->shape[k];
        for (int64_t b0 = 0; b0 < c->shape[i]; b0 += TILE) {
            int64_t len = b0 + TILE < c->shape[i] ? TILE : c->shape[i] - b0;
            for (int64_t a = a0; a < a1; a++)
                copy_row(d + a * c->dst_strides[k] + b0 * c->dst_strides[i], c->dst_strides[i],
                         s + a * c->src_strides[k] + b0 * c->src_strides[i], c->src_strides[i], len, c->elem);
        }
    }
}

/* One strided row, split over threads. */
static void copy_1d(void *p, int64_t begin, int64_t end) {
    const copy_plan *c = p;
    copy_row(c->dst + begin * c->dst_strides[0], c->dst_strides[0], c->src + begin * c->src_strides[0],
             c->src_strides[0], end - begin, c->elem);
}

/* One contiguous memcpy, split over threads. */
static void copy_flat(void *p, int64_t begin, int64_t end) {
    const copy_plan *c = p;
    memcpy(c->dst + begin * (int64_t)c->elem, c->src + begin * (int64_t)c->elem, (size_t)(end - begin) * c->elem);
}

void cpu_copy_strided(void *dst, const int64_t *dst_strides, const void *src, const int64_t *src_strides,
                      int ndim, const int64_t *shape, size_t elem_size) {
    copy_plan c = {.dst = dst, .src = src, .elem = elem_size};
    int64_t numel = 1;
    int nd = 0;
    for (int k = 0; k < ndim; k++) {
        numel *= shape[k];
        if (shape[k] == 1) continue;
        int64_t ds = dst_strides[k] * (int64_t)elem_size, ss = src_strides[k] * (int64_t)elem_size;
        /* merge with the previous kept dim when it steps exactly over this one in both */
        if (nd > 0 && c.dst_strides[nd - 1] == ds * shape[k] && c.src_strides[nd - 1] == ss * shape[k]) {
            c.shape[nd - 1] *= shape[k];
            c.dst_strides[nd - 1] = ds;
            c.src_strides[nd - 1] = ss;
            continue;
        }
        if (nd == MAXD) return;   /* unreachable for the engine's 8 dims */
        c.shape[nd] = shape[k];
        c.dst_strides[nd] = ds;
        c.src_strides[nd] = ss;
        nd++;
    }
    if (numel <= 0) return;
    if (nd == 0) {   /* ndim 0 or all dims of size 1: one element */
        memcpy(dst, src, elem_size);
        return;
    }
    c.ndim = nd;
    if (nd == 1 && c.dst_strides[0] == (int64_t)elem_size && c.src_strides[0] == (int64_t)elem_size) {
        cpu_parallel_for(numel, COPY_GRAIN * 4 / (int64_t)elem_size + 1, copy_flat, &c);
        return;
    }
    if (nd == 1) {
        cpu_parallel_for(numel, COPY_GRAIN, copy_1d, &c);
        return;
    }
    int64_t es = (int64_t)elem_size;
    if (nd >= 2 && c.src_strides[nd - 1] != es && c.src_strides[nd - 2] == es && c.shape[nd - 1] >= TILE &&
        c.shape[nd - 2] >= TILE) {
        int64_t items = numel / c.shape[nd - 1] / c.shape[nd - 2] * ((c.shape[nd - 2] + TILE - 1) / TILE);
        cpu_parallel_for(items, COPY_GRAIN / (TILE * c.shape[nd - 1]) + 1, copy_tiles, &c);
        return;
    }
    int64_t rows = numel / c.shape[nd - 1];
    int64_t grain = COPY_GRAIN / c.shape[nd - 1] + 1;
    cpu_parallel_for(rows, grain, copy_rows, &c);
}

typedef struct { float *out; float v; } fill_ctx;

static void fill_range(void *p, int64_t begin, int64_t end) {
    const fill_ctx *c = p;
    /* locals: a store through c->out could change c itself as far as the
     * compiler knows, which kept this loop scalar */
    float *out = c->out;
    const float v = c->v;
    for (int64_t i = begin; i < end; i++) out[i] = v;
}

void cpu_fill_f32(float *out, float v, int64_t n) {
    fill_ctx c = {out, v};
    cpu_parallel_for(n, 1 << 16, fill_range, &c);
}
