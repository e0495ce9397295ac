/* reduce_shape.h: summing a gradient back onto a broadcast operand's shape,
 * shared by the broadcasting ops, expand, and sum/mean. */
#ifndef FSDP_REDUCE_SHAPE_H
#define FSDP_REDUCE_SHAPE_H
#include "internal.h"

/* g is f32 contiguous; *out (f32 contiguous, shape (ndim, shape)) is g
 * summed over the dims where shape (aligned to the right) is 1 or missing.
 * Returns g itself, retained, when nothing needs summing. */
fsdp_status sum_to_shape(fsdp_tensor **out, fsdp_tensor *g, int ndim, const int64_t *shape);
/* Sums f32 contiguous t over the dims flagged in reduce[] (keeping them as 1). */
fsdp_status sum_dims_keep(fsdp_tensor **out, fsdp_tensor *t, const bool *reduce);

#endif
