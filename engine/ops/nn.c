/* nn.c: the neural-network ops: activations, softmax, normalization,
 * embedding, cross-entropy and dropout (attention: attention.c).
 *
 * Each op checks its arguments (messages name the op and every tensor),
 * stages float inputs to contiguous f32, runs the CPU kernel into an f32
 * result, converts that back to the input dtype and records a node whose
 * backward does the same in reverse. Backward functions read their inputs
 * from node->in[] and the op's output from node->out[]; node->saved[] holds
 * only what the forward computed on the side (row statistics, lse). */
#include "ops_util.h"
#include "trace.h"
#include <stddef.h>
#include <stdlib.h>
#include <math.h>
#include <stdarg.h>

/* (rows, cols) view over the last dim; a 0-dim tensor is one row of one. */
static void rows_cols(const fsdp_tensor *x, int64_t *rows, int64_t *cols) {
    *cols = x->ndim ? x->shape[x->ndim - 1] : 1;
    *rows = *cols ? tensor_numel(x) / *cols : 0;
}

/* ---- elementwise activations ---- */

typedef void (*unary_fwd_fn)(float *out, const float *x, int64_t n);
typedef void (*unary_bwd_fn)(float *dx, const float *x, const float *dout, int64_t n);
typedef void (*unary_fwd_bf16_fn)(uint16_t *out, const uint16_t *x, int64_t n);
typedef void (*unary_bwd_bf16_fn)(uint16_t *dx, const uint16_t *x, const uint16_t *dout, int64_t n);

/* The helpers below take the kernel as its slot in the device table (an
 * offsetof), so that the device of the tensors picks the implementation;
 * slot16 is the bf16 entry's slot, used when the tensors are bf16 and the
 * device has that (optional) entry. */
#define KERNEL_AT(t, type, slot) (*(const type *)((const char *)KERNELS(t) + (slot)))

/* Is there a bf16 entry at slot16 for tensors like t? */
static bool bf16_at(const fsdp_tensor *t, size_t slot16) {
    return t->dtype == FSDP_BF16 && KERNEL_AT(t, unary_fwd_bf16_fn, slot16) != NULL;
}

static fsdp_status unary_backward_bf16(fsdp_node *node, size_t slot16) {
    fsdp_tensor *dout, *x = NULL, *dx = NULL;
    FSDP_TRY(op_grad_out_as(node, 0, FSDP_BF16, &dout));
    if (!dout) return FSDP_OK;
    fsdp_status st = tensor_contiguous(&x, node->in[0]);
    if (st == FSDP_OK) st = op_new_as(&dx, FSDP_BF16, x->ndim, x->shape);
    if (st == FSDP_OK)
        KERNEL_AT(x, unary_bwd_bf16_fn, slot16)(tensor_data(dx), tensor_data(x), tensor_data(dout), tensor_numel(x));
    tensor_release(x);
    tensor_release(dout);
    return st == FSDP_OK ? op_give_grad(node, 0, dx) : st;
}

static fsdp_status unary_backward(fsdp_node *node, size_t slot, size_t slot16) {
    if (bf16_at(node->in[0], slot16)) return unary_backward_bf16(node, slot16);
    fsdp_tensor *dout, *x = NULL, *dx = NULL;
    FSDP_TRY(op_grad_out_f32(node, 0, &dout));
    if (!dout) return FSDP_OK;
    fsdp_status st = tensor_as_f32(&x, node->in[0]);
    if (st == FSDP_OK) st = op_new_f32(&dx, x->ndim, x->shape);
    if (st == FSDP_OK) KERNEL_AT(x, unary_bwd_fn, slot)(f32p(dx), f32p(x), f32p(dout), tensor_numel(x));
    tensor_release(x);
    tensor_release(dout);
    return st == FSDP_OK ? op_give_grad(node, 0, dx) : st;
}

