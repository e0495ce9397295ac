/* tensor.c: reference-counted storage, tensors as strided views of it, and
 * the public calls that make, inspect, fill and copy tensors. */
#include "internal.h"
#include "convert.h"
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* ---- names and descriptions ---- */

const char *shape_str(int ndim, const int64_t *shape, char *buf, size_t size) {
    size_t n = 0;
    n += (size_t)snprintf(buf + n, size - n, "[");
    for (int d = 0; d < ndim && n < size; d++)
        n += (size_t)snprintf(buf + n, size - n, d ? ",%lld" : "%lld", (long long)shape[d]);
    if (n < size) snprintf(buf + n, size - n, "]");
    return buf;
}

const char *tensor_desc(const fsdp_tensor *t, char *buf, size_t size) {
    if (!t) {
        snprintf(buf, size, "NULL");
        return buf;
    }
    char s[160];
    snprintf(buf, size, "%s%s %s", fsdp_dtype_name(t->dtype), shape_str(t->ndim, t->shape, s, sizeof s),
             fsdp_device_name(tensor_device(t)));
    return buf;
}

bool shape_fits(int ndim, const int64_t *shape) {
    int64_t span = 1;
    for (int d = 0; d < ndim; d++) {
        if (shape[d] < 0) return false;
        int64_t p = shape[d] > 0 ? shape[d] : 1;
        if (span > INT64_MAX / 8 / p) return false;
        span *= p;
    }
    return true;
}

void contiguous_strides(int ndim, const int64_t *shape, int64_t *strides) {
    int64_t s = 1;
    for (int d = ndim - 1; d >= 0; d--) {
        strides[d] = s;
        s *= shape[d];
    }
}

int64_t tensor_numel(const fsdp_tensor *t) {
    int64_t n = 1;
    for (int d = 0; d < t->ndim; d++) n *= t->shape[d];
    return n;
}

bool tensor_is_contiguous(const fsdp_tensor *t) {
    int64_t s = 1;
    for (int d = t->ndim - 1; d >= 0; d--) {
        if (t->shape[d] != 1 && t->strides[d] != s) return false;
        s *= t->shape[d];
    }
    return true;
}

/* ---- life cycle ---- */

static void storage_release(fsdp_storage *s) {
    if (atomic_fetch_sub(&s->refcount, 1) == 1) {
        fsdp_free(s->device, s->tag, s->data, s->nbytes);
        if (s->copy) storage_release(s->copy);
        free(s);
    }
}

fsdp_status tensor_new(fsdp_tensor **out, int dtype, int ndim, const int64_t *shape, int device, int tag, bool zero) {
    char sb[160];
    if (dtype < 0 || dtype >= FSDP_DTYPE_COUNT)
        return fsdp_set_error(FSDP_ERR_DTYPE, "tensor_new: unknown dtype %d", dtype);
    if (ndim < 0 || ndim > FSDP_MAX_DIMS)
        return fsdp_set_error(FSDP_ERR_SHAPE, "tensor_new: %d dims, expected 0..%d", ndim, FSDP_MAX_DIMS);
    if (ndim > 0 && !shape) return fsdp_set_error(FSDP_ERR_INVALID, "tensor_new: shape is NULL");
    int64_t numel = 1;
    for (int d = 0; d < ndim; d++) {
        if (shape[d] < 0)
            return fsdp_set_error(FSDP_ERR_SHAPE, "tensor_new: negative size in shape %s",
                                  shape_str(ndim, shape, sb, sizeof sb));
        numel *= shape[d];
    }
    /* Strides multiply the sizes of every dim, zero-sized ones skipped, so
     * that product must fit (bytes too) even when numel is 0. */
    if (!shape_fits(ndim, shape))
        return fsdp_set_error(FSDP_ERR_SHAPE, "tensor_new: shape %s is too large (its dims multiply to more "
                              "than 2^60)", shape_str(ndim, shape, sb, sizeof sb));
    if (!device_kernels(device))
        return fsdp_set_error(FSDP_ERR_DEVICE, "tensor_new: device %s is not built into this engine, or has no "
                              "hardware", fsdp_device_name(device));
    size_t nbytes = (size_t)numel * fsdp_dtype_size(dtype);
    fsdp_storage *s = calloc(1, sizeof *s);
    fsdp_tensor *t = calloc(1, sizeof *t);
    if (!s || !t) {
        free(s);
        free(t);
        return fsdp_set_error(FSDP_ERR_OOM, "tensor_new: out of host memory for a tensor header");
    }
    fsdp_status st = fsdp_alloc(device, tag, nbytes, &s->data);
    if (st != FSDP_OK) {
        free(s);
        free(t);
        return st;
    }
    if (zero) device_kernels(device)->zero(s->data, nbytes);
    atomic_init(&s->refcount, 1);
    s->version = 1;   /* a compute copy made later records a version >= 1: 0 is never current */
    s->nbytes = nbytes;
    s->device = device;
    s->tag = tag;
    atomic_init(&t->refcount, 1);
    t->storage = s;
    t->ndim = ndim;
    t->dtype = dtype;
    t->is_leaf = true;
    for (int d = 0; d < ndim; d++) t->shape[d] = shape[d];
    contiguous_strides(ndim, t->shape, t->strides);
    *out = t;
    return FSDP_OK;
}

