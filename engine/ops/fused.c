/* fused.c: a Linear's bias with the op that follows it (after llm.c):
 * fsdp_bias_gelu (GPT-2's MLP: gelu(x W^T + b)) and fsdp_bias_residual (an
 * output projection and the residual add: res + (x W^T + b)), each one pass
 * over the activations where the unfused ops take two or three.
 *
 * x is the matmul's output (..., C) without its bias, bias (C). The device's
 * bias_gelu_* and bias_residual_* entries do the work in the dtype of the
 * tensors; where a device has none for it, the ops are the unfused ones
 * (add, then gelu or add), so the result never depends on which ran beyond
 * the rounding of x + bias (kept in f32 by the fused kernels). */
#include "ops_util.h"
#include "trace.h"
#include "reduce_shape.h"

#define SLOT(name) offsetof(fsdp_device_kernels, name)

typedef void (*bias_gelu_fwd_f32_fn)(float *, const float *, const float *, int64_t, int64_t);
typedef void (*bias_gelu_fwd_bf16_fn)(uint16_t *, const uint16_t *, const uint16_t *, int64_t, int64_t);
typedef void (*bias_gelu_bwd_f32_fn)(float *, float *, const float *, const float *, const float *, int64_t, int64_t,
                                     int);
typedef void (*bias_gelu_bwd_bf16_fn)(uint16_t *, uint16_t *, const uint16_t *, const uint16_t *, const uint16_t *,
                                      int64_t, int64_t, int);
typedef void (*bias_residual_f32_fn)(float *, const float *, const float *, const float *, int64_t, int64_t);
typedef void (*bias_residual_bf16_fn)(uint16_t *, const uint16_t *, const uint16_t *, const uint16_t *, int64_t,
                                      int64_t);

/* The table entry at the f32 or bf16 slot for tensors like t, or NULL. */
static void *entry_for(const fsdp_tensor *t, size_t slot_f32, size_t slot_bf16) {
    size_t slot = t->dtype == FSDP_BF16 ? slot_bf16 : slot_f32;
    void *fn;
    memcpy(&fn, (const char *)KERNELS(t) + slot, sizeof fn);
    return fn;
}

/* x (..., C) float, bias (C) of x's dtype (and res of x's shape and dtype) */
static fsdp_status check_fused(const char *op, void *out, int n, const char *const *names, fsdp_tensor *const *ts) {
    FSDP_TRY(op_check(op, out, n, names, ts, NULL));
    FSDP_TRY(op_check_float(op, n, names, ts));
    const fsdp_tensor *x = ts[0], *b = ts[1];
    if (x->ndim < 1)
        return op_fail(FSDP_ERR_SHAPE, op, n, names, ts, "x must have at least 1 dim (the bias's)");
    int64_t C = x->shape[x->ndim - 1];
    if (b->ndim != 1 || b->shape[0] != C)
        return op_fail(FSDP_ERR_SHAPE, op, n, names, ts, "bias must be 1-D with %lld elements (the last dim of x)",
                       (long long)C);
    if (n > 2) {
        const fsdp_tensor *r = ts[2];
        if (r->ndim != x->ndim || memcmp(r->shape, x->shape, sizeof(int64_t) * (size_t)x->ndim) != 0)
            return op_fail(FSDP_ERR_SHAPE, op, n, names, ts, "res must have the shape of x");
    }
    return FSDP_OK;
}

/* ---- bias + GELU ---- */