static fsdp_status unary_forward(fsdp_tensor **out, fsdp_tensor *x, const char *op, const char *name,
                                 size_t slot, size_t slot16, fsdp_backward_fn bwd) {
    const char *names[] = {"x"};
    fsdp_tensor *ts[] = {x}, *xs, *r;
    FSDP_TRY(op_check(op, out, 1, names, ts, NULL));
    FSDP_TRY(op_check_float(op, 1, names, ts));
    bool native = bf16_at(x, slot16);
    FSDP_TRY(native ? tensor_contiguous(&xs, x) : tensor_as_f32(&xs, x));
    fsdp_status st = op_new_as(&r, native ? FSDP_BF16 : FSDP_F32, x->ndim, x->shape);
    if (st == FSDP_OK) {
        if (native) KERNEL_AT(xs, unary_fwd_bf16_fn, slot16)(tensor_data(r), tensor_data(xs), tensor_numel(x));
        else KERNEL_AT(xs, unary_fwd_fn, slot)(f32p(r), f32p(xs), tensor_numel(x));
    }
    tensor_release(xs);
    if (st != FSDP_OK) return st;
    return op_done(out, NULL, r, x->dtype, name, bwd, 1, ts, 0, NULL);
}

#define SLOT(name) offsetof(fsdp_device_kernels, name)

static fsdp_status gelu_backward(fsdp_node *node) {
    return unary_backward(node, SLOT(gelu_backward_f32), SLOT(gelu_backward_bf16));
}
static fsdp_status silu_backward(fsdp_node *node) {
    return unary_backward(node, SLOT(silu_backward_f32), SLOT(silu_backward_bf16));
}

fsdp_status fsdp_gelu(fsdp_tensor **out, fsdp_tensor *x) {
    TRACE_OP("gelu", out);
    return unary_forward(out, x, "fsdp_gelu", "gelu", SLOT(gelu_forward_f32), SLOT(gelu_forward_bf16), gelu_backward);
}

fsdp_status fsdp_silu(fsdp_tensor **out, fsdp_tensor *x) {
    TRACE_OP("silu", out);
    return unary_forward(out, x, "fsdp_silu", "silu", SLOT(silu_forward_f32), SLOT(silu_forward_bf16), silu_backward);
}

/* ---- softmax and log-softmax over the last dim ---- */

typedef void (*row_fwd_fn)(float *out, const float *x, int64_t rows, int64_t cols);
typedef void (*row_bwd_fn)(float *dx, const float *y, const float *dy, int64_t rows, int64_t cols);
typedef void (*row_fwd_bf16_fn)(uint16_t *out, const uint16_t *x, int64_t rows, int64_t cols);
typedef void (*row_bwd_bf16_fn)(uint16_t *dx, const uint16_t *y, const uint16_t *dy, int64_t rows, int64_t cols);

/* Both backwards need only the output y, which the node holds. */
static fsdp_status softmax_like_backward(fsdp_node *node, size_t slot, size_t slot16) {
    bool native = bf16_at(node->in[0], slot16);
    fsdp_tensor *dout, *y = NULL, *dx = NULL;
    FSDP_TRY(native ? op_grad_out_as(node, 0, FSDP_BF16, &dout) : op_grad_out_f32(node, 0, &dout));
    if (!dout) return FSDP_OK;
    int64_t rows, cols;
    rows_cols(node->in[0], &rows, &cols);
    fsdp_status st = native ? tensor_contiguous(&y, node->out[0]) : tensor_as_f32(&y, node->out[0]);
    if (st == FSDP_OK) st = op_new_as(&dx, native ? FSDP_BF16 : FSDP_F32, y->ndim, y->shape);
    if (st == FSDP_OK) {
        if (native)
            KERNEL_AT(y, row_bwd_bf16_fn, slot16)(tensor_data(dx), tensor_data(y), tensor_data(dout), rows, cols);
        else
            KERNEL_AT(y, row_bwd_fn, slot)(f32p(dx), f32p(y), f32p(dout), rows, cols);
    }
    tensor_release(y);
    tensor_release(dout);
    return st == FSDP_OK ? op_give_grad(node, 0, dx) : st;
}

