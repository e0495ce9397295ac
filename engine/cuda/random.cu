/* random.cu: parameter init and dropout from Philox4x32-10, element i
 * taking counter (offset + i), so a value depends only on (seed, stream,
 * offset + i): the same values as engine/cpu/random.c, whatever the split
 * into ranks, blocks or threads. The per-element math lives in
 * cuda_internal.h (host and device alike), where the bitwise agreement with
 * the CPU is spelled out. */
#include "cuda_internal.h"

__global__ void init_normal_kernel(float *out, int64_t n, float mean, float std, uint64_t seed, uint64_t stream,
                                   int64_t offset) {
    GRID_STRIDE(i, n) {
        uint32_t w0, w1;
        fsdp_philox2(seed, stream, (uint64_t)(offset + i), &w0, &w1);
        out[i] = fsdp_rng_normal(w0, w1, mean, std);
    }
}

__global__ void init_uniform_kernel(float *out, int64_t n, float low, float span, float high, float below_high,
                                    uint64_t seed, uint64_t stream, int64_t offset) {
    GRID_STRIDE(i, n) {
        uint32_t w0, w1;
        fsdp_philox2(seed, stream, (uint64_t)(offset + i), &w0, &w1);
        out[i] = fsdp_rng_uniform(w0, low, span, high, below_high);
    }
}

__global__ void dropout_kernel(float *out, const float *x, int64_t n, float p, float scale, uint64_t seed,
                               int64_t offset) {
    GRID_STRIDE(i, n) {
        uint32_t w0, w1;
        fsdp_philox2(seed, FSDP_DROPOUT_STREAM, (uint64_t)(offset + i), &w0, &w1);
        out[i] = fsdp_rng_dropout(w0, x[i], p, scale);
    }
}

void cuda_init_normal_f32(float *out, int64_t n, float mean, float std, uint64_t seed, uint64_t stream,
                          int64_t offset) {
    CUDA_ENTER();
    if (n <= 0) return;
    LAUNCH(init_normal_kernel, cuda_blocks(n, CUDA_THREADS), CUDA_THREADS, 0)(out, n, mean, std, seed, stream, offset);
    CUDA_CHECK_LAUNCH();
}

void cuda_init_uniform_f32(float *out, int64_t n, float low, float high, uint64_t seed, uint64_t stream,
                           int64_t offset) {
    CUDA_ENTER();
    if (n <= 0) return;
    float span = high - low, below_high = nextafterf(high, low);   /* as random.c, on the host */
    LAUNCH(init_uniform_kernel, cuda_blocks(n, CUDA_THREADS), CUDA_THREADS, 0)(out, n, low, span, high, below_high,
                                                                               seed, stream, offset);
    CUDA_CHECK_LAUNCH();
}

void cuda_dropout_f32(float *out, const float *x, int64_t n, float p, uint64_t seed, int64_t offset) {
    CUDA_ENTER();
    if (n <= 0) return;
    if (p <= 0.0f) {   /* identity, as random.c (x * 1 is exact; fine when out == x) */
        cuda_scale_f32(out, x, 1.0f, n);
        return;
    }
    /* x * (1/(1-p)), the same rounding as the CPU */
    float scale = 1.0f / (1.0f - p);
    LAUNCH(dropout_kernel, cuda_blocks(n, CUDA_THREADS), CUDA_THREADS, 0)(out, x, n, p, scale, seed, offset);
    CUDA_CHECK_LAUNCH();
}
