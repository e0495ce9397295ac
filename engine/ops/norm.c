/* norm.c: LayerNorm and RMSNorm over the last dim (the kernels: cpu/norm.c,
 * cuda/norm.cu).
 *
 * Each op checks its arguments (messages name the op and every tensor),
 * stages float inputs to contiguous f32 (or runs the device's bf16 kernel),
 * and records a node whose backward does the same in reverse. Backward
 * functions read their inputs from node->in[] and the op's output from
 * node->out[]; node->saved[] holds only what the forward computed on the
 * side (row statistics, lse). */
#include "ops_util.h"
#include "trace.h"
#include <math.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdlib.h>

/* ---- layernorm and RMSNorm over the last dim ---- */

/* A norm's weight or bias (names[i]) must be (C), C the last dim of x. */
static fsdp_status check_norm_params(const char *op, int n, const char *const *names, fsdp_tensor *const *ts,
                                     double eps) {
    int64_t rows, C;
    rows_cols(ts[0], &rows, &C);
    for (int i = 1; i < n; i++) {
        fsdp_tensor *p = ts[i];
        if (!p || (p->ndim == 1 && p->shape[0] == C)) continue;
        if (tensor_numel(p) != C)
            return op_fail(FSDP_ERR_SHAPE, op, n, names, ts, "%s has %lld elements, expected %lld (the last dim of x)",
                           names[i], (long long)tensor_numel(p), (long long)C);
        return op_fail(FSDP_ERR_SHAPE, op, n, names, ts, "%s must be 1-D with %lld elements (the last dim of x)",
                       names[i], (long long)C);
    }
    if (!(eps >= 0))   /* NaN too */
        return op_fail(FSDP_ERR_INVALID, op, n, names, ts, "eps is %g, expected >= 0", eps);
    return FSDP_OK;
}

/* Input i's .grad when an op may write its gradient there and it is
 * unwritten (an FSDP unit's flat gradient before its first gradient), with
 * no side effect; else NULL. */
static fsdp_tensor *unwritten_grad(fsdp_node *node, int i) {
    fsdp_tensor *g = node_grad_peek(node, i, FSDP_BF16);
    return g && g->unwritten ? g : NULL;
}

/* Gradient buffer (dtype) for optional parameter i, or NULL when it needs none. */
static fsdp_status param_grad_buf(fsdp_node *node, int i, int dtype, fsdp_tensor **out) {
    *out = NULL;
    if (!node_needs_grad(node, i)) return FSDP_OK;
    return op_new_as(out, dtype, node->in[i]->ndim, node->in[i]->shape);
}

/* Gives dx and the optional parameter gradients (NULL where none: dx NULL
 * when the kernel added it into x's gradient itself); takes all. */
static fsdp_status give_norm_grads(fsdp_node *node, fsdp_tensor *dx, fsdp_tensor *dw, fsdp_tensor *db) {
    /* op_give_grad takes its argument even when it fails: give all three */
    fsdp_status s1 = dx ? op_give_grad(node, 0, dx) : FSDP_OK;
    fsdp_status s2 = dw ? op_give_grad(node, 1, dw) : FSDP_OK;
    fsdp_status s3 = db ? op_give_grad(node, 2, db) : FSDP_OK;
    return s1 != FSDP_OK ? s1 : s2 != FSDP_OK ? s2 : s3;
}

