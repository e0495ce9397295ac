/* gradcheck.h: compares an op's backward with central finite differences
 * of its forward, through the public API only. */
#ifndef FSDP_GRADCHECK_H
#define FSDP_GRADCHECK_H
#include "fsdp.h"

/* Runs the op on inputs; *out is the op's output. */
typedef fsdp_status (*gc_forward_fn)(fsdp_tensor **out, fsdp_tensor **in, void *ctx);

typedef struct {
    int n_in;
    int ndim[4];
    int64_t shape[4][8];
    int differentiable[4];    /* 0: an input that takes no gradient (ids, targets) */
    fsdp_tensor *fixed[4];    /* used as is when set (integer inputs) */
} gc_spec;

/* Checks d(sum(out * R))/d(in) for random inputs and a random R; returns
 * the number of wrong gradient entries (each reported). */
int gradcheck(const char *name, gc_forward_fn fn, void *ctx, const gc_spec *spec, unsigned seed, double eps,
              double tol);

/* A new f32 tensor from values. */
fsdp_tensor *gc_tensor(int ndim, const int64_t *shape, const float *values);
#endif
