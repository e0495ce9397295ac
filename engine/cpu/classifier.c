/* classifier.c: the vocabulary-chunked LM head and embedding (llm.c's fused
 * classifier, chunked): one slice of the table's rows at a time, so that
 * neither the (N, V) logits nor the whole table need be in memory at once.
 *
 * A slice is `blocks` runs of `block_rows` consecutive table rows, run b
 * starting at table row b * block_stride + row0; its rows sit one after the
 * other in the slice buffer (blocks * block_rows rows). An unsharded table
 * is one run per slice; a table sharded over N ranks is gathered as N runs,
 * one from each rank's shard of rows (block_stride rows each). Rows at or
 * past valid_v are vocabulary padding and take no part.
 *
 * Online log-sum-exp over slices (per row n of the logits):
 *   m' = max(m, max_j x_j),  s' = s exp(m - m') + sum_j exp(x_j - m'),
 *   lse = m + log s at the end; the target's logit is picked up by the
 *   slice that holds it. Backward, per slice, with the final lse:
 *   dlogits_j = g (exp(x_j - lse) - [row j is the target]), g = dloss / count. */
#include "cpu_kernels.h"
#include <math.h>
#include <stdbool.h>
#include <string.h>

/* Table row of slice row i. */
static inline int64_t table_row(int64_t i, int64_t block_rows, int64_t block_stride, int64_t row0) {
    return (i / block_rows) * block_stride + row0 + i % block_rows;
}

/* Slice row of table row g, or -1 when the slice does not hold it. */
static inline int64_t slice_row(int64_t g, int64_t blocks, int64_t block_rows, int64_t block_stride, int64_t row0) {
    int64_t b = g / block_stride, o = g % block_stride - row0;
    if (b >= blocks || o < 0 || o >= block_rows) return -1;
    return b * block_rows + o;
}

typedef struct {
    float *m, *s, *tlogit, *dlogits;
    const float *logits, *lse;
    const int64_t *targets;
    int64_t R, blocks, block_rows, block_stride, row0, valid_v, ignore_index;
    float g;
} cls_ctx;

static int64_t grain_of(int64_t R) { return R >= 16384 ? 1 : 16384 / (R > 0 ? R : 1); }

static void lse_range(void *p, int64_t begin, int64_t end) {
    cls_ctx *c = p;
    for (int64_t n = begin; n < end; n++) {
        const float *x = c->logits + n * c->R;   // (R)
        float m = c->m[n];
        for (int64_t i = 0; i < c->R; i++)
            if (table_row(i, c->block_rows, c->block_stride, c->row0) < c->valid_v) m = fmaxf(m, x[i]);
        if (m == -INFINITY) continue;   /* nothing valid in this slice, nor before */
        double sum = 0;
        for (int64_t i = 0; i < c->R; i++)
            if (table_row(i, c->block_rows, c->block_stride, c->row0) < c->valid_v) sum += expf(x[i] - m);
        c->s[n] = (float)((double)c->s[n] * exp((double)c->m[n] - m) + sum);
        c->m[n] = m;
        int64_t t = c->targets[n];
        if (t != c->ignore_index && t >= 0) {
            int64_t i = slice_row(t, c->blocks, c->block_rows, c->block_stride, c->row0);
            if (i >= 0) c->tlogit[n] = x[i];
        }
    }
}

void cpu_classifier_lse_f32(float *m, float *s, float *tlogit, const float *logits, const int64_t *targets,
                            int64_t N, int64_t blocks, int64_t block_rows, int64_t block_stride, int64_t row0,
                            int64_t valid_v, int64_t ignore_index) {
    cls_ctx c = {.m = m, .s = s, .tlogit = tlogit, .logits = logits, .targets = targets, .R = blocks * block_rows,
                 .blocks = blocks, .block_rows = block_rows, .block_stride = block_stride, .row0 = row0,
                 .valid_v = valid_v, .ignore_index = ignore_index};
    cpu_parallel_for(N, grain_of(c.R), lse_range, &c);
}

