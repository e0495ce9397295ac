/* arith.c: broadcasting arithmetic, reductions, matmul and casts, with
 * their backward. */
#include "ops_util.h"
#include "trace.h"
#include "reduce_shape.h"
#include <math.h>
#include <stdlib.h>

/* ---- summing onto a shape ---- */

fsdp_status sum_dims_keep(fsdp_tensor **out, fsdp_tensor *t, const bool *reduce) {
    int nd = t->ndim;
    fsdp_tensor *cur = t;
    tensor_retain(cur);
    /* one pass per run of adjacent reduced dims: (outer, red, inner) */
    for (int d = 0; d < nd;) {
        if (!reduce[d] || cur->shape[d] == 1) { d++; continue; }
        int e = d;
        while (e + 1 < nd && reduce[e + 1]) e++;
        int64_t outer = 1, red = 1, inner = 1, shape[FSDP_MAX_DIMS];
        for (int k = 0; k < nd; k++) {
            shape[k] = cur->shape[k];
            if (k < d) outer *= cur->shape[k];
            else if (k <= e) { red *= cur->shape[k]; shape[k] = 1; }
            else inner *= cur->shape[k];
        }
        fsdp_tensor *next;
        bool native = BF16_KERNEL(cur, sum_dim) != NULL;   /* bf16 in and out, one rounding per pass */
        fsdp_status st = op_new_as(&next, native ? FSDP_BF16 : FSDP_F32, nd, shape);
        if (st != FSDP_OK) {
            tensor_release(cur);
            return st;
        }
        if (native) KERNELS(next)->sum_dim_bf16(tensor_data(next), tensor_data(cur), outer, red, inner);
        else KERNELS(next)->sum_dim_f32(tensor_data(next), tensor_data(cur), outer, red, inner);
        tensor_release(cur);
        cur = next;
        d = e + 1;
    }
    *out = cur;
    return FSDP_OK;
}

fsdp_status sum_to_shape(fsdp_tensor **out, fsdp_tensor *g, int ndim, const int64_t *shape) {
    int lead = g->ndim - ndim;
    bool reduce[FSDP_MAX_DIMS];
    for (int k = 0; k < g->ndim; k++) reduce[k] = k < lead || (shape[k - lead] == 1 && g->shape[k] != 1);
    fsdp_tensor *r;
    FSDP_TRY(sum_dims_keep(&r, g, reduce));
    /* drop the leading dims: same data, target shape */
    int64_t strides[FSDP_MAX_DIMS];
    contiguous_strides(ndim, shape, strides);
    fsdp_tensor *v = tensor_view(r, ndim, shape, strides, r->offset);
    tensor_release(r);
    if (!v) return fsdp_set_error(FSDP_ERR_OOM, "sum_to_shape: out of host memory");
    *out = v;
    return FSDP_OK;
}

/* Adds the sum of t (bf16, contiguous) onto the shape of node input i
 * straight into the .grad input i has, in one pass of the device's
 * sum_dim_acc_bf16, when that .grad exists and the summed dims are one run
 * (a bias gradient: (B, T, C) onto (C)). Sets *done when it did; otherwise
 * the caller sums and gives the gradient as usual. */
static fsdp_status sum_into_grad(fsdp_node *node, int i, fsdp_tensor *t, bool *done) {
    *done = false;
    const fsdp_tensor *in = node->in[i];
    fsdp_tensor *acc = node_grad_peek(node, i, FSDP_BF16);
    if (!acc || t->dtype != FSDP_BF16 || !tensor_is_contiguous(t) || !KERNELS(acc)->sum_dim_acc_bf16 ||
        !KERNELS(acc)->sum_dim_bf16)
        return FSDP_OK;
    int nd = t->ndim, lead = nd - in->ndim, first = -1, last = -1;
    for (int k = 0; k < nd; k++) {
        bool r = k < lead || (in->shape[k - lead] == 1 && t->shape[k] != 1);
        if (!r || t->shape[k] == 1) continue;
        if (first >= 0 && last != k - 1) {   /* a second run: not one pass */
            bool gap_of_ones = true;
            for (int j = last + 1; j < k; j++) gap_of_ones &= t->shape[j] == 1;
            if (!gap_of_ones) return FSDP_OK;
        }
        if (first < 0) first = k;
        last = k;
    }
    if (first < 0) return FSDP_OK;   /* nothing summed: an add of the same shape */
    int64_t outer = 1, red = 1, inner = 1;
    for (int k = 0; k < nd; k++) {
        if (k < first) outer *= t->shape[k];
        else if (k <= last) red *= t->shape[k];
        else inner *= t->shape[k];
    }
    if (outer * inner != tensor_numel(acc)) return FSDP_OK;
    /* an unwritten .grad (an FSDP unit's first gradient into it) is written, else added to */
    float beta;
    node_grad_target(node, i, FSDP_BF16, &beta);
    if (beta == 0.0f) KERNELS(acc)->sum_dim_bf16(tensor_data(acc), tensor_data(t), outer, red, inner);
    else KERNELS(acc)->sum_dim_acc_bf16(tensor_data(acc), tensor_data(t), outer, red, inner);
    *done = true;
    return FSDP_OK;
}