static fsdp_status bias_gelu_backward(fsdp_node *node) {
    fsdp_tensor *x = node->in[0], *b = node->in[1];
    int dt = x->dtype;
    bool want_b = node_needs_grad(node, 1);
    fsdp_tensor *dout, *xs = NULL, *bs = NULL, *dx = NULL, *db = NULL;
    FSDP_TRY(op_grad_out_as(node, 0, dt, &dout));
    if (!dout) return FSDP_OK;
    int64_t rows, cols;
    rows_cols(x, &rows, &cols);
    /* the bias gradient goes straight into a .grad that exists (an FSDP
     * unit's gradient slice: written when it is unwritten, else added to),
     * else into a new tensor given to it */
    float beta = 1.0f;
    fsdp_tensor *acc = want_b ? node_grad_target(node, 1, dt, &beta) : NULL;
    fsdp_status st = tensor_contiguous(&xs, x);
    if (st == FSDP_OK) st = tensor_contiguous(&bs, b);
    if (st == FSDP_OK) st = op_new_as(&dx, dt, x->ndim, x->shape);
    if (st == FSDP_OK && want_b && !acc) st = op_new_as(&db, dt, b->ndim, b->shape);
    if (st == FSDP_OK) {
        void *dbias = acc ? tensor_data(acc) : db ? tensor_data(db) : NULL;
        void *fn = entry_for(xs, SLOT(bias_gelu_backward_f32), SLOT(bias_gelu_backward_bf16));
        if (dt == FSDP_BF16)
            ((bias_gelu_bwd_bf16_fn)fn)(tensor_data(dx), dbias, tensor_data(dout), tensor_data(xs), tensor_data(bs),
                                        rows, cols, acc && beta != 0.0f);
        else
            ((bias_gelu_bwd_f32_fn)fn)(tensor_data(dx), dbias, tensor_data(dout), tensor_data(xs), tensor_data(bs),
                                       rows, cols, acc && beta != 0.0f);
    }
    tensor_release(xs);
    tensor_release(bs);
    tensor_release(dout);
    if (st != FSDP_OK) {
        tensor_release(dx);
        tensor_release(db);
        return st;
    }
    if (db) st = node_add_grad(node, 1, db);
    if (st != FSDP_OK) {
        tensor_release(dx);
        return st;
    }
    return op_give_grad(node, 0, dx);
}

/* the unfused ops: gelu(x + bias) */
static fsdp_status bias_then(fsdp_tensor **out, fsdp_tensor *x, fsdp_tensor *bias, fsdp_tensor *res) {
    fsdp_tensor *t;
    FSDP_TRY(fsdp_add(&t, x, bias));
    fsdp_status st = res ? fsdp_add(out, res, t) : fsdp_gelu(out, t);
    tensor_release(t);
    return st;
}

fsdp_status fsdp_bias_gelu(fsdp_tensor **out, fsdp_tensor *x, fsdp_tensor *bias) {
    TRACE_OP("bias_gelu", out);
    const char *names[] = {"x", "bias"};
    fsdp_tensor *ts[] = {x, bias};
    FSDP_TRY(check_fused("fsdp_bias_gelu", out, 2, names, ts));
    void *fwd = entry_for(x, SLOT(bias_gelu_forward_f32), SLOT(bias_gelu_forward_bf16));
    void *bwd = entry_for(x, SLOT(bias_gelu_backward_f32), SLOT(bias_gelu_backward_bf16));
    if (!fwd || !bwd) return bias_then(out, x, bias, NULL);
    int64_t rows, cols;
    rows_cols(x, &rows, &cols);
    fsdp_tensor *xs, *bs = NULL, *r = NULL;
    FSDP_TRY(tensor_contiguous(&xs, x));
    fsdp_status st = tensor_contiguous(&bs, bias);
    if (st == FSDP_OK) st = op_new_as(&r, x->dtype, x->ndim, x->shape);
    if (st == FSDP_OK) {
        if (x->dtype == FSDP_BF16)
            ((bias_gelu_fwd_bf16_fn)fwd)(tensor_data(r), tensor_data(xs), tensor_data(bs), rows, cols);
        else
            ((bias_gelu_fwd_f32_fn)fwd)(tensor_data(r), tensor_data(xs), tensor_data(bs), rows, cols);
    }
    tensor_release(xs);
    tensor_release(bs);
    if (st != FSDP_OK) {
        tensor_release(r);
        return st;
    }
    return op_done(out, NULL, r, x->dtype, "bias_gelu", bias_gelu_backward, 2, ts, 0, NULL);
}