fsdp_tensor *tensor_view(fsdp_tensor *t, int ndim, const int64_t *shape, const int64_t *strides, int64_t offset) {
    fsdp_tensor *v = calloc(1, sizeof *v);
    if (!v) return NULL;
    atomic_init(&v->refcount, 1);
    atomic_fetch_add(&t->storage->refcount, 1);
    v->storage = t->storage;
    v->offset = offset;
    v->ndim = ndim;
    v->dtype = t->dtype;
    v->is_leaf = true;
    for (int d = 0; d < ndim; d++) {
        v->shape[d] = shape[d];
        v->strides[d] = strides[d];
    }
    return v;
}

void tensor_retain(fsdp_tensor *t) {
    if (t) atomic_fetch_add(&t->refcount, 1);
}

void tensor_release(fsdp_tensor *t) {
    if (!t) return;
    if (atomic_fetch_sub(&t->refcount, 1) == 1) {
        tensor_release(t->grad);
        tensor_release(t->bgrad);
        storage_release(t->storage);
        free(t);
    }
}

/* ---- host ranges of integer storages ---- */

void storage_set_host_range(fsdp_storage *s, int dtype, const void *host, int64_t n) {
    s->host_range = false;
    if (n <= 0 || (dtype != FSDP_I64 && dtype != FSDP_I32 && dtype != FSDP_U16)) return;
    int64_t lo = INT64_MAX, hi = INT64_MIN;
    for (int64_t i = 0; i < n; i++) {
        int64_t v = dtype == FSDP_I64 ? ((const int64_t *)host)[i]
                    : dtype == FSDP_I32 ? ((const int32_t *)host)[i] : ((const uint16_t *)host)[i];
        if (v < lo) lo = v;
        if (v > hi) hi = v;
    }
    s->range_lo = lo;
    s->range_hi = hi;
    s->host_range = true;
}

/* A copy or widening of integers holds values of its source's range. */
static void inherit_host_range(fsdp_tensor *to, const fsdp_tensor *from) {
    int64_t lo, hi;
    if (!tensor_host_range(from, &lo, &hi) || tensor_numel(to) == 0) return;
    bool widening = to->dtype == from->dtype || to->dtype == FSDP_I64;
    if (!widening || (to->dtype != FSDP_I64 && to->dtype != FSDP_I32 && to->dtype != FSDP_U16)) return;
    to->storage->range_lo = lo;
    to->storage->range_hi = hi;
    to->storage->host_range = true;
}

/* ---- conversions used by the op layer ---- */

