/* cuda_optim.cu: fused optimizer updates, one pass over flat buffers, with
 * the float expressions of engine/cpu/optim_kernels.c. */
#include "cuda_internal.h"

/* AdamW, PyTorch's update: p = p*decay - step_size * m / (sqrt(v)*inv_sqrt_bc2 + eps) */
__global__ void adamw_kernel(float *p, const float *g, float *m, float *v, int64_t n, float beta1, float beta2,
                             float eps, float decay, float step_size, float inv_sqrt_bc2) {
    GRID_STRIDE(i, n) {
        float gi = g[i];
        float pi = p[i] * decay;   /* decoupled weight decay */
        float mi = beta1 * m[i] + (1.0f - beta1) * gi;
        float vi = beta2 * v[i] + (1.0f - beta2) * gi * gi;
        float denom = sqrtf(vi) * inv_sqrt_bc2 + eps;
        m[i] = mi;
        v[i] = vi;
        p[i] = pi - step_size * mi / denom;
    }
}

/* SGD, PyTorch's update; buf NULL when momentum is 0; first initializes buf with d. */
__global__ void sgd_kernel(float *p, const float *g, float *buf, int64_t n, float lr, float momentum, float dampening,
                           float wd, int nesterov, int first) {
    GRID_STRIDE(i, n) {
        float d = g[i] + wd * p[i];
        if (buf) {
            float b = first ? d : momentum * buf[i] + (1.0f - dampening) * d;
            buf[i] = b;
            d = nesterov ? d + momentum * b : b;
        }
        p[i] -= lr * d;
    }
}

void cuda_adamw_f32(float *p, const float *g, float *m, float *v, int64_t n, float beta1, float beta2, float eps,
                    float decay, float step_size, float inv_sqrt_bc2) {
    CUDA_ENTER();
    if (n <= 0) return;
    LAUNCH(adamw_kernel, cuda_blocks(n, CUDA_THREADS), CUDA_THREADS, 0)(p, g, m, v, n, beta1, beta2, eps, decay,
                                                                        step_size, inv_sqrt_bc2);
    CUDA_CHECK_LAUNCH();
}

void cuda_sgd_f32(float *p, const float *g, float *buf, int64_t n, float lr, float momentum, float dampening,
                  float weight_decay, int nesterov, int first) {
    CUDA_ENTER();
    if (n <= 0) return;
    LAUNCH(sgd_kernel, cuda_blocks(n, CUDA_THREADS), CUDA_THREADS, 0)(p, g, buf, n, lr, momentum, dampening,
                                                                      weight_decay, nesterov, first);
    CUDA_CHECK_LAUNCH();
}
