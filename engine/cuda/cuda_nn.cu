/* cuda_nn.cu: activations, softmax, normalization and cross-entropy,
 * forward and backward, with the semantics of engine/cpu activation.c,
 * softmax.c, norm.c and loss.c (the embedding: cuda_embedding.cu).
 *
 * Row-wise kernels take one block per row (warp shuffles, then the warps'
 * results in shared memory); row statistics accumulate in double, as on the
 * CPU. Every sum is taken in an order fixed by the sizes alone: no atomics
 * on floats anywhere, so results repeat bit for bit. */
#include "cuda_internal.h"
#include "gelu.h"
#include <float.h>

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

/* ---- row launches ---- */

/* Blocks for one block per row (rows beyond the grid loop). */
static unsigned row_blocks(int64_t rows) { return (unsigned)cuda_min64(rows, (int64_t)1 << 30); }

#define FOR_ROWS(r, rows) for (int64_t r = blockIdx.x; r < (rows); r += gridDim.x)

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
    LAUNCH(softmax_fwd_kernel<T>, row_blocks(rows), cuda_row_threads(cols), 0)(out, x, rows, cols, log_mode);
    CUDA_CHECK_LAUNCH();
}

template <class T> static void softmax_bwd(T *dx, const T *y, const T *dy, int64_t rows, int64_t cols, int log_mode) {
    if (rows <= 0 || cols <= 0) return;
    LAUNCH(softmax_bwd_kernel<T>, row_blocks(rows), cuda_row_threads(cols), 0)(dx, y, dy, rows, cols, log_mode);
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

/* ---- layernorm and RMSNorm over the last dim of (rows, cols) ---- */

/* layernorm: out = (x - mean) * rstd * w + b, mean and var in double, two
 * passes (no cancellation). rms: out = x * rstd * w, rstd = 1/sqrt(mean(x^2) + eps). */
template <class T>
__global__ void norm_fwd_kernel(T *__restrict__ out, float *mean_out, float *rstd_out, const T *__restrict__ x,
                                const T *__restrict__ weight, const T *__restrict__ bias, int64_t rows, int64_t cols,
                                float eps, int rms) {
    __shared__ double sd[32];
    FOR_ROWS(r, rows) {
        const T *xr = x + r * cols;   // (cols)
        T *yr = out + r * cols;
        float mean = 0.0f, rstd;
        if (rms) {
            double ss = 0.0;
            for (int64_t j = threadIdx.x; j < cols; j += blockDim.x) {
                float v = ldf(xr[j]);
                ss += (double)v * v;
            }
            ss = block_sum_d(ss, sd);
            rstd = (float)(1.0 / sqrt(ss / (double)cols + eps));
        } else {
            double sum = 0.0;
            for (int64_t j = threadIdx.x; j < cols; j += blockDim.x) sum += ldf(xr[j]);
            double m = block_sum_d(sum, sd) / (double)cols, var = 0.0;
            for (int64_t j = threadIdx.x; j < cols; j += blockDim.x) var += (ldf(xr[j]) - m) * (ldf(xr[j]) - m);
            var = block_sum_d(var, sd);
            mean = (float)m;
            rstd = (float)(1.0 / sqrt(var / (double)cols + eps));
        }
        for (int64_t j = threadIdx.x; j < cols; j += blockDim.x) {
            float y, v = ldf(xr[j]);
            if (rms) {
                y = weight ? v * rstd * ldf(weight[j]) : v * rstd;
            } else {
                y = (v - mean) * rstd;
                if (weight) y *= ldf(weight[j]);
                if (bias) y += ldf(bias[j]);
            }
            stf(yr + j, y);
        }
        if (threadIdx.x == 0) {
            if (mean_out) mean_out[r] = mean;
            rstd_out[r] = rstd;
        }
    }
}

/* With xhat = (x - mean) rstd (mean 0 for rms) and g = dout * w:
 * layernorm dx = rstd (g - mean(g) - xhat mean(g xhat)); rms dx = rstd (g - xhat mean(g xhat)).
 * addx: dx receives what it holds + that, in f32, one rounding. */
__device__ __forceinline__ float norm_dx_old(const float *p, int addx) { return addx ? *p : 0.0f; }
__device__ __forceinline__ float norm_dx_old(const uint16_t *p, int addx) { return addx ? ldf(*p) : 0.0f; }

/* A row's means over its columns of g = dout * weight (0 for RMSNorm) and
 * of g * xhat, xhat = (x - mean) * rstd: what dx of a norm needs. The whole
 * block calls it (a block sum). */
template <class T>
__device__ void norm_bwd_row_means(float *mg, float *mgx, const T *dr, const T *xr, const T *weight, float mean,
                                   float rstd, int64_t cols, int rms, double *sd) {
    double sg = 0.0, sgx = 0.0;
    for (int64_t j = threadIdx.x; j < cols; j += blockDim.x) {
        float g = weight ? ldf(dr[j]) * ldf(weight[j]) : ldf(dr[j]);
        sg += g;
        sgx += g * ((ldf(xr[j]) - mean) * rstd);
    }
    *mg = rms ? 0.0f : (float)(block_sum_d(sg, sd) / (double)cols);
    *mgx = (float)(block_sum_d(sgx, sd) / (double)cols);
}

template <class T>
__global__ void norm_bwd_dx_kernel(T *__restrict__ dx, const T *__restrict__ dout, const T *__restrict__ x,
                                   const T *__restrict__ weight, const float *mean_in, const float *rstd_in,
                                   int64_t rows, int64_t cols, int rms, int addx) {
    __shared__ double sd[32];
    FOR_ROWS(r, rows) {
        const T *xr = x + r * cols, *dr = dout + r * cols;   // (cols)
        T *dxr = dx + r * cols;
        float mean = rms ? 0.0f : mean_in[r], rstd = rstd_in[r];
        float mg, mgx;
        norm_bwd_row_means(&mg, &mgx, dr, xr, weight, mean, rstd, cols, rms, sd);
        for (int64_t j = threadIdx.x; j < cols; j += blockDim.x) {
            float g = weight ? ldf(dr[j]) * ldf(weight[j]) : ldf(dr[j]);
            float v = ldf(xr[j]);
            float old = norm_dx_old(dxr + j, addx);
            if (rms) {
                stf(dxr + j, old + rstd * (g - v * rstd * mgx));
            } else {
                float xhat = (v - mean) * rstd;
                stf(dxr + j, old + rstd * (g - mg - xhat * mgx));
            }
        }
    }
}

/* dweight[j] = sum_r dout xhat, dbias[j] = sum_r dout over the rows of one
 * slice: block (32, 8) per (slice, tile of 32 columns), the 8 thread rows
 * striding over the slice's rows and added in order; partials (slices, cols). */
#define NORM_TILE 32
#define NORM_LANES 8

template <class T>
__global__ void norm_wgrad_kernel(double *pw, double *pb, const T *__restrict__ dout, const T *__restrict__ x,
                                  const float *mean_in, const float *rstd_in, int64_t rows, int64_t cols,
                                  int64_t tiles, int64_t slice_len) {
    __shared__ double part_w[NORM_LANES][NORM_TILE], part_b[NORM_LANES][NORM_TILE];
    int64_t t = blockIdx.x % tiles, s = blockIdx.x / tiles;
    int64_t j = t * NORM_TILE + threadIdx.x;
    int64_t r0 = s * slice_len, r1 = cuda_min64(r0 + slice_len, rows);
    double aw = 0.0, ab = 0.0;
    if (j < cols)
        for (int64_t r = r0 + threadIdx.y; r < r1; r += NORM_LANES) {
            float d = ldf(dout[r * cols + j]);
            float mean = mean_in ? mean_in[r] : 0.0f;
            aw += d * ((ldf(x[r * cols + j]) - mean) * rstd_in[r]);
            ab += d;
        }
    part_w[threadIdx.y][threadIdx.x] = aw;
    part_b[threadIdx.y][threadIdx.x] = ab;
    __syncthreads();
    if (threadIdx.y == 0 && j < cols) {
        double sw = 0.0, sb = 0.0;
        for (int k = 0; k < NORM_LANES; k++) {
            sw += part_w[k][threadIdx.x];
            sb += part_b[k][threadIdx.x];
        }
        if (pw) pw[s * cols + j] = sw;
        if (pb) pb[s * cols + j] = sb;
    }
}

/* dweight and dbias from their partials in one launch (either may be NULL):
 * slices added in order, stored or (acc) added to what they hold */
template <class T>
__global__ void norm_wgrad_finish_kernel(T *dweight, T *dbias, const double *pw, const double *pb, int64_t slices,
                                         int64_t cols, int acc) {
    GRID_STRIDE(j, cols) {
        if (dweight) {
            double s = 0.0;
            for (int64_t k = 0; k < slices; k++) s += pw[k * cols + j];
            stf(dweight + j, acc ? (float)((double)ldf(dweight[j]) + s) : (float)s);
        }
        if (dbias) {
            double s = 0.0;
            for (int64_t k = 0; k < slices; k++) s += pb[k * cols + j];
            stf(dbias + j, acc ? (float)((double)ldf(dbias[j]) + s) : (float)s);
        }
    }
}

template <class T>
static void norm_weight_grads(T *dweight, T *dbias, const T *dout, const T *x, const float *mean, const float *rstd,
                              int64_t rows, int64_t cols, int acc = 0) {
    if (!dweight && !dbias) return;
    if (rows <= 0) {   /* empty sums: 0, or nothing to add */
        if (acc) return;
        if (dweight) CUDA_CHECK(cudaMemsetAsync(dweight, 0, (size_t)cols * sizeof(T), cuda_stream()));
        if (dbias) CUDA_CHECK(cudaMemsetAsync(dbias, 0, (size_t)cols * sizeof(T), cuda_stream()));
        return;
    }
    /* slices of at least 64 rows, enough for some 512 blocks */
    int64_t tiles = cuda_ceil_div(cols, NORM_TILE);
    int64_t slices = cuda_min64(cuda_ceil_div(512, tiles), cuda_ceil_div(rows, 64));
    int64_t slice_len = cuda_ceil_div(rows, slices);
    slices = cuda_ceil_div(rows, slice_len);
    double *pw = dweight ? (double *)cuda_tmp_alloc((size_t)(slices * cols) * sizeof(double)) : NULL;
    double *pb = dbias ? (double *)cuda_tmp_alloc((size_t)(slices * cols) * sizeof(double)) : NULL;
    LAUNCH(norm_wgrad_kernel<T>, (unsigned)(tiles * slices), dim3(NORM_TILE, NORM_LANES), 0)(pw, pb, dout, x, mean,
                                                                                            rstd, rows, cols, tiles,
                                                                                            slice_len);
    CUDA_CHECK_LAUNCH();
    LAUNCH(norm_wgrad_finish_kernel<T>, cuda_blocks(cols, CUDA_THREADS), CUDA_THREADS, 0)(dweight, dbias, pw, pb,
                                                                                         slices, cols, acc);
    CUDA_CHECK_LAUNCH();
    cuda_tmp_free(pw);
    cuda_tmp_free(pb);
}

/* dx and the weight and bias gradients' partial sums in one pass over dout
 * and x (the two kernels above read both twice): a block per chunk of
 * rows, rows in order, each as norm_bwd_dx_kernel; thread t owns columns
 * t, t + blockDim, ... and adds their dout xhat and dout into its own slots
 * of shared memory (no races), then writes them as the chunk's partials
 * (chunks, cols), added in chunk order by norm_wgrad_finish_kernel. */
#define NORM_FUSED_MAX_COLS 2048   /* 2 x 2048 doubles: 32 KiB of shared memory */

template <class T>
__global__ void norm_bwd_fused_kernel(T *__restrict__ dx, double *pw, double *pb, const T *__restrict__ dout,
                                      const T *__restrict__ x, const T *__restrict__ weight, const float *mean_in,
                                      const float *rstd_in, int64_t rows, int64_t cols, int64_t chunk_rows,
                                      int rms, int addx) {
    __shared__ double sd[32];
    double *aw = (double *)CUDA_DYN_SMEM(), *ab = aw + cols;   // (cols) each
    for (int64_t j = threadIdx.x; j < cols; j += blockDim.x) aw[j] = ab[j] = 0.0;
    int64_t r0 = (int64_t)blockIdx.x * chunk_rows, r1 = cuda_min64(r0 + chunk_rows, rows);
    for (int64_t r = r0; r < r1; r++) {
        const T *xr = x + r * cols, *dr = dout + r * cols;   // (cols)
        T *dxr = dx + r * cols;
        float mean = rms ? 0.0f : mean_in[r], rstd = rstd_in[r];
        float mg, mgx;
        norm_bwd_row_means(&mg, &mgx, dr, xr, weight, mean, rstd, cols, rms, sd);
        for (int64_t j = threadIdx.x; j < cols; j += blockDim.x) {
            float d = ldf(dr[j]);
            float g = weight ? d * ldf(weight[j]) : d;
            float v = ldf(xr[j]);
            float xhat = (v - mean) * rstd;
            float old = norm_dx_old(dxr + j, addx);
            if (rms) stf(dxr + j, old + rstd * (g - v * rstd * mgx));
            else stf(dxr + j, old + rstd * (g - mg - xhat * mgx));
            aw[j] += d * xhat;
            ab[j] += d;
        }
    }
    for (int64_t j = threadIdx.x; j < cols; j += blockDim.x) {
        if (pw) pw[(int64_t)blockIdx.x * cols + j] = aw[j];
        if (pb) pb[(int64_t)blockIdx.x * cols + j] = ab[j];
    }
}

/* The whole norm backward: dx (addx: added to what it holds), and dweight,
 * dbias (either may be NULL; acc: added to what they hold). One pass where the row fits the fused kernel's
 * shared memory, else the dx kernel and norm_weight_grads. */
template <class T>
static void norm_backward(T *dx, T *dweight, T *dbias, const T *dout, const T *x, const T *weight, const float *mean,
                          const float *rstd, int64_t rows, int64_t cols, int rms, int acc, int addx = 0) {
    if (cols <= 0) return;
    bool grads = dweight || dbias;
    if (rows > 0 && (!grads || cols > NORM_FUSED_MAX_COLS)) {
        LAUNCH(norm_bwd_dx_kernel<T>, row_blocks(rows), cuda_row_threads(cols), 0)(dx, dout, x, weight, mean, rstd,
                                                                                   rows, cols, rms, addx);
        CUDA_CHECK_LAUNCH();
    }
    if (!grads) return;
    if (rows <= 0 || cols > NORM_FUSED_MAX_COLS) {
        norm_weight_grads(dweight, dbias, dout, x, mean, rstd, rows, cols, acc);
        return;
    }
    /* chunks of at least 16 rows, some 2 blocks per SM */
    int64_t chunks = cuda_min64((int64_t)cuda_sm_count() * 2, cuda_ceil_div(rows, 16));
    int64_t chunk_rows = cuda_ceil_div(rows, chunks);
    chunks = cuda_ceil_div(rows, chunk_rows);
    double *pw = dweight ? (double *)cuda_tmp_alloc((size_t)(chunks * cols) * sizeof(double)) : NULL;
    double *pb = dbias ? (double *)cuda_tmp_alloc((size_t)(chunks * cols) * sizeof(double)) : NULL;
    LAUNCH(norm_bwd_fused_kernel<T>, (unsigned)chunks, cuda_row_threads(cols), (size_t)(2 * cols) * sizeof(double))(
        dx, pw, pb, dout, x, weight, mean, rstd, rows, cols, chunk_rows, rms, addx);
    CUDA_CHECK_LAUNCH();
    LAUNCH(norm_wgrad_finish_kernel<T>, cuda_blocks(cols, CUDA_THREADS), CUDA_THREADS, 0)(dweight, dbias, pw, pb,
                                                                                         chunks, cols, acc);
    CUDA_CHECK_LAUNCH();
    cuda_tmp_free(pw);
    cuda_tmp_free(pb);
}

#define NORM_ENTRIES(T, sfx)                                                                                     \
    void cuda_layernorm_forward_##sfx(T *out, float *mean, float *rstd, const T *x, const T *weight, const T *bias, \
                                      int64_t rows, int64_t cols, float eps) {                                    \
        CUDA_ENTER();                                                                                            \
        if (rows <= 0 || cols <= 0) return;                                                                      \
        LAUNCH(norm_fwd_kernel<T>, row_blocks(rows), cuda_row_threads(cols), 0)(out, mean, rstd, x, weight, bias, \
                                                                                rows, cols, eps, 0);              \
        CUDA_CHECK_LAUNCH();                                                                                     \
    }                                                                                                            \
    void cuda_layernorm_backward_##sfx(T *dx, T *dweight, T *dbias, const T *dout, const T *x, const T *weight,   \
                                       const float *mean, const float *rstd, int64_t rows, int64_t cols) {        \
        CUDA_ENTER();                                                                                            \
        norm_backward(dx, dweight, dbias, dout, x, weight, mean, rstd, rows, cols, 0, 0);                        \
    }                                                                                                            \
    void cuda_rmsnorm_forward_##sfx(T *out, float *rstd, const T *x, const T *weight, int64_t rows, int64_t cols, \
                                    float eps) {                                                                 \
        CUDA_ENTER();                                                                                            \
        if (rows <= 0 || cols <= 0) return;                                                                      \
        LAUNCH(norm_fwd_kernel<T>, row_blocks(rows), cuda_row_threads(cols), 0)(out, NULL, rstd, x, weight,      \
                                                                                (const T *)NULL, rows, cols, eps, 1); \
        CUDA_CHECK_LAUNCH();                                                                                     \
    }                                                                                                            \
    void cuda_rmsnorm_backward_##sfx(T *dx, T *dweight, const T *dout, const T *x, const T *weight,              \
                                     const float *rstd, int64_t rows, int64_t cols) {                            \
        CUDA_ENTER();                                                                                            \
        norm_backward(dx, dweight, (T *)NULL, dout, x, weight, (const float *)NULL, rstd, rows, cols, 1, 0);     \
    }