int64_t cpu_classifier_finish_f32(float *lse, float *losses, const float *m, const float *s, const float *tlogit,
                                  const int64_t *targets, int64_t N, int64_t ignore_index) {
    int64_t count = 0;
    for (int64_t n = 0; n < N; n++) {
        float logsum = (float)log((double)s[n]);
        lse[n] = m[n] + logsum;
        bool ignored = targets[n] == ignore_index;
        /* (m - x_t) + logsum, as cross_entropy computes it */
        losses[n] = ignored ? 0.0f : (m[n] - tlogit[n]) + logsum;
        count += !ignored;
    }
    return count;
}

static void dlogits_range(void *p, int64_t begin, int64_t end) {
    cls_ctx *c = p;
    for (int64_t n = begin; n < end; n++) {
        const float *x = c->logits + n * c->R;
        float *dx = c->dlogits + n * c->R;
        int64_t t = c->targets[n];
        if (t == c->ignore_index) {
            memset(dx, 0, (size_t)c->R * sizeof(float));
            continue;
        }
        float lse = c->lse[n];
        for (int64_t i = 0; i < c->R; i++) {
            bool valid = table_row(i, c->block_rows, c->block_stride, c->row0) < c->valid_v;
            dx[i] = valid ? c->g * expf(x[i] - lse) : 0.0f;
        }
        int64_t i = slice_row(t, c->blocks, c->block_rows, c->block_stride, c->row0);
        if (i >= 0) dx[i] -= c->g;
    }
}

void cpu_classifier_dlogits_f32(float *dlogits, const float *logits, const float *lse, const int64_t *targets,
                                int64_t N, int64_t blocks, int64_t block_rows, int64_t block_stride, int64_t row0,
                                int64_t valid_v, int64_t ignore_index, const float *dloss, int64_t count) {
    cls_ctx c = {.dlogits = dlogits, .logits = logits, .lse = lse, .targets = targets, .R = blocks * block_rows,
                 .blocks = blocks, .block_rows = block_rows, .block_stride = block_stride, .row0 = row0,
                 .valid_v = valid_v, .ignore_index = ignore_index, .g = count ? dloss[0] / (float)count : 0.0f};
    cpu_parallel_for(N, grain_of(c.R), dlogits_range, &c);
}

/* ---- embedding by slices ---- */

typedef struct {
    float *out;
    const float *in;
    const int64_t *ids;
    int64_t n, dim, blocks, block_rows, block_stride, row0;
} emb_slice_ctx;

static void emb_fwd_range(void *p, int64_t begin, int64_t end) {
    emb_slice_ctx *c = p;
    for (int64_t k = begin; k < end; k++) {
        int64_t i = slice_row(c->ids[k], c->blocks, c->block_rows, c->block_stride, c->row0);
        if (i >= 0) memcpy(c->out + k * c->dim, c->in + i * c->dim, (size_t)c->dim * sizeof(float));
    }
}

void cpu_embedding_slice_forward_f32(float *out, const int64_t *ids, int64_t n, const float *rows, int64_t dim,
                                     int64_t blocks, int64_t block_rows, int64_t block_stride, int64_t row0) {
    emb_slice_ctx c = {out, rows, ids, n, dim, blocks, block_rows, block_stride, row0};   // out (n, dim)
    cpu_parallel_for(n, dim >= 4096 ? 1 : 4096 / (dim > 0 ? dim : 1), emb_fwd_range, &c);
}

/* columns [begin, end) of every id in the slice, in id order: the same sums
 * for any thread count */
static void emb_bwd_range(void *p, int64_t begin, int64_t end) {
    emb_slice_ctx *c = p;
    for (int64_t k = 0; k < c->n; k++) {
        int64_t i = slice_row(c->ids[k], c->blocks, c->block_rows, c->block_stride, c->row0);
        if (i < 0) continue;
        float *dst = c->out + i * c->dim;
        const float *src = c->in + k * c->dim;
        for (int64_t j = begin; j < end; j++) dst[j] += src[j];
    }
}

void cpu_embedding_slice_backward_f32(float *drows, const int64_t *ids, int64_t n, const float *dout, int64_t dim,
                                      int64_t blocks, int64_t block_rows, int64_t block_stride, int64_t row0) {
    memset(drows, 0, (size_t)(blocks * block_rows * dim) * sizeof(float));
    emb_slice_ctx c = {drows, dout, ids, n, dim, blocks, block_rows, block_stride, row0};
    cpu_parallel_for(dim, 64, emb_bwd_range, &c);
}
