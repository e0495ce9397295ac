/* gelu.h: GELU in its tanh form, one element at a time, as the CPU kernels
 * (activation.c, fused.c), the CUDA kernels (activation.cu, fused.cu: host
 * and device code) and the CUDA emulation all compute it (vec512.h has the
 * 16-lane twin). C, C++ and CUDA. One formula makes the plain and the
 * bias-fused kernels of one device agree bit for bit. It does not make
 * devices agree: a GPU's expf is not the host's (ulps apart), nvcc contracts
 * the multiply-adds into FMAs, and vec512.h's twin has its own exp and FMAs,
 * so the CPU, the emulation and a real GPU agree to rounding only.
 *   gelu(x) = x sigmoid(2u), u = sqrt(2/pi) (x + 0.044715 x^3),
 * since 0.5 (1 + tanh u) = sigmoid(2u) (no cancellation in 1 + tanh u for
 * negative x, one exp instead of a tanh), and its derivative
 *   s + 2 x s (1 - s) du/dx, s = sigmoid(2u) (1 - tanh^2 u = 4 s (1 - s)). */
#ifndef FSDP_GELU_H
#define FSDP_GELU_H

#include <math.h>

#if defined(__CUDACC__)
#define FSDP_GELU_FN static __host__ __device__ __forceinline__
#else
#define FSDP_GELU_FN static inline
#endif

#define GELU_C 0.7978845608028654f   /* sqrt(2/pi) */
#define GELU_A 0.044715f

FSDP_GELU_FN float gelu_sigmoid(float z) { return 1.0f / (1.0f + expf(-z)); }

FSDP_GELU_FN float gelu(float x) {
    float u = GELU_C * (x + GELU_A * x * x * x);
    return x * gelu_sigmoid(2.0f * u);
}

FSDP_GELU_FN float gelu_grad(float x) {
    float u = GELU_C * (x + GELU_A * x * x * x);
    float du = GELU_C * (1.0f + 3.0f * GELU_A * x * x);
    float s = gelu_sigmoid(2.0f * u);
    return s + 2.0f * x * s * (1.0f - s) * du;
}

#endif
