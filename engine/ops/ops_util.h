/* ops_util.h: what every op file shares: argument checks that produce the
 * engine's error messages, f32 staging of bf16 tensors, and the output
 * step (convert back to the input dtype, record on the tape). */
#ifndef FSDP_OPS_UTIL_H
#define FSDP_OPS_UTIL_H

#include "internal.h"
#include "cpu_kernels.h"
#include <stdarg.h>
#include <stdio.h>
#include <string.h>

/* "fsdp_matmul(a f32[2,3] cpu, b f32[4,5] cpu)" into buf, for messages. */
static inline const char *op_sig(char *buf, size_t size, const char *op, int n, const char *const *names,
                                 fsdp_tensor *const *ts) {
    size_t k = (size_t)snprintf(buf, size, "%s(", op);
    for (int i = 0; i < n && k < size; i++) {
        char d[200];
        k += (size_t)snprintf(buf + k, size - k, "%s%s %s", i ? ", " : "", names[i],
                              ts[i] ? tensor_desc(ts[i], d, sizeof d) : "none");
    }
    if (k < size) snprintf(buf + k, size - k, ")");
    return buf;
}

/* Sets the error "<op signature>: <message>" and returns st. */
static inline fsdp_status op_fail(fsdp_status st, const char *op, int n, const char *const *names,
                                  fsdp_tensor *const *ts, const char *fmt, ...) __attribute__((format(printf, 6, 7)));
static inline fsdp_status op_fail(fsdp_status st, const char *op, int n, const char *const *names,
                                  fsdp_tensor *const *ts, const char *fmt, ...) {
    char sig[1024], msg[1024];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    return fsdp_set_error(st, "%s: %s", op_sig(sig, sizeof sig, op, n, names, ts), msg);
}

/* Checks shared by every op: non-NULL out and tensors, one device, and the
 * CPU backend (the CUDA backend plugs in per device). names[i] names ts[i]
 * in messages; optional tensors may be NULL when optional[i]. */
static inline fsdp_status op_check(const char *op, void *out, int n, const char *const *names,
                                   fsdp_tensor *const *ts, const bool *optional) {
    char sig[1024];
    if (!out) return fsdp_set_error(FSDP_ERR_INVALID, "%s: output pointer is NULL", op);
    for (int i = 0; i < n; i++)
        if (!ts[i] && !(optional && optional[i]))
            return fsdp_set_error(FSDP_ERR_INVALID, "%s: %s is NULL", op, names[i]);
    for (int i = 0; i < n; i++)
        if (ts[i] && !ts[i]->storage->data && ts[i]->storage->nbytes > 0)
            return fsdp_set_error(FSDP_ERR_STATE,
                                  "%s: %s is a parameter of a resharded unit (its full buffer is freed); "
                                  "run it inside the unit's forward, or unshard the unit first",
                                  op_sig(sig, sizeof sig, op, n, names, ts), names[i]);
    int dev = -1;
    for (int i = 0; i < n; i++) {
        if (!ts[i]) continue;
        if (dev >= 0 && tensor_device(ts[i]) != dev)
            return fsdp_set_error(FSDP_ERR_DEVICE, "%s: tensors on different devices",
                                  op_sig(sig, sizeof sig, op, n, names, ts));
        dev = tensor_device(ts[i]);
    }
    if (dev >= 0 && !device_kernels(dev))
        return fsdp_set_error(FSDP_ERR_UNSUPPORTED, "%s: no %s kernels in this build",
                              op_sig(sig, sizeof sig, op, n, names, ts), fsdp_device_name(dev));
    fsdp_set_op_device(dev >= 0 ? dev : FSDP_DEVICE_CPU);
    return FSDP_OK;
}