/* ---- broadcasting binary ops ---- */

static const char *const binary_names[] = {"fsdp_add", "fsdp_sub", "fsdp_mul", "fsdp_div"};

/* Output shape of broadcasting a and b, and each one's read strides. */
static bool broadcast2(const fsdp_tensor *a, const fsdp_tensor *b, int *ndim, int64_t *shape, int64_t *sa,
                       int64_t *sb) {
    int nd = a->ndim > b->ndim ? a->ndim : b->ndim;
    for (int k = 0; k < nd; k++) {
        int ka = k - (nd - a->ndim), kb = k - (nd - b->ndim);
        int64_t da = ka >= 0 ? a->shape[ka] : 1, db = kb >= 0 ? b->shape[kb] : 1;
        if (da != db && da != 1 && db != 1) return false;
        shape[k] = da > db ? da : db;
        sa[k] = (ka < 0 || da == 1) ? 0 : a->strides[ka];
        sb[k] = (kb < 0 || db == 1) ? 0 : b->strides[kb];
    }
    *ndim = nd;
    return true;
}

/* out = x op y with y (and x) read through broadcast strides onto g's
 * shape; x and y both f32, or both bf16 on a device with binary_bf16. */
static fsdp_status binary_like(fsdp_tensor **out, int op, fsdp_tensor *x, fsdp_tensor *y, int nd,
                               const int64_t *shape) {
    int64_t sx[FSDP_MAX_DIMS], sy[FSDP_MAX_DIMS], s2[FSDP_MAX_DIMS];
    int nd2;
    broadcast2(x, y, &nd2, s2, sx, sy);
    FSDP_TRY(op_new_as(out, x->dtype, nd, shape));
    if (x->dtype == FSDP_BF16)
        KERNELS(*out)->binary_bf16(op, tensor_data(*out), tensor_data(x), sx, tensor_data(y), sy, nd, shape);
    else
        KERNELS(*out)->binary_f32(op, tensor_data(*out), tensor_data(x), sx, tensor_data(y), sy, nd, shape);
    return FSDP_OK;
}

/* Are a binary op's gradients bf16 on this device (operands bf16, and the
 * entries the backward needs there)? */
static bool binary_native(const fsdp_tensor *a, const fsdp_tensor *b) {
    return a->dtype == FSDP_BF16 && b->dtype == FSDP_BF16 && BF16_KERNEL(a, binary) && BF16_KERNEL(a, scale) &&
           BF16_KERNEL(a, sum_dim);
}

