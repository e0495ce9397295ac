/* optim.cu: fused optimizer updates, one pass over flat buffers, with
 * the float expressions of engine/cpu/optim.c. */
#include "cuda_internal.h"

/* AdamW, PyTorch's update: p = p*decay - step_size * m / (sqrt(v)*inv_sqrt_bc2 + eps),
 * on the gradient g * grad_scale (a clip's coefficient folded into the pass) */
__global__ void adamw_kernel(float *p, const float *g, float *m, float *v, int64_t n, float beta1, float beta2,
                             float eps, float decay, float step_size, float inv_sqrt_bc2, float grad_scale) {
    GRID_STRIDE(i, n) {
        float gi = g[i] * grad_scale;
        float pi = p[i] * decay;   /* decoupled weight decay */
        float mi = beta1 * m[i] + (1.0f - beta1) * gi;
        float vi = beta2 * v[i] + (1.0f - beta2) * gi * gi;
        float denom = sqrtf(vi) * inv_sqrt_bc2 + eps;
        m[i] = mi;
        v[i] = vi;
        p[i] = pi - step_size * mi / denom;
    }
}

/* ---- AdamW over many tensors: a few launches for a whole model ----
 * The tensors go ADAM_GROUP at a time in a struct argument (kernel parameter
 * space: no descriptor copy to the device, under the 4 KiB every CUDA
 * version takes); tensor k of a group owns blocks [block0[k], block0[k] +
 * ceil(n[k] / ADAM_PER_BLOCK)), and a block finds its tensor by a binary
 * search over block0. Each element gets adamw_kernel's expressions; where
 * pb[k] is given, the new value's bf16 rounding goes there too (the
 * master's compute copy: f32_to_bf16 of the float stored in p, so bit for
 * bit the cast a gather would make of it). */
#define ADAM_GROUP 56
#define ADAM_PER_BLOCK ((int64_t)CUDA_THREADS * 8)

struct adam_group {
    float *p[ADAM_GROUP];
    uint16_t *pb[ADAM_GROUP];
    const float *g[ADAM_GROUP];
    float *m[ADAM_GROUP], *v[ADAM_GROUP];
    int64_t n[ADAM_GROUP], block0[ADAM_GROUP];
    float decay[ADAM_GROUP], step_size[ADAM_GROUP], inv_sqrt_bc2[ADAM_GROUP];
    int count;
};
static_assert(sizeof(adam_group) <= 4000, "adam_group must fit the 4 KiB of kernel parameters");

/* the emulation opens the memory a kernel reaches through a struct argument */
[[maybe_unused]] static inline void emu_kernel_ptrs(const adam_group &a, emu_ptr_list &list) {
    for (int k = 0; k < a.count; k++) {
        list.add(a.p[k]);
        if (a.pb[k]) list.add(a.pb[k]);
        list.add(a.g[k]);
        list.add(a.m[k]);
        list.add(a.v[k]);
    }
}

__global__ void adamw_group_kernel(adam_group a, float beta1, float beta2, float eps, float grad_scale) {
    int lo = 0, hi = a.count - 1;   /* the last k with block0[k] <= blockIdx.x */
    while (lo < hi) {
        int mid = (lo + hi + 1) / 2;
        if (a.block0[mid] <= (int64_t)blockIdx.x) lo = mid;
        else hi = mid - 1;
    }
    int k = lo;
    int64_t start = ((int64_t)blockIdx.x - a.block0[k]) * ADAM_PER_BLOCK;
    int64_t end = cuda_min64(start + ADAM_PER_BLOCK, a.n[k]);
    float *p = a.p[k], *m = a.m[k], *v = a.v[k];
    uint16_t *pb = a.pb[k];
    const float *g = a.g[k];
    float decay = a.decay[k], step_size = a.step_size[k], inv_sqrt_bc2 = a.inv_sqrt_bc2[k];
    for (int64_t i = start + threadIdx.x; i < end; i += blockDim.x) {
        float gi = g[i] * grad_scale;
        float pi = p[i] * decay;
        float mi = beta1 * m[i] + (1.0f - beta1) * gi;
        float vi = beta2 * v[i] + (1.0f - beta2) * gi * gi;
        float denom = sqrtf(vi) * inv_sqrt_bc2 + eps;
        float pn = pi - step_size * mi / denom;
        m[i] = mi;
        v[i] = vi;
        p[i] = pn;
        if (pb) pb[i] = f32_to_bf16(pn);
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
                    float decay, float step_size, float inv_sqrt_bc2, float grad_scale) {
    CUDA_ENTER();
    if (n <= 0) return;
    LAUNCH(adamw_kernel, cuda_blocks(n, CUDA_THREADS), CUDA_THREADS, 0)(p, g, m, v, n, beta1, beta2, eps, decay,
                                                                        step_size, inv_sqrt_bc2, grad_scale);
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

void cuda_adamw_many_f32(float *const *p, uint16_t *const *pb, const float *const *g, float *const *m,
                         float *const *v, const int64_t *counts, const float *decay, const float *step_size,
                         const float *inv_sqrt_bc2, int n, float beta1, float beta2, float eps, float grad_scale) {
    CUDA_ENTER();
    adam_group a;
    a.count = 0;
    int64_t blocks = 0;   /* of the group being filled */
    for (int i = 0; i <= n; i++) {
        bool flush = i == n || a.count == ADAM_GROUP;
        if (flush && a.count > 0) {
            if (blocks > INT32_MAX) cuda_fail(__func__, __FILE__, __LINE__, "adamw_many", "more than 2^31 - 1 blocks");
            LAUNCH(adamw_group_kernel, (unsigned)blocks, CUDA_THREADS, 0)(a, beta1, beta2, eps, grad_scale);
            CUDA_CHECK_LAUNCH();
            a.count = 0;
            blocks = 0;
        }
        if (i == n || counts[i] <= 0) continue;
        int k = a.count++;
        a.p[k] = p[i];
        a.pb[k] = pb ? pb[i] : nullptr;
        a.g[k] = g[i];
        a.m[k] = m[i];
        a.v[k] = v[i];
        a.n[k] = counts[i];
        a.block0[k] = blocks;
        a.decay[k] = decay[i];
        a.step_size[k] = step_size[i];
        a.inv_sqrt_bc2[k] = inv_sqrt_bc2[i];
        blocks += cuda_ceil_div(counts[i], ADAM_PER_BLOCK);
    }
}