static fsdp_status softmax_like_forward(fsdp_tensor **out, fsdp_tensor *x, const char *op, const char *name,
                                        size_t slot, size_t slot16, fsdp_backward_fn bwd) {
    const char *names[] = {"x"};
    fsdp_tensor *ts[] = {x}, *xs, *r;
    FSDP_TRY(op_check(op, out, 1, names, ts, NULL));
    FSDP_TRY(op_check_float(op, 1, names, ts));
    int64_t rows, cols;
    rows_cols(x, &rows, &cols);
    bool native = bf16_at(x, slot16);
    FSDP_TRY(native ? tensor_contiguous(&xs, x) : tensor_as_f32(&xs, x));
    fsdp_status st = op_new_as(&r, native ? FSDP_BF16 : FSDP_F32, x->ndim, x->shape);
    if (st == FSDP_OK) {
        if (native) KERNEL_AT(xs, row_fwd_bf16_fn, slot16)(tensor_data(r), tensor_data(xs), rows, cols);
        else KERNEL_AT(xs, row_fwd_fn, slot)(f32p(r), f32p(xs), rows, cols);
    }
    tensor_release(xs);
    if (st != FSDP_OK) return st;
    return op_done(out, NULL, r, x->dtype, name, bwd, 1, ts, 0, NULL);
}

static fsdp_status softmax_backward(fsdp_node *node) {
    return softmax_like_backward(node, SLOT(softmax_backward_f32), SLOT(softmax_backward_bf16));
}
static fsdp_status log_softmax_backward(fsdp_node *node) {
    return softmax_like_backward(node, SLOT(log_softmax_backward_f32), SLOT(log_softmax_backward_bf16));
}

fsdp_status fsdp_softmax(fsdp_tensor **out, fsdp_tensor *x) {
    TRACE_OP("softmax", out);
    return softmax_like_forward(out, x, "fsdp_softmax", "softmax", SLOT(softmax_forward_f32),
                                SLOT(softmax_forward_bf16), softmax_backward);
}

fsdp_status fsdp_log_softmax(fsdp_tensor **out, fsdp_tensor *x) {
    TRACE_OP("log_softmax", out);
    return softmax_like_forward(out, x, "fsdp_log_softmax", "log_softmax", SLOT(log_softmax_forward_f32),
                                SLOT(log_softmax_forward_bf16), log_softmax_backward);
}

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

/* Stages t for a kernel: contiguous in its own dtype (native bf16) or as
 * f32; NULL (an absent optional input) passes through. */