static fsdp_status binary_backward(fsdp_node *node) {
    int op = (int)node->i[0];
    bool native = binary_native(node->in[0], node->in[1]);
    fsdp_tensor *g, *a = NULL, *b = NULL, *ga = NULL, *gb = NULL, *t1 = NULL, *t2 = NULL;
    FSDP_TRY(op_grad_out_as(node, 0, native ? FSDP_BF16 : FSDP_F32, &g));
    if (!g) return FSDP_OK;
    fsdp_status st = FSDP_OK;
    int nd = g->ndim;
    const int64_t *shape = g->shape;
    if (op == FSDP_MUL || op == FSDP_DIV) {   /* (bf16: read through their own strides) */
        if (native) {
            a = node->in[0];
            b = node->in[1];
            tensor_retain(a);
            tensor_retain(b);
        } else {
            if ((st = tensor_as_f32(&a, node->in[0])) != FSDP_OK) goto done;
            if ((st = tensor_as_f32(&b, node->in[1])) != FSDP_OK) goto done;
        }
    }
    /* gradient of a, at the output's shape */
    if (node_needs_grad(node, 0)) {
        if (op == FSDP_ADD || op == FSDP_SUB) { t1 = g; tensor_retain(g); }
        else if ((st = binary_like(&t1, op == FSDP_MUL ? FSDP_MUL : FSDP_DIV, g, b, nd, shape)) != FSDP_OK) goto done;
        st = sum_to_shape(&ga, t1, node->in[0]->ndim, node->in[0]->shape);
        tensor_release(t1);
        t1 = NULL;
        if (st != FSDP_OK) goto done;
    }
    if (node_needs_grad(node, 1)) {
        if (op == FSDP_ADD) { t1 = g; tensor_retain(g); }
        else if (op == FSDP_SUB) {
            if ((st = op_new_as(&t1, g->dtype, nd, shape)) != FSDP_OK) goto done;
            if (native) KERNELS(t1)->scale_bf16(tensor_data(t1), tensor_data(g), -1.0f, tensor_numel(g));
            else KERNELS(t1)->scale_f32(tensor_data(t1), tensor_data(g), -1.0f, tensor_numel(g));
        } else if (op == FSDP_MUL) {
            if ((st = binary_like(&t1, FSDP_MUL, g, a, nd, shape)) != FSDP_OK) goto done;
        } else { /* d(a/b)/db = -g a / b^2 */
            if ((st = binary_like(&t2, FSDP_MUL, g, a, nd, shape)) != FSDP_OK) goto done;
            if ((st = binary_like(&t1, FSDP_DIV, t2, b, nd, shape)) != FSDP_OK) goto done;
            tensor_release(t2);
            t2 = NULL;
            if ((st = binary_like(&t2, FSDP_DIV, t1, b, nd, shape)) != FSDP_OK) goto done;
            if (native) KERNELS(t2)->scale_bf16(tensor_data(t2), tensor_data(t2), -1.0f, tensor_numel(t2));
            else KERNELS(t2)->scale_f32(tensor_data(t2), tensor_data(t2), -1.0f, tensor_numel(t2));
            tensor_release(t1);
            t1 = t2;
            t2 = NULL;
        }
        bool added = false;
        if (native) st = sum_into_grad(node, 1, t1, &added);   /* a bias: summed into its .grad */
        if (st == FSDP_OK && !added) st = sum_to_shape(&gb, t1, node->in[1]->ndim, node->in[1]->shape);
        tensor_release(t1);
        t1 = NULL;
        if (st != FSDP_OK) goto done;
    }
    if (ga) { st = op_give_grad(node, 0, ga); ga = NULL; }
    if (gb && st == FSDP_OK) { st = op_give_grad(node, 1, gb); gb = NULL; }
done:
    tensor_release(g);
    tensor_release(a);
    tensor_release(b);
    tensor_release(ga);
    tensor_release(gb);
    tensor_release(t2);
    return st;
}

fsdp_status fsdp_binary(fsdp_tensor **out, fsdp_binary_op op, fsdp_tensor *a, fsdp_tensor *b) {
    TRACE_OP("binary", out);
    if (op < FSDP_ADD || op > FSDP_DIV)
        return fsdp_set_error(FSDP_ERR_INVALID, "fsdp_binary: unknown op %d (expected 0..3)", op);
    const char *name = binary_names[op];
    trace_scope_.name = name + 5;   /* "fsdp_add" -> "add" on the timeline */
    const char *names[] = {"a", "b"};
    fsdp_tensor *ts[] = {a, b};
    FSDP_TRY(op_check(name, out, 2, names, ts, NULL));
    FSDP_TRY(op_check_float(name, 2, names, ts));
    int nd;
    int64_t shape[FSDP_MAX_DIMS], sa[FSDP_MAX_DIMS], sb[FSDP_MAX_DIMS];
    char sig[1024];
    if (!broadcast2(a, b, &nd, shape, sa, sb))
        return fsdp_set_error(FSDP_ERR_SHAPE, "%s: shapes do not broadcast", op_sig(sig, sizeof sig, name, 2, names, ts));
    fsdp_tensor *r;
    if (a->dtype == FSDP_F32 || BF16_KERNEL(a, binary)) {   /* read straight through the operands' strides */
        FSDP_TRY(op_new_as(&r, a->dtype, nd, shape));
        if (a->dtype == FSDP_F32)
            KERNELS(r)->binary_f32(op, tensor_data(r), tensor_data(a), sa, tensor_data(b), sb, nd, shape);
        else
            KERNELS(r)->binary_bf16(op, tensor_data(r), tensor_data(a), sa, tensor_data(b), sb, nd, shape);
    } else {
        fsdp_tensor *a32, *b32;
        FSDP_TRY(tensor_as_f32(&a32, a));
        fsdp_status st = tensor_as_f32(&b32, b);
        if (st == FSDP_OK) {
            st = binary_like(&r, op, a32, b32, nd, shape);
            tensor_release(b32);
        }
        tensor_release(a32);
        FSDP_TRY(st);
    }
    fsdp_node *node = NULL;
    FSDP_TRY(op_done(out, &node, r, a->dtype, "binary", binary_backward, 2, ts, 0, NULL));
    if (node) node->i[0] = op;
    return FSDP_OK;
}

