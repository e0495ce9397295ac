/* activation.c: ReLU, GELU and SiLU, elementwise (the kernels: cpu/activation.c,
 * cuda/activation.cu).
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

/* ---- elementwise activations ---- */

typedef void (*unary_fwd_fn)(float *out, const float *x, int64_t n);
typedef void (*unary_bwd_fn)(float *dx, const float *x, const float *dout, int64_t n);
typedef void (*unary_fwd_bf16_fn)(uint16_t *out, const uint16_t *x, int64_t n);
typedef void (*unary_bwd_bf16_fn)(uint16_t *dx, const uint16_t *x, const uint16_t *dout, int64_t n);

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


static fsdp_status gelu_backward(fsdp_node *node) {
    return unary_backward(node, SLOT(gelu_backward_f32), SLOT(gelu_backward_bf16));
}
static fsdp_status silu_backward(fsdp_node *node) {
    return unary_backward(node, SLOT(silu_backward_f32), SLOT(silu_backward_bf16));
}

static fsdp_status relu_backward(fsdp_node *node) {
    return unary_backward(node, SLOT(relu_backward_f32), SLOT(relu_backward_bf16));
}

fsdp_status fsdp_relu(fsdp_tensor **out, fsdp_tensor *x) {
    TRACE_OP("relu", out);
    return unary_forward(out, x, "fsdp_relu", "relu", SLOT(relu_forward_f32), SLOT(relu_forward_bf16), relu_backward);
}

fsdp_status fsdp_gelu(fsdp_tensor **out, fsdp_tensor *x) {
    TRACE_OP("gelu", out);
    return unary_forward(out, x, "fsdp_gelu", "gelu", SLOT(gelu_forward_f32), SLOT(gelu_forward_bf16), gelu_backward);
}

fsdp_status fsdp_silu(fsdp_tensor **out, fsdp_tensor *x) {
    TRACE_OP("silu", out);
    return unary_forward(out, x, "fsdp_silu", "silu", SLOT(silu_forward_f32), SLOT(silu_forward_bf16), silu_backward);
}