NORM_ENTRIES(float, f32)
NORM_ENTRIES(uint16_t, bf16)

/* layernorm_backward_bf16 adding dweight and dbias into what they hold */
void cuda_layernorm_backward_acc_bf16(uint16_t *dx, uint16_t *dweight, uint16_t *dbias, const uint16_t *dout,
                                      const uint16_t *x, const uint16_t *weight, const float *mean, const float *rstd,
                                      int64_t rows, int64_t cols) {
    CUDA_ENTER();
    norm_backward(dx, dweight, dbias, dout, x, weight, mean, rstd, rows, cols, 0, 1);
}

/* layernorm_backward_bf16 adding dx into what it holds (a residual's
 * gradient), dweight and dbias written (acc 0) or added to (acc 1) */
void cuda_layernorm_backward_addx_bf16(uint16_t *dx, uint16_t *dweight, uint16_t *dbias, const uint16_t *dout,
                                       const uint16_t *x, const uint16_t *weight, const float *mean,
                                       const float *rstd, int64_t rows, int64_t cols, int acc) {
    CUDA_ENTER();
    norm_backward(dx, dweight, dbias, dout, x, weight, mean, rstd, rows, cols, 0, acc, 1);
}

/* ---- cross-entropy over logits (N, V), the first valid_v columns real ---- */