fsdp_status tensor_contiguous(fsdp_tensor **out, fsdp_tensor *t) {
    if (tensor_is_contiguous(t)) {
        tensor_retain(t);
        *out = t;
        return FSDP_OK;
    }
    fsdp_tensor *c;
    FSDP_TRY(tensor_new(&c, t->dtype, t->ndim, t->shape, tensor_device(t), fsdp_default_tag(), false));
    KERNELS(c)->copy_strided(tensor_data(c), c->strides, tensor_data(t), t->strides, t->ndim, t->shape,
                     fsdp_dtype_size(t->dtype));
    inherit_host_range(c, t);
    *out = c;
    return FSDP_OK;
}

static fsdp_status tensor_convert(fsdp_tensor **out, fsdp_tensor *t, int dtype) {
    if (t->dtype == dtype) return tensor_contiguous(out, t);
    fsdp_tensor *c, *r;
    FSDP_TRY(tensor_contiguous(&c, t));
    fsdp_status st = tensor_new(&r, dtype, t->ndim, t->shape, tensor_device(t), fsdp_default_tag(), false);
    if (st == FSDP_OK) {
        KERNELS(r)->cast_any(tensor_data(r), dtype, tensor_data(c), c->dtype, tensor_numel(c));
        inherit_host_range(r, c);
    }
    tensor_release(c);
    if (st == FSDP_OK) *out = r;
    return st;
}

fsdp_status tensor_as_f32(fsdp_tensor **out, fsdp_tensor *t) { return tensor_convert(out, t, FSDP_F32); }
fsdp_status tensor_as_i64(fsdp_tensor **out, fsdp_tensor *t) { return tensor_convert(out, t, FSDP_I64); }
fsdp_status tensor_from_f32(fsdp_tensor **out, fsdp_tensor *src, int dtype) { return tensor_convert(out, src, dtype); }

/* ---- public: making and inspecting ---- */

/* A parameter view of a resharded FSDP unit has no data until regathered. */
#define CHECK_LIVE(op, t)                                                                          \
    if ((t)->storage->data == NULL && (t)->storage->nbytes > 0) {                                  \
        char d_[200];                                                                              \
        return fsdp_set_error(FSDP_ERR_STATE, "%s: %s belongs to a resharded unit (no data until " \
                              "it is gathered again)", op, tensor_desc(t, d_, sizeof d_));         \
    }

#define CHECK_OUT(op, p) \
    if (!(p)) return fsdp_set_error(FSDP_ERR_INVALID, "%s: output pointer is NULL", op)
#define CHECK_T(op, t) \
    if (!(t)) return fsdp_set_error(FSDP_ERR_INVALID, "%s: tensor is NULL", op)

static fsdp_status check_tag(const char *op, int tag) {
    if (tag < 0 || tag >= FSDP_TAG_COUNT)
        return fsdp_set_error(FSDP_ERR_INVALID, "%s: unknown tag %d (expected 0..%d)", op, tag, FSDP_TAG_COUNT - 1);
    return FSDP_OK;
}

fsdp_status fsdp_tensor_empty(fsdp_tensor **out, fsdp_dtype dtype, int ndim, const int64_t *shape, fsdp_device device, fsdp_tag tag) {
    CHECK_OUT("fsdp_tensor_empty", out);
    FSDP_TRY(check_tag("fsdp_tensor_empty", tag));
    return tensor_new(out, dtype, ndim, shape, device, tag, false);
}

fsdp_status fsdp_tensor_zeros(fsdp_tensor **out, fsdp_dtype dtype, int ndim, const int64_t *shape, fsdp_device device, fsdp_tag tag) {
    CHECK_OUT("fsdp_tensor_zeros", out);
    FSDP_TRY(check_tag("fsdp_tensor_zeros", tag));
    return tensor_new(out, dtype, ndim, shape, device, tag, true);
}

