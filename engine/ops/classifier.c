/* classifier.c: the LM head with its loss, and the embedding, by
 * vocabulary chunks (kernels in engine/cpu/classifier.c).
 *
 * A table (V, C) is read a slice at a time: chunk_rows consecutive rows of
 * a plain tensor (a view, nothing copied for f32), or, for a parameter of a
 * sliced unit (sched.c), the same rows of every rank's shard gathered on
 * their own: blocks = N runs of ceil(chunk_rows / N) rows. Each slice's
 * gradient is reduce-scattered as soon as it is computed, so a sliced table
 * is never whole on a rank, nor its gradient. */
#include "ops_util.h"
#include "trace.h"
#include <math.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdlib.h>

typedef struct {
    fsdp_tensor *w;                 /* (V, C) */
    const fsdp_row_slicer *sl;      /* NULL: slices are views of w */
    int64_t V, C;
    int64_t blocks, block_stride;   /* runs per slice, table rows between runs */
    int64_t rows, n_slices;         /* rows per run of a full slice */
} table_slices;

/* The checks every chunked op makes: the table (n = 0) may be a sliced
 * unit's resharded parameter, the other tensors must hold data. */
static fsdp_status check_args(const char *op, void *out, int n, const char *const *names, fsdp_tensor *const *ts,
                              int64_t chunk_rows) {
    fsdp_tensor *rest[4];
    for (int i = 1; i < n; i++) rest[i - 1] = ts[i];
    if (!ts[0]) return fsdp_set_error(FSDP_ERR_INVALID, "%s: %s is NULL", op, names[0]);
    FSDP_TRY(op_check(op, out, n - 1, names + 1, rest, NULL));
    fsdp_tensor *w = ts[0];
    if (!w->storage->data && w->storage->nbytes > 0 && !w->storage->slicer)
        return op_fail(FSDP_ERR_STATE, op, n, names, ts, "%s is a parameter of a resharded unit; run it inside the "
                    "unit's forward, or unshard the unit first", names[0]);
    if (tensor_device(w) != fsdp_op_device())
        return op_fail(FSDP_ERR_DEVICE, op, n, names, ts, "tensors on different devices");
    if (!device_kernels(tensor_device(w)))
        return op_fail(FSDP_ERR_UNSUPPORTED, op, n, names, ts, "no %s kernels in this build",
                    fsdp_device_name(tensor_device(w)));
    if (!KERNELS(w)->classifier_lse_f32 || !KERNELS(w)->embedding_slice_forward_f32)
        return op_fail(FSDP_ERR_UNSUPPORTED, op, n, names, ts, "the %s device has no chunked-classifier kernels yet; "
                    "use the unchunked head there", fsdp_device_name(tensor_device(w)));
    if (!fsdp_dtype_is_float(w->dtype)) return op_fail(FSDP_ERR_DTYPE, op, n, names, ts, "%s must be f32 or bf16", names[0]);
    if (w->ndim != 2) return op_fail(FSDP_ERR_SHAPE, op, n, names, ts, "%s must be 2-D (V, C)", names[0]);
    if (chunk_rows < 1)
        return op_fail(FSDP_ERR_INVALID, op, n, names, ts, "chunk_rows is %lld, expected a positive row count",
                    (long long)chunk_rows);
    return FSDP_OK;
}

/* At backward time the table's slicer may be gone: the sharded model
 * (its schedule) was freed after the forward, and with it the slices'
 * gathers and reductions; the resharded table has no data either.
 * sliced: the forward read it by slices (the embedding's chunked path
 * always does; the head's did when the table has no data of its own). */
static fsdp_status check_table_alive(const char *op, const char *name, fsdp_tensor *w, bool sliced) {
    fsdp_storage *st = w->storage;
    if (st->slicer || (!sliced && (st->data || st->nbytes == 0))) return FSDP_OK;
    const char *names[] = {name};
    return op_fail(FSDP_ERR_STATE, op, 1, names, &w, "%s belongs to a sharded model that was freed before this "
                   "backward (its schedule, which gathers and reduces the slices, is gone); keep the model until "
                   "the backward, or clear the tape (fsdp.tape_clear) before freeing it", name);
}