fsdp_status fsdp_add(fsdp_tensor **out, fsdp_tensor *a, fsdp_tensor *b) { return fsdp_binary(out, FSDP_ADD, a, b); }
fsdp_status fsdp_sub(fsdp_tensor **out, fsdp_tensor *a, fsdp_tensor *b) { return fsdp_binary(out, FSDP_SUB, a, b); }
fsdp_status fsdp_mul(fsdp_tensor **out, fsdp_tensor *a, fsdp_tensor *b) { return fsdp_binary(out, FSDP_MUL, a, b); }
fsdp_status fsdp_div(fsdp_tensor **out, fsdp_tensor *a, fsdp_tensor *b) { return fsdp_binary(out, FSDP_DIV, a, b); }

/* ---- scalar ops ---- */

static fsdp_status scale_backward(fsdp_node *node) {
    fsdp_tensor *g, *r;
    bool native = BF16_KERNEL(node->in[0], scale) != NULL;
    FSDP_TRY(op_grad_out_as(node, 0, native ? FSDP_BF16 : FSDP_F32, &g));
    if (!g) return FSDP_OK;
    fsdp_status st = op_new_as(&r, g->dtype, g->ndim, g->shape);
    if (st == FSDP_OK && native)
        KERNELS(r)->scale_bf16(tensor_data(r), tensor_data(g), (float)node->f[0], tensor_numel(g));
    else if (st == FSDP_OK)
        KERNELS(r)->scale_f32(tensor_data(r), tensor_data(g), (float)node->f[0], tensor_numel(g));
    /* a gradient the host knows (backward()'s one) stays known: the kernel's product, rounded alike */
    double v;
    if (st == FSDP_OK && tensor_numel(r) == 1 && tape_known_value(node_grad_out(node, 0), &v)) {
        float p = (float)v * (float)node->f[0];
        tape_note_value(r, r->dtype == FSDP_BF16 ? (double)bf16_to_f32(f32_to_bf16(p)) : (double)p);
    }
    tensor_release(g);
    FSDP_TRY(st);
    return op_give_grad(node, 0, r);
}

static fsdp_status scalar_op(const char *name, fsdp_tensor **out, fsdp_tensor *a, double s, bool add) {
    const char *names[] = {"a"};
    fsdp_tensor *ts[] = {a};
    FSDP_TRY(op_check(name, out, 1, names, ts, NULL));
    FSDP_TRY(op_check_float(name, 1, names, ts));
    fsdp_tensor *a32, *r;
    bool native = BF16_KERNEL(a, scale) && BF16_KERNEL(a, add_scalar);
    FSDP_TRY(native ? tensor_contiguous(&a32, a) : tensor_as_f32(&a32, a));
    fsdp_status st = op_new_as(&r, a32->dtype, a->ndim, a->shape);
    if (st == FSDP_OK && native) {
        if (add) KERNELS(r)->add_scalar_bf16(tensor_data(r), tensor_data(a32), (float)s, tensor_numel(a));
        else KERNELS(r)->scale_bf16(tensor_data(r), tensor_data(a32), (float)s, tensor_numel(a));
    } else if (st == FSDP_OK) {
        if (add) KERNELS(r)->add_scalar_f32(tensor_data(r), tensor_data(a32), (float)s, tensor_numel(a));
        else KERNELS(r)->scale_f32(tensor_data(r), tensor_data(a32), (float)s, tensor_numel(a));
    }
    tensor_release(a32);
    FSDP_TRY(st);
    fsdp_node *node = NULL;
    FSDP_TRY(op_done(out, &node, r, a->dtype, add ? "add_scalar" : "scale", scale_backward, 1, ts, 0, NULL));
    if (node) node->f[0] = add ? 1.0 : s;   /* d(a + s)/da = 1: a scale by one */
    return FSDP_OK;
}

fsdp_status fsdp_scale(fsdp_tensor **out, fsdp_tensor *a, double s) { return scalar_op("fsdp_scale", out, a, s, false); }
fsdp_status fsdp_add_scalar(fsdp_tensor **out, fsdp_tensor *a, double s) {
    TRACE_OP("add_scalar", out);
    return scalar_op("fsdp_add_scalar", out, a, s, true);
}

/* ---- sum and mean ---- */