/* saved[0] mean (rows), saved[1] rstd (rows) */
static fsdp_status layernorm_backward(fsdp_node *node) {
    bool native = BF16_KERNEL(node->in[0], layernorm_backward) != NULL;
    int dt = native ? FSDP_BF16 : FSDP_F32;
    fsdp_tensor *dout, *x = NULL, *w = NULL, *dx = NULL, *dw = NULL, *db = NULL;
    FSDP_TRY(op_grad_out_as(node, 0, dt, &dout));
    if (!dout) return FSDP_OK;
    int64_t rows, cols;
    rows_cols(node->in[0], &rows, &cols);
    fsdp_status st = stage(&x, node->in[0], native);
    if (st == FSDP_OK) st = stage(&w, node->in[1], native);
    /* x's gradient so far (a residual stream's, from the op that used x
     * later) held by nothing else: the kernel adds dx into it, instead of a
     * dx written here and added by the tape (a write and two reads less) */
    bool addx = native && KERNELS(node->in[0])->layernorm_backward_addx_bf16;
    fsdp_tensor *held = addx ? node_grad_held(node, 0, FSDP_BF16) : NULL;
    if (st == FSDP_OK && !held) st = op_new_as(&dx, dt, x->ndim, x->shape);
    /* weight and bias whose .grad exists (an FSDP unit's gradient slices):
     * the kernel writes their gradients there when both are unwritten (the
     * unit's first gradient into them), else adds them there; none is made
     * and added */
    fsdp_tensor *write_w = native ? unwritten_grad(node, 1) : NULL, *write_b = native ? unwritten_grad(node, 2) : NULL;
    bool write = (write_w || write_b) && (write_w || !node_needs_grad(node, 1)) &&
                 (write_b || !node_needs_grad(node, 2));
    float beta;
    if (write) {   /* claimed: the kernel below writes every element of them */
        if (write_w) node_grad_target(node, 1, FSDP_BF16, &beta);
        if (write_b) node_grad_target(node, 2, FSDP_BF16, &beta);
    }
    fsdp_tensor *acc_w = native && !write ? node_grad_accumulator(node, 1, FSDP_BF16) : NULL;
    fsdp_tensor *acc_b = native && !write ? node_grad_accumulator(node, 2, FSDP_BF16) : NULL;
    bool in_place = !write && native && KERNELS(node->in[0])->layernorm_backward_acc_bf16 &&
                    (acc_w || !node_needs_grad(node, 1)) && (acc_b || !node_needs_grad(node, 2)) && (acc_w || acc_b);
    if (st == FSDP_OK && !in_place && !write) st = param_grad_buf(node, 1, dt, &dw);
    if (st == FSDP_OK && !in_place && !write) st = param_grad_buf(node, 2, dt, &db);
    void *w_ = w ? tensor_data(w) : NULL, *dw_ = dw ? tensor_data(dw) : NULL, *db_ = db ? tensor_data(db) : NULL;
    if (write) {
        dw_ = write_w ? tensor_data(write_w) : NULL;
        db_ = write_b ? tensor_data(write_b) : NULL;
    }
    if (st == FSDP_OK && held)
        KERNELS(held)->layernorm_backward_addx_bf16(
            tensor_data(held), in_place ? (acc_w ? tensor_data(acc_w) : NULL) : dw_,
            in_place ? (acc_b ? tensor_data(acc_b) : NULL) : db_, tensor_data(dout), tensor_data(x), w_,
            f32p(node->saved[0]), f32p(node->saved[1]), rows, cols, in_place);
    else if (st == FSDP_OK && in_place)
        KERNELS(dx)->layernorm_backward_acc_bf16(tensor_data(dx), acc_w ? tensor_data(acc_w) : NULL,
                                                 acc_b ? tensor_data(acc_b) : NULL, tensor_data(dout), tensor_data(x),
                                                 w_, f32p(node->saved[0]), f32p(node->saved[1]), rows, cols);
    else if (st == FSDP_OK && native)
        KERNELS(dx)->layernorm_backward_bf16(tensor_data(dx), dw_, db_, tensor_data(dout), tensor_data(x), w_,
                                             f32p(node->saved[0]), f32p(node->saved[1]), rows, cols);
    else if (st == FSDP_OK)
        KERNELS(dx)->layernorm_backward_f32(f32p(dx), dw_, db_, f32p(dout), f32p(x), w_, f32p(node->saved[0]),
                                            f32p(node->saved[1]), rows, cols);
    tensor_release(x);
    tensor_release(w);
    tensor_release(dout);
    if (st != FSDP_OK) {
        tensor_release(dx);
        tensor_release(dw);
        tensor_release(db);
        return st;
    }
    return give_norm_grads(node, dx, dw, db);
}

fsdp_status fsdp_layernorm(fsdp_tensor **out, fsdp_tensor *x, fsdp_tensor *weight, fsdp_tensor *bias, double eps) {
    TRACE_OP("layernorm", out);
    const char *op = "fsdp_layernorm", *names[] = {"x", "weight", "bias"};
    fsdp_tensor *ts[] = {x, weight, bias};
    const bool optional[] = {false, true, true};
    FSDP_TRY(op_check(op, out, 3, names, ts, optional));
    FSDP_TRY(op_check_float(op, 3, names, ts));
    FSDP_TRY(check_norm_params(op, 3, names, ts, eps));
    int64_t rows, cols, rshape[1];
    rows_cols(x, &rows, &cols);
    rshape[0] = rows;
    bool native = BF16_KERNEL(x, layernorm_forward) != NULL;
    fsdp_tensor *xs = NULL, *ws = NULL, *bs = NULL, *r = NULL, *mean = NULL, *rstd = NULL;
    fsdp_status st = stage(&xs, x, native);
    if (st == FSDP_OK) st = stage(&ws, weight, native);
    if (st == FSDP_OK) st = stage(&bs, bias, native);
    if (st == FSDP_OK) st = op_new_as(&r, native ? FSDP_BF16 : FSDP_F32, x->ndim, x->shape);
    if (st == FSDP_OK) st = op_new_f32(&mean, 1, rshape);
    if (st == FSDP_OK) st = op_new_f32(&rstd, 1, rshape);
    void *w_ = ws ? tensor_data(ws) : NULL, *b_ = bs ? tensor_data(bs) : NULL;
    if (st == FSDP_OK && native)
        KERNELS(r)->layernorm_forward_bf16(tensor_data(r), f32p(mean), f32p(rstd), tensor_data(xs), w_, b_, rows, cols,
                                           (float)eps);
    else if (st == FSDP_OK)
        KERNELS(r)->layernorm_forward_f32(f32p(r), f32p(mean), f32p(rstd), f32p(xs), w_, b_, rows, cols, (float)eps);
    tensor_release(xs);
    tensor_release(ws);
    tensor_release(bs);
    if (st != FSDP_OK) {
        tensor_release(r);
        tensor_release(mean);
        tensor_release(rstd);
        return st;
    }
    fsdp_tensor *saved[] = {mean, rstd};
    return op_done(out, NULL, r, x->dtype, "layernorm", layernorm_backward, 3, ts, 2, saved);
}

