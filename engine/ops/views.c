/* views.c: reshape, permute, narrow, expand, contiguous, detach. Views share
 * their input's storage; their backward maps the gradient back onto the
 * input's shape. */
#include "ops_util.h"
#include "reduce_shape.h"
#include <stdint.h>
#include <stdlib.h>

#define NAMES1 const char *names[] = {"t"}; fsdp_tensor *ts[] = {t}

/* Records a view node; on failure releases v. */
static fsdp_status finish_view(fsdp_tensor **out, fsdp_tensor *v, const char *op, fsdp_backward_fn fn,
                               fsdp_tensor *t, const int64_t *ints, int nints) {
    fsdp_status st;
    fsdp_node *node = op_record(&st, op, fn, 1, &t, 1, &v);
    if (st != FSDP_OK) {
        tensor_release(v);
        return st;
    }
    if (node)
        for (int k = 0; k < nints; k++) node->i[k] = ints[k];
    *out = v;
    return FSDP_OK;
}

static fsdp_status oom_view(const char *op) { return fsdp_set_error(FSDP_ERR_OOM, "%s: out of host memory", op); }

/* ---- reshape ---- */

static fsdp_status reshape_backward(fsdp_node *node) {
    fsdp_tensor *g = node_grad_out(node, 0), *in = node->in[0];
    if (!g) return FSDP_OK;
    fsdp_tensor *c, *v;
    FSDP_TRY(tensor_contiguous(&c, g));
    int64_t strides[FSDP_MAX_DIMS];
    contiguous_strides(in->ndim, in->shape, strides);
    v = tensor_view(c, in->ndim, in->shape, strides, c->offset);
    tensor_release(c);
    if (!v) return oom_view("reshape backward");
    return node_add_grad(node, 0, v);
}

fsdp_status fsdp_reshape(fsdp_tensor **out, fsdp_tensor *t, int ndim, const int64_t *shape) {
    NAMES1;
    FSDP_TRY(op_check("fsdp_reshape", out, 1, names, ts, NULL));
    char d[200], s[200];
    if (ndim < 0 || ndim > FSDP_MAX_DIMS || (ndim > 0 && !shape))
        return fsdp_set_error(FSDP_ERR_SHAPE, "fsdp_reshape(t %s): %d dims asked, expected 0..%d",
                              tensor_desc(t, d, sizeof d), ndim, FSDP_MAX_DIMS);
    int64_t want[FSDP_MAX_DIMS], known = 1;
    int infer = -1;
    for (int k = 0; k < ndim; k++) {
        want[k] = shape[k];
        if (shape[k] == -1 && infer < 0) infer = k;
        else if (shape[k] < 0 || (shape[k] > 0 && known > INT64_MAX / 8 / shape[k]))
            return fsdp_set_error(FSDP_ERR_SHAPE, "fsdp_reshape(t %s): bad target shape %s",
                                  tensor_desc(t, d, sizeof d), shape_str(ndim, shape, s, sizeof s));
        else known *= shape[k];
    }
    int64_t numel = tensor_numel(t);
    if (infer >= 0) {
        if (known == 0 || numel % known != 0)
            return fsdp_set_error(FSDP_ERR_SHAPE, "fsdp_reshape(t %s): cannot infer -1 in %s from %lld elements",
                                  tensor_desc(t, d, sizeof d), shape_str(ndim, shape, s, sizeof s),
                                  (long long)numel);
        want[infer] = numel / known;
        known *= want[infer];
    }
    if (!shape_fits(ndim, want))
        return fsdp_set_error(FSDP_ERR_SHAPE, "fsdp_reshape(t %s): target %s is too large (its dims multiply to "
                              "more than 2^60)", tensor_desc(t, d, sizeof d), shape_str(ndim, want, s, sizeof s));
    if (known != numel)
        return fsdp_set_error(FSDP_ERR_SHAPE, "fsdp_reshape(t %s): target %s has %lld elements, expected %lld",
                              tensor_desc(t, d, sizeof d), shape_str(ndim, want, s, sizeof s), (long long)known,
                              (long long)numel);
    fsdp_tensor *c;
    FSDP_TRY(tensor_contiguous(&c, t));   /* a copy only when t's layout cannot be viewed */
    int64_t strides[FSDP_MAX_DIMS];
    contiguous_strides(ndim, want, strides);
    fsdp_tensor *v = tensor_view(c, ndim, want, strides, c->offset);
    tensor_release(c);
    if (!v) return oom_view("fsdp_reshape");
    return finish_view(out, v, "reshape", reshape_backward, t, NULL, 0);
}

/* ---- permute ---- */