/* backward: broadcast g (keepdim shape) over the input, times f[0] */
static fsdp_status reduce_backward(fsdp_node *node) {
    fsdp_tensor *g, *in = node->in[0], *r;
    FSDP_TRY(op_grad_out_f32(node, 0, &g));
    if (!g) return FSDP_OK;
    int nd = in->ndim;
    int64_t strides[FSDP_MAX_DIMS], kept[FSDP_MAX_DIMS];
    for (int k = 0; k < nd; k++) kept[k] = node->i[k] ? 1 : in->shape[k];   /* keepdim shape of g */
    contiguous_strides(nd, kept, strides);
    for (int k = 0; k < nd; k++)
        if (node->i[k]) strides[k] = 0;
    fsdp_status st = op_new_f32(&r, nd, in->shape);
    if (st == FSDP_OK) {
        KERNELS(r)->copy_strided(tensor_data(r), r->strides, tensor_data(g), strides, nd, in->shape, sizeof(float));
        if (node->f[0] != 1.0) KERNELS(r)->scale_f32(tensor_data(r), tensor_data(r), (float)node->f[0], tensor_numel(r));
    }
    tensor_release(g);
    FSDP_TRY(st);
    return op_give_grad(node, 0, r);
}

static fsdp_status reduce_op(const char *name, fsdp_tensor **out, fsdp_tensor *t, int ndims, const int *dims,
                             int keepdim, bool mean) {
    const char *names[] = {"t"};
    fsdp_tensor *ts[] = {t};
    FSDP_TRY(op_check(name, out, 1, names, ts, NULL));
    FSDP_TRY(op_check_float(name, 1, names, ts));
    char d[200];
    int nd = t->ndim;
    bool reduce[FSDP_MAX_DIMS] = {0};
    if (ndims < 0 || (ndims > 0 && !dims))
        return fsdp_set_error(FSDP_ERR_INVALID, "%s(t %s): %d dims given", name, tensor_desc(t, d, sizeof d), ndims);
    for (int k = 0; k < ndims; k++) {
        int dd = dims[k] < 0 ? dims[k] + nd : dims[k];
        if (dd < 0 || dd >= nd)
            return fsdp_set_error(FSDP_ERR_SHAPE, "%s(t %s): dim %d out of range -%d..%d", name,
                                  tensor_desc(t, d, sizeof d), dims[k], nd, nd - 1);
        reduce[dd] = true;
    }
    if (ndims == 0)
        for (int k = 0; k < nd; k++) reduce[k] = true;
    int64_t count = 1;
    for (int k = 0; k < nd; k++)
        if (reduce[k]) count *= t->shape[k];
    fsdp_tensor *t32, *r;
    FSDP_TRY(tensor_as_f32(&t32, t));
    fsdp_status st = sum_dims_keep(&r, t32, reduce);
    tensor_release(t32);
    FSDP_TRY(st);
    double factor = mean ? (count ? 1.0 / (double)count : NAN) : 1.0;
    if (mean) KERNELS(r)->scale_f32(tensor_data(r), tensor_data(r), (float)factor, tensor_numel(r));
    /* the output shape: keep the reduced dims as 1, or drop them */
    int64_t shape[FSDP_MAX_DIMS], strides[FSDP_MAX_DIMS];
    int ond = 0;
    for (int k = 0; k < nd; k++)
        if (keepdim || !reduce[k]) shape[ond++] = reduce[k] ? 1 : t->shape[k];
    contiguous_strides(ond, shape, strides);
    fsdp_tensor *v = tensor_view(r, ond, shape, strides, r->offset);
    tensor_release(r);
    if (!v) return fsdp_set_error(FSDP_ERR_OOM, "%s: out of host memory", name);
    fsdp_node *node = NULL;
    FSDP_TRY(op_done(out, &node, v, t->dtype, mean ? "mean" : "sum", reduce_backward, 1, ts, 0, NULL));
    if (node) {
        for (int k = 0; k < nd; k++) node->i[k] = reduce[k];
        node->f[0] = factor;
    }
    return FSDP_OK;
}

fsdp_status fsdp_sum(fsdp_tensor **out, fsdp_tensor *t, int ndims, const int *dims, int keepdim) {
    TRACE_OP("sum", out);
    return reduce_op("fsdp_sum", out, t, ndims, dims, keepdim, false);
}
fsdp_status fsdp_mean(fsdp_tensor **out, fsdp_tensor *t, int ndims, const int *dims, int keepdim) {
    TRACE_OP("mean", out);
    return reduce_op("fsdp_mean", out, t, ndims, dims, keepdim, true);
}

/* ---- matmul ---- */

typedef struct {
    int64_t batch, M, N, K;
    bool shared_b;          /* b is 2-D and used by every batch */
} mm_dims;

/* bf16 operands on a device with a bf16 GEMM (the tensor cores) skip the
 * f32 staging: contiguous bf16 in, bf16 out, f32 accumulation inside. */