static fsdp_status stage(fsdp_tensor **out, fsdp_tensor *t, bool native) {
    *out = NULL;
    if (!t) return FSDP_OK;
    return native ? tensor_contiguous(out, t) : tensor_as_f32(out, t);
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

/* ---- index checks shared by embedding and cross-entropy ---- */

/* "[1,2]": the multi-index of flat position pos in shape, for messages. */
static const char *index_str(int ndim, const int64_t *shape, int64_t pos, char *buf, size_t size) {
    int64_t idx[FSDP_MAX_DIMS];
    for (int d = ndim - 1; d >= 0; d--) {
        idx[d] = shape[d] ? pos % shape[d] : 0;
        pos = shape[d] ? pos / shape[d] : 0;
    }
    return shape_str(ndim, idx, buf, size);
}

/* First position of ids (i64, contiguous) outside [0, limit), or -1, and
 * its value in *value; with has_skip, the value skip (an ignore_index) is
 * allowed too. Ids in device memory are checked from a host copy. */
static int64_t first_bad_index(const fsdp_tensor *ids, int64_t limit, bool has_skip, int64_t skip, int64_t *value) {
    int64_t n = tensor_numel(ids), lo, hi;
    /* values host code gave (a batch, positions): their range decides
     * without reading them back; otherwise, or when it does not, they are read */
    if (tensor_device(ids) != FSDP_DEVICE_CPU && tensor_host_range(ids, &lo, &hi) && lo >= 0 && hi < limit) return -1;
    const int64_t *p = tensor_data(ids);
    int64_t *host = NULL;
    if (tensor_device(ids) != FSDP_DEVICE_CPU) {
        host = malloc((size_t)(n ? n : 1) * sizeof *host);
        if (!host) return -1;
        KERNELS(ids)->copy_to_host(host, p, (size_t)n * sizeof *host);
        p = host;
    }
    int64_t bad = -1;
    for (int64_t i = 0; i < n && bad < 0; i++)
        if ((p[i] < 0 || p[i] >= limit) && !(has_skip && p[i] == skip)) bad = i;
    if (bad >= 0) *value = p[bad];
    free(host);
    return bad;
}

/* ---- embedding ---- */

/* A bf16 table with the device's bf16 kernel: its gradient stays bf16; else
 * f32 throughout. When the table's .grad exists (an FSDP unit's gradient
 * slice, the tied LM head's) only the rows of the ids are added there. */
static fsdp_status embedding_backward(fsdp_node *node) {
    if (!node_needs_grad(node, 0)) return FSDP_OK;
    fsdp_tensor *table = node->in[0];
    bool native = BF16_KERNEL(table, embedding_backward) != NULL;
    const fsdp_device_kernels *k = KERNELS(table);
    fsdp_tensor *acc = native && k->embedding_backward_acc_bf16 ? node_grad_accumulator(node, 0, FSDP_BF16)
                       : !native && table->dtype == FSDP_F32 && k->embedding_backward_acc_f32
                           ? node_grad_accumulator(node, 0, FSDP_F32)
                           : NULL;
    fsdp_tensor *dout, *ids = NULL, *dtable = NULL;
    FSDP_TRY(op_grad_out_as(node, 0, native ? FSDP_BF16 : FSDP_F32, &dout));
    if (!dout) return FSDP_OK;
    int64_t V = table->shape[0], C = table->shape[1];
    fsdp_status st = tensor_as_i64(&ids, node->in[1]);
    int64_t n = ids ? tensor_numel(ids) : 0;
    if (st == FSDP_OK && acc && native) {
        KERNELS(acc)->embedding_backward_acc_bf16(tensor_data(acc), tensor_data(ids), n, tensor_data(dout), C);
    } else if (st == FSDP_OK && acc) {
        KERNELS(acc)->embedding_backward_acc_f32(f32p(acc), tensor_data(ids), n, f32p(dout), C);
    } else if (st == FSDP_OK && native) {
        st = op_new_as(&dtable, FSDP_BF16, 2, table->shape);
        if (st == FSDP_OK) KERNELS(dtable)->embedding_backward_bf16(tensor_data(dtable), V, tensor_data(ids), n,
                                                                    tensor_data(dout), C);
    } else if (st == FSDP_OK) {
        st = op_new_f32(&dtable, 2, table->shape);
        if (st == FSDP_OK) KERNELS(dtable)->embedding_backward_f32(f32p(dtable), V, tensor_data(ids), n, f32p(dout), C);
    }
    tensor_release(ids);
    tensor_release(dout);
    if (st != FSDP_OK || acc) return st;
    return op_give_grad(node, 0, dtable);
}

/* Gathers rows of any element size: a bf16 table is read in place rather
 * than widening all V rows for the few the ids pick. */
static void gather_rows(void *out, const void *table, const int64_t *ids, int64_t n, size_t row_bytes) {
    for (int64_t i = 0; i < n; i++)
        memcpy((char *)out + (size_t)i * row_bytes, (const char *)table + (size_t)ids[i] * row_bytes, row_bytes);
}

fsdp_status fsdp_embedding(fsdp_tensor **out, fsdp_tensor *table, fsdp_tensor *ids) {
    TRACE_OP("embedding", out);
    const char *op = "fsdp_embedding", *names[] = {"table", "ids"};
    fsdp_tensor *ts[] = {table, ids};
    FSDP_TRY(op_check(op, out, 2, names, ts, NULL));
    FSDP_TRY(op_check_float(op, 1, names, ts));
    if (table->ndim != 2)
        return op_fail(FSDP_ERR_SHAPE, op, 2, names, ts, "table must be 2-D (V, C)");
    if (!dtype_is_index(ids->dtype))
        return op_fail(FSDP_ERR_DTYPE, op, 2, names, ts, "ids must be i32, i64 or u16");
    if (ids->ndim + 1 > FSDP_MAX_DIMS)
        return op_fail(FSDP_ERR_SHAPE, op, 2, names, ts, "ids has %d dims; the output would have more than %d",
                       ids->ndim, FSDP_MAX_DIMS);
    int64_t V = table->shape[0], C = table->shape[1], n = tensor_numel(ids);
    fsdp_tensor *ids64 = NULL, *tab = NULL, *res = NULL;
    FSDP_TRY(tensor_as_i64(&ids64, ids));
    fsdp_status st = FSDP_OK;
    int64_t bad_value = 0, bad = first_bad_index(ids64, V, false, 0, &bad_value);
    if (bad >= 0) {
        char pos[160];
        st = op_fail(FSDP_ERR_INDEX, op, 2, names, ts, "ids%s is %lld, expected 0 <= id < %lld (the rows of table)",
                     index_str(ids->ndim, ids->shape, bad, pos, sizeof pos), (long long)bad_value, (long long)V);
    }
    int64_t oshape[FSDP_MAX_DIMS];
    memcpy(oshape, ids->shape, sizeof(int64_t) * (size_t)ids->ndim);
    oshape[ids->ndim] = C;
    if (st == FSDP_OK) st = tensor_contiguous(&tab, table);
    /* the output is made in the table's dtype directly: nothing to convert */
    if (st == FSDP_OK)
        st = tensor_new(&res, table->dtype, ids->ndim + 1, oshape, tensor_device(table), fsdp_default_tag(), false);
    if (st == FSDP_OK) {
        if (table->dtype == FSDP_F32)
            KERNELS(res)->embedding_forward_f32(f32p(res), tensor_data(ids64), n, f32p(tab), C);
        else if (tensor_device(table) == FSDP_DEVICE_CPU)
            gather_rows(tensor_data(res), tensor_data(tab), tensor_data(ids64), n,
                        (size_t)C * fsdp_dtype_size(table->dtype));
        else if (BF16_KERNEL(table, embedding_forward))   /* the rows as they are, no widened table */
            KERNELS(res)->embedding_forward_bf16(tensor_data(res), tensor_data(ids64), n, tensor_data(tab), C);
        else {   /* another device: widen, gather, narrow */
            fsdp_tensor *t32 = NULL, *r32 = NULL;
            st = tensor_as_f32(&t32, tab);
            if (st == FSDP_OK) st = op_new_f32(&r32, ids->ndim + 1, oshape);
            if (st == FSDP_OK) {
                KERNELS(r32)->embedding_forward_f32(f32p(r32), tensor_data(ids64), n, f32p(t32), C);
                st = fsdp_copy(res, r32);
            }
            tensor_release(t32);
            tensor_release(r32);
        }
    }
    tensor_release(ids64);
    tensor_release(tab);
    if (st != FSDP_OK) {
        tensor_release(res);
        return st;
    }
    /* res is already in its final dtype; F32 makes op_finish pass it through */
    return op_done(out, NULL, res, FSDP_F32, "embedding", embedding_backward, 2, ts, 0, NULL);
}

/* ---- cross-entropy ---- */

/* saved[0] lse (N); i[0] ignore_index, i[1] valid_v, i[2] count of rows not ignored */
static fsdp_status cross_entropy_backward(fsdp_node *node) {
    if (!node_needs_grad(node, 0)) return FSDP_OK;
    fsdp_tensor *dout, *logits = NULL, *targets = NULL, *dx = NULL;
    FSDP_TRY(op_grad_out_f32(node, 0, &dout));
    if (!dout) return FSDP_OK;
    int64_t N = node->in[0]->shape[0], V = node->in[0]->shape[1], count = node->i[2];
    /* the loss is a mean: each row's share of dloss is dloss / count, which the
     * kernel reads where dloss lives (on a GPU: no host read, no sync) */
    bool native = BF16_KERNEL(node->in[0], cross_entropy_backward) != NULL;   /* bf16 logits, bf16 dlogits */
    fsdp_status st = stage(&logits, node->in[0], native);
    if (st == FSDP_OK) st = tensor_as_i64(&targets, node->in[1]);
    if (st == FSDP_OK) st = op_new_as(&dx, native ? FSDP_BF16 : FSDP_F32, 2, node->in[0]->shape);
    if (st == FSDP_OK && native)
        KERNELS(dx)->cross_entropy_backward_bf16(tensor_data(dx), tensor_data(logits), f32p(node->saved[0]),
                                                 tensor_data(targets), N, V, node->i[1], node->i[0], f32p(dout),
                                                 count);
    else if (st == FSDP_OK)
        KERNELS(dx)->cross_entropy_backward_f32(f32p(dx), f32p(logits), f32p(node->saved[0]), tensor_data(targets), N, V,
                                       node->i[1], node->i[0], f32p(dout), count);
    tensor_release(dout);
    tensor_release(logits);
    tensor_release(targets);
    return st == FSDP_OK ? op_give_grad(node, 0, dx) : st;
}

fsdp_status fsdp_cross_entropy(fsdp_tensor **out, fsdp_tensor *logits, fsdp_tensor *targets, int64_t ignore_index,
                               int64_t valid_vocab) {
    TRACE_OP("cross_entropy", out);
    const char *op = "fsdp_cross_entropy", *names[] = {"logits", "targets"};
    fsdp_tensor *ts[] = {logits, targets};
    FSDP_TRY(op_check(op, out, 2, names, ts, NULL));
    FSDP_TRY(op_check_float(op, 1, names, ts));
    if (!dtype_is_index(targets->dtype))
        return op_fail(FSDP_ERR_DTYPE, op, 2, names, ts, "targets must be i32, i64 or u16");
    if (logits->ndim != 2) return op_fail(FSDP_ERR_SHAPE, op, 2, names, ts, "logits must be 2-D (N, V)");
    int64_t N = logits->shape[0], V = logits->shape[1];
    if (targets->ndim != 1 || targets->shape[0] != N)
        return op_fail(FSDP_ERR_SHAPE, op, 2, names, ts, "targets must be 1-D with %lld elements (the rows of logits)",
                       (long long)N);
    if (valid_vocab < 0 || valid_vocab > V)
        return op_fail(FSDP_ERR_INVALID, op, 2, names, ts, "valid_vocab is %lld, expected 0..%lld (0 = all columns)",
                       (long long)valid_vocab, (long long)V);
    int64_t valid_v = valid_vocab ? valid_vocab : V, rshape[1] = {N};
    fsdp_tensor *t64 = NULL, *x32 = NULL, *losses = NULL, *lse = NULL, *r = NULL;
    FSDP_TRY(tensor_as_i64(&t64, targets));
    fsdp_status st = FSDP_OK;
    int64_t bad_value = 0, bad = first_bad_index(t64, valid_v, true, ignore_index, &bad_value);
    if (bad >= 0)
        st = op_fail(FSDP_ERR_INDEX, op, 2, names, ts,
                     "targets[%lld] is %lld, expected 0 <= target < %lld (valid_vocab) or ignore_index %lld",
                     (long long)bad, (long long)bad_value, (long long)valid_v, (long long)ignore_index);
    bool native = BF16_KERNEL(logits, cross_entropy_forward) != NULL;   /* bf16 logits read as they are */
    if (st == FSDP_OK) st = stage(&x32, logits, native);
    if (st == FSDP_OK) st = op_new_f32(&losses, 1, rshape);
    if (st == FSDP_OK) st = op_new_f32(&lse, 1, rshape);
    if (st == FSDP_OK) st = op_new_f32(&r, 0, NULL);
    int64_t count = 0, lo, hi;
    const fsdp_device_kernels *k = KERNELS(logits);
    /* targets whose host range leaves out ignore_index: every row counts,
     * and the mean stays on the device (no value comes back) */
    bool all_rows = tensor_host_range(t64, &lo, &hi) && (ignore_index < lo || ignore_index > hi) &&
                    (native ? k->cross_entropy_rows_bf16 != NULL : k->cross_entropy_rows_f32 != NULL);
    if (st == FSDP_OK && all_rows) {
        count = N;
        if (native)
            k->cross_entropy_rows_bf16(f32p(losses), f32p(lse), tensor_data(x32), tensor_data(t64), N, V, valid_v,
                                       ignore_index);
        else
            k->cross_entropy_rows_f32(f32p(losses), f32p(lse), f32p(x32), tensor_data(t64), N, V, valid_v,
                                      ignore_index);
        if (N > 0) {   /* r = sum(losses) / N */
            k->sum_dim_f32(f32p(r), f32p(losses), 1, N, 1);
            k->scale_f32(f32p(r), f32p(r), (float)(1.0 / (double)N), 1);
        } else {
            k->fill_f32(f32p(r), 0.0f, 1);
        }
    } else if (st == FSDP_OK) {
        if (native)
            count = k->cross_entropy_forward_bf16(f32p(losses), f32p(lse), tensor_data(x32), tensor_data(t64), N, V,
                                                  valid_v, ignore_index);
        else
            count = k->cross_entropy_forward_f32(f32p(losses), f32p(lse), f32p(x32), tensor_data(t64), N, V, valid_v,
                                                 ignore_index);
        /* ignored rows hold 0, so the sum runs over all N; no rows: loss 0 */
        float mean = count ? (float)(k->sum_all_f32(f32p(losses), N) / (double)count) : 0.0f;
        k->fill_f32(f32p(r), mean, 1);
    }
    tensor_release(t64);
    tensor_release(x32);
    tensor_release(losses);
    if (st != FSDP_OK) {
        tensor_release(lse);
        tensor_release(r);
        return st;
    }
    fsdp_node *node = NULL;
    fsdp_tensor *saved[] = {lse};
    FSDP_TRY(op_done(out, &node, r, logits->dtype, "cross_entropy", cross_entropy_backward, 2, ts, 1, saved));
    if (node) {
        node->i[0] = ignore_index;
        node->i[1] = valid_v;
        node->i[2] = count;
    }
    return FSDP_OK;
}

/* ---- dropout ---- */

/* f[0] p, i[0] seed, i[1] offset: the mask is recomputed, never stored */
static fsdp_status dropout_backward(fsdp_node *node) {
    fsdp_tensor *dout, *dx = NULL;
    FSDP_TRY(op_grad_out_f32(node, 0, &dout));
    if (!dout) return FSDP_OK;
    fsdp_status st = op_new_f32(&dx, dout->ndim, dout->shape);
    if (st == FSDP_OK)
        KERNELS(dx)->dropout_f32(f32p(dx), f32p(dout), tensor_numel(dout), (float)node->f[0], (uint64_t)node->i[0],
                        node->i[1]);
    tensor_release(dout);
    return st == FSDP_OK ? op_give_grad(node, 0, dx) : st;
}

fsdp_status fsdp_dropout(fsdp_tensor **out, fsdp_tensor *x, double p, uint64_t seed, int64_t offset) {
    TRACE_OP("dropout", out);
    const char *op = "fsdp_dropout", *names[] = {"x"};
    fsdp_tensor *ts[] = {x}, *x32, *r;
    FSDP_TRY(op_check(op, out, 1, names, ts, NULL));
    FSDP_TRY(op_check_float(op, 1, names, ts));
    /* the kernel works in float: p that rounds to 1 would scale by 1/0 */
    if (!(p >= 0 && p < 1) || (float)p >= 1.0f)
        return op_fail(FSDP_ERR_INVALID, op, 1, names, ts, "p is %.17g, expected 0 <= p < 1", p);
    if (offset < 0) return op_fail(FSDP_ERR_INVALID, op, 1, names, ts, "offset is %lld, expected >= 0", (long long)offset);
    FSDP_TRY(tensor_as_f32(&x32, x));
    fsdp_status st = op_new_f32(&r, x->ndim, x->shape);
    if (st == FSDP_OK) KERNELS(r)->dropout_f32(f32p(r), f32p(x32), tensor_numel(x), (float)p, seed, offset);
    tensor_release(x32);
    if (st != FSDP_OK) return st;
    fsdp_node *node = NULL;
    FSDP_TRY(op_done(out, &node, r, x->dtype, "dropout", dropout_backward, 1, ts, 0, NULL));
    if (node) {
        node->f[0] = p;
        node->i[0] = (int64_t)seed;
        node->i[1] = offset;
    }
    return FSDP_OK;
}