/* Float inputs of one dtype (f32 or bf16). */
static inline fsdp_status op_check_float(const char *op, int n, const char *const *names, fsdp_tensor *const *ts) {
    char sig[1024];
    int dt = -1;
    for (int i = 0; i < n; i++) {
        if (!ts[i]) continue;
        if (!fsdp_dtype_is_float(ts[i]->dtype))
            return fsdp_set_error(FSDP_ERR_DTYPE, "%s: %s must be f32 or bf16",
                                  op_sig(sig, sizeof sig, op, n, names, ts), names[i]);
        if (dt >= 0 && ts[i]->dtype != dt)
            return fsdp_set_error(FSDP_ERR_DTYPE, "%s: dtypes differ; cast one first",
                                  op_sig(sig, sizeof sig, op, n, names, ts));
        dt = ts[i]->dtype;
    }
    return FSDP_OK;
}

/* Integer index tensors (i32, i64, u16). */
static inline bool dtype_is_index(int dt) { return dt == FSDP_I32 || dt == FSDP_I64 || dt == FSDP_U16; }

/* A new f32 contiguous tensor (activation tag) of the given shape, on the
 * device of the op being run (set by op_check, and by the tape for a backward). */
static inline fsdp_status op_new_f32(fsdp_tensor **out, int ndim, const int64_t *shape) {
    return tensor_new(out, FSDP_F32, ndim, shape, fsdp_op_device(), fsdp_default_tag(), false);
}

/* bf16 natively: the device's `<name>_bf16` entry when t is bf16 and the
 * device has one (device.h), else NULL and the op stages through f32. */
#define BF16_KERNEL(t, name) ((t)->dtype == FSDP_BF16 ? KERNELS(t)->name##_bf16 : NULL)

/* A new contiguous tensor of dtype (activation tag) on the op's device. */
static inline fsdp_status op_new_as(fsdp_tensor **out, int dtype, int ndim, const int64_t *shape) {
    return tensor_new(out, dtype, ndim, shape, fsdp_op_device(), fsdp_default_tag(), false);
}

/* Output i's gradient as a contiguous tensor of dtype (*out NULL when none flowed). */
static inline fsdp_status op_grad_out_as(fsdp_node *node, int i, int dtype, fsdp_tensor **out) {
    fsdp_tensor *g = node_grad_out(node, i);
    *out = NULL;
    if (!g) return FSDP_OK;
    return tensor_from_f32(out, g, dtype);   /* (a converting copy, or g itself when it fits) */
}

/* Turns an f32 result into the op's output dtype; takes r. */
static inline fsdp_status op_finish(fsdp_tensor **out, fsdp_tensor *r, int dtype) {
    if (dtype == FSDP_F32) {
        *out = r;
        return FSDP_OK;
    }
    fsdp_status st = tensor_from_f32(out, r, dtype);
    tensor_release(r);
    return st;
}

/* Gives a gradient (f32 contiguous, input i's shape) to input i in that
 * input's dtype; takes g. */
static inline fsdp_status op_give_grad(fsdp_node *node, int i, fsdp_tensor *g) {
    if (!node_needs_grad(node, i)) {
        tensor_release(g);
        return FSDP_OK;
    }
    if (node->in[i]->dtype != g->dtype) {
        fsdp_tensor *c;
        fsdp_status st = tensor_from_f32(&c, g, node->in[i]->dtype);
        tensor_release(g);
        if (st != FSDP_OK) return st;
        g = c;
    }
    return node_add_grad(node, i, g);
}

/* Output i's gradient as f32 contiguous (*out NULL when none flowed). */
static inline fsdp_status op_grad_out_f32(fsdp_node *node, int i, fsdp_tensor **out) {
    fsdp_tensor *g = node_grad_out(node, i);
    *out = NULL;
    if (!g) return FSDP_OK;
    return tensor_as_f32(out, g);
}

/* Records node for op when the tape wants it; returns NULL (no error) when
 * not recorded, and sets *st on failure. */
static inline fsdp_node *op_record(fsdp_status *st, const char *op, fsdp_backward_fn fn, int n_in,
                                   fsdp_tensor *const *in, int n_out, fsdp_tensor *const *out) {
    *st = FSDP_OK;
    if (!tape_wants(n_in, in)) return NULL;
    fsdp_node *node = tape_record(op, fn, n_in, in, n_out, out);
    if (!node) *st = strstr(fsdp_last_error(), "during its backward") ? FSDP_ERR_STATE : FSDP_ERR_OOM;
    return node;
}