static bool matmul_in_bf16(fsdp_tensor *a, fsdp_tensor *b) {
    return a->dtype == FSDP_BF16 && b->dtype == FSDP_BF16 && KERNELS(a)->matmul_bf16 != NULL;
}

/* The backward of matmul_in_bf16: dA and dB in bf16. Not for a shared b
 * whose gradient sums over a batch loop: that goes through f32, so that the
 * sum is rounded once. */
static fsdp_status matmul_backward_bf16(fsdp_node *node, fsdp_tensor *g0, float alpha, const mm_dims *m, int ta,
                                       int tb) {
    fsdp_tensor *g = NULL, *a = NULL, *b = NULL, *ga = NULL, *gb = NULL;
    if (!g0) return FSDP_OK;
    fsdp_status st;
    if ((st = tensor_from_f32(&g, g0, FSDP_BF16)) != FSDP_OK) goto out;   /* (bf16 contiguous, whatever came in) */
    if ((st = tensor_contiguous(&a, node->in[0])) != FSDP_OK) goto out;
    if ((st = tensor_contiguous(&b, node->in[1])) != FSDP_OK) goto out;
    int64_t sa = m->M * m->K, sb = m->shared_b ? 0 : m->K * m->N, sc = m->M * m->N;
    const uint16_t *A = tensor_data(a), *B = tensor_data(b), *G = tensor_data(g);
    if (node_needs_grad(node, 0)) {
        if ((st = tensor_new(&ga, FSDP_BF16, a->ndim, a->shape, fsdp_op_device(), fsdp_default_tag(), false)))
            goto out;
        if (!ta)
            KERNELS(ga)->matmul_bf16(tensor_data(ga), G, B, m->batch, m->M, m->K, m->N, 0, !tb, alpha, 0, sc, sb, sa);
        else
            KERNELS(ga)->matmul_bf16(tensor_data(ga), B, G, m->batch, m->K, m->M, m->N, tb, 1, alpha, 0, sb, sc, sa);
        st = op_give_grad(node, 0, ga);
        ga = NULL;
        if (st != FSDP_OK) goto out;
    }
    if (node_needs_grad(node, 1)) {   /* (shared b: batch is 1 here) */
        /* a weight whose .grad exists (an FSDP unit's gradient slice, a
         * second micro-batch): the GEMM adds into it, beta = 1 */
        float beta = 0.0f;   /* 0: a new gradient, or the first into an unwritten .grad */
        fsdp_tensor *acc = node_grad_target(node, 1, FSDP_BF16, &beta);
        if (acc) {
            tensor_retain(acc);
            gb = acc;
        } else if ((st = tensor_new(&gb, FSDP_BF16, b->ndim, b->shape, fsdp_op_device(), fsdp_default_tag(), false))) {
            goto out;
        }
        int64_t per = m->shared_b ? 1 : m->batch;
        if (!tb)
            KERNELS(gb)->matmul_bf16(tensor_data(gb), A, G, per, m->K, m->N, m->M, !ta, 0, alpha, beta, sa, sc,
                                     m->K * m->N);
        else
            KERNELS(gb)->matmul_bf16(tensor_data(gb), G, A, per, m->N, m->K, m->M, 1, ta, alpha, beta, sc, sa,
                                     m->K * m->N);
        if (!acc) st = op_give_grad(node, 1, gb);
        else tensor_release(gb);
        gb = NULL;
    }
out:
    tensor_release(g);
    tensor_release(a);
    tensor_release(b);
    tensor_release(ga);
    tensor_release(gb);
    return st;
}

