/* embedding.c: the embedding lookup and its gradient (the kernels:
 * cpu/embedding.c, cuda/embedding.cu).
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
