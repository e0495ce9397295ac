/* attention.c: scaled dot-product attention, from separate q, k, v or from
 * a packed qkv buffer, forward and backward. A bf16 qkv on a device with
 * tensor-core kernels takes the fused flash kernels when they cover the
 * shape (attention_flash_covers), else the batched bf16 GEMMs with a fused
 * causal softmax; anything else unpacks q, k, v to f32.
 * FSDP_CUDA_ATTENTION=gemm sends bf16 to the GEMM path even where flash
 * covers it (to compare the two); =flash, or unset, is the default. */
#include "ops_util.h"
#include "trace.h"
#include <math.h>
#include <stdlib.h>

/* ---- attention ---- */

/* saved[0] lse (B, H, T), saved[1] the output; f[0] scale, i[0] causal */
static fsdp_status attention_backward(fsdp_node *node) {
    fsdp_tensor *dout, *q = NULL, *k = NULL, *v = NULL, *o = NULL, *dq = NULL, *dk = NULL, *dv = NULL;
    FSDP_TRY(op_grad_out_f32(node, 0, &dout));
    if (!dout) return FSDP_OK;
    const int64_t *s = node->in[0]->shape;
    fsdp_status st = tensor_as_f32(&q, node->in[0]);
    if (st == FSDP_OK) st = tensor_as_f32(&k, node->in[1]);
    if (st == FSDP_OK) st = tensor_as_f32(&v, node->in[2]);
    if (st == FSDP_OK) st = tensor_as_f32(&o, node->saved[1]);
    if (st == FSDP_OK) st = op_new_f32(&dq, 4, s);
    if (st == FSDP_OK) st = op_new_f32(&dk, 4, s);
    if (st == FSDP_OK) st = op_new_f32(&dv, 4, s);
    if (st == FSDP_OK)
        KERNELS(dq)->attention_backward_f32(f32p(dq), f32p(dk), f32p(dv), f32p(dout), f32p(q), f32p(k), f32p(v), f32p(o),
                                   f32p(node->saved[0]), s[0], s[1], s[2], s[3], (int)node->i[0],
                                   (float)node->f[0]);
    tensor_release(q);
    tensor_release(k);
    tensor_release(v);
    tensor_release(o);
    tensor_release(dout);
    if (st != FSDP_OK) {
        tensor_release(dq);
        tensor_release(dk);
        tensor_release(dv);
        return st;
    }
    fsdp_status s1 = op_give_grad(node, 0, dq);
    fsdp_status s2 = op_give_grad(node, 1, dk);
    fsdp_status s3 = op_give_grad(node, 2, dv);
    return s1 != FSDP_OK ? s1 : s2 != FSDP_OK ? s2 : s3;
}

fsdp_status fsdp_attention(fsdp_tensor **out, fsdp_tensor *q, fsdp_tensor *k, fsdp_tensor *v, int causal,
                           double scale) {
    TRACE_OP("attention", out);
    const char *op = "fsdp_attention", *names[] = {"q", "k", "v"};
    fsdp_tensor *ts[] = {q, k, v};
    FSDP_TRY(op_check(op, out, 3, names, ts, NULL));
    FSDP_TRY(op_check_float(op, 3, names, ts));
    if (q->ndim != 4) return op_fail(FSDP_ERR_SHAPE, op, 3, names, ts, "q must be 4-D (B, H, T, D)");
    for (int i = 1; i < 3; i++)
        if (ts[i]->ndim != 4 || memcmp(ts[i]->shape, q->shape, 4 * sizeof(int64_t)) != 0)
            return op_fail(FSDP_ERR_SHAPE, op, 3, names, ts, "%s must have the shape of q", names[i]);
    if (isnan(scale)) return op_fail(FSDP_ERR_INVALID, op, 3, names, ts, "scale is NaN");
    const int64_t *s = q->shape;
    if (scale <= 0) scale = s[3] > 0 ? 1.0 / sqrt((double)s[3]) : 1.0;
    int64_t lshape[3] = {s[0], s[1], s[2]};
    fsdp_tensor *q32 = NULL, *k32 = NULL, *v32 = NULL, *r = NULL, *lse = NULL;
    fsdp_status st = tensor_as_f32(&q32, q);
    if (st == FSDP_OK) st = tensor_as_f32(&k32, k);
    if (st == FSDP_OK) st = tensor_as_f32(&v32, v);
    if (st == FSDP_OK) st = op_new_f32(&r, 4, s);
    if (st == FSDP_OK) st = op_new_f32(&lse, 3, lshape);
    if (st == FSDP_OK)
        KERNELS(r)->attention_forward_f32(f32p(r), f32p(lse), f32p(q32), f32p(k32), f32p(v32), s[0], s[1], s[2], s[3],
                                  causal != 0, (float)scale);
    tensor_release(q32);
    tensor_release(k32);
    tensor_release(v32);
    if (st != FSDP_OK) {
        tensor_release(r);
        tensor_release(lse);
        return st;
    }
    fsdp_node *node = NULL;
    fsdp_tensor *res, *saved[] = {lse};
    FSDP_TRY(op_done(&res, &node, r, q->dtype, "attention", attention_backward, 3, ts, 1, saved));
    if (node) {
        node->f[0] = scale;
        node->i[0] = causal != 0;
        /* A second tensor object over the output's storage, not the output
         * itself: the tape's sweep judges a node dead by the references to
         * its outputs, which an extra one here would keep alive forever. */
        node->saved[1] = tensor_view(res, res->ndim, res->shape, res->strides, res->offset);
        if (!node->saved[1]) {
            tensor_release(res);
            return op_fail(FSDP_ERR_OOM, op, 3, names, ts, "out of host memory for a saved view");
        }
    }
    *out = res;
    return FSDP_OK;
}

