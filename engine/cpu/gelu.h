/* gelu.h: GELU in its tanh form as the CPU kernels compute it, one
 * element at a time (vec512.h has the 16-lane twin):
 *   gelu(x) = x sigmoid(2u), u = sqrt(2/pi) (x + 0.044715 x^3),
 * since 0.5 (1 + tanh u) = sigmoid(2u), and its derivative
 *   s + 2 x s (1 - s) du/dx, s = sigmoid(2u) (1 - tanh^2 u = 4 s (1 - s)).
 * Shared by activation.c and fused.c so that the plain and the
 * bias-fused kernels agree bit for bit. */
#ifndef FSDP_CPU_GELU_H
#define FSDP_CPU_GELU_H

#include <math.h>

#define GELU_C 0.7978845608028654f   /* sqrt(2/pi) */
#define GELU_A 0.044715f

static inline float gelu_sigmoid(float z) { return 1.0f / (1.0f + expf(-z)); }

static inline float gelu(float x) {
    float u = GELU_C * (x + GELU_A * x * x * x);
    return x * gelu_sigmoid(2.0f * u);
}

static inline float gelu_grad(float x) {
    float u = GELU_C * (x + GELU_A * x * x * x);
    float du = GELU_C * (1.0f + 3.0f * GELU_A * x * x);
    float s = gelu_sigmoid(2.0f * u);
    return s + 2.0f * x * s * (1.0f - s) * du;
}

#endif
