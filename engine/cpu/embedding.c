/* embedding.c: row gather forward, scatter-add backward.
 *
 * Backward splits the columns of dim between threads: every thread walks all
 * ids in order over its own columns, so no two threads touch one element and
 * the sums come out the same for any thread count. */
#include "cpu_kernels.h"
#include <stdbool.h>
#include <stdlib.h>
#include <string.h>

typedef struct {
    float *out;
    const float *in;
    const int64_t *ids;
    int64_t n, dim;
} emb_ctx;

static void gather_range(void *p, int64_t begin, int64_t end) {
    emb_ctx *c = p;
    for (int64_t i = begin; i < end; i++)
        memcpy(c->out + i * c->dim, c->in + c->ids[i] * c->dim, (size_t)c->dim * sizeof(float));
}

static void zero_range(void *p, int64_t begin, int64_t end) {
    emb_ctx *c = p;
    memset(c->out + begin * c->dim, 0, (size_t)((end - begin) * c->dim) * sizeof(float));
}

/* columns [begin, end): dtable[ids[i], j] += dout[i, j] */
static void scatter_range(void *p, int64_t begin, int64_t end) {
    emb_ctx *c = p;
    for (int64_t i = 0; i < c->n; i++) {
        float *dst = c->out + c->ids[i] * c->dim;
        const float *src = c->in + i * c->dim;
        for (int64_t j = begin; j < end; j++) dst[j] += src[j];
    }
}

void cpu_embedding_forward_f32(float *out, const int64_t *ids, int64_t n, const float *table, int64_t dim) {
    emb_ctx c = {out, table, ids, n, dim};   // out (n, dim), table (V, dim)
    cpu_parallel_for(n, dim >= 4096 ? 1 : 4096 / (dim > 0 ? dim : 1), gather_range, &c);
}

void cpu_embedding_backward_f32(float *dtable, int64_t vocab, const int64_t *ids, int64_t n,
                                const float *dout, int64_t dim) {
    emb_ctx c = {dtable, dout, ids, n, dim};   // dtable (vocab, dim), dout (n, dim)
    if (dim <= 0) return;
    cpu_parallel_for(vocab, 65536 / dim + 1, zero_range, &c);
    /* 64-column chunks at least: whole cache lines per thread, mostly */
    cpu_parallel_for(dim, 64, scatter_range, &c);
}

void cpu_embedding_backward_acc_f32(float *dtable, const int64_t *ids, int64_t n, const float *dout, int64_t dim) {
    emb_ctx c = {dtable, dout, ids, n, dim};   // dtable (vocab, dim), dout (n, dim)
    if (dim <= 0) return;
    cpu_parallel_for(dim, 64, scatter_range, &c);
}

/* ---- bf16: dout rows summed per id in f32, each dtable element rounded
 * once (ids that repeat would otherwise round at every add) ---- */

typedef struct {
    uint16_t *dtable;
    const uint16_t *dout;
    const int64_t *ids, *order;   /* order: positions sorted by (id, position) */
    int64_t n, dim;
} emb16_ctx;

#define EMB_BLOCK 256   /* columns per f32 accumulator block */

/* columns [begin, end): dtable[id, j] = bf16(dtable[id, j] + sum of dout[i, j]
 * over the positions i of id, in position order) */
static void scatter16_range(void *p, int64_t begin, int64_t end) {
    emb16_ctx *c = p;
    for (int64_t j0 = begin; j0 < end; j0 += EMB_BLOCK) {
        int64_t w = end - j0 < EMB_BLOCK ? end - j0 : EMB_BLOCK;
        for (int64_t g = 0; g < c->n;) {
            int64_t id = c->ids[c->order[g]];
            uint16_t *row = c->dtable + id * c->dim + j0;
            float acc[EMB_BLOCK];
            for (int64_t j = 0; j < w; j++) acc[j] = bf16_to_f32(row[j]);
            for (; g < c->n && c->ids[c->order[g]] == id; g++) {
                const uint16_t *src = c->dout + c->order[g] * c->dim + j0;
                for (int64_t j = 0; j < w; j++) acc[j] += bf16_to_f32(src[j]);
            }
            for (int64_t j = 0; j < w; j++) row[j] = f32_to_bf16(acc[j]);
        }
    }
}

typedef struct { int64_t id, pos; } id_pos;

static int by_id_then_pos(const void *a, const void *b) {
    const id_pos *x = a, *y = b;
    if (x->id != y->id) return x->id < y->id ? -1 : 1;
    return x->pos < y->pos ? -1 : x->pos > y->pos;
}

/* Positions grouped by id (each id's in position order): sorted when there
 * is memory for it, else by a scan that finds each id's first position
 * (O(n^2), the same order). NULL only when even the result array fails. */
static int64_t *group_by_id(const int64_t *ids, int64_t n) {
    int64_t *order = malloc((size_t)(n > 0 ? n : 1) * sizeof *order);
    if (!order) return NULL;
    id_pos *tmp = malloc((size_t)(n > 0 ? n : 1) * sizeof *tmp);
    if (tmp) {
        for (int64_t i = 0; i < n; i++) tmp[i] = (id_pos){ids[i], i};
        qsort(tmp, (size_t)n, sizeof *tmp, by_id_then_pos);
        for (int64_t i = 0; i < n; i++) order[i] = tmp[i].pos;
        free(tmp);
        return order;
    }
    int64_t k = 0;
    for (int64_t i = 0; i < n; i++) {
        bool first = true;
        for (int64_t q = 0; q < i && first; q++) first = ids[q] != ids[i];
        if (!first) continue;
        for (int64_t q = i; q < n; q++)
            if (ids[q] == ids[i]) order[k++] = q;
    }
    return order;
}

/* Adds into dtable (vocab, dim) as it is. */
void cpu_embedding_backward_acc_bf16(uint16_t *dtable, const int64_t *ids, int64_t n, const uint16_t *dout,
                                     int64_t dim) {
    if (dim <= 0 || n <= 0) return;
    int64_t *order = group_by_id(ids, n);
    if (!order) {   /* no memory even for n positions: one position at a time, rounding per add */
        for (int64_t i = 0; i < n; i++) {
            uint16_t *row = dtable + ids[i] * dim;
            for (int64_t j = 0; j < dim; j++) row[j] = f32_to_bf16(bf16_to_f32(row[j]) + bf16_to_f32(dout[i * dim + j]));
        }
        return;
    }
    emb16_ctx c = {dtable, dout, ids, order, n, dim};
    cpu_parallel_for(dim, 64, scatter16_range, &c);
    free(order);
}

static void zero16_range(void *p, int64_t begin, int64_t end) {
    emb16_ctx *c = p;
    memset(c->dtable + begin * c->dim, 0, (size_t)((end - begin) * c->dim) * sizeof(uint16_t));
}

void cpu_embedding_backward_bf16(uint16_t *dtable, int64_t vocab, const int64_t *ids, int64_t n,
                                 const uint16_t *dout, int64_t dim) {
    if (dim <= 0) return;
    emb16_ctx c = {dtable, dout, ids, NULL, n, dim};
    cpu_parallel_for(vocab, 65536 / dim + 1, zero16_range, &c);
    cpu_embedding_backward_acc_bf16(dtable, ids, n, dout, dim);
}
