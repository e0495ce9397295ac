/* classifier.cu: the vocabulary-chunked classifier and embedding
 * (CPU reference and slice geometry: engine/cpu/classifier.c). A block per
 * row of logits; the online log-sum-exp keeps the running max and sum in
 * f32 as the CPU does (the block's sum of the slice in double). The
 * embedding's backward walks the ids in order for each column, so the sums
 * are bit-equal to the CPU's. */
#include "cuda_internal.h"


/* Table row of slice row i, and the slice row of table row g (-1: not in the slice). */
__device__ __forceinline__ int64_t cls_table_row(int64_t i, int64_t br, int64_t stride, int64_t row0) {
    return (i / br) * stride + row0 + i % br;
}
__device__ __forceinline__ int64_t cls_slice_row(int64_t g, int64_t blocks, int64_t br, int64_t stride,
                                                 int64_t row0) {
    if (g < 0) return -1;
    int64_t b = g / stride, o = g % stride - row0;
    return (b >= blocks || o < 0 || o >= br) ? -1 : b * br + o;
}

__global__ void cls_lse_kernel(float *m, float *s, float *tlogit, const float *__restrict__ logits,
                               const int64_t *targets, int64_t N, int64_t blocks, int64_t br, int64_t stride,
                               int64_t row0, int64_t valid_v, int64_t ignore_index) {
    __shared__ double sd[32];
    __shared__ float sf[32];
    int64_t R = blocks * br;
    FOR_ROWS(n, N) {
        const float *x = logits + n * R;   // (R)
        float m_old = m[n], mx = m_old;
        for (int64_t i = threadIdx.x; i < R; i += blockDim.x)
            if (cls_table_row(i, br, stride, row0) < valid_v) mx = fmaxf(mx, x[i]);
        mx = block_max_f(mx, sf);
        if (mx == -INFINITY) continue;   /* the same for the whole block */
        double sum = 0.0;
        for (int64_t i = threadIdx.x; i < R; i += blockDim.x)
            if (cls_table_row(i, br, stride, row0) < valid_v) sum += (double)expf(x[i] - mx);
        sum = block_sum_d(sum, sd);
        if (threadIdx.x == 0) {
            s[n] = (float)((double)s[n] * exp((double)m_old - mx) + sum);
            m[n] = mx;
            int64_t t = targets[n];
            if (t != ignore_index) {
                int64_t i = cls_slice_row(t, blocks, br, stride, row0);
                if (i >= 0) tlogit[n] = x[i];
            }
        }
    }
}

void cuda_classifier_lse_f32(float *m, float *s, float *tlogit, const float *logits, const int64_t *targets,
                             int64_t N, int64_t blocks, int64_t block_rows, int64_t block_stride, int64_t row0,
                             int64_t valid_v, int64_t ignore_index) {
    CUDA_ENTER();
    if (N <= 0 || blocks * block_rows <= 0) return;
    LAUNCH(cls_lse_kernel, cuda_row_blocks(N), cuda_row_threads(blocks * block_rows), 0)(
        m, s, tlogit, logits, targets, N, blocks, block_rows, block_stride, row0, valid_v, ignore_index);
    CUDA_CHECK_LAUNCH();
}

__global__ void cls_finish_kernel(float *lse, float *losses, unsigned long long *count, const float *m,
                                  const float *s, const float *tlogit, const int64_t *targets, int64_t N,
                                  int64_t ignore_index) {
    for (int64_t n = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; n < N; n += (int64_t)gridDim.x * blockDim.x) {
        float logsum = (float)log((double)s[n]);
        bool ignored = targets[n] == ignore_index;
        lse[n] = m[n] + logsum;
        losses[n] = ignored ? 0.0f : (m[n] - tlogit[n]) + logsum;
        if (!ignored) atomicAdd(count, 1ull);   /* integer: exact in any order */
    }
}

int64_t cuda_classifier_finish_f32(float *lse, float *losses, const float *m, const float *s, const float *tlogit,
                                   const int64_t *targets, int64_t N, int64_t ignore_index) {
    CUDA_ENTER();
    if (N <= 0) return 0;
    unsigned long long *count = (unsigned long long *)cuda_tmp_alloc(sizeof *count);
    CUDA_CHECK(cudaMemsetAsync(count, 0, sizeof *count, cuda_stream()));
    unsigned grid = (unsigned)cuda_min64(cuda_ceil_div(N, 256), 4096);
    LAUNCH(cls_finish_kernel, grid, 256, 0)(lse, losses, count, m, s, tlogit, targets, N, ignore_index);
    CUDA_CHECK_LAUNCH();
    unsigned long long host = 0;
    CUDA_CHECK(cudaMemcpyAsync(&host, count, sizeof host, cudaMemcpyDeviceToHost, cuda_stream()));
    cuda_tmp_free(count);
    CUDA_CHECK(cudaStreamSynchronize(cuda_stream()));
    return (int64_t)host;
}

