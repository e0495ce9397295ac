/* softmax.c: softmax and log-softmax over the last dim (the kernels:
 * cpu/softmax.c, cuda/softmax.cu).
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