static fsdp_status slices_init(table_slices *t, fsdp_tensor *w, int64_t chunk_rows, const char *op) {
    t->w = w;
    t->sl = w->storage->slicer;
    t->V = w->shape[0];
    t->C = w->shape[1];
    if (t->sl) {
        if (w->offset != 0 || !tensor_is_contiguous(w) || t->C < 1 || t->sl->shard_n % t->C != 0)
            return fsdp_set_error(FSDP_ERR_INVALID, "%s: a sliced unit's table must be its only parameter, whole "
                                  "rows per shard (shard of %lld elements, rows of %lld)", op,
                                  (long long)t->sl->shard_n, (long long)t->C);
        t->blocks = t->sl->blocks;
        t->block_stride = t->sl->shard_n / t->C;
        t->rows = (chunk_rows + t->blocks - 1) / t->blocks;
    } else {
        t->blocks = 1;
        t->block_stride = t->V;
        t->rows = chunk_rows;
    }
    if (t->rows > t->block_stride) t->rows = t->block_stride > 0 ? t->block_stride : 1;
    t->n_slices = t->block_stride > 0 ? (t->block_stride + t->rows - 1) / t->rows : 0;
    return FSDP_OK;
}

/* Slice j as f32 (blocks * *br, C) contiguous, its first run's table row *row0. */
static fsdp_status slice_get(const table_slices *t, int64_t j, fsdp_tensor **rows, int64_t *br, int64_t *row0) {
    *row0 = j * t->rows;
    *br = t->block_stride - *row0 < t->rows ? t->block_stride - *row0 : t->rows;
    int64_t shape[2] = {t->blocks * *br, t->C}, strides[2] = {t->C, 1};
    fsdp_tensor *g = NULL;
    if (t->sl) {
        FSDP_TRY(t->sl->gather(t->sl, *row0 * t->C, *br * t->C, &g));
        fsdp_tensor *v = tensor_view(g, 2, shape, strides, g->offset);
        tensor_release(g);
        if (!v) return fsdp_set_error(FSDP_ERR_OOM, "chunked classifier: out of host memory");
        g = v;
    } else {
        g = tensor_view(t->w, 2, shape, t->w->strides, t->w->offset + *row0 * t->w->strides[0]);
        if (!g) return fsdp_set_error(FSDP_ERR_OOM, "chunked classifier: out of host memory");
    }
    fsdp_status st = tensor_as_f32(rows, g);   /* f32 contiguous: g itself */
    tensor_release(g);
    return st;
}

/* The N ids of t64 where host code can read them: in place on the CPU,
 * else copied back into *host (the caller frees it; on a GPU, a host sync;
 * the counting device reads back zeros). */
static fsdp_status ids_on_host(const char *op, fsdp_tensor *t64, const int64_t **p, int64_t **host) {
    int64_t N = tensor_numel(t64);
    *p = tensor_data(t64);
    *host = NULL;
    if (tensor_device(t64) == FSDP_DEVICE_CPU) return FSDP_OK;
    *host = malloc((size_t)(N ? N : 1) * sizeof **host);
    if (!*host) return fsdp_set_error(FSDP_ERR_OOM, "%s: out of host memory", op);
    KERNELS(t64)->copy_to_host(*host, *p, (size_t)N * sizeof **host);
    *p = *host;
    return FSDP_OK;
}

/* Indices (what: "targets" or "ids") in [0, valid_v) or ignore_index; the first bad one named. */
static fsdp_status check_targets(const char *op, int n, const char *const *names, fsdp_tensor *const *ts,
                                 const char *what, fsdp_tensor *t64, int64_t valid_v, int64_t ignore_index) {
    int64_t N = tensor_numel(t64), lo, hi;
    /* values host code gave: their known range decides without a read-back (no host sync on a GPU) */
    if (tensor_device(t64) != FSDP_DEVICE_CPU && tensor_host_range(t64, &lo, &hi) && lo >= 0 && hi < valid_v)
        return FSDP_OK;
    const int64_t *p;
    int64_t *host = NULL;
    FSDP_TRY(ids_on_host(op, t64, &p, &host));
    fsdp_status st = FSDP_OK;
    for (int64_t i = 0; i < N && st == FSDP_OK; i++)
        if ((p[i] < 0 || p[i] >= valid_v) && p[i] != ignore_index)
            st = op_fail(FSDP_ERR_INDEX, op, n, names, ts,
                      "%s[%lld] is %lld, expected 0 <= %s < %lld%s", what, (long long)i, (long long)p[i], what,
                      (long long)valid_v, ignore_index == INT64_MIN ? " (the rows of the table)"
                                                                    : " (valid_vocab) or ignore_index");
    free(host);
    return st;
}

/* ---- the head and its loss ---- */

