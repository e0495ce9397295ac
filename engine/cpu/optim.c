/* optim.c: fused optimizer updates, one pass over flat buffers. */
#include "cpu_kernels.h"
#include <math.h>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

typedef struct {
    float *p, *m, *v;
    const float *g;
    float beta1, beta2, eps, decay, step_size, inv_sqrt_bc2, grad_scale;
} adamw_args;

/* The update of elements [begin, end), one at a time: the reference (and
 * the tail) of the vector loop below, which evaluates the same expressions
 * in the same order. The gradient is read as g * grad_scale, rounded to f32:
 * what a clip's scale pass over g (cpu_scale_f32) would have stored, so the
 * clip costs no pass of its own. Restrict locals: the four buffers never
 * overlap, and without it every store reloads the pointers and the loop
 * stays scalar. */
static void adamw_scalar(const adamw_args *a, int64_t begin, int64_t end) {
    float *restrict p = a->p, *restrict mb = a->m, *restrict vb = a->v;
    const float *restrict gb = a->g;
    const float beta1 = a->beta1, beta2 = a->beta2, eps = a->eps, decay = a->decay, step_size = a->step_size,
                ibc2 = a->inv_sqrt_bc2, grad_scale = a->grad_scale;
    for (int64_t i = begin; i < end; i++) {
        float g = gb[i] * grad_scale;
        float m = beta1 * mb[i] + (1.0f - beta1) * g;
        float v = beta2 * vb[i] + (1.0f - beta2) * g * g;
        float denom = sqrtf(v) * ibc2 + eps;    /* sqrt(v / bc2) + eps, as PyTorch */
        mb[i] = m;
        vb[i] = v;
        p[i] = p[i] * decay - step_size * m / denom;   /* decoupled weight decay first */
    }
}

static void adamw_range(void *ctx, int64_t begin, int64_t end) {
    const adamw_args *a = ctx;
    int64_t i = begin;
#if defined(__AVX512F__)
    /* 16 lanes: the pass is memory-bound once sqrt and the division are
     * vector instructions (the scalar loop is bound by them instead) */
    const __m512 beta1 = _mm512_set1_ps(a->beta1), one_m_beta1 = _mm512_set1_ps(1.0f - a->beta1);
    const __m512 beta2 = _mm512_set1_ps(a->beta2), one_m_beta2 = _mm512_set1_ps(1.0f - a->beta2);
    const __m512 eps = _mm512_set1_ps(a->eps), decay = _mm512_set1_ps(a->decay);
    const __m512 step_size = _mm512_set1_ps(a->step_size), ibc2 = _mm512_set1_ps(a->inv_sqrt_bc2);
    const __m512 grad_scale = _mm512_set1_ps(a->grad_scale);
    for (; i + 16 <= end; i += 16) {
        __m512 g = _mm512_mul_ps(_mm512_loadu_ps(a->g + i), grad_scale);
        __m512 m = _mm512_fmadd_ps(beta1, _mm512_loadu_ps(a->m + i), _mm512_mul_ps(one_m_beta1, g));
        __m512 v = _mm512_fmadd_ps(beta2, _mm512_loadu_ps(a->v + i), _mm512_mul_ps(_mm512_mul_ps(one_m_beta2, g), g));
        __m512 denom = _mm512_fmadd_ps(_mm512_sqrt_ps(v), ibc2, eps);
        __m512 p = _mm512_sub_ps(_mm512_mul_ps(_mm512_loadu_ps(a->p + i), decay),
                                 _mm512_div_ps(_mm512_mul_ps(step_size, m), denom));
        _mm512_storeu_ps(a->m + i, m);
        _mm512_storeu_ps(a->v + i, v);
        _mm512_storeu_ps(a->p + i, p);
    }
#endif
    adamw_scalar(a, i, end);
}

void cpu_adamw_f32(float *p, const float *g, float *m, float *v, int64_t n, float beta1, float beta2, float eps,
                   float decay, float step_size, float inv_sqrt_bc2, float grad_scale) {
    adamw_args a = {p, m, v, g, beta1, beta2, eps, decay, step_size, inv_sqrt_bc2, grad_scale};
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
