/* softmax.cu: softmax and log-softmax over the last dim of (rows, cols),
 * forward and backward, with the semantics of engine/cpu/softmax.c.
 *
 * Row-wise kernels take one block per row (warp shuffles, then the warps'
 * results in shared memory); row statistics accumulate in double, as on the
 * CPU. Every sum is taken in an order fixed by the sizes alone: no atomics
 * on floats anywhere, so results repeat bit for bit. */
#include "cuda_internal.h"
#include <float.h>

/* ---- softmax and log-softmax over the last dim of (rows, cols) ---- */

/* log_mode 0: y = exp(x - max) / sum; 1: y = (x - max) - log sum */
template <class T>
__global__ void softmax_fwd_kernel(T *__restrict__ out, const T *__restrict__ x, int64_t rows, int64_t cols,
                                   int log_mode) {
    __shared__ double sd[32];
    __shared__ float sf[32];
    FOR_ROWS(r, rows) {
        const T *xr = x + r * cols;   // (cols)
        T *yr = out + r * cols;
        float m = -INFINITY;
        for (int64_t j = threadIdx.x; j < cols; j += blockDim.x) m = fmaxf(m, ldf(xr[j]));
        m = block_max_f(m, sf);
        double sum = 0.0;
        for (int64_t j = threadIdx.x; j < cols; j += blockDim.x) sum += (double)expf(ldf(xr[j]) - m);
        sum = block_sum_d(sum, sd);
        if (log_mode) {
            float logsum = (float)log(sum);
            for (int64_t j = threadIdx.x; j < cols; j += blockDim.x) stf(yr + j, (ldf(xr[j]) - m) - logsum);
        } else {
            float inv = (float)(1.0 / sum);
            for (int64_t j = threadIdx.x; j < cols; j += blockDim.x) stf(yr + j, expf(ldf(xr[j]) - m) * inv);
        }
    }
}

/* log_mode 0 (y = softmax): dx = y (dy - sum dy y);
 * log_mode 1 (y = log softmax): dx = dy - exp(y) sum dy */
template <class T>
__global__ void softmax_bwd_kernel(T *__restrict__ dx, const T *__restrict__ y, const T *__restrict__ dy, int64_t rows,
                                   int64_t cols, int log_mode) {
    __shared__ double sd[32];
    FOR_ROWS(r, rows) {
        const T *yr = y + r * cols, *dyr = dy + r * cols;   // (cols)
        T *dxr = dx + r * cols;
        double acc = 0.0;
        for (int64_t j = threadIdx.x; j < cols; j += blockDim.x)
            acc += log_mode ? (double)ldf(dyr[j]) : (double)ldf(dyr[j]) * ldf(yr[j]);
        float s = (float)block_sum_d(acc, sd);
        if (log_mode)
            for (int64_t j = threadIdx.x; j < cols; j += blockDim.x) stf(dxr + j, ldf(dyr[j]) - expf(ldf(yr[j])) * s);
        else
            for (int64_t j = threadIdx.x; j < cols; j += blockDim.x) stf(dxr + j, ldf(yr[j]) * (ldf(dyr[j]) - s));
    }
}

template <class T> static void softmax_fwd(T *out, const T *x, int64_t rows, int64_t cols, int log_mode) {
    if (rows <= 0 || cols <= 0) return;
    LAUNCH(softmax_fwd_kernel<T>, cuda_row_blocks(rows), cuda_row_threads(cols), 0)(out, x, rows, cols, log_mode);
    CUDA_CHECK_LAUNCH();
}

template <class T> static void softmax_bwd(T *dx, const T *y, const T *dy, int64_t rows, int64_t cols, int log_mode) {
    if (rows <= 0 || cols <= 0) return;
    LAUNCH(softmax_bwd_kernel<T>, cuda_row_blocks(rows), cuda_row_threads(cols), 0)(dx, y, dy, rows, cols, log_mode);
    CUDA_CHECK_LAUNCH();
}

#define SOFTMAX_ENTRIES(T, sfx)                                                                   \
    void cuda_softmax_forward_##sfx(T *out, const T *x, int64_t rows, int64_t cols) {             \
        CUDA_ENTER();                                                                             \
        softmax_fwd(out, x, rows, cols, 0);                                                       \
    }                                                                                             \
    void cuda_softmax_backward_##sfx(T *dx, const T *y, const T *dy, int64_t rows, int64_t cols) { \
        CUDA_ENTER();                                                                             \
        softmax_bwd(dx, y, dy, rows, cols, 0);                                                    \
    }                                                                                             \
    void cuda_log_softmax_forward_##sfx(T *out, const T *x, int64_t rows, int64_t cols) {         \
        CUDA_ENTER();                                                                             \
        softmax_fwd(out, x, rows, cols, 1);                                                       \
    }                                                                                             \
    void cuda_log_softmax_backward_##sfx(T *dx, const T *y, const T *dy, int64_t rows, int64_t cols) { \
        CUDA_ENTER();                                                                             \
        softmax_bwd(dx, y, dy, rows, cols, 1);                                                    \
    }
SOFTMAX_ENTRIES(float, f32)
SOFTMAX_ENTRIES(uint16_t, bf16)