/* in: x, weight, targets; saved[0] lse (N); i[0] chunk_rows, i[1] ignore_index, i[2] valid_v, i[3] count */
static fsdp_status chunked_ce_backward(fsdp_node *node) {
    bool need_x = node_needs_grad(node, 0), need_w = node_needs_grad(node, 1);
    if (!need_x && !need_w) return FSDP_OK;
    fsdp_tensor *dloss = NULL, *x32 = NULL, *t64 = NULL, *dx = NULL, *dw = NULL;
    FSDP_TRY(op_grad_out_f32(node, 0, &dloss));
    if (!dloss) return FSDP_OK;
    table_slices t;
    const char *op = "fsdp_chunked_cross_entropy backward";
    fsdp_status st = check_table_alive(op, "weight", node->in[1], false);
    if (st != FSDP_OK) {
        tensor_release(dloss);
        return st;
    }
    st = slices_init(&t, node->in[1], node->i[0], op);
    int64_t N = node->in[0]->shape[0], C = t.C;
    if (st == FSDP_OK) st = tensor_as_f32(&x32, node->in[0]);
    if (st == FSDP_OK) st = tensor_as_i64(&t64, node->in[2]);
    if (st == FSDP_OK && need_x) st = tensor_new(&dx, FSDP_F32, 2, node->in[0]->shape, fsdp_op_device(),
                                                 fsdp_default_tag(), true);
    /* a plain table's gradient is whole (the unsharded model's), slices write their rows */
    if (st == FSDP_OK && need_w && !t.sl)
        st = tensor_new(&dw, FSDP_F32, 2, t.w->shape, fsdp_op_device(), FSDP_TAG_GRAD, false);
    const fsdp_device_kernels *k = device_kernels(fsdp_op_device());
    for (int64_t j = 0; st == FSDP_OK && j < t.n_slices; j++) {
        fsdp_tensor *rows = NULL, *lg = NULL, *dws = NULL;
        int64_t br, row0;
        st = slice_get(&t, j, &rows, &br, &row0);
        int64_t R = t.blocks * br, lshape[2] = {N, R}, wshape[2] = {R, C};
        if (st == FSDP_OK) st = op_new_f32(&lg, 2, lshape);   // (N, R)
        if (st == FSDP_OK) {
            k->matmul_f32(f32p(lg), f32p(x32), f32p(rows), 1, N, R, C, 0, 1, 1.0f, 0.0f, 0, 0, 0);
            k->classifier_dlogits_f32(f32p(lg), f32p(lg), f32p(node->saved[0]), tensor_data(t64), N, t.blocks, br,
                                      t.block_stride, row0, node->i[2], node->i[1], f32p(dloss), node->i[3]);
            if (need_x)   // dx += dlogits (N, R) @ rows (R, C)
                k->matmul_f32(f32p(dx), f32p(lg), f32p(rows), 1, N, C, R, 0, 0, 1.0f, 1.0f, 0, 0, 0);
        }
        if (st == FSDP_OK && need_w) {   // dW_slice (R, C) = dlogits^T @ x
            if (t.sl) st = tensor_new(&dws, FSDP_F32, 2, wshape, fsdp_op_device(), FSDP_TAG_GRAD, false);
            float *dst = t.sl ? (st == FSDP_OK ? f32p(dws) : NULL) : f32p(dw) + row0 * C;
            if (st == FSDP_OK) k->matmul_f32(dst, f32p(lg), f32p(x32), 1, R, C, N, 1, 0, 1.0f, 0.0f, 0, 0, 0);
            tensor_release(lg);
            lg = NULL;   /* the logits go before the reduction needs its buffers */
            if (st == FSDP_OK && t.sl) st = t.sl->reduce(t.sl, row0 * C, br * C, dws);
        }
        tensor_release(dws);
        tensor_release(lg);
        tensor_release(rows);
    }
    tensor_release(dloss);
    tensor_release(x32);
    tensor_release(t64);
    if (st != FSDP_OK) {
        tensor_release(dx);
        tensor_release(dw);
        return st;
    }
    if (dx) st = op_give_grad(node, 0, dx);
    if (dw) {
        if (st == FSDP_OK) st = op_give_grad(node, 1, dw);
        else tensor_release(dw);
    }
    return st;
}