fsdp_status matmul_grads(fsdp_node *node, fsdp_tensor *g0, float alpha) {
    int ta = (int)node->i[0], tb = (int)node->i[1];
    mm_dims m = {node->i[2], node->i[3], node->i[4], node->i[5], node->i[6] != 0};
    bool b_sums_batches = m.shared_b && m.batch > 1 && node_needs_grad(node, 1);
    if (!g0) return FSDP_OK;
    if (matmul_in_bf16(node->in[0], node->in[1]) && !b_sums_batches)
        return matmul_backward_bf16(node, g0, alpha, &m, ta, tb);
    fsdp_tensor *g, *a = NULL, *b = NULL, *ga = NULL, *gb = NULL;
    FSDP_TRY(tensor_as_f32(&g, g0));
    fsdp_status st;
    if ((st = tensor_as_f32(&a, node->in[0])) != FSDP_OK) goto done;
    if ((st = tensor_as_f32(&b, node->in[1])) != FSDP_OK) goto done;
    int64_t sa = m.M * m.K, sb = m.shared_b ? 0 : m.K * m.N, sc = m.M * m.N;
    const float *A = tensor_data(a), *B = tensor_data(b), *G = tensor_data(g);
    if (node_needs_grad(node, 0)) {
        if ((st = op_new_f32(&ga, a->ndim, a->shape)) != FSDP_OK) goto done;
        if (!ta) /* dA (M,K) = dC (M,N) @ op(B)^T */
            KERNELS(ga)->matmul_f32(tensor_data(ga), G, B, m.batch, m.M, m.K, m.N, 0, !tb, alpha, 0.0f, sc, sb, sa);
        else     /* dA stored (K,M) = op(B) (K,N) @ dC^T */
            KERNELS(ga)->matmul_f32(tensor_data(ga), B, G, m.batch, m.K, m.M, m.N, tb, 1, alpha, 0.0f, sb, sc, sa);
    }
    fsdp_tensor *acc = NULL;   /* b's .grad, written by the GEMM itself (an f32 weight's, an FSDP unit's slice) */
    float beta0 = 0.0f;
    if (node_needs_grad(node, 1)) {
        acc = node_grad_target(node, 1, FSDP_F32, &beta0);
        if (acc) {
            tensor_retain(acc);
            gb = acc;
        } else if ((st = op_new_f32(&gb, b->ndim, b->shape)) != FSDP_OK) {
            goto done;
        }
        /* a shared b sums its gradient over the batch: accumulate with beta = 1 */
        int64_t nb = m.shared_b ? m.batch : 1, per = m.shared_b ? 1 : m.batch;
        for (int64_t k = 0; k < nb; k++) {
            const float *Ak = A + k * sa, *Gk = G + k * sc;
            float beta = k ? 1.0f : beta0;
            if (!tb) /* dB (K,N) = op(A)^T (K,M) @ dC (M,N) */
                KERNELS(gb)->matmul_f32(tensor_data(gb), Ak, Gk, per, m.K, m.N, m.M, !ta, 0, alpha, beta, sa, sc,
                                        m.K * m.N);
            else     /* dB stored (N,K) = dC^T (N,M) @ op(A) (M,K) */
                KERNELS(gb)->matmul_f32(tensor_data(gb), Gk, Ak, per, m.N, m.K, m.M, 1, ta, alpha, beta, sc, sa,
                                        m.K * m.N);
        }
    }
    if (ga) { st = op_give_grad(node, 0, ga); ga = NULL; }
    if (gb && !acc && st == FSDP_OK) { st = op_give_grad(node, 1, gb); gb = NULL; }
done:
    tensor_release(g);
    tensor_release(a);
    tensor_release(b);
    tensor_release(ga);
    tensor_release(gb);
    return st;
}

static fsdp_status matmul_backward(fsdp_node *node) { return matmul_grads(node, node_grad_out(node, 0), 1.0f); }