static fsdp_status permute_backward(fsdp_node *node) {
    fsdp_tensor *g = node_grad_out(node, 0);
    if (!g) return FSDP_OK;
    int nd = g->ndim;
    int64_t shape[FSDP_MAX_DIMS], strides[FSDP_MAX_DIMS];
    for (int k = 0; k < nd; k++) {   /* out dim k came from in dim perm[k] */
        int p = (int)node->i[k];
        shape[p] = g->shape[k];
        strides[p] = g->strides[k];
    }
    fsdp_tensor *v = tensor_view(g, nd, shape, strides, g->offset);
    if (!v) return oom_view("permute backward");
    return node_add_grad(node, 0, v);
}

static fsdp_status permute_impl(const char *op, fsdp_tensor **out, fsdp_tensor *t, int ndim, const int *perm) {
    char d[200];
    if (ndim != t->ndim || !perm)
        return fsdp_set_error(FSDP_ERR_SHAPE, "%s(t %s): permutation of %d dims given, expected %d", op,
                              tensor_desc(t, d, sizeof d), ndim, t->ndim);
    int seen[FSDP_MAX_DIMS] = {0};
    int64_t shape[FSDP_MAX_DIMS], strides[FSDP_MAX_DIMS], ints[FSDP_MAX_DIMS];
    for (int k = 0; k < ndim; k++) {
        int p = perm[k] < 0 ? perm[k] + ndim : perm[k];
        if (p < 0 || p >= ndim || seen[p]++)
            return fsdp_set_error(FSDP_ERR_SHAPE, "%s(t %s): entry %d (%d) makes no permutation of %d dims", op,
                                  tensor_desc(t, d, sizeof d), k, perm[k], ndim);
        shape[k] = t->shape[p];
        strides[k] = t->strides[p];
        ints[k] = p;
    }
    fsdp_tensor *v = tensor_view(t, ndim, shape, strides, t->offset);
    if (!v) return oom_view(op);
    return finish_view(out, v, "permute", permute_backward, t, ints, ndim);
}

fsdp_status fsdp_permute(fsdp_tensor **out, fsdp_tensor *t, int ndim, const int *perm) {
    NAMES1;
    FSDP_TRY(op_check("fsdp_permute", out, 1, names, ts, NULL));
    return permute_impl("fsdp_permute", out, t, ndim, perm);
}

fsdp_status fsdp_transpose(fsdp_tensor **out, fsdp_tensor *t, int dim0, int dim1) {
    NAMES1;
    FSDP_TRY(op_check("fsdp_transpose", out, 1, names, ts, NULL));
    int nd = t->ndim, a = dim0 < 0 ? dim0 + nd : dim0, b = dim1 < 0 ? dim1 + nd : dim1;
    char d[200];
    if (a < 0 || a >= nd || b < 0 || b >= nd)
        return fsdp_set_error(FSDP_ERR_SHAPE, "fsdp_transpose(t %s): dims %d and %d, expected -%d..%d",
                              tensor_desc(t, d, sizeof d), dim0, dim1, nd, nd - 1);
    int perm[FSDP_MAX_DIMS];
    for (int k = 0; k < nd; k++) perm[k] = k;
    perm[a] = b;
    perm[b] = a;
    return permute_impl("fsdp_transpose", out, t, nd, perm);
}

/* ---- narrow ---- */

static fsdp_status narrow_backward(fsdp_node *node) {
    fsdp_tensor *g = node_grad_out(node, 0), *in = node->in[0];
    if (!g) return FSDP_OK;
    int dim = (int)node->i[0];
    fsdp_tensor *full;
    FSDP_TRY(tensor_new(&full, g->dtype, in->ndim, in->shape, tensor_device(g), fsdp_default_tag(), true));
    fsdp_tensor *part = tensor_view(full, full->ndim, g->shape, full->strides, node->i[1] * full->strides[dim]);
    if (!part) {
        tensor_release(full);
        return oom_view("narrow backward");
    }
    fsdp_status st = fsdp_copy(part, g);
    tensor_release(part);
    if (st != FSDP_OK) {
        tensor_release(full);
        return st;
    }
    return node_add_grad(node, 0, full);
}