fsdp_status fsdp_chunked_cross_entropy(fsdp_tensor **out, fsdp_tensor *x, fsdp_tensor *weight, fsdp_tensor *targets,
                                       int64_t chunk_rows, int64_t ignore_index, int64_t valid_vocab) {
    TRACE_OP("chunked_cross_entropy", out);
    const char *op = "fsdp_chunked_cross_entropy", *names[] = {"weight", "x", "targets"};
    fsdp_tensor *ts[] = {weight, x, targets};
    FSDP_TRY(check_args(op, out, 3, names, ts, chunk_rows));
    if (!fsdp_dtype_is_float(x->dtype) || x->dtype != weight->dtype)
        return op_fail(FSDP_ERR_DTYPE, op, 3, names, ts, "x must be f32 or bf16, the dtype of weight");
    if (!dtype_is_index(targets->dtype)) return op_fail(FSDP_ERR_DTYPE, op, 3, names, ts, "targets must be i32, i64 or u16");
    if (x->ndim != 2 || x->shape[1] != weight->shape[1])
        return op_fail(FSDP_ERR_SHAPE, op, 3, names, ts, "x must be 2-D (N, C) with C = %lld (the columns of weight)",
                    (long long)weight->shape[1]);
    int64_t N = x->shape[0], V = weight->shape[0];
    if (targets->ndim != 1 || targets->shape[0] != N)
        return op_fail(FSDP_ERR_SHAPE, op, 3, names, ts, "targets must be 1-D with %lld elements (the rows of x)",
                    (long long)N);
    if (valid_vocab < 0 || valid_vocab > V)
        return op_fail(FSDP_ERR_INVALID, op, 3, names, ts, "valid_vocab is %lld, expected 0..%lld (0 = all rows)",
                    (long long)valid_vocab, (long long)V);
    int64_t valid_v = valid_vocab ? valid_vocab : V, nshape[1] = {N};
    table_slices t;
    FSDP_TRY(slices_init(&t, weight, chunk_rows, op));
    fsdp_tensor *t64 = NULL, *x32 = NULL, *m = NULL, *s = NULL, *tl = NULL, *lse = NULL, *losses = NULL, *r = NULL;
    FSDP_TRY(tensor_as_i64(&t64, targets));
    fsdp_status st = check_targets(op, 3, names, ts, "targets", t64, valid_v, ignore_index);
    if (st == FSDP_OK) st = tensor_as_f32(&x32, x);
    if (st == FSDP_OK) st = op_new_f32(&m, 1, nshape);
    if (st == FSDP_OK) st = tensor_new(&s, FSDP_F32, 1, nshape, fsdp_op_device(), fsdp_default_tag(), true);
    if (st == FSDP_OK) st = tensor_new(&tl, FSDP_F32, 1, nshape, fsdp_op_device(), fsdp_default_tag(), true);
    const fsdp_device_kernels *k = device_kernels(fsdp_op_device());
    if (st == FSDP_OK) k->fill_f32(f32p(m), -INFINITY, N);
    for (int64_t j = 0; st == FSDP_OK && j < t.n_slices; j++) {
        fsdp_tensor *rows = NULL, *lg = NULL;
        int64_t br, row0;
        st = slice_get(&t, j, &rows, &br, &row0);
        int64_t R = t.blocks * br, lshape[2] = {N, R};
        if (st == FSDP_OK) st = op_new_f32(&lg, 2, lshape);   // (N, R)
        if (st == FSDP_OK) {
            k->matmul_f32(f32p(lg), f32p(x32), f32p(rows), 1, N, R, t.C, 0, 1, 1.0f, 0.0f, 0, 0, 0);
            k->classifier_lse_f32(f32p(m), f32p(s), f32p(tl), f32p(lg), tensor_data(t64), N, t.blocks, br,
                                  t.block_stride, row0, valid_v, ignore_index);
        }
        tensor_release(lg);
        tensor_release(rows);
    }
    if (st == FSDP_OK) st = op_new_f32(&lse, 1, nshape);
    if (st == FSDP_OK) st = op_new_f32(&losses, 1, nshape);
    if (st == FSDP_OK) st = op_new_f32(&r, 0, NULL);
    int64_t count = 0;
    if (st == FSDP_OK) {
        count = k->classifier_finish_f32(f32p(lse), f32p(losses), f32p(m), f32p(s), f32p(tl), tensor_data(t64), N,
                                         ignore_index);
        float mean = count ? (float)(k->sum_all_f32(f32p(losses), N) / (double)count) : 0.0f;
        k->fill_f32(f32p(r), mean, 1);
    }
    tensor_release(t64);
    tensor_release(x32);
    tensor_release(m);
    tensor_release(s);
    tensor_release(tl);
    tensor_release(losses);
    if (st != FSDP_OK) {
        tensor_release(lse);
        tensor_release(r);
        return st;
    }
    fsdp_tensor *in[] = {x, weight, targets}, *saved[] = {lse};
    fsdp_node *node = NULL;
    FSDP_TRY(op_done(out, &node, r, x->dtype, "chunked_cross_entropy", chunked_ce_backward, 3, in, 1, saved));
    if (node) {
        node->i[0] = chunk_rows;
        node->i[1] = ignore_index;
        node->i[2] = valid_v;
        node->i[3] = count;
    }
    return FSDP_OK;
}

/* ---- the embedding ---- */