fsdp_status fsdp_matmul(fsdp_tensor **out, fsdp_tensor *a, fsdp_tensor *b, int trans_a, int trans_b) {
    TRACE_OP("matmul", out);
    const char *names[] = {"a", "b"};
    fsdp_tensor *ts[] = {a, b};
    FSDP_TRY(op_check("fsdp_matmul", out, 2, names, ts, NULL));
    FSDP_TRY(op_check_float("fsdp_matmul", 2, names, ts));
    char sig[1024];
    if (a->ndim < 2 || b->ndim < 2)
        return fsdp_set_error(FSDP_ERR_SHAPE, "%s: both operands need at least 2 dims",
                              op_sig(sig, sizeof sig, "fsdp_matmul", 2, names, ts));
    int nd = a->ndim;
    mm_dims m;
    m.M = trans_a ? a->shape[nd - 1] : a->shape[nd - 2];
    int64_t Ka = trans_a ? a->shape[nd - 2] : a->shape[nd - 1];
    int64_t Kb = trans_b ? b->shape[b->ndim - 1] : b->shape[b->ndim - 2];
    m.N = trans_b ? b->shape[b->ndim - 2] : b->shape[b->ndim - 1];
    m.K = Ka;
    if (Ka != Kb)
        return fsdp_set_error(FSDP_ERR_SHAPE, "%s (trans_a %d, trans_b %d): inner dimensions differ (%lld vs %lld)",
                              op_sig(sig, sizeof sig, "fsdp_matmul", 2, names, ts), trans_a != 0, trans_b != 0,
                              (long long)Ka, (long long)Kb);
    m.shared_b = b->ndim == 2;
    m.batch = 1;
    for (int k = 0; k < nd - 2; k++) m.batch *= a->shape[k];
    if (!m.shared_b) {
        bool same = b->ndim == nd;
        for (int k = 0; same && k < nd - 2; k++) same = a->shape[k] == b->shape[k];
        if (!same)
            return fsdp_set_error(FSDP_ERR_SHAPE, "%s: batch dims differ (b must be 2-D or share a's batch dims)",
                                  op_sig(sig, sizeof sig, "fsdp_matmul", 2, names, ts));
    }
    int64_t shape[FSDP_MAX_DIMS];
    for (int k = 0; k < nd - 2; k++) shape[k] = a->shape[k];
    shape[nd - 2] = m.M;
    shape[nd - 1] = m.N;
    if (m.shared_b && !trans_a) {   /* (batch, M, K) @ (K, N) is one (batch*M, K) @ (K, N) */
        m.M *= m.batch;
        m.batch = 1;
    }
    fsdp_tensor *a32, *b32, *r, *res;
    fsdp_status st;
    if (matmul_in_bf16(a, b)) {
        fsdp_tensor *ac, *bc;
        FSDP_TRY(tensor_contiguous(&ac, a));
        fsdp_status st2 = tensor_contiguous(&bc, b);
        if (st2 == FSDP_OK) {
            st2 = tensor_new(&res, FSDP_BF16, nd, shape, fsdp_op_device(), fsdp_default_tag(), false);
            if (st2 == FSDP_OK)
                KERNELS(res)->matmul_bf16(tensor_data(res), tensor_data(ac), tensor_data(bc), m.batch, m.M, m.N, m.K,
                                          trans_a != 0, trans_b != 0, 1.0f, 0.0f, m.M * m.K,
                                          m.shared_b ? 0 : m.K * m.N, m.M * m.N);
            tensor_release(bc);
        }
        tensor_release(ac);
        FSDP_TRY(st2);
        goto record;
    }
    FSDP_TRY(tensor_as_f32(&a32, a));
    st = tensor_as_f32(&b32, b);
    if (st == FSDP_OK) {
        st = op_new_f32(&r, nd, shape);
        if (st == FSDP_OK)
            KERNELS(r)->matmul_f32(tensor_data(r), tensor_data(a32), tensor_data(b32), m.batch, m.M, m.N, m.K, trans_a != 0,
                           trans_b != 0, 1.0f, 0.0f, m.M * m.K, m.shared_b ? 0 : m.K * m.N, m.M * m.N);
        tensor_release(b32);
    }
    tensor_release(a32);
    FSDP_TRY(st);
    FSDP_TRY(op_finish(&res, r, a->dtype));
record:
    st = FSDP_OK;
    fsdp_node *node = op_record(&st, "matmul", matmul_backward, 2, ts, 1, &res);
    if (st != FSDP_OK) {
        tensor_release(res);
        return st;
    }
    if (node) {
        node->i[0] = trans_a != 0;
        node->i[1] = trans_b != 0;
        node->i[2] = m.batch;
        node->i[3] = m.M;
        node->i[4] = m.N;
        node->i[5] = m.K;
        node->i[6] = m.shared_b;
    }
    *out = res;
    return FSDP_OK;
}

/* ---- cast ---- */

static fsdp_status cast_backward(fsdp_node *node) {
    fsdp_tensor *g;
    FSDP_TRY(op_grad_out_f32(node, 0, &g));
    if (!g) return FSDP_OK;
    return op_give_grad(node, 0, g);   /* converted to the input's dtype there */
}

fsdp_status fsdp_cast(fsdp_tensor **out, fsdp_tensor *t, fsdp_dtype dtype) {
    TRACE_OP("cast", out);
    const char *names[] = {"t"};
    fsdp_tensor *ts[] = {t};
    FSDP_TRY(op_check("fsdp_cast", out, 1, names, ts, NULL));
    char d[200];
    if (dtype < 0 || dtype >= FSDP_DTYPE_COUNT)
        return fsdp_set_error(FSDP_ERR_DTYPE, "fsdp_cast(t %s): unknown dtype %d", tensor_desc(t, d, sizeof d), dtype);
    fsdp_tensor *res;
    FSDP_TRY(tensor_new(&res, dtype, t->ndim, t->shape, tensor_device(t), fsdp_default_tag(), false));
    fsdp_status st = fsdp_copy(res, t);
    if (st != FSDP_OK) {
        tensor_release(res);
        return st;
    }
    if (fsdp_dtype_is_float(t->dtype) && fsdp_dtype_is_float(dtype)) {
        op_record(&st, "cast", cast_backward, 1, ts, 1, &res);
        if (st != FSDP_OK) {
            tensor_release(res);
            return st;
        }
    }
    *out = res;
    return FSDP_OK;
}
