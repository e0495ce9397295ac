/* cast.c: dtype conversions, element by element.
 * f32 <-> bf16 are the hot pair (every bf16 op widens its inputs and narrows
 * its output), so they get their own parallel loops; the rest go through one
 * generic loop per (source kind, destination) pair. */
#include "cpu_kernels.h"
#include "fsdp.h"
#include <string.h>

#define CAST_GRAIN (1 << 16)

typedef struct { void *out; const void *in; } cast_ctx;

static void f32_to_bf16_range(void *p, int64_t begin, int64_t end) {
    cast_ctx *c = p;
    uint16_t *out = c->out;
    const float *in = c->in;
    for (int64_t i = begin; i < end; i++) out[i] = f32_to_bf16(in[i]);
}

static void bf16_to_f32_range(void *p, int64_t begin, int64_t end) {
    cast_ctx *c = p;
    float *out = c->out;
    const uint16_t *in = c->in;
    for (int64_t i = begin; i < end; i++) out[i] = bf16_to_f32(in[i]);
}

void cpu_cast_f32_to_bf16(uint16_t *out, const float *in, int64_t n) {
    cast_ctx c = {out, in};
    cpu_parallel_for(n, CAST_GRAIN, f32_to_bf16_range, &c);
}

void cpu_cast_bf16_to_f32(float *out, const uint16_t *in, int64_t n) {
    cast_ctx c = {out, in};
    cpu_parallel_for(n, CAST_GRAIN, bf16_to_f32_range, &c);
}

/* (float -> integer: f_to_i64, f_to_i32, f_to_u16 in convert.h) */

/* Load element i of a buffer of dtype dt: floats as double (exact for f32
 * and bf16), integers as int64 (exact for all three). */
static inline double load_float(const void *p, int dt, int64_t i) {
    return dt == FSDP_F32 ? (double)((const float *)p)[i] : (double)bf16_to_f32(((const uint16_t *)p)[i]);
}
static inline int64_t load_int(const void *p, int dt, int64_t i) {
    switch (dt) {
    case FSDP_I32: return ((const int32_t *)p)[i];
    case FSDP_I64: return ((const int64_t *)p)[i];
    default:       return ((const uint16_t *)p)[i];
    }
}

typedef struct { void *out; int out_dtype; const void *in; int in_dtype; } cast_any_ctx;

/* One loop per destination; the source switch is loop-invariant, which the
 * compiler hoists (unswitches). */
#define CAST_LOOP(T, from_float, from_int)                                          \
    do {                                                                            \
        T *o = c->out;                                                              \
        if (in_is_float)                                                            \
            for (int64_t i = begin; i < end; i++) o[i] = from_float(load_float(c->in, c->in_dtype, i)); \
        else                                                                        \
            for (int64_t i = begin; i < end; i++) o[i] = from_int(load_int(c->in, c->in_dtype, i));     \
    } while (0)

#define TO_F32(v)  ((float)(v))
#define TO_BF16(v) f32_to_bf16((float)(v))
#define I_TO_I32(v) ((int32_t)(v))
#define I_TO_I64(v) ((int64_t)(v))
#define I_TO_U16(v) ((uint16_t)(v))   /* wraps modulo 2^16, like C */

static void cast_any_range(void *p, int64_t begin, int64_t end) {
    cast_any_ctx *c = p;
    int in_is_float = c->in_dtype == FSDP_F32 || c->in_dtype == FSDP_BF16;
    switch (c->out_dtype) {
    case FSDP_F32:  CAST_LOOP(float, TO_F32, TO_F32); break;
    case FSDP_BF16: CAST_LOOP(uint16_t, TO_BF16, TO_BF16); break;
    case FSDP_I32:  CAST_LOOP(int32_t, f_to_i32, I_TO_I32); break;
    case FSDP_I64:  CAST_LOOP(int64_t, f_to_i64, I_TO_I64); break;
    case FSDP_U16:  CAST_LOOP(uint16_t, f_to_u16, I_TO_U16); break;
    default: break;
    }
}

static size_t dtype_bytes(int dt) {
    switch (dt) {
    case FSDP_F32: case FSDP_I32: return 4;
    case FSDP_I64: return 8;
    default: return 2;
    }
}

void cpu_cast_any(void *out, int out_dtype, const void *in, int in_dtype, int64_t n) {
    if (n <= 0) return;
    if (out_dtype == in_dtype) { memcpy(out, in, (size_t)n * dtype_bytes(in_dtype)); return; }
    if (in_dtype == FSDP_F32 && out_dtype == FSDP_BF16) { cpu_cast_f32_to_bf16(out, in, n); return; }
    if (in_dtype == FSDP_BF16 && out_dtype == FSDP_F32) { cpu_cast_bf16_to_f32(out, in, n); return; }
    cast_any_ctx c = {out, out_dtype, in, in_dtype};
    cpu_parallel_for(n, CAST_GRAIN, cast_any_range, &c);
}