/* One pass over each row (online softmax): every thread keeps its own
 * running max m and sum s = sum exp(x - m) in f32, rescaling s when a larger
 * logit arrives; the block then takes M = max m and adds s exp(m - M) in
 * double, in a fixed order. lse_n = M + log sum_{j < valid_v} exp(x_nj - M);
 * loss_n = (M - x_nt) + log sum (0 when ignored); count += rows not ignored
 * (count NULL: not counted). m starts at -FLT_MAX, not -inf, so that a -inf
 * logit adds exp(-inf) = 0 instead of exp(-inf + inf) = NaN. */
__device__ __forceinline__ void ce_online(float &m, float &s, float v) {
    if (v > m) {
        s = s * expf(m - v) + 1.0f;
        m = v;
    } else {
        s += expf(v - m);   /* a NaN logit lands here and makes the row NaN, as on the CPU */
    }
}

/* W logits per access: 16 bytes (rows of a multiple of 16 bytes, aligned) or one */
template <class T, int W> struct alignas(sizeof(T) * W) ce_pack {
    T v[W];
};

/* Row xr's M = max and sum = sum exp(x - M) over its first valid_v logits, the
 * same on every thread of the block: each thread's online pass over whole
 * W-packs (then the tail one by one), then the block's max and its double
 * sum in a fixed order. */