fsdp_status fsdp_tensor_from_data(fsdp_tensor **out, fsdp_dtype dtype, int ndim, const int64_t *shape, const void *data,
                                  int64_t nbytes, fsdp_device device, fsdp_tag tag) {
    CHECK_OUT("fsdp_tensor_from_data", out);
    FSDP_TRY(check_tag("fsdp_tensor_from_data", tag));
    if (!data && nbytes > 0) return fsdp_set_error(FSDP_ERR_INVALID, "fsdp_tensor_from_data: data is NULL");
    fsdp_tensor *t;
    FSDP_TRY(tensor_new(&t, dtype, ndim, shape, device, tag, false));
    if ((size_t)nbytes != t->storage->nbytes) {
        char d[200];
        fsdp_status st = fsdp_set_error(FSDP_ERR_SHAPE, "fsdp_tensor_from_data: %s needs %zu bytes, got %lld",
                                        tensor_desc(t, d, sizeof d), t->storage->nbytes, (long long)nbytes);
        tensor_release(t);
        return st;
    }
    if (nbytes) KERNELS(t)->copy_from_host(t->storage->data, data, (size_t)nbytes);
    if (device != FSDP_DEVICE_CPU) storage_set_host_range(t->storage, dtype, data, tensor_numel(t));
    *out = t;
    return FSDP_OK;
}

fsdp_status fsdp_tensor_to_data(fsdp_tensor *t, void *dst, int64_t nbytes) {
    CHECK_T("fsdp_tensor_to_data", t);
    CHECK_LIVE("fsdp_tensor_to_data", t);
    int64_t need = tensor_numel(t) * (int64_t)fsdp_dtype_size(t->dtype);
    if (!dst || nbytes < need) {
        char d[200];
        return fsdp_set_error(FSDP_ERR_INVALID, "fsdp_tensor_to_data: %s needs %lld bytes, destination has %lld",
                              tensor_desc(t, d, sizeof d), (long long)need, (long long)nbytes);
    }
    int64_t strides[FSDP_MAX_DIMS];
    contiguous_strides(t->ndim, t->shape, strides);
    if (tensor_device(t) == FSDP_DEVICE_CPU) {
        device_kernels(FSDP_DEVICE_CPU)->copy_strided(dst, strides, tensor_data(t), t->strides, t->ndim, t->shape,
                                                      fsdp_dtype_size(t->dtype));
        return FSDP_OK;
    }
    /* another device: make it contiguous there, then one copy to the host */
    fsdp_tensor *c;
    FSDP_TRY(tensor_contiguous(&c, t));
    KERNELS(c)->copy_to_host(dst, tensor_data(c), (size_t)need);
    tensor_release(c);
    return FSDP_OK;
}

fsdp_status fsdp_tensor_retain(fsdp_tensor *t) {
    CHECK_T("fsdp_tensor_retain", t);
    tensor_retain(t);
    return FSDP_OK;
}

fsdp_status fsdp_tensor_release(fsdp_tensor *t) {
    tensor_release(t);
    return FSDP_OK;
}

fsdp_status fsdp_tensor_ndim(fsdp_tensor *t, int *out) {
    CHECK_T("fsdp_tensor_ndim", t);
    CHECK_OUT("fsdp_tensor_ndim", out);
    *out = t->ndim;
    return FSDP_OK;
}

fsdp_status fsdp_tensor_shape(fsdp_tensor *t, int64_t *shape) {
    CHECK_T("fsdp_tensor_shape", t);
    CHECK_OUT("fsdp_tensor_shape", shape);
    for (int d = 0; d < t->ndim; d++) shape[d] = t->shape[d];
    return FSDP_OK;
}

fsdp_status fsdp_tensor_strides(fsdp_tensor *t, int64_t *strides) {
    CHECK_T("fsdp_tensor_strides", t);
    CHECK_OUT("fsdp_tensor_strides", strides);
    for (int d = 0; d < t->ndim; d++) strides[d] = t->strides[d];
    return FSDP_OK;
}

fsdp_status fsdp_tensor_dtype(fsdp_tensor *t, int *out) {
    CHECK_T("fsdp_tensor_dtype", t);
    CHECK_OUT("fsdp_tensor_dtype", out);
    *out = t->dtype;
    return FSDP_OK;
}

