/* optim_kernels.c: fused optimizer updates, one pass over flat buffers. */
#include "cpu_kernels.h"
#include <math.h>

typedef struct {
    float *p, *m, *v;
    const float *g;
    float beta1, beta2, eps, decay, step_size, inv_sqrt_bc2;
} adamw_args;

static void adamw_range(void *ctx, int64_t begin, int64_t end) {
    const adamw_args *a = ctx;
    for (int64_t i = begin; i < end; i++) {
        float g = a->g[i];
        float p = a->p[i] * a->decay;                          /* decoupled weight decay */
        float m = a->beta1 * a->m[i] + (1.0f - a->beta1) * g;
        float v = a->beta2 * a->v[i] + (1.0f - a->beta2) * g * g;
        float denom = sqrtf(v) * a->inv_sqrt_bc2 + a->eps;    /* sqrt(v / bc2) + eps, as PyTorch */
        a->m[i] = m;
        a->v[i] = v;
        a->p[i] = p - a->step_size * m / denom;
    }
}

void cpu_adamw_f32(float *p, const float *g, float *m, float *v, int64_t n, float beta1, float beta2, float eps,
                   float decay, float step_size, float inv_sqrt_bc2) {
    adamw_args a = {p, m, v, g, beta1, beta2, eps, decay, step_size, inv_sqrt_bc2};
    cpu_parallel_for(n, 1 << 15, adamw_range, &a);
}

typedef struct {
    float *p, *buf;
    const float *g;
    float lr, momentum, dampening, wd;
    int nesterov, first;
} sgd_args;

static void sgd_range(void *ctx, int64_t begin, int64_t end) {
    const sgd_args *a = ctx;
    for (int64_t i = begin; i < end; i++) {
        float d = a->g[i] + a->wd * a->p[i];
        if (a->buf) {
            float b = a->first ? d : a->momentum * a->buf[i] + (1.0f - a->dampening) * d;
            a->buf[i] = b;
            d = a->nesterov ? d + a->momentum * b : b;
        }
        a->p[i] -= a->lr * d;
    }
}

void cpu_sgd_f32(float *p, const float *g, float *buf, int64_t n, float lr, float momentum, float dampening,
                 float weight_decay, int nesterov, int first) {
    sgd_args a = {p, buf, g, lr, momentum, dampening, weight_decay, nesterov, first};
    cpu_parallel_for(n, 1 << 15, sgd_range, &a);
}