template <class T, int W>
__device__ __forceinline__ void ce_row_max_sum(const T *xr, int64_t valid_v, float *sf, double *sd, float *M,
                                               double *sum) {
    typedef ce_pack<T, W> P;
    const int64_t packs = valid_v / W;   /* whole packs below valid_v; the rest one by one */
    float m = -FLT_MAX, s = 0.0f;
    for (int64_t p = threadIdx.x; p < packs; p += blockDim.x) {
        P xv = ((const P *)xr)[p];
#pragma unroll
        for (int k = 0; k < W; k++) ce_online(m, s, ldf(xv.v[k]));
    }
    for (int64_t j = packs * W + threadIdx.x; j < valid_v; j += blockDim.x) ce_online(m, s, ldf(xr[j]));
    *M = block_max_f(m, sf);
    *sum = block_sum_d((double)s * (double)expf(m - *M), sd);
}

template <class T, int W>
__global__ void ce_fwd_kernel(float *losses, float *lse, unsigned long long *count, const T *__restrict__ logits,
                              const int64_t *targets, int64_t N, int64_t V, int64_t valid_v, int64_t ignore_index) {
    __shared__ double sd[32];
    __shared__ float sf[32];
    FOR_ROWS(n, N) {
        const T *xr = logits + n * V;   // (V)
        float M;
        double sum;
        ce_row_max_sum<T, W>(xr, valid_v, sf, sd, &M, &sum);
        if (threadIdx.x == 0) {
            float logsum = (float)log(sum);
            int64_t t = targets[n];
            lse[n] = M + logsum;
            /* the target's logit: one element of the row just read */
            losses[n] = t == ignore_index ? 0.0f : (M - ldf(xr[t])) + logsum;
            if (count && t != ignore_index) atomicAdd(count, 1ull);   /* integer: exact in any order */
        }
    }
}