/* in: table, ids; i[0] chunk_rows */
static fsdp_status chunked_embedding_backward(fsdp_node *node) {
    if (!node_needs_grad(node, 0)) return FSDP_OK;
    fsdp_tensor *dout = NULL, *ids = NULL;
    FSDP_TRY(op_grad_out_f32(node, 0, &dout));
    if (!dout) return FSDP_OK;
    table_slices t;
    const char *op = "fsdp_chunked_embedding backward";
    fsdp_status st = check_table_alive(op, "table", node->in[0], true);
    if (st != FSDP_OK) {
        tensor_release(dout);
        return st;
    }
    st = slices_init(&t, node->in[0], node->i[0], op);
    if (st == FSDP_OK) st = tensor_as_i64(&ids, node->in[1]);
    const fsdp_device_kernels *k = device_kernels(fsdp_op_device());
    int64_t n = ids ? tensor_numel(ids) : 0;
    /* no gather: the embedding's gradient needs only the ids and dout */
    for (int64_t j = 0; st == FSDP_OK && j < t.n_slices; j++) {
        int64_t row0 = j * t.rows, br = t.block_stride - row0 < t.rows ? t.block_stride - row0 : t.rows;
        int64_t shape[2] = {t.blocks * br, t.C};
        fsdp_tensor *drows = NULL;
        st = tensor_new(&drows, FSDP_F32, 2, shape, fsdp_op_device(), FSDP_TAG_GRAD, false);
        if (st == FSDP_OK) {
            k->embedding_slice_backward_f32(f32p(drows), tensor_data(ids), n, f32p(dout), t.C, t.blocks, br,
                                            t.block_stride, row0);
            st = t.sl->reduce(t.sl, row0 * t.C, br * t.C, drows);
        }
        tensor_release(drows);
    }
    tensor_release(ids);
    tensor_release(dout);
    return st;
}

fsdp_status fsdp_chunked_embedding(fsdp_tensor **out, fsdp_tensor *table, fsdp_tensor *ids, int64_t chunk_rows) {
    const char *op = "fsdp_chunked_embedding", *names[] = {"table", "ids"};
    fsdp_tensor *ts[] = {table, ids};
    FSDP_TRY(check_args(op, out, 2, names, ts, chunk_rows));
    if (!table->storage->slicer) return fsdp_embedding(out, table, ids);   /* a whole table: the plain op */
    TRACE_OP("chunked_embedding", out);
    if (!dtype_is_index(ids->dtype)) return op_fail(FSDP_ERR_DTYPE, op, 2, names, ts, "ids must be i32, i64 or u16");
    if (ids->ndim + 1 > FSDP_MAX_DIMS)
        return op_fail(FSDP_ERR_SHAPE, op, 2, names, ts, "ids has %d dims; the output would have more than %d",
                    ids->ndim, FSDP_MAX_DIMS);
    table_slices t;
    FSDP_TRY(slices_init(&t, table, chunk_rows, op));
    fsdp_tensor *ids64 = NULL, *res = NULL;
    FSDP_TRY(tensor_as_i64(&ids64, ids));
    fsdp_status st = check_targets(op, 2, names, ts, "ids", ids64, t.V, INT64_MIN);   /* (INT64_MIN: none skipped) */
    if (st != FSDP_OK) {
        tensor_release(ids64);
        return st;
    }
    int64_t oshape[FSDP_MAX_DIMS], n = tensor_numel(ids64);
    memcpy(oshape, ids->shape, sizeof(int64_t) * (size_t)ids->ndim);
    oshape[ids->ndim] = t.C;
    st = op_new_f32(&res, ids->ndim + 1, oshape);
    const fsdp_device_kernels *k = device_kernels(fsdp_op_device());
    for (int64_t j = 0; st == FSDP_OK && j < t.n_slices; j++) {
        fsdp_tensor *rows = NULL;
        int64_t br, row0;
        st = slice_get(&t, j, &rows, &br, &row0);
        if (st == FSDP_OK)
            k->embedding_slice_forward_f32(f32p(res), tensor_data(ids64), n, f32p(rows), t.C, t.blocks, br,
                                           t.block_stride, row0);
        tensor_release(rows);
    }
    tensor_release(ids64);
    if (st != FSDP_OK) {
        tensor_release(res);
        return st;
    }
    fsdp_node *node = NULL;
    FSDP_TRY(op_done(out, &node, res, table->dtype, "chunked_embedding", chunked_embedding_backward, 2, ts, 0, NULL));
    if (node) node->i[0] = chunk_rows;
    return FSDP_OK;
}

/* ---- logits without gradients ---- */