/* dlogits = g (exp(x - lse) - onehot), g = dloss[0] / count (read here: no host wait); in place allowed */
__global__ void cls_dlogits_kernel(float *dlogits, const float *logits, const float *lse, const int64_t *targets,
                                   int64_t N, int64_t blocks, int64_t br, int64_t stride, int64_t row0,
                                   int64_t valid_v, int64_t ignore_index, const float *dloss_in, int64_t count) {
    const float g = count ? dloss_in[0] / (float)count : 0.0f;
    int64_t R = blocks * br;
    FOR_ROWS(n, N) {
        const float *x = logits + n * R;
        float *dx = dlogits + n * R;
        int64_t t = targets[n];
        bool ignored = t == ignore_index;
        int64_t ti = ignored ? -1 : cls_slice_row(t, blocks, br, stride, row0);
        float l = ignored ? 0.0f : lse[n];
        for (int64_t i = threadIdx.x; i < R; i += blockDim.x) {
            float d = 0.0f;
            if (!ignored && cls_table_row(i, br, stride, row0) < valid_v)
                d = __fmul_rn(g, expf(x[i] - l));   /* rounded before the subtraction, as the CPU */
            if (i == ti) d -= g;
            dx[i] = d;
        }
    }
}

void cuda_classifier_dlogits_f32(float *dlogits, const float *logits, const float *lse, const int64_t *targets,
                                 int64_t N, int64_t blocks, int64_t block_rows, int64_t block_stride, int64_t row0,
                                 int64_t valid_v, int64_t ignore_index, const float *dloss, int64_t count) {
    CUDA_ENTER();
    if (N <= 0 || blocks * block_rows <= 0) return;
    LAUNCH(cls_dlogits_kernel, cuda_row_blocks(N), cuda_row_threads(blocks * block_rows), 0)(
        dlogits, logits, lse, targets, N, blocks, block_rows, block_stride, row0, valid_v, ignore_index, dloss,
        count);
    CUDA_CHECK_LAUNCH();
}

/* ---- embedding by slices ---- */

__global__ void emb_slice_fwd_kernel(float *out, const int64_t *ids, int64_t n, const float *rows, int64_t dim,
                                     int64_t blocks, int64_t br, int64_t stride, int64_t row0) {
    FOR_ROWS(k, n) {
        int64_t i = cls_slice_row(ids[k], blocks, br, stride, row0);
        if (i < 0) continue;
        for (int64_t j = threadIdx.x; j < dim; j += blockDim.x) out[k * dim + j] = rows[i * dim + j];
    }
}

void cuda_embedding_slice_forward_f32(float *out, const int64_t *ids, int64_t n, const float *rows, int64_t dim,
                                      int64_t blocks, int64_t block_rows, int64_t block_stride, int64_t row0) {
    CUDA_ENTER();
    if (n <= 0 || dim <= 0) return;
    LAUNCH(emb_slice_fwd_kernel, cuda_row_blocks(n), cuda_row_threads(dim), 0)(out, ids, n, rows, dim, blocks,
                                                                             block_rows, block_stride, row0);
    CUDA_CHECK_LAUNCH();
}

/* a thread per column, the ids in order: the CPU's sums, bit for bit */
__global__ void emb_slice_bwd_kernel(float *drows, const int64_t *ids, int64_t n, const float *dout, int64_t dim,
                                     int64_t blocks, int64_t br, int64_t stride, int64_t row0) {
    int64_t j = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (j >= dim) return;
    for (int64_t k = 0; k < n; k++) {
        int64_t i = cls_slice_row(ids[k], blocks, br, stride, row0);
        if (i >= 0) drows[i * dim + j] += dout[k * dim + j];
    }
}

void cuda_embedding_slice_backward_f32(float *drows, const int64_t *ids, int64_t n, const float *dout, int64_t dim,
                                       int64_t blocks, int64_t block_rows, int64_t block_stride, int64_t row0) {
    CUDA_ENTER();
    if (dim <= 0 || blocks * block_rows <= 0) return;
    CUDA_CHECK(cudaMemsetAsync(drows, 0, (size_t)(blocks * block_rows * dim) * sizeof(float), cuda_stream()));
    if (n <= 0) return;
    LAUNCH(emb_slice_bwd_kernel, (unsigned)cuda_ceil_div(dim, 128), 128, 0)(drows, ids, n, dout, dim, blocks,
                                                                          block_rows, block_stride, row0);
    CUDA_CHECK_LAUNCH();
}