/* ---- attention from a packed qkv ---- */

/* The fast path's (B, H, T, T) buffers live only while the op or its
 * backward runs, except the probabilities (bf16), which the node keeps.
 * Beyond this many elements the f32 path runs instead (it needs no (T, T)
 * storage at all). */
#define ATTN_QKV_MAX_SCORES ((int64_t)1 << 31)

/* Part `which` (0 q, 1 k, 2 v) of a contiguous qkv (B, T, 3C) as a
 * (B, H, T, D) view. */
static fsdp_tensor *qkv_part(fsdp_tensor *qkv, int which, int64_t H) {
    int64_t B = qkv->shape[0], T = qkv->shape[1], C = qkv->shape[2] / 3, D = C / H;
    int64_t shape[4] = {B, H, T, D}, strides[4] = {T * 3 * C, D, 3 * C, 1};
    return tensor_view(qkv, 4, shape, strides, qkv->offset + which * C);
}

/* A contiguous f32 copy of part `which` of qkv (B, T, 3C), as (B, H, T, D). */
static fsdp_status qkv_part_f32(fsdp_tensor **out, fsdp_tensor *qkv32, int which, int64_t H) {
    fsdp_tensor *v = qkv_part(qkv32, which, H);
    if (!v) return fsdp_set_error(FSDP_ERR_OOM, "fsdp_attention_qkv: out of host memory for a view");
    fsdp_status st = tensor_contiguous(out, v);
    tensor_release(v);
    return st;
}

/* Does the device's packed bf16 path take this call? */
static bool attention_qkv_fast(const fsdp_tensor *qkv, int64_t H) {
    const fsdp_device_kernels *k = KERNELS(qkv);
    if (qkv->dtype != FSDP_BF16 || !k->attention_qkv_forward_bf16 || !k->attention_qkv_backward_bf16) return false;
    int64_t B = qkv->shape[0], T = qkv->shape[1], C3 = qkv->shape[2];
    if (B * H > INT32_MAX || T > INT32_MAX || C3 > INT32_MAX) return false;
    return T == 0 || B * H <= ATTN_QKV_MAX_SCORES / T / T;
}

/* The kernels a packed qkv runs on (node->i[1]) */
enum { ATTN_QKV_F32 = 0, ATTN_QKV_GEMM = 1, ATTN_QKV_FLASH = 2 };

static fsdp_status attention_qkv_path(int *path, fsdp_tensor *qkv, int64_t H, const char *op, const char *const *names,
                                      fsdp_tensor *const *ts) {
    const fsdp_device_kernels *k = KERNELS(qkv);
    bool flash = qkv->dtype == FSDP_BF16 && k->attention_flash_forward_bf16 && k->attention_flash_backward_bf16;
    *path = ATTN_QKV_F32;
    if (flash) {
        const char *want = getenv("FSDP_CUDA_ATTENTION");
        if (want && *want && strcmp(want, "flash") != 0 && strcmp(want, "gemm") != 0)
            return op_fail(FSDP_ERR_INVALID, op, 1, names, ts,
                           "FSDP_CUDA_ATTENTION is \"%s\", expected flash (the default) or gemm", want);
        int64_t B = qkv->shape[0], T = qkv->shape[1], D = qkv->shape[2] / 3 / H;
        if (!(want && strcmp(want, "gemm") == 0) && attention_flash_covers(B, H, T, D)) {
            *path = ATTN_QKV_FLASH;
            return FSDP_OK;
        }
    }
    if (attention_qkv_fast(qkv, H)) *path = ATTN_QKV_GEMM;
    return FSDP_OK;
}

