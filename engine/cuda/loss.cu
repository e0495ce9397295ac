/* loss.cu: cross-entropy over logits (N, V), forward, backward, the
 * counted rows and the fused one-pass classifier, with the semantics of
 * engine/cpu/loss.c.
 *
 * Row-wise kernels take one block per row (warp shuffles, then the warps'
 * results in shared memory); row statistics accumulate in double, as on the
 * CPU. Every sum is taken in an order fixed by the sizes alone: no atomics
 * on floats anywhere, so results repeat bit for bit. */
#include "cuda_internal.h"
#include <float.h>

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
    LAUNCH(kernel, cuda_row_blocks(N), cuda_row_threads(wide ? valid_v / W : valid_v), 0)(losses, lse, count, logits,
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
    LAUNCH(kernel, cuda_row_blocks(N), threads, 0)(losses, logits, targets, N, V, valid_v, ignore_index, count);
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
    LAUNCH(ce_bwd_kernel<T>, cuda_row_blocks(N), cuda_row_threads(V), 0)(dlogits, logits, lse, targets, N, V, valid_v,
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
