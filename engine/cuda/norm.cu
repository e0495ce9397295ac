/* norm.cu: LayerNorm and RMSNorm over the last dim of (rows, cols),
 * forward and backward (the weight and bias gradients as slice sums),
 * with the semantics of engine/cpu/norm.c.
 *
 * Row-wise kernels take one block per row (warp shuffles, then the warps'
 * results in shared memory); row statistics accumulate in double, as on the
 * CPU. Every sum is taken in an order fixed by the sizes alone: no atomics
 * on floats anywhere, so results repeat bit for bit. */
#include "cuda_internal.h"

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
        LAUNCH(norm_bwd_dx_kernel<T>, cuda_row_blocks(rows), cuda_row_threads(cols), 0)(dx, dout, x, weight, mean, rstd,
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
        LAUNCH(norm_fwd_kernel<T>, cuda_row_blocks(rows), cuda_row_threads(cols), 0)(out, mean, rstd, x, weight, bias, \
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
        LAUNCH(norm_fwd_kernel<T>, cuda_row_blocks(rows), cuda_row_threads(cols), 0)(out, NULL, rstd, x, weight,      \
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