/* the forward's kernel for these rows: 16-byte accesses where every row starts on 16 bytes */
template <class T> static void ce_fwd_launch(float *losses, float *lse, unsigned long long *count, const T *logits,
                                             const int64_t *targets, int64_t N, int64_t V, int64_t valid_v,
                                             int64_t ignore_index) {
    const int W = 16 / (int)sizeof(T);
    bool wide = V % W == 0 && ((uintptr_t)logits & 15u) == 0 && valid_v >= W;
    void (*kernel)(float *, float *, unsigned long long *, const T *, const int64_t *, int64_t, int64_t, int64_t,
                   int64_t) = wide ? ce_fwd_kernel<T, 16 / sizeof(T)> : ce_fwd_kernel<T, 1>;
    LAUNCH(kernel, row_blocks(N), cuda_row_threads(wide ? valid_v / W : valid_v), 0)(losses, lse, count, logits,
                                                                                     targets, N, V, valid_v,
                                                                                     ignore_index);
    CUDA_CHECK_LAUNCH();
}

/* dlogits = g (softmax - onehot) for j < valid_v of rows not ignored; 0 elsewhere;
 * g = dloss[0] / count, read here so that the host never waits for dloss */
template <class T>
__global__ void ce_bwd_kernel(T *__restrict__ dlogits, const T *__restrict__ logits, const float *lse,
                              const int64_t *targets, int64_t N, int64_t V, int64_t valid_v, int64_t ignore_index,
                              const float *dloss_in, int64_t count) {
    const float dloss = count ? dloss_in[0] / (float)count : 0.0f;
    FOR_ROWS(n, N) {
        const T *xr = logits + n * V;   // (V)
        T *dr = dlogits + n * V;
        int64_t t = targets[n];
        bool ignored = t == ignore_index;
        float l = ignored ? 0.0f : lse[n];
        for (int64_t j = threadIdx.x; j < V; j += blockDim.x) {
            float d = 0.0f;
            if (!ignored && j < valid_v) {
                d = __fmul_rn(dloss, expf(ldf(xr[j]) - l));   /* rounded before the subtraction, as the CPU */
                if (j == t) d -= dloss;
            }
            stf(dr + j, d);
        }
    }
}