fsdp_status fsdp_tensor_device(fsdp_tensor *t, int *out) {
    CHECK_T("fsdp_tensor_device", t);
    CHECK_OUT("fsdp_tensor_device", out);
    *out = tensor_device(t);
    return FSDP_OK;
}

fsdp_status fsdp_tensor_tag(fsdp_tensor *t, int *out) {
    CHECK_T("fsdp_tensor_tag", t);
    CHECK_OUT("fsdp_tensor_tag", out);
    *out = t->storage->tag;
    return FSDP_OK;
}

fsdp_status fsdp_tensor_numel(fsdp_tensor *t, int64_t *out) {
    CHECK_T("fsdp_tensor_numel", t);
    CHECK_OUT("fsdp_tensor_numel", out);
    *out = tensor_numel(t);
    return FSDP_OK;
}

fsdp_status fsdp_tensor_is_contiguous(fsdp_tensor *t, int *out) {
    CHECK_T("fsdp_tensor_is_contiguous", t);
    CHECK_OUT("fsdp_tensor_is_contiguous", out);
    *out = tensor_is_contiguous(t);
    return FSDP_OK;
}

/* The host address of t's element 0, for the public pointer calls (op). */
static fsdp_status host_address(const char *op, fsdp_tensor *t, const void *out) {
    CHECK_T(op, t);
    CHECK_LIVE(op, t);
    CHECK_OUT(op, out);
    if (tensor_device(t) != FSDP_DEVICE_CPU) {
        char d[200];
        return fsdp_set_error(FSDP_ERR_DEVICE, "%s: %s is not in host memory", op, tensor_desc(t, d, sizeof d));
    }
    return FSDP_OK;
}

fsdp_status fsdp_tensor_data_ptr(fsdp_tensor *t, void **out) {
    FSDP_TRY(host_address("fsdp_tensor_data_ptr", t, out));
    /* the caller may write through it: whatever was derived from the
     * contents (a master's compute copy) is stale from here on */
    storage_written(t->storage);
    *out = tensor_data(t);
    return FSDP_OK;
}

fsdp_status fsdp_tensor_read_ptr(fsdp_tensor *t, const void **out) {
    FSDP_TRY(host_address("fsdp_tensor_read_ptr", t, out));
    *out = tensor_data(t);
    return FSDP_OK;
}

fsdp_status fsdp_tensor_item(fsdp_tensor *t, double *out) {
    CHECK_T("fsdp_tensor_item", t);
    CHECK_LIVE("fsdp_tensor_item", t);
    CHECK_OUT("fsdp_tensor_item", out);
    char d[200];
    if (tensor_numel(t) != 1)
        return fsdp_set_error(FSDP_ERR_SHAPE, "fsdp_tensor_item: %s has %lld elements, expected 1",
                              tensor_desc(t, d, sizeof d), (long long)tensor_numel(t));
    union { float f; uint16_t h; int32_t i; int64_t l; } v;
    KERNELS(t)->copy_to_host(&v, tensor_data(t), fsdp_dtype_size(t->dtype));
    const void *p = &v;
    switch (t->dtype) {
    case FSDP_F32: *out = *(const float *)p; break;
    case FSDP_BF16: *out = bf16_to_f32(*(const uint16_t *)p); break;
    case FSDP_I32: *out = *(const int32_t *)p; break;
    case FSDP_I64: *out = (double)*(const int64_t *)p; break;
    case FSDP_U16: *out = *(const uint16_t *)p; break;
    }
    return FSDP_OK;
}

fsdp_status fsdp_tensor_describe(fsdp_tensor *t, char *buf, int64_t size) {
    CHECK_T("fsdp_tensor_describe", t);
    if (!buf || size <= 0) return fsdp_set_error(FSDP_ERR_INVALID, "fsdp_tensor_describe: no buffer");
    tensor_desc(t, buf, (size_t)size);
    return FSDP_OK;
}