/* The gradients of a matmul node's inputs in[0] (a) and in[1] (b), the
 * node's i[0..6] as fsdp_matmul records them (trans_a, trans_b, batch, M,
 * N, K, shared_b), from g0, the output's gradient, times alpha (folded
 * into the GEMMs; 1 for matmul's own backward). arith.c. */
fsdp_status matmul_grads(fsdp_node *node, fsdp_tensor *g0, float alpha);

/* A tensor's data as float *, NULL for none. */
static inline float *f32p(const fsdp_tensor *t) { return t ? (float *)tensor_data(t) : NULL; }

/* The common tail of every forward: converts the f32 result r to dtype,
 * records the node when the tape wants it and moves saved[] into it (they
 * are released when nothing is recorded). Takes r and saved[] on every
 * path. *node_out (optional) is the node, or NULL when not recorded. */
static inline fsdp_status op_done(fsdp_tensor **out, fsdp_node **node_out, fsdp_tensor *r, int dtype, const char *name,
                                  fsdp_backward_fn fn, int n_in, fsdp_tensor *const *in, int n_saved,
                                  fsdp_tensor *const *saved) {
    fsdp_tensor *res = NULL;
    fsdp_node *node = NULL;
    fsdp_status st = op_finish(&res, r, dtype);
    if (st == FSDP_OK) node = op_record(&st, name, fn, n_in, in, 1, &res);
    for (int i = 0; i < n_saved; i++) {
        if (node) node->saved[i] = saved[i];
        else tensor_release(saved[i]);
    }
    if (st != FSDP_OK) {
        tensor_release(res);
        return st;
    }
    if (node_out) *node_out = node;
    *out = res;
    return FSDP_OK;
}

/* The row and elementwise helpers of activation.c, softmax.c and norm.c
 * take a kernel as its slot in the device table (SLOT: an offsetof), so the
 * tensors' device picks the implementation; slot16 is the bf16 entry's,
 * used when the tensors are bf16 and the device has that optional entry. */
#define SLOT(name) offsetof(fsdp_device_kernels, name)
#define KERNEL_AT(t, type, slot) (*(const type *)((const char *)KERNELS(t) + (slot)))
typedef void (*kernel_slot_fn)(void);
/* Is there a bf16 entry at slot16 for tensors like t? */
static inline bool bf16_at(const fsdp_tensor *t, size_t slot16) {
    return t->dtype == FSDP_BF16 && KERNEL_AT(t, kernel_slot_fn, slot16) != NULL;
}

/* (rows, cols) view over the last dim; a 0-dim tensor is one row of one. */
static inline void rows_cols(const fsdp_tensor *x, int64_t *rows, int64_t *cols) {
    *cols = x->ndim ? x->shape[x->ndim - 1] : 1;
    *rows = *cols ? tensor_numel(x) / *cols : 0;
}

/* t as the kernel reads it: contiguous in its dtype (native: the device has
 * the kernel in that dtype), else a contiguous f32 copy; NULL stays NULL. */
static inline fsdp_status stage(fsdp_tensor **out, fsdp_tensor *t, bool native) {
    *out = NULL;
    if (!t) return FSDP_OK;
    return native ? tensor_contiguous(out, t) : tensor_as_f32(out, t);
}

/* indices.c: "[1,2]", the multi-index of flat position pos in shape (for
 * messages); the first position of ids (i64, contiguous) outside [0, limit)
 * (with has_skip, the value skip is allowed too), or -1, its value in *value. */
const char *index_str(int ndim, const int64_t *shape, int64_t pos, char *buf, size_t size);
int64_t first_bad_index(const fsdp_tensor *ids, int64_t limit, bool has_skip, int64_t skip, int64_t *value);

#endif
