/* activation.c: GELU (tanh form) and SiLU, forward and backward.
 *
 * GELU is the tanh approximation 0.5 x (1 + tanh(u)), u = sqrt(2/pi)(x + 0.044715 x^3),
 * evaluated through the identity 0.5 (1 + tanh(u)) = sigmoid(2u): same function,
 * but it avoids the cancellation in 1 + tanh(u) for negative x, and it costs one
 * exp instead of a tanh. */
#include "cpu_kernels.h"
#include "gelu.h"
#include "vec512.h"
#include <math.h>

#define GRAIN 16384                   /* elements per chunk: an exp costs a few ns */

typedef struct {
    float *out;
    const float *x, *dout;
} act_ctx;

static inline float sigmoidf(float z) { return 1.0f / (1.0f + expf(-z)); }

static void gelu_fwd_range(void *p, int64_t begin, int64_t end) {
    act_ctx *c = p;
#ifdef FSDP_VEC512
    for (int64_t i = begin; i < end; i += 16) {
        __mmask16 k = v16_mask(end - i);
        v16_store(c->out + i, k, v16_gelu(v16_load(c->x + i, k)));
    }
#else
    for (int64_t i = begin; i < end; i++) c->out[i] = gelu(c->x[i]);
#endif
}

static void gelu_bwd_range(void *p, int64_t begin, int64_t end) {
    act_ctx *c = p;
#ifdef FSDP_VEC512
    for (int64_t i = begin; i < end; i += 16) {
        __mmask16 k = v16_mask(end - i);
        v16_store(c->out + i, k, _mm512_mul_ps(v16_load(c->dout + i, k), v16_gelu_grad(v16_load(c->x + i, k))));
    }
#else
    for (int64_t i = begin; i < end; i++) c->out[i] = c->dout[i] * gelu_grad(c->x[i]);
#endif
}

/* bf16: widened as loaded, rounded once as stored */
typedef struct {
    uint16_t *out;
    const uint16_t *x, *dout;
} act16_ctx;

static void gelu_fwd16_range(void *p, int64_t begin, int64_t end) {
    act16_ctx *c = p;
#ifdef FSDP_VEC512
    for (int64_t i = begin; i < end; i += 16) {
        __mmask16 k = v16_mask(end - i);
        v16_store_bf16(c->out + i, k, v16_gelu(v16_load_bf16(c->x + i, k)));
    }
#else
    for (int64_t i = begin; i < end; i++) c->out[i] = f32_to_bf16(gelu(bf16_to_f32(c->x[i])));
#endif
}

static void gelu_bwd16_range(void *p, int64_t begin, int64_t end) {
    act16_ctx *c = p;
#ifdef FSDP_VEC512
    for (int64_t i = begin; i < end; i += 16) {
        __mmask16 k = v16_mask(end - i);
        __m512 g = v16_gelu_grad(v16_load_bf16(c->x + i, k));
        v16_store_bf16(c->out + i, k, _mm512_mul_ps(v16_load_bf16(c->dout + i, k), g));
    }
#else
    for (int64_t i = begin; i < end; i++)
        c->out[i] = f32_to_bf16(bf16_to_f32(c->dout[i]) * gelu_grad(bf16_to_f32(c->x[i])));
#endif
}

static void silu_fwd_range(void *p, int64_t begin, int64_t end) {
    act_ctx *c = p;
    for (int64_t i = begin; i < end; i++) c->out[i] = c->x[i] * sigmoidf(c->x[i]);
}

/* d/dx [x s(x)] = s + x s (1 - s) */
static void silu_bwd_range(void *p, int64_t begin, int64_t end) {
    act_ctx *c = p;
    for (int64_t i = begin; i < end; i++) {
        float x = c->x[i], s = sigmoidf(x);
        c->out[i] = c->dout[i] * s * (1.0f + x * (1.0f - s));
    }
}

/* ReLU; a NaN input passes through (x > 0 is false, and max would drop it) */
static void relu_fwd_range(void *p, int64_t begin, int64_t end) {
    act_ctx *c = p;
    for (int64_t i = begin; i < end; i++) c->out[i] = c->x[i] > 0.0f ? c->x[i] : (c->x[i] != c->x[i] ? c->x[i] : 0.0f);
}

static void relu_bwd_range(void *p, int64_t begin, int64_t end) {
    act_ctx *c = p;
    for (int64_t i = begin; i < end; i++) c->out[i] = c->x[i] > 0.0f ? c->dout[i] : 0.0f;
}

void cpu_relu_forward_f32(float *out, const float *x, int64_t n) {
    act_ctx c = {out, x, NULL};
    cpu_parallel_for(n, GRAIN, relu_fwd_range, &c);
}

void cpu_relu_backward_f32(float *dx, const float *x, const float *dout, int64_t n) {
    act_ctx c = {dx, x, dout};
    cpu_parallel_for(n, GRAIN, relu_bwd_range, &c);
}

void cpu_gelu_forward_f32(float *out, const float *x, int64_t n) {
    act_ctx c = {out, x, NULL};
    cpu_parallel_for(n, GRAIN, gelu_fwd_range, &c);
}

void cpu_gelu_backward_f32(float *dx, const float *x, const float *dout, int64_t n) {
    act_ctx c = {dx, x, dout};
    cpu_parallel_for(n, GRAIN, gelu_bwd_range, &c);
}

void cpu_silu_forward_f32(float *out, const float *x, int64_t n) {
    act_ctx c = {out, x, NULL};
    cpu_parallel_for(n, GRAIN, silu_fwd_range, &c);
}

void cpu_silu_backward_f32(float *dx, const float *x, const float *dout, int64_t n) {
    act_ctx c = {dx, x, dout};
    cpu_parallel_for(n, GRAIN, silu_bwd_range, &c);
}

void cpu_gelu_forward_bf16(uint16_t *out, const uint16_t *x, int64_t n) {
    act16_ctx c = {out, x, NULL};
    cpu_parallel_for(n, GRAIN, gelu_fwd16_range, &c);
}

void cpu_gelu_backward_bf16(uint16_t *dx, const uint16_t *x, const uint16_t *dout, int64_t n) {
    act16_ctx c = {dx, x, dout};
    cpu_parallel_for(n, GRAIN, gelu_bwd16_range, &c);
}
