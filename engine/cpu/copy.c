/* copy.c: strided N-d copy and fill.
 * The copy first drops size-1 dims and merges dims that are contiguous in
 * both dst and src, so a contiguous copy becomes one memcpy and most views
 * become a few long rows. The remaining outer dims are walked with an index
 * counter, in parallel over outer rows for big tensors. */
#include "cpu_kernels.h"
#if defined(__AVX512F__)
#include <immintrin.h>
#endif
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

/* Fills and zeroings of at least STREAM_MIN bytes (beyond the 2-4 MiB of a
 * core's L2: a unit's gradient buffers, the gradient shards' zero_grad)
 * write with streaming stores where the target has them: each line is
 * written without being read first, half the memory traffic of plain
 * stores (measured here: 124M floats zeroed in 48-56 ms against 105-118 ms
 * for stores or memset, one thread). Smaller ones stay in cache for the
 * reader that follows. */
#define STREAM_MIN ((size_t)4 << 20)

typedef struct { float *out; float v; int stream; } fill_ctx;

static void fill_range(void *p, int64_t begin, int64_t end) {
    const fill_ctx *c = p;
    /* locals: a store through c->out could change c itself as far as the
     * compiler knows, which kept this loop scalar */
    float *out = c->out;
    const float v = c->v;
    int64_t i = begin;
#if defined(__AVX512F__)
    if (c->stream) {
        for (; i < end && ((uintptr_t)(out + i) & 63); i++) out[i] = v;   /* up to a 64-byte line */
        const __m512 vv = _mm512_set1_ps(v);
        for (; i + 16 <= end; i += 16) _mm512_stream_ps(out + i, vv);
        _mm_sfence();   /* visible before the pool reports this chunk done */
    }
#endif
    for (; i < end; i++) out[i] = v;
}

void cpu_fill_f32(float *out, float v, int64_t n) {
    fill_ctx c = {out, v, (size_t)n * sizeof(float) >= STREAM_MIN};
    cpu_parallel_for(n, 1 << 16, fill_range, &c);
}

/* nbytes of zeros (the device table's zero: new tensors asked zeroed) */
typedef struct { unsigned char *dst; } zero_ctx;

#define ZERO_LINE 64
static void zero_range(void *p, int64_t begin, int64_t end) {   /* lines [begin, end) */
    unsigned char *d = ((const zero_ctx *)p)->dst + begin * ZERO_LINE;
#if defined(__AVX512F__)
    const __m512i z = _mm512_setzero_si512();
    for (int64_t l = begin; l < end; l++, d += ZERO_LINE) _mm512_stream_si512((void *)d, z);
    _mm_sfence();
#else
    memset(d, 0, (size_t)(end - begin) * ZERO_LINE);
#endif
}

void cpu_zero(void *dst, size_t nbytes) {
    if (nbytes < STREAM_MIN) {
        memset(dst, 0, nbytes);
        return;
    }
    unsigned char *d = dst;
    size_t head = (ZERO_LINE - ((uintptr_t)d & (ZERO_LINE - 1))) & (ZERO_LINE - 1);
    memset(d, 0, head);
    size_t lines = (nbytes - head) / ZERO_LINE, tail = nbytes - head - lines * ZERO_LINE;
    zero_ctx c = {d + head};
    cpu_parallel_for((int64_t)lines, 1 << 12, zero_range, &c);
    memset(d + head + lines * ZERO_LINE, 0, tail);
}
