/* loss.c: cross-entropy over the last dim, with ignored rows (the kernels:
 * cpu/loss.c, cuda/loss.cu).
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