fsdp_status fsdp_tensor_to_device(fsdp_tensor **out, fsdp_tensor *t, fsdp_device device) {
    CHECK_OUT("fsdp_tensor_to_device", out);
    *out = NULL;
    CHECK_T("fsdp_tensor_to_device", t);
    CHECK_LIVE("fsdp_tensor_to_device", t);
    char d[200];
    int from = tensor_device(t);
    const fsdp_device_kernels *dk = device_kernels(device);
    if (!dk)
        return fsdp_set_error(FSDP_ERR_DEVICE, "fsdp_tensor_to_device: %s -> %s: %s is not built into this engine, "
                              "or has no hardware", tensor_desc(t, d, sizeof d), fsdp_device_name(device),
                              fsdp_device_name(device));
    fsdp_tensor *r;
    FSDP_TRY(tensor_new(&r, t->dtype, t->ndim, t->shape, device, t->storage->tag, false));
    size_t nbytes = r->storage->nbytes;
    if (from == (int)device) {   /* a contiguous copy on the same device */
        if (nbytes) dk->copy_strided(tensor_data(r), r->strides, tensor_data(t), t->strides, t->ndim, t->shape,
                                     fsdp_dtype_size(t->dtype));
        *out = r;
        return FSDP_OK;
    }
    fsdp_tensor *c;   /* contiguous where it is, so that one transfer moves it */
    fsdp_status st = tensor_contiguous(&c, t);
    if (st != FSDP_OK) {
        tensor_release(r);
        return st;
    }
    if (nbytes == 0) {
        /* nothing to move */
    } else if (from == FSDP_DEVICE_CPU) {
        dk->copy_from_host(tensor_data(r), tensor_data(c), nbytes);
        storage_set_host_range(r->storage, r->dtype, tensor_data(c), tensor_numel(r));
    } else if (device == FSDP_DEVICE_CPU) {
        KERNELS(c)->copy_to_host(tensor_data(r), tensor_data(c), nbytes);
    } else {   /* device to device: through the host */
        void *bounce = NULL;
        st = fsdp_alloc(FSDP_DEVICE_CPU, FSDP_TAG_OTHER, nbytes, &bounce);
        if (st == FSDP_OK) {
            KERNELS(c)->copy_to_host(bounce, tensor_data(c), nbytes);
            dk->copy_from_host(tensor_data(r), bounce, nbytes);
            fsdp_free(FSDP_DEVICE_CPU, FSDP_TAG_OTHER, bounce, nbytes);
        }
    }
    tensor_release(c);
    if (st != FSDP_OK) {
        tensor_release(r);
        return st;
    }
    *out = r;
    return FSDP_OK;
}

/* ---- public: in place ---- */

/* Writing through a view whose elements alias each other (stride 0 over a
 * dim longer than 1) would race and is refused. */
/* Every write into an existing tensor goes through here (fill, copy,
 * random init): the values it held are no longer the host's. */
static fsdp_status check_writable(const char *op, fsdp_tensor *t) {
    storage_written(t->storage);
    if (tensor_numel(t) == 0) return FSDP_OK;
    for (int d = 0; d < t->ndim; d++)
        if (t->strides[d] == 0 && t->shape[d] > 1) {
            char s[200];
            return fsdp_set_error(FSDP_ERR_LAYOUT,
                                  "%s: cannot write into %s: it is a broadcast (expanded) view whose "
                                  "dim %d has stride 0; write into a contiguous tensor",
                                  op, tensor_desc(t, s, sizeof s), d);
        }
    return FSDP_OK;
}

