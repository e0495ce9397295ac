/* activation.cu: GELU and SiLU, forward and backward, f32 and bf16, with
 * the semantics of engine/cpu/activation.c. Elementwise, grid-stride. */
#include "cuda_internal.h"
#include "gelu.h"

/* ---- activations ----
 * GELU, tanh form: gelu.h's, as activation.c. */

__device__ __forceinline__ float sigmoid_f(float z) { return 1.0f / (1.0f + expf(-z)); }

template <class T> __global__ void gelu_fwd_kernel(T *__restrict__ out, const T *__restrict__ x, int64_t n) {
    GRID_STRIDE(i, n) {
        float v = ldf(x[i]);
        stf(out + i, gelu(v));
    }
}

/* d/dx [x s(2u)] = s + x * 2 s (1 - s) * du/dx */
template <class T>
__global__ void gelu_bwd_kernel(T *__restrict__ dx, const T *__restrict__ x, const T *__restrict__ dout, int64_t n) {
    GRID_STRIDE(i, n) {
        float v = ldf(x[i]);
        stf(dx + i, ldf(dout[i]) * gelu_grad(v));
    }
}

template <class T> __global__ void silu_fwd_kernel(T *__restrict__ out, const T *__restrict__ x, int64_t n) {
    GRID_STRIDE(i, n) {
        float v = ldf(x[i]);
        stf(out + i, v * sigmoid_f(v));
    }
}

/* d/dx [x s(x)] = s + x s (1 - s) */
template <class T>
__global__ void silu_bwd_kernel(T *__restrict__ dx, const T *__restrict__ x, const T *__restrict__ dout, int64_t n) {
    GRID_STRIDE(i, n) {
        float v = ldf(x[i]), s = sigmoid_f(v);
        stf(dx + i, ldf(dout[i]) * s * (1.0f + v * (1.0f - s)));
    }
}

/* ReLU, as engine/cpu/activation.c: a NaN passes through */
template <class T> __global__ void relu_fwd_kernel(T *__restrict__ out, const T *__restrict__ x, int64_t n) {
    GRID_STRIDE(i, n) {
        float v = ldf(x[i]);
        stf(out + i, v > 0.0f ? v : (v != v ? v : 0.0f));
    }
}

template <class T>
__global__ void relu_bwd_kernel(T *__restrict__ dx, const T *__restrict__ x, const T *__restrict__ dout, int64_t n) {
    GRID_STRIDE(i, n) stf(dx + i, ldf(x[i]) > 0.0f ? ldf(dout[i]) : 0.0f);
}

#define ELEMENTWISE_ENTRY(name, kernel, params, args)                                   \
    void name params {                                                                  \
        CUDA_ENTER();                                                                   \
        if (n <= 0) return;                                                             \
        LAUNCH(kernel, cuda_blocks(n, CUDA_THREADS), CUDA_THREADS, 0) args;             \
        CUDA_CHECK_LAUNCH();                                                            \
    }
ELEMENTWISE_ENTRY(cuda_gelu_forward_f32, gelu_fwd_kernel<float>, (float *out, const float *x, int64_t n), (out, x, n))
ELEMENTWISE_ENTRY(cuda_gelu_backward_f32, gelu_bwd_kernel<float>,
                  (float *dx, const float *x, const float *dout, int64_t n), (dx, x, dout, n))
ELEMENTWISE_ENTRY(cuda_silu_forward_f32, silu_fwd_kernel<float>, (float *out, const float *x, int64_t n), (out, x, n))
ELEMENTWISE_ENTRY(cuda_silu_backward_f32, silu_bwd_kernel<float>,
                  (float *dx, const float *x, const float *dout, int64_t n), (dx, x, dout, n))
ELEMENTWISE_ENTRY(cuda_gelu_forward_bf16, gelu_fwd_kernel<uint16_t>, (uint16_t *out, const uint16_t *x, int64_t n),
                  (out, x, n))
ELEMENTWISE_ENTRY(cuda_gelu_backward_bf16, gelu_bwd_kernel<uint16_t>,
                  (uint16_t *dx, const uint16_t *x, const uint16_t *dout, int64_t n), (dx, x, dout, n))
ELEMENTWISE_ENTRY(cuda_silu_forward_bf16, silu_fwd_kernel<uint16_t>, (uint16_t *out, const uint16_t *x, int64_t n),
                  (out, x, n))
ELEMENTWISE_ENTRY(cuda_silu_backward_bf16, silu_bwd_kernel<uint16_t>,
                  (uint16_t *dx, const uint16_t *x, const uint16_t *dout, int64_t n), (dx, x, dout, n))
ELEMENTWISE_ENTRY(cuda_relu_forward_f32, relu_fwd_kernel<float>, (float *out, const float *x, int64_t n), (out, x, n))
ELEMENTWISE_ENTRY(cuda_relu_backward_f32, relu_bwd_kernel<float>,
                  (float *dx, const float *x, const float *dout, int64_t n), (dx, x, dout, n))
ELEMENTWISE_ENTRY(cuda_relu_forward_bf16, relu_fwd_kernel<uint16_t>, (uint16_t *out, const uint16_t *x, int64_t n),
                  (out, x, n))
ELEMENTWISE_ENTRY(cuda_relu_backward_bf16, relu_bwd_kernel<uint16_t>,
                  (uint16_t *dx, const uint16_t *x, const uint16_t *dout, int64_t n), (dx, x, dout, n))