/* A block of up to 1024 threads has 64 registers a thread at most (65536 an
 * SM): __launch_bounds__ makes ptxas keep to that, so the launch cannot fail
 * with "too many resources requested" on a GPU (the emulation has no
 * registers to run out of). */
#define CE_FUSED_MAX_THREADS 1024

/* The loss and its gradient in one pass over each row (after llm.c): the
 * forward's online max and sum, then, from the row just read (in L2),
 * dlogits = g (softmax - onehot) written over it, g = 1 / count (dloss 1):
 * element for element the expression of ce_bwd_kernel, so the values are
 * those of the forward and backward kernels run one after the other. The
 * target's logit is read before the block's reductions, whose barriers keep
 * it ahead of any write. */
template <class T, int W>
__global__ void __launch_bounds__(CE_FUSED_MAX_THREADS)
    ce_fused_kernel(float *losses, T *logits, const int64_t *targets, int64_t N, int64_t V, int64_t valid_v,
                    int64_t ignore_index, int64_t count) {
    typedef ce_pack<T, W> P;
    __shared__ double sd[32];
    __shared__ float sf[32];
    const float g = count ? 1.0f / (float)count : 0.0f;
    FOR_ROWS(n, N) {
        T *xr = logits + n * V;   // (V): logits in, dlogits out
        const int64_t t = targets[n];
        const bool ignored = t == ignore_index;
        float xt = 0.0f;
        if (threadIdx.x == 0 && !ignored) xt = ldf(xr[t]);
        float M;
        double sum;   /* every thread gets the same M, sum */
        ce_row_max_sum<T, W>(xr, valid_v, sf, sd, &M, &sum);
        float logsum = (float)log(sum), l = M + logsum;
        if (threadIdx.x == 0) losses[n] = ignored ? 0.0f : (M - xt) + logsum;
        const int64_t vpacks = W > 1 ? V / W : 0;   /* the wide path has V % W == 0 */
        for (int64_t p = threadIdx.x; p < vpacks; p += blockDim.x) {
            P xv = ((const P *)xr)[p], dv;
#pragma unroll
            for (int k = 0; k < W; k++) {
                int64_t j = p * W + k;
                float d = 0.0f;
                if (!ignored && j < valid_v) {
                    d = __fmul_rn(g, expf(ldf(xv.v[k]) - l));
                    if (j == t) d -= g;
                }
                stf(&dv.v[k], d);
            }
            ((P *)xr)[p] = dv;
        }
        for (int64_t j = vpacks * W + threadIdx.x; j < V; j += blockDim.x) {
            float d = 0.0f;
            if (!ignored && j < valid_v) {
                d = __fmul_rn(g, expf(ldf(xr[j]) - l));
                if (j == t) d -= g;
            }
            stf(xr + j, d);
        }
    }
}