fsdp_status fsdp_fill(fsdp_tensor *t, double value) {
    CHECK_T("fsdp_fill", t);
    CHECK_LIVE("fsdp_fill", t);
    FSDP_TRY(check_writable("fsdp_fill", t));
    /* fill one element, then copy it out with a broadcast read */
    int64_t n = tensor_numel(t);
    if (n == 0) return FSDP_OK;
    if (value == 0.0 && !signbit(value) && tensor_is_contiguous(t)) {
        /* +0 is all-zero bits in every dtype: a memset, with no f32 staging
         * copy on a device (a bf16 flat gradient's would be twice its size) */
        KERNELS(t)->zero(tensor_data(t), (size_t)n * fsdp_dtype_size(t->dtype));
        return FSDP_OK;
    }
    union { float f; uint16_t h; int32_t i; int64_t l; } v;
    switch (t->dtype) {
    case FSDP_F32: v.f = (float)value; break;
    case FSDP_BF16: v.h = f32_to_bf16((float)value); break;
    case FSDP_I32: v.i = (int32_t)value; break;
    case FSDP_I64: v.l = (int64_t)value; break;
    default: v.h = (uint16_t)value; break;
    }
    int64_t zero[FSDP_MAX_DIMS] = {0};
    if (t->dtype == FSDP_F32 && tensor_is_contiguous(t)) {
        KERNELS(t)->fill_f32(tensor_data(t), v.f, n);
    } else if (device_is_host_like(tensor_device(t))) {   /* the value read in place with stride 0 */
        KERNELS(t)->copy_strided(tensor_data(t), t->strides, &v, zero, t->ndim, t->shape, fsdp_dtype_size(t->dtype));
    } else {   /* elsewhere the value must live on the device first: an f32 fill, then a converting copy */
        fsdp_tensor *f;
        FSDP_TRY(tensor_new(&f, FSDP_F32, t->ndim, t->shape, tensor_device(t), FSDP_TAG_OTHER, false));
        KERNELS(f)->fill_f32(tensor_data(f), (float)value, n);
        fsdp_status st = fsdp_copy(t, f);
        tensor_release(f);
        return st;
    }
    return FSDP_OK;
}

/* Strides that read src as if it had dst's shape (numpy broadcasting).
 * Returns false when the shapes do not broadcast. */
static bool broadcast_strides(const fsdp_tensor *src, int ndim, const int64_t *shape, int64_t *strides) {
    if (src->ndim > ndim) return false;
    int lead = ndim - src->ndim;
    for (int d = 0; d < ndim; d++) {
        if (d < lead) { strides[d] = 0; continue; }
        int64_t s = src->shape[d - lead];
        if (s == shape[d]) strides[d] = s == 1 ? 0 : src->strides[d - lead];
        else if (s == 1) strides[d] = 0;
        else return false;
    }
    return true;
}

