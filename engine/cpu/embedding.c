/* embedding.c: row gather forward, scatter-add backward.
 *
 * Backward splits the columns of dim between threads: every thread walks all
 * ids in order over its own columns, so no two threads touch one element and
 * the sums come out the same for any thread count. */
#include "cpu_kernels.h"
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
