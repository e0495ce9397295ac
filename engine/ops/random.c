/* random.c: dropout, its mask drawn from (seed, offset) by the counter-based
 * RNG (the kernels: cpu/random.c, cuda/random.cu).
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