fsdp_status fsdp_copy(fsdp_tensor *dst, fsdp_tensor *src) {
    CHECK_T("fsdp_copy", dst);
    CHECK_T("fsdp_copy", src);
    CHECK_LIVE("fsdp_copy", dst);
    CHECK_LIVE("fsdp_copy", src);
    char a[200], b[200];
    FSDP_TRY(check_writable("fsdp_copy", dst));
    if (tensor_device(dst) != tensor_device(src)) {
        /* across devices: src moves to dst's device first (contiguous, as is) */
        fsdp_tensor *moved;
        FSDP_TRY(fsdp_tensor_to_device(&moved, src, tensor_device(dst)));
        fsdp_status st = fsdp_copy(dst, moved);
        tensor_release(moved);
        return st;
    }
    int64_t strides[FSDP_MAX_DIMS];
    if (!broadcast_strides(src, dst->ndim, dst->shape, strides))
        return fsdp_set_error(FSDP_ERR_SHAPE, "fsdp_copy: src %s does not broadcast to dst %s",
                              tensor_desc(src, b, sizeof b), tensor_desc(dst, a, sizeof a));
    if (src->dtype == dst->dtype) {
        KERNELS(dst)->copy_strided(tensor_data(dst), dst->strides, tensor_data(src), strides, dst->ndim, dst->shape,
                         fsdp_dtype_size(dst->dtype));
        return FSDP_OK;
    }
    /* both contiguous, the same shape and apart in memory: one cast straight
     * into dst, no staged copy (a shard group of one casting its f32 master
     * into the unit's bf16 buffer, or its bf16 gradient into an f32 one) */
    bool same_shape = src->ndim == dst->ndim;
    for (int i = 0; same_shape && i < dst->ndim; i++) same_shape = src->shape[i] == dst->shape[i];
    if (same_shape && tensor_is_contiguous(src) && tensor_is_contiguous(dst)) {
        const char *d0 = tensor_data(dst), *s0 = tensor_data(src);
        int64_t n = tensor_numel(dst);
        size_t dn = (size_t)n * fsdp_dtype_size(dst->dtype), sn = (size_t)n * fsdp_dtype_size(src->dtype);
        if (n == 0) return FSDP_OK;
        if (d0 + dn <= s0 || s0 + sn <= d0) {
            KERNELS(dst)->cast_any(tensor_data(dst), dst->dtype, tensor_data(src), src->dtype, n);
            return FSDP_OK;
        }
    }
    /* convert first (src may alias dst only when dtypes match) */
    fsdp_tensor *c;
    FSDP_TRY(tensor_convert(&c, src, dst->dtype));
    broadcast_strides(c, dst->ndim, dst->shape, strides);
    KERNELS(dst)->copy_strided(tensor_data(dst), dst->strides, tensor_data(c), strides, dst->ndim, dst->shape,
                     fsdp_dtype_size(dst->dtype));
    tensor_release(c);
    return FSDP_OK;
}

static fsdp_status init_random(const char *op, fsdp_tensor *t, int uniform, double a, double b, uint64_t seed,
                               uint64_t stream, int64_t offset) {
    CHECK_T(op, t);
    CHECK_LIVE(op, t);
    char d[200];
    if (!fsdp_dtype_is_float(t->dtype))
        return fsdp_set_error(FSDP_ERR_DTYPE, "%s: %s is not a float tensor", op, tensor_desc(t, d, sizeof d));
    if (offset < 0) return fsdp_set_error(FSDP_ERR_INVALID, "%s: negative offset %lld", op, (long long)offset);
    FSDP_TRY(check_writable(op, t));
    int64_t n = tensor_numel(t);
    if (t->dtype == FSDP_F32 && tensor_is_contiguous(t)) {
        if (uniform) KERNELS(t)->init_uniform_f32(tensor_data(t), n, (float)a, (float)b, seed, stream, offset);
        else KERNELS(t)->init_normal_f32(tensor_data(t), n, (float)a, (float)b, seed, stream, offset);
        return FSDP_OK;
    }
    fsdp_tensor *tmp;
    FSDP_TRY(tensor_new(&tmp, FSDP_F32, t->ndim, t->shape, tensor_device(t), FSDP_TAG_OTHER, false));
    if (uniform) KERNELS(tmp)->init_uniform_f32(tensor_data(tmp), n, (float)a, (float)b, seed, stream, offset);
    else KERNELS(tmp)->init_normal_f32(tensor_data(tmp), n, (float)a, (float)b, seed, stream, offset);
    fsdp_status st = fsdp_copy(t, tmp);
    tensor_release(tmp);
    return st;
}

fsdp_status fsdp_init_normal(fsdp_tensor *t, double mean, double std, uint64_t seed, uint64_t stream,
                             int64_t offset) {
    if (!(std >= 0)) return fsdp_set_error(FSDP_ERR_INVALID, "fsdp_init_normal: std %g is negative", std);
    return init_random("fsdp_init_normal", t, 0, mean, std, seed, stream, offset);
}

fsdp_status fsdp_init_uniform(fsdp_tensor *t, double low, double high, uint64_t seed, uint64_t stream,
                              int64_t offset) {
    if (!(low <= high))
        return fsdp_set_error(FSDP_ERR_INVALID, "fsdp_init_uniform: low %g is above high %g", low, high);
    return init_random("fsdp_init_uniform", t, 1, low, high, seed, stream, offset);
}