template <class T>
static void cross_entropy_fused(float *losses, T *logits, const int64_t *targets, int64_t N, int64_t V,
                                int64_t valid_v, int64_t ignore_index, int64_t count) {
    if (N <= 0 || V <= 0) return;
    const int W = 16 / (int)sizeof(T);
    bool wide = V % W == 0 && ((uintptr_t)logits & 15u) == 0 && valid_v >= W;
    void (*kernel)(float *, T *, const int64_t *, int64_t, int64_t, int64_t, int64_t, int64_t) =
        wide ? ce_fused_kernel<T, 16 / sizeof(T)> : ce_fused_kernel<T, 1>;
    /* up to 1024 threads a row, as llm.c's classifier: at most 2 blocks an SM, so the rows in flight
     * (264 of 100 KB at GPT-2's vocabulary on an H200) stay in L2 for their second visit */
    int64_t cols = wide ? V / W : V;
    int threads = 32;
    while (threads < CE_FUSED_MAX_THREADS && threads < cols) threads *= 2;
    LAUNCH(kernel, row_blocks(N), threads, 0)(losses, logits, targets, N, V, valid_v, ignore_index, count);
    CUDA_CHECK_LAUNCH();
}

template <class T>
static int64_t cross_entropy_forward(float *losses, float *lse, const T *logits, const int64_t *targets, int64_t N,
                                     int64_t V, int64_t valid_v, int64_t ignore_index) {
    if (N <= 0) return 0;
    unsigned long long *count = (unsigned long long *)cuda_tmp_alloc(sizeof *count);
    CUDA_CHECK(cudaMemsetAsync(count, 0, sizeof *count, cuda_stream()));
    ce_fwd_launch(losses, lse, count, logits, targets, N, V, valid_v, ignore_index);
    unsigned long long host = 0;
    CUDA_CHECK(cudaMemcpyAsync(&host, count, sizeof host, cudaMemcpyDeviceToHost, cuda_stream()));
    cuda_tmp_free(count);
    CUDA_CHECK(cudaStreamSynchronize(cuda_stream()));
    return (int64_t)host;
}