/* A contiguous tensor of t's values at a 16-byte aligned address (the
 * flash kernels' vector accesses): t itself, retained, when it is one. */
static fsdp_status aligned_contiguous(fsdp_tensor **out, fsdp_tensor *t) {
    fsdp_tensor *c = NULL, *a = NULL;
    FSDP_TRY(tensor_contiguous(&c, t));
    if (((uintptr_t)tensor_data(c) & 15u) == 0) {
        *out = c;
        return FSDP_OK;
    }
    fsdp_status st = tensor_new(&a, c->dtype, c->ndim, c->shape, tensor_device(c), fsdp_default_tag(), false);
    if (st == FSDP_OK) st = fsdp_copy(a, c);
    tensor_release(c);
    if (st != FSDP_OK) {
        tensor_release(a);
        return st;
    }
    *out = a;
    return FSDP_OK;
}

static fsdp_status new_scratch(fsdp_tensor **out, int dtype, const int64_t *bhtt) {
    return tensor_new(out, dtype, 4, bhtt, fsdp_op_device(), fsdp_default_tag(), false);
}

/* in[0] qkv; i[0] causal, i[1] the path (ATTN_QKV_*), i[2] H; f[0] scale.
 * GEMM path: saved[0] probs (B, H, T, T). Flash: saved[0] lse (B, H, T),
 * saved[1] the output (B, T, C) bf16. f32 path: saved[0] lse (B, H, T),
 * saved[1] the output as (B, H, T, D) f32. */
static fsdp_status attention_qkv_backward(fsdp_node *node) {
    fsdp_tensor *g = node_grad_out(node, 0), *qkv_in = node->in[0];
    if (!g) return FSDP_OK;
    int64_t B = qkv_in->shape[0], T = qkv_in->shape[1], C = qkv_in->shape[2] / 3, H = node->i[2], D = C / H;
    int causal = (int)node->i[0];
    float scale = (float)node->f[0];
    fsdp_status st;
    if (node->i[1] == ATTN_QKV_FLASH) {
        fsdp_tensor *dout16 = NULL, *dout = NULL, *qkv = NULL, *out = NULL, *dqkv = NULL, *drow = NULL;
        int64_t bht[3] = {B, H, T};
        st = tensor_from_f32(&dout16, g, FSDP_BF16);   /* bf16 contiguous, a copy only when it is not */
        if (st == FSDP_OK) st = aligned_contiguous(&dout, dout16);
        if (st == FSDP_OK) st = aligned_contiguous(&qkv, qkv_in);
        if (st == FSDP_OK) st = aligned_contiguous(&out, node->saved[1]);
        if (st == FSDP_OK) st = tensor_new(&dqkv, FSDP_BF16, 3, qkv_in->shape, fsdp_op_device(), fsdp_default_tag(), false);
        if (st == FSDP_OK) st = op_new_f32(&drow, 3, bht);
        if (st == FSDP_OK)
            KERNELS(dqkv)->attention_flash_backward_bf16(tensor_data(dqkv), f32p(drow), tensor_data(dout),
                                                         tensor_data(qkv), tensor_data(out), f32p(node->saved[0]), B,
                                                         H, T, D, causal, scale);
        tensor_release(dout16);
        tensor_release(dout);
        tensor_release(qkv);
        tensor_release(out);
        tensor_release(drow);
        if (st != FSDP_OK) {
            tensor_release(dqkv);
            return st;
        }
        return op_give_grad(node, 0, dqkv);
    }
    if (node->i[1] == ATTN_QKV_GEMM) {
        fsdp_tensor *dout = NULL, *qkv = NULL, *dqkv = NULL, *dprobs = NULL, *dscores = NULL;
        int64_t bhtt[4] = {B, H, T, T};
        st = tensor_from_f32(&dout, g, FSDP_BF16);   /* bf16 contiguous, a copy only when it is not */
        if (st == FSDP_OK) st = tensor_contiguous(&qkv, qkv_in);
        if (st == FSDP_OK) st = tensor_new(&dqkv, FSDP_BF16, 3, qkv_in->shape, fsdp_op_device(), fsdp_default_tag(), false);
        if (st == FSDP_OK) st = new_scratch(&dprobs, FSDP_F32, bhtt);
        if (st == FSDP_OK) st = new_scratch(&dscores, FSDP_BF16, bhtt);
        if (st == FSDP_OK)
            KERNELS(dqkv)->attention_qkv_backward_bf16(tensor_data(dqkv), f32p(dprobs), tensor_data(dscores),
                                                       tensor_data(dout), tensor_data(qkv),
                                                       tensor_data(node->saved[0]), B, H, T, D, causal, scale);
        tensor_release(dout);
        tensor_release(qkv);
        tensor_release(dprobs);
        tensor_release(dscores);
        if (st != FSDP_OK) {
            tensor_release(dqkv);
            return st;
        }
        return op_give_grad(node, 0, dqkv);
    }
    /* f32: unpack q, k, v and dout to (B, H, T, D), pack dq, dk, dv */
    fsdp_tensor *d32 = NULL, *dv4 = NULL, *dout = NULL, *qkv32 = NULL, *part[3] = {NULL, NULL, NULL};
    fsdp_tensor *grad[3] = {NULL, NULL, NULL}, *dqkv = NULL;
    int64_t bhtd[4] = {B, H, T, D}, dstrides[4] = {T * C, D, C, 1};
    st = tensor_as_f32(&d32, g);
    if (st == FSDP_OK && !(dv4 = tensor_view(d32, 4, bhtd, dstrides, d32->offset)))
        st = fsdp_set_error(FSDP_ERR_OOM, "attention_qkv backward: out of host memory for a view");
    if (st == FSDP_OK) st = tensor_contiguous(&dout, dv4);
    if (st == FSDP_OK) st = tensor_as_f32(&qkv32, qkv_in);
    for (int w = 0; w < 3 && st == FSDP_OK; w++) st = qkv_part_f32(&part[w], qkv32, w, H);
    for (int w = 0; w < 3 && st == FSDP_OK; w++) st = op_new_f32(&grad[w], 4, bhtd);
    if (st == FSDP_OK) st = op_new_f32(&dqkv, 3, qkv_in->shape);
    if (st == FSDP_OK)
        KERNELS(dqkv)->attention_backward_f32(f32p(grad[0]), f32p(grad[1]), f32p(grad[2]), f32p(dout), f32p(part[0]),
                                              f32p(part[1]), f32p(part[2]), f32p(node->saved[1]),
                                              f32p(node->saved[0]), B, H, T, D, causal, scale);
    for (int w = 0; w < 3 && st == FSDP_OK; w++) {
        fsdp_tensor *dst = qkv_part(dqkv, w, H);
        st = dst ? fsdp_copy(dst, grad[w]) : fsdp_set_error(FSDP_ERR_OOM, "attention_qkv backward: out of host memory");
        tensor_release(dst);
    }
    tensor_release(d32);
    tensor_release(dv4);
    tensor_release(dout);
    tensor_release(qkv32);
    for (int w = 0; w < 3; w++) {
        tensor_release(part[w]);
        tensor_release(grad[w]);
    }
    if (st != FSDP_OK) {
        tensor_release(dqkv);
        return st;
    }
    return op_give_grad(node, 0, dqkv);
}