/* saved[0] rstd (rows) */
static fsdp_status rmsnorm_backward(fsdp_node *node) {
    bool native = BF16_KERNEL(node->in[0], rmsnorm_backward) != NULL;
    int dt = native ? FSDP_BF16 : FSDP_F32;
    fsdp_tensor *dout, *x = NULL, *w = NULL, *dx = NULL, *dw = NULL;
    FSDP_TRY(op_grad_out_as(node, 0, dt, &dout));
    if (!dout) return FSDP_OK;
    int64_t rows, cols;
    rows_cols(node->in[0], &rows, &cols);
    fsdp_status st = stage(&x, node->in[0], native);
    if (st == FSDP_OK) st = stage(&w, node->in[1], native);
    if (st == FSDP_OK) st = op_new_as(&dx, dt, x->ndim, x->shape);
    if (st == FSDP_OK) st = param_grad_buf(node, 1, dt, &dw);
    void *w_ = w ? tensor_data(w) : NULL, *dw_ = dw ? tensor_data(dw) : NULL;
    if (st == FSDP_OK && native)
        KERNELS(dx)->rmsnorm_backward_bf16(tensor_data(dx), dw_, tensor_data(dout), tensor_data(x), w_,
                                           f32p(node->saved[0]), rows, cols);
    else if (st == FSDP_OK)
        KERNELS(dx)->rmsnorm_backward_f32(f32p(dx), dw_, f32p(dout), f32p(x), w_, f32p(node->saved[0]), rows, cols);
    tensor_release(x);
    tensor_release(w);
    tensor_release(dout);
    if (st != FSDP_OK) {
        tensor_release(dx);
        tensor_release(dw);
        return st;
    }
    return give_norm_grads(node, dx, dw, NULL);
}

fsdp_status fsdp_rmsnorm(fsdp_tensor **out, fsdp_tensor *x, fsdp_tensor *weight, double eps) {
    TRACE_OP("rmsnorm", out);
    const char *op = "fsdp_rmsnorm", *names[] = {"x", "weight"};
    fsdp_tensor *ts[] = {x, weight};
    const bool optional[] = {false, true};
    FSDP_TRY(op_check(op, out, 2, names, ts, optional));
    FSDP_TRY(op_check_float(op, 2, names, ts));
    FSDP_TRY(check_norm_params(op, 2, names, ts, eps));
    int64_t rows, cols, rshape[1];
    rows_cols(x, &rows, &cols);
    rshape[0] = rows;
    bool native = BF16_KERNEL(x, rmsnorm_forward) != NULL;
    fsdp_tensor *xs = NULL, *ws = NULL, *r = NULL, *rstd = NULL;
    fsdp_status st = stage(&xs, x, native);
    if (st == FSDP_OK) st = stage(&ws, weight, native);
    if (st == FSDP_OK) st = op_new_as(&r, native ? FSDP_BF16 : FSDP_F32, x->ndim, x->shape);
    if (st == FSDP_OK) st = op_new_f32(&rstd, 1, rshape);
    void *w_ = ws ? tensor_data(ws) : NULL;
    if (st == FSDP_OK && native)
        KERNELS(r)->rmsnorm_forward_bf16(tensor_data(r), f32p(rstd), tensor_data(xs), w_, rows, cols, (float)eps);
    else if (st == FSDP_OK)
        KERNELS(r)->rmsnorm_forward_f32(f32p(r), f32p(rstd), f32p(xs), w_, rows, cols, (float)eps);
    tensor_release(xs);
    tensor_release(ws);
    if (st != FSDP_OK) {
        tensor_release(r);
        tensor_release(rstd);
        return st;
    }
    fsdp_tensor *saved[] = {rstd};
    return op_done(out, NULL, r, x->dtype, "rmsnorm", rmsnorm_backward, 2, ts, 1, saved);
}