fsdp_status fsdp_chunked_logits(fsdp_tensor **out, fsdp_tensor *x, fsdp_tensor *weight, int64_t chunk_rows) {
    TRACE_OP("chunked_logits", out);
    const char *op = "fsdp_chunked_logits", *names[] = {"weight", "x"};
    fsdp_tensor *ts[] = {weight, x};
    FSDP_TRY(check_args(op, out, 2, names, ts, chunk_rows));
    if (!fsdp_dtype_is_float(x->dtype) || x->dtype != weight->dtype)
        return op_fail(FSDP_ERR_DTYPE, op, 2, names, ts, "x must be f32 or bf16, the dtype of weight");
    if (x->ndim != 2 || x->shape[1] != weight->shape[1])
        return op_fail(FSDP_ERR_SHAPE, op, 2, names, ts, "x must be 2-D (N, C) with C = %lld (the columns of weight)",
                    (long long)weight->shape[1]);
    fsdp_tensor *in[] = {x, weight};
    if (tape_wants(2, in))
        return op_fail(FSDP_ERR_STATE, op, 2, names, ts, "has no gradient; train with fsdp_chunked_cross_entropy, or "
                    "call it with gradients disabled (no_grad)");
    table_slices t;
    FSDP_TRY(slices_init(&t, weight, chunk_rows, op));
    int64_t N = x->shape[0], V = t.V, oshape[2] = {N, V};
    fsdp_tensor *x32 = NULL, *res = NULL;
    FSDP_TRY(tensor_as_f32(&x32, x));
    fsdp_status st = op_new_f32(&res, 2, oshape);
    const fsdp_device_kernels *k = device_kernels(fsdp_op_device());
    for (int64_t j = 0; st == FSDP_OK && j < t.n_slices; j++) {
        fsdp_tensor *rows = NULL, *lg = NULL;
        int64_t br, row0;
        st = slice_get(&t, j, &rows, &br, &row0);
        int64_t R = t.blocks * br, lshape[2] = {N, R};
        if (st == FSDP_OK) st = op_new_f32(&lg, 2, lshape);
        if (st == FSDP_OK) k->matmul_f32(f32p(lg), f32p(x32), f32p(rows), 1, N, R, t.C, 0, 1, 1.0f, 0.0f, 0, 0, 0);
        /* run b of the slice holds table rows b * block_stride + row0 ..: those columns of out (none past V) */
        for (int64_t b = 0; st == FSDP_OK && b < t.blocks; b++) {
            int64_t col = b * t.block_stride + row0, w = col >= V ? 0 : (V - col < br ? V - col : br);
            if (w <= 0) continue;
            int64_t shape[2] = {N, w}, dst_strides[2] = {V, 1}, src_strides[2] = {R, 1};
            k->copy_strided(f32p(res) + col, dst_strides, f32p(lg) + b * br, src_strides, 2, shape, sizeof(float));
        }
        tensor_release(lg);
        tensor_release(rows);
    }
    tensor_release(x32);
    if (st != FSDP_OK) {
        tensor_release(res);
        return st;
    }
    return op_finish(out, res, x->dtype);
}

/* ---- the whole-vocabulary head with its loss (the fused classifier) ---- */

/* Checks targets (i64) as fsdp_cross_entropy does and counts the rows not
 * ignored. The host knows the count without reading the targets back when
 * their host range holds only valid ids (every row counts); otherwise they
 * are read once, for the check and the count together (on a GPU that read
 * is the check's own host sync; fsdp_cross_entropy reads them alike). */
static fsdp_status check_count_targets(const char *op, int n, const char *const *names, fsdp_tensor *const *ts,
                                       fsdp_tensor *t64, int64_t valid_v, int64_t ignore_index, int64_t *count) {
    int64_t N = tensor_numel(t64), lo, hi;
    if (tensor_host_range(t64, &lo, &hi) && lo >= 0 && hi < valid_v && (ignore_index < lo || ignore_index > hi)) {
        *count = N;
        return FSDP_OK;
    }
    const int64_t *p;
    int64_t *host = NULL;
    FSDP_TRY(ids_on_host(op, t64, &p, &host));
    fsdp_status st = FSDP_OK;
    int64_t c = 0;
    for (int64_t i = 0; i < N && st == FSDP_OK; i++) {
        if (p[i] == ignore_index) continue;
        if (p[i] < 0 || p[i] >= valid_v)
            st = op_fail(FSDP_ERR_INDEX, op, n, names, ts,
                         "targets[%lld] is %lld, expected 0 <= target < %lld (valid_vocab) or ignore_index %lld",
                         (long long)i, (long long)p[i], (long long)valid_v, (long long)ignore_index);
        c++;
    }
    free(host);
    *count = c;
    return st;
}