fsdp_status fsdp_attention_qkv(fsdp_tensor **out, fsdp_tensor *qkv, int64_t n_head, int causal, double scale) {
    TRACE_OP("attention_qkv", out);
    const char *op = "fsdp_attention_qkv", *names[] = {"qkv"};
    fsdp_tensor *ts[] = {qkv};
    FSDP_TRY(op_check(op, out, 1, names, ts, NULL));
    FSDP_TRY(op_check_float(op, 1, names, ts));
    if (qkv->ndim != 3) return op_fail(FSDP_ERR_SHAPE, op, 1, names, ts, "qkv must be 3-D (B, T, 3C)");
    if (n_head < 1) return op_fail(FSDP_ERR_INVALID, op, 1, names, ts, "n_head is %lld, expected >= 1", (long long)n_head);
    if (qkv->shape[2] % (3 * n_head) != 0)
        return op_fail(FSDP_ERR_SHAPE, op, 1, names, ts, "the last dim (3C) is not a multiple of 3 x %lld heads",
                       (long long)n_head);
    if (isnan(scale)) return op_fail(FSDP_ERR_INVALID, op, 1, names, ts, "scale is NaN");
    int64_t B = qkv->shape[0], T = qkv->shape[1], C = qkv->shape[2] / 3, H = n_head, D = C / H;
    if (scale <= 0) scale = D > 0 ? 1.0 / sqrt((double)D) : 1.0;
    int64_t oshape[3] = {B, T, C};
    int path;
    FSDP_TRY(attention_qkv_path(&path, qkv, H, op, names, ts));
    fsdp_tensor *r = NULL, *saved[2] = {NULL, NULL};
    int n_saved = 0;
    fsdp_status st = FSDP_OK;
    if (path == ATTN_QKV_FLASH) {
        /* bf16 in and out, no (T, T) buffer: out and lse, which the backward
         * keeps with a view of the output */
        fsdp_tensor *c = NULL, *lse = NULL;
        int64_t bht[3] = {B, H, T};
        st = aligned_contiguous(&c, qkv);
        if (st == FSDP_OK) st = tensor_new(&r, FSDP_BF16, 3, oshape, fsdp_op_device(), fsdp_default_tag(), false);
        if (st == FSDP_OK) st = op_new_f32(&lse, 3, bht);
        if (st == FSDP_OK)
            KERNELS(c)->attention_flash_forward_bf16(tensor_data(r), f32p(lse), tensor_data(c), B, H, T, D,
                                                     causal != 0, (float)scale);
        tensor_release(c);
        saved[0] = lse;
        n_saved = 1;
    } else if (path == ATTN_QKV_GEMM) {
        /* bf16 in and out: r is the output itself (op_done's cast is a no-op) */
        fsdp_tensor *c = NULL, *scores = NULL, *probs = NULL;
        int64_t bhtt[4] = {B, H, T, T};
        st = tensor_contiguous(&c, qkv);
        if (st == FSDP_OK) st = tensor_new(&r, FSDP_BF16, 3, oshape, fsdp_op_device(), fsdp_default_tag(), false);
        if (st == FSDP_OK) st = new_scratch(&scores, FSDP_F32, bhtt);
        if (st == FSDP_OK) st = new_scratch(&probs, FSDP_BF16, bhtt);
        if (st == FSDP_OK)
            KERNELS(c)->attention_qkv_forward_bf16(tensor_data(r), tensor_data(probs), f32p(scores), tensor_data(c), B,
                                                   H, T, D, causal != 0, (float)scale);
        tensor_release(c);
        tensor_release(scores);
        saved[0] = probs;
        n_saved = 1;
    } else {
        /* f32: unpack q, k, v, run the fused f32 kernel, pack the output */
        fsdp_tensor *qkv32 = NULL, *part[3] = {NULL, NULL, NULL}, *o = NULL, *lse = NULL, *ov = NULL;
        int64_t bhtd[4] = {B, H, T, D}, lshape[3] = {B, H, T};
        st = tensor_as_f32(&qkv32, qkv);
        for (int w = 0; w < 3 && st == FSDP_OK; w++) st = qkv_part_f32(&part[w], qkv32, w, H);
        if (st == FSDP_OK) st = op_new_f32(&o, 4, bhtd);
        if (st == FSDP_OK) st = op_new_f32(&lse, 3, lshape);
        if (st == FSDP_OK) st = op_new_f32(&r, 3, oshape);
        if (st == FSDP_OK)
            KERNELS(o)->attention_forward_f32(f32p(o), f32p(lse), f32p(part[0]), f32p(part[1]), f32p(part[2]), B, H,
                                              T, D, causal != 0, (float)scale);
        if (st == FSDP_OK) {   /* r (B, T, C) seen as (B, H, T, D) */
            int64_t rstrides[4] = {T * C, D, C, 1};
            ov = tensor_view(r, 4, bhtd, rstrides, r->offset);
            st = ov ? fsdp_copy(ov, o) : fsdp_set_error(FSDP_ERR_OOM, "%s: out of host memory for a view", op);
        }
        tensor_release(ov);
        tensor_release(qkv32);
        for (int w = 0; w < 3; w++) tensor_release(part[w]);
        saved[0] = lse;
        saved[1] = o;
        n_saved = 2;
    }
    if (st != FSDP_OK) {
        tensor_release(r);
        for (int i = 0; i < 2; i++) tensor_release(saved[i]);
        return st;
    }
    fsdp_node *node = NULL;
    FSDP_TRY(op_done(out, &node, r, qkv->dtype, "attention_qkv", attention_qkv_backward, 1, ts, n_saved, saved));
    if (node) {
        node->f[0] = scale;
        node->i[0] = causal != 0;
        node->i[1] = path;
        node->i[2] = H;
        if (path == ATTN_QKV_FLASH) {
            /* a second tensor object over the output's storage (see fsdp_attention) */
            fsdp_tensor *res = *out;
            node->saved[1] = tensor_view(res, res->ndim, res->shape, res->strides, res->offset);
            if (!node->saved[1]) {
                tensor_release(res);
                *out = NULL;
                return op_fail(FSDP_ERR_OOM, op, 1, names, ts, "out of host memory for a saved view");
            }
        }
    }
    return FSDP_OK;
}