fsdp_status fsdp_narrow(fsdp_tensor **out, fsdp_tensor *t, int dim, int64_t start, int64_t length) {
    NAMES1;
    FSDP_TRY(op_check("fsdp_narrow", out, 1, names, ts, NULL));
    char d[200];
    int nd = t->ndim, dd = dim < 0 ? dim + nd : dim;
    if (dd < 0 || dd >= nd)
        return fsdp_set_error(FSDP_ERR_SHAPE, "fsdp_narrow(t %s): dim %d, expected -%d..%d",
                              tensor_desc(t, d, sizeof d), dim, nd, nd - 1);
    if (start < 0 || length < 0 || start + length > t->shape[dd])
        return fsdp_set_error(FSDP_ERR_INDEX,
                              "fsdp_narrow(t %s): range [%lld, %lld) of dim %d is outside [0, %lld)",
                              tensor_desc(t, d, sizeof d), (long long)start, (long long)(start + length), dd,
                              (long long)t->shape[dd]);
    int64_t shape[FSDP_MAX_DIMS];
    for (int k = 0; k < nd; k++) shape[k] = t->shape[k];
    shape[dd] = length;
    fsdp_tensor *v = tensor_view(t, nd, shape, t->strides, t->offset + start * t->strides[dd]);
    if (!v) return oom_view("fsdp_narrow");
    int64_t ints[2] = {dd, start};
    return finish_view(out, v, "narrow", narrow_backward, t, ints, 2);
}

/* ---- expand ---- */

static fsdp_status expand_backward(fsdp_node *node) {
    fsdp_tensor *g = node_grad_out(node, 0), *in = node->in[0], *g32, *r;
    if (!g) return FSDP_OK;
    FSDP_TRY(tensor_as_f32(&g32, g));
    fsdp_status st = sum_to_shape(&r, g32, in->ndim, in->shape);
    tensor_release(g32);
    if (st != FSDP_OK) return st;
    return op_give_grad(node, 0, r);
}

fsdp_status fsdp_expand(fsdp_tensor **out, fsdp_tensor *t, int ndim, const int64_t *shape) {
    NAMES1;
    FSDP_TRY(op_check("fsdp_expand", out, 1, names, ts, NULL));
    char d[200], s[200];
    if (ndim < t->ndim || ndim > FSDP_MAX_DIMS || !shape)
        return fsdp_set_error(FSDP_ERR_SHAPE, "fsdp_expand(t %s): %d target dims, expected %d..%d",
                              tensor_desc(t, d, sizeof d), ndim, t->ndim, FSDP_MAX_DIMS);
    int lead = ndim - t->ndim;
    int64_t want[FSDP_MAX_DIMS], strides[FSDP_MAX_DIMS];
    for (int k = 0; k < ndim; k++) {
        int64_t have = k < lead ? 1 : t->shape[k - lead];
        want[k] = shape[k] == -1 && k >= lead ? have : shape[k];
        if (want[k] < 0 || (have != want[k] && have != 1))
            return fsdp_set_error(FSDP_ERR_SHAPE,
                                  "fsdp_expand(t %s): cannot expand to %s (dim %d has size %lld, not 1)",
                                  tensor_desc(t, d, sizeof d), shape_str(ndim, shape, s, sizeof s), k,
                                  (long long)have);
        strides[k] = (k < lead || have != want[k]) ? 0 : t->strides[k - lead];
    }
    if (!shape_fits(ndim, want))
        return fsdp_set_error(FSDP_ERR_SHAPE, "fsdp_expand(t %s): target %s is too large (its dims multiply to "
                              "more than 2^60)", tensor_desc(t, d, sizeof d), shape_str(ndim, want, s, sizeof s));
    fsdp_tensor *v = tensor_view(t, ndim, want, strides, t->offset);
    if (!v) return oom_view("fsdp_expand");
    return finish_view(out, v, "expand", expand_backward, t, NULL, 0);
}

/* ---- contiguous, detach ---- */

static fsdp_status identity_backward(fsdp_node *node) {
    fsdp_tensor *g = node_grad_out(node, 0);
    if (!g) return FSDP_OK;
    tensor_retain(g);
    return node_add_grad(node, 0, g);
}

fsdp_status fsdp_contiguous(fsdp_tensor **out, fsdp_tensor *t) {
    NAMES1;
    FSDP_TRY(op_check("fsdp_contiguous", out, 1, names, ts, NULL));
    if (tensor_is_contiguous(t)) {   /* the same tensor: the tape needs nothing */
        tensor_retain(t);
        *out = t;
        return FSDP_OK;
    }
    fsdp_tensor *c;
    FSDP_TRY(tensor_contiguous(&c, t));
    return finish_view(out, c, "contiguous", identity_backward, t, NULL, 0);
}

fsdp_status fsdp_detach(fsdp_tensor **out, fsdp_tensor *t) {
    NAMES1;
    FSDP_TRY(op_check("fsdp_detach", out, 1, names, ts, NULL));
    fsdp_tensor *v = tensor_view(t, t->ndim, t->shape, t->strides, t->offset);
    if (!v) return oom_view("fsdp_detach");
    *out = v;   /* a leaf that does not require grad */
    return FSDP_OK;
}