/* out = grad * dloss where dloss (one element, out's dtype) is a device value:
 * the backward of a loss whose gradient the host does not know (a pass over
 * the (N, V) dlogits, which a known gradient folds into the GEMMs instead). */
static fsdp_status scale_by_device_scalar(fsdp_tensor **out, fsdp_tensor *grad, fsdp_tensor *dloss) {
    const int64_t zero[2] = {0, 0};
    const fsdp_device_kernels *k = KERNELS(grad);
    if (grad->dtype == FSDP_BF16 && dloss->dtype == FSDP_BF16 && k->binary_bf16) {
        FSDP_TRY(tensor_new(out, FSDP_BF16, 2, grad->shape, fsdp_op_device(), fsdp_default_tag(), false));
        k->binary_bf16(FSDP_MUL, tensor_data(*out), tensor_data(grad), grad->strides, tensor_data(dloss), zero, 2,
                       grad->shape);
        return FSDP_OK;
    }
    fsdp_tensor *g32 = NULL, *d32 = NULL, *r = NULL;
    fsdp_status st = tensor_as_f32(&g32, grad);
    if (st == FSDP_OK) st = tensor_as_f32(&d32, dloss);
    if (st == FSDP_OK) st = op_new_f32(&r, 2, grad->shape);
    if (st == FSDP_OK) k->binary_f32(FSDP_MUL, f32p(r), f32p(g32), g32->strides, f32p(d32), zero, 2, grad->shape);
    tensor_release(g32);
    tensor_release(d32);
    if (st != FSDP_OK) {
        tensor_release(r);
        return st;
    }
    return op_finish(out, r, grad->dtype);
}

/* in: x, weight, targets; i[0..6] the logits' matmul (fsdp_matmul's layout:
 * 0, 1, 1, N, V, C, 1); saved[0] dlogits (N, V) for a loss gradient of one,
 * written over the logits by the forward. The backward reads only them: the
 * loss's gradient goes into the GEMMs' alpha when the host knows it (the one
 * of loss:backward(), or that scaled by a constant), else one pass scales
 * the dlogits first. */
static fsdp_status classifier_ce_backward(fsdp_node *node) {
    fsdp_tensor *dloss = node_grad_out(node, 0), *dl = node->saved[0], *scaled = NULL;
    if (!dloss || !dl) return FSDP_OK;
    double v;
    float alpha = 1.0f;
    fsdp_status st = FSDP_OK;
    if (tape_known_value(dloss, &v)) alpha = (float)v;
    else st = scale_by_device_scalar(&scaled, dl, dloss);
    if (st == FSDP_OK) st = matmul_grads(node, scaled ? scaled : dl, alpha);
    tensor_release(scaled);
    node->saved[0] = NULL;   /* the (N, V) buffer goes now, before the nodes below run */
    tensor_release(dl);
    return st;
}