/* ---- bias + residual ---- */

/* d res = d x = dout (one gradient, shared as an add shares it), d bias =
 * dout summed over the rows */
static fsdp_status bias_residual_backward(fsdp_node *node) {
    fsdp_tensor *x = node->in[0], *b = node->in[1], *g, *db = NULL;
    bool native = x->dtype == FSDP_BF16 && BF16_KERNEL(x, sum_dim);   /* else summed in f32 */
    FSDP_TRY(op_grad_out_as(node, 0, native ? FSDP_BF16 : FSDP_F32, &g));
    if (!g) return FSDP_OK;
    fsdp_status st = FSDP_OK;
    if (node_needs_grad(node, 1)) {
        /* into a .grad that exists (an FSDP unit's gradient slice) in one pass */
        fsdp_tensor *acc = native ? node_grad_peek(node, 1, FSDP_BF16) : NULL;
        int64_t rows, cols;
        rows_cols(x, &rows, &cols);
        if (acc && KERNELS(acc)->sum_dim_acc_bf16) {
            float beta;   /* an unwritten .grad is written, else added to */
            node_grad_target(node, 1, FSDP_BF16, &beta);
            if (beta == 0.0f) KERNELS(acc)->sum_dim_bf16(tensor_data(acc), tensor_data(g), 1, rows, cols);
            else KERNELS(acc)->sum_dim_acc_bf16(tensor_data(acc), tensor_data(g), 1, rows, cols);
        } else {
            st = sum_to_shape(&db, g, b->ndim, b->shape);
            if (st == FSDP_OK) st = op_give_grad(node, 1, db);
        }
    }
    for (int i = 0; i < 3 && st == FSDP_OK; i += 2)   /* x and res: the gradient itself */
        if (node_needs_grad(node, i)) {
            tensor_retain(g);
            st = op_give_grad(node, i, g);
        }
    tensor_release(g);
    return st;
}

fsdp_status fsdp_bias_residual(fsdp_tensor **out, fsdp_tensor *x, fsdp_tensor *bias, fsdp_tensor *res) {
    TRACE_OP("bias_residual", out);
    const char *names[] = {"x", "bias", "res"};
    fsdp_tensor *ts[] = {x, bias, res};
    FSDP_TRY(check_fused("fsdp_bias_residual", out, 3, names, ts));
    void *fn = entry_for(x, SLOT(bias_residual_f32), SLOT(bias_residual_bf16));
    if (!fn) return bias_then(out, x, bias, res);
    int64_t rows, cols;
    rows_cols(x, &rows, &cols);
    fsdp_tensor *xs, *bs = NULL, *rs = NULL, *r = NULL;
    FSDP_TRY(tensor_contiguous(&xs, x));
    fsdp_status st = tensor_contiguous(&bs, bias);
    if (st == FSDP_OK) st = tensor_contiguous(&rs, res);
    if (st == FSDP_OK) st = op_new_as(&r, x->dtype, x->ndim, x->shape);
    if (st == FSDP_OK) {
        if (x->dtype == FSDP_BF16)
            ((bias_residual_bf16_fn)fn)(tensor_data(r), tensor_data(xs), tensor_data(bs), tensor_data(rs), rows, cols);
        else
            ((bias_residual_f32_fn)fn)(tensor_data(r), tensor_data(xs), tensor_data(bs), tensor_data(rs), rows, cols);
    }
    tensor_release(xs);
    tensor_release(bs);
    tensor_release(rs);
    if (st != FSDP_OK) {
        tensor_release(r);
        return st;
    }
    return op_done(out, NULL, r, x->dtype, "bias_residual", bias_residual_backward, 3, ts, 0, NULL);
}