/* the forward's rows without the count (the caller knows it) */
template <class T>
static void cross_entropy_rows(float *losses, float *lse, const T *logits, const int64_t *targets, int64_t N,
                               int64_t V, int64_t valid_v, int64_t ignore_index) {
    if (N <= 0) return;
    ce_fwd_launch(losses, lse, (unsigned long long *)NULL, logits, targets, N, V, valid_v, ignore_index);
}

template <class T>
static void cross_entropy_backward(T *dlogits, const T *logits, const float *lse, const int64_t *targets, int64_t N,
                                   int64_t V, int64_t valid_v, int64_t ignore_index, const float *dloss,
                                   int64_t count) {
    if (N <= 0 || V <= 0) return;
    LAUNCH(ce_bwd_kernel<T>, row_blocks(N), cuda_row_threads(V), 0)(dlogits, logits, lse, targets, N, V, valid_v,
                                                                    ignore_index, dloss, count);
    CUDA_CHECK_LAUNCH();
}

int64_t cuda_cross_entropy_forward_f32(float *losses, float *lse, const float *logits, const int64_t *targets,
                                       int64_t N, int64_t V, int64_t valid_v, int64_t ignore_index) {
    CUDA_ENTER();
    return cross_entropy_forward(losses, lse, logits, targets, N, V, valid_v, ignore_index);
}

void cuda_cross_entropy_backward_f32(float *dlogits, const float *logits, const float *lse, const int64_t *targets,
                                     int64_t N, int64_t V, int64_t valid_v, int64_t ignore_index,
                                     const float *dloss, int64_t count) {
    CUDA_ENTER();
    cross_entropy_backward(dlogits, logits, lse, targets, N, V, valid_v, ignore_index, dloss, count);
}

int64_t cuda_cross_entropy_forward_bf16(float *losses, float *lse, const uint16_t *logits, const int64_t *targets,
                                        int64_t N, int64_t V, int64_t valid_v, int64_t ignore_index) {
    CUDA_ENTER();
    return cross_entropy_forward(losses, lse, logits, targets, N, V, valid_v, ignore_index);
}

void cuda_cross_entropy_backward_bf16(uint16_t *dlogits, const uint16_t *logits, const float *lse,
                                      const int64_t *targets, int64_t N, int64_t V, int64_t valid_v,
                                      int64_t ignore_index, const float *dloss, int64_t count) {
    CUDA_ENTER();
    cross_entropy_backward(dlogits, logits, lse, targets, N, V, valid_v, ignore_index, dloss, count);
}

void cuda_cross_entropy_rows_f32(float *losses, float *lse, const float *logits, const int64_t *targets, int64_t N,
                                 int64_t V, int64_t valid_v, int64_t ignore_index) {
    CUDA_ENTER();
    cross_entropy_rows(losses, lse, logits, targets, N, V, valid_v, ignore_index);
}

void cuda_cross_entropy_rows_bf16(float *losses, float *lse, const uint16_t *logits, const int64_t *targets, int64_t N,
                                  int64_t V, int64_t valid_v, int64_t ignore_index) {
    CUDA_ENTER();
    cross_entropy_rows(losses, lse, logits, targets, N, V, valid_v, ignore_index);
}

void cuda_cross_entropy_fused_f32(float *losses, float *logits, const int64_t *targets, int64_t N, int64_t V,
                                  int64_t valid_v, int64_t ignore_index, int64_t count) {
    CUDA_ENTER();
    cross_entropy_fused(losses, logits, targets, N, V, valid_v, ignore_index, count);
}

void cuda_cross_entropy_fused_bf16(float *losses, uint16_t *logits, const int64_t *targets, int64_t N, int64_t V,
                                   int64_t valid_v, int64_t ignore_index, int64_t count) {
    CUDA_ENTER();
    cross_entropy_fused(losses, logits, targets, N, V, valid_v, ignore_index, count);
}