fsdp_status fsdp_classifier_cross_entropy(fsdp_tensor **out, fsdp_tensor *x, fsdp_tensor *weight,
                                          fsdp_tensor *targets, int64_t ignore_index, int64_t valid_vocab) {
    TRACE_OP("classifier_cross_entropy", out);
    const char *op = "fsdp_classifier_cross_entropy", *names[] = {"x", "weight", "targets"};
    fsdp_tensor *ts[] = {x, weight, targets};
    FSDP_TRY(op_check(op, out, 3, names, ts, NULL));
    FSDP_TRY(op_check_float(op, 2, names, ts));
    if (!dtype_is_index(targets->dtype)) return op_fail(FSDP_ERR_DTYPE, op, 3, names, ts, "targets must be i32, i64 or u16");
    if (x->ndim != 2 || weight->ndim != 2 || x->shape[1] != weight->shape[1])
        return op_fail(FSDP_ERR_SHAPE, op, 3, names, ts, "x must be 2-D (N, C) and weight 2-D (V, C), the same C");
    int64_t N = x->shape[0], V = weight->shape[0], C = x->shape[1];
    if (targets->ndim != 1 || targets->shape[0] != N)
        return op_fail(FSDP_ERR_SHAPE, op, 3, names, ts, "targets must be 1-D with %lld elements (the rows of x)",
                       (long long)N);
    if (valid_vocab < 0 || valid_vocab > V)
        return op_fail(FSDP_ERR_INVALID, op, 3, names, ts, "valid_vocab is %lld, expected 0..%lld (0 = all rows)",
                       (long long)valid_vocab, (long long)V);
    const fsdp_device_kernels *k = KERNELS(x);
    fsdp_tensor *grads_of[] = {x, weight};
    bool train = tape_wants(2, grads_of), bf16 = x->dtype == FSDP_BF16;
    if (train && !(bf16 ? k->cross_entropy_fused_bf16 != NULL : k->cross_entropy_fused_f32 != NULL))
        return op_fail(FSDP_ERR_UNSUPPORTED, op, 3, names, ts, "the %s device has no fused classifier kernel for %s",
                       fsdp_device_name(tensor_device(x)), bf16 ? "bf16" : "f32");
    int64_t valid_v = valid_vocab ? valid_vocab : V, nshape[1] = {N}, count = 0;
    fsdp_tensor *t64 = NULL, *logits = NULL, *l32 = NULL, *losses = NULL, *lse = NULL, *r = NULL;
    FSDP_TRY(tensor_as_i64(&t64, targets));
    fsdp_status st = check_count_targets(op, 3, names, ts, t64, valid_v, ignore_index, &count);
    if (st == FSDP_OK) {   /* logits (N, V) = x @ weight^T: fsdp_matmul's GEMM, not recorded */
        int was = 1;
        fsdp_set_grad_enabled(0, &was);
        st = fsdp_matmul(&logits, x, weight, 0, 1);
        fsdp_set_grad_enabled(was, NULL);
        fsdp_set_op_device(tensor_device(x));
    }
    if (st == FSDP_OK) st = op_new_f32(&losses, 1, nshape);
    if (st == FSDP_OK && train) {   /* losses, and dlogits over the logits, in one pass */
        if (bf16) k->cross_entropy_fused_bf16(f32p(losses), tensor_data(logits), tensor_data(t64), N, V, valid_v,
                                              ignore_index, count);
        else k->cross_entropy_fused_f32(f32p(losses), f32p(logits), tensor_data(t64), N, V, valid_v, ignore_index,
                                        count);
    } else if (st == FSDP_OK) {   /* no gradient: the loss alone, as fsdp_cross_entropy computes it */
        bool native = bf16 && k->cross_entropy_forward_bf16;
        st = native ? FSDP_OK : tensor_as_f32(&l32, logits);
        if (st == FSDP_OK) st = op_new_f32(&lse, 1, nshape);
        if (st == FSDP_OK && native && k->cross_entropy_rows_bf16)
            k->cross_entropy_rows_bf16(f32p(losses), f32p(lse), tensor_data(logits), tensor_data(t64), N, V, valid_v,
                                       ignore_index);
        else if (st == FSDP_OK && native)
            k->cross_entropy_forward_bf16(f32p(losses), f32p(lse), tensor_data(logits), tensor_data(t64), N, V,
                                          valid_v, ignore_index);
        else if (st == FSDP_OK && k->cross_entropy_rows_f32)
            k->cross_entropy_rows_f32(f32p(losses), f32p(lse), f32p(l32), tensor_data(t64), N, V, valid_v,
                                      ignore_index);
        else if (st == FSDP_OK)
            k->cross_entropy_forward_f32(f32p(losses), f32p(lse), f32p(l32), tensor_data(t64), N, V, valid_v,
                                         ignore_index);
    }
    if (st == FSDP_OK) st = op_new_f32(&r, 0, NULL);
    if (st == FSDP_OK) {
        /* the mean over the rows not ignored (no rows: 0); on a device with
         * cross_entropy_rows (a GPU) it stays there, as in fsdp_cross_entropy */
        if (count == 0) k->fill_f32(f32p(r), 0.0f, 1);
        else if (k->cross_entropy_rows_f32) {
            k->sum_dim_f32(f32p(r), f32p(losses), 1, N, 1);
            k->scale_f32(f32p(r), f32p(r), (float)(1.0 / (double)count), 1);
        } else {
            k->fill_f32(f32p(r), (float)(k->sum_all_f32(f32p(losses), N) / (double)count), 1);
        }
    }
    tensor_release(t64);
    tensor_release(l32);
    tensor_release(lse);
    tensor_release(losses);
    if (!train || st != FSDP_OK) {   /* no backward: the logits go now */
        tensor_release(logits);
        logits = NULL;
    }
    if (st != FSDP_OK) {
        tensor_release(r);
        return st;
    }
    fsdp_node *node = NULL;
    fsdp_tensor *saved[] = {logits};
    FSDP_TRY(op_done(out, &node, r, x->dtype, "classifier_cross_entropy", classifier_ce_backward, 3, ts, 1, saved));
    if (node) {
        const int64_t mm[7] = {0, 1, 1, N, V, C, 1};   /* not transposed, transposed, batch, M, N, K, shared */
        for (int i = 0; i < 7; i++) node->i[i] = mm[i];
    }
    return FSDP_OK;
}
