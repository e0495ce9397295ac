/* fused.cu: a Linear's bias with the op that follows it, in one pass
 * (after llm.c), with the semantics of engine/cpu/fused.c:
 *   bias_gelu_forward   out = gelu(x + bias)                      (B, T, 4C)
 *   bias_gelu_backward  dx = dout gelu'(x + bias), dbias = sum_rows dx
 *   bias_residual       out = res + (x + bias)                    (B, T, C)
 * x (rows, cols) is the matmul's output without its bias. bf16 in memory,
 * f32 in registers; rows of a multiple of 16 bytes take 16-byte loads and
 * stores (8 bf16 or 4 f32 per access). The bias gradient adds the stored
 * (rounded) dx in double: per block a tile of columns over a chunk of rows,
 * then the chunks in order (cuda_sum_slices), so results repeat bit for bit. */
#include "cuda_internal.h"
#include "gelu.h"   /* gelu, gelu_grad: the tanh form, as activation.cu and fused.c */

/* V elements of T in one access (16 bytes, or one element) */
template <class T, int V> struct alignas(sizeof(T) * V) pack_t {
    T v[V];
};

/* *dst = v as one 16-byte access. nvcc moves a pack element by element and
 * merges neighbouring accesses back into vector ones where it can prove the
 * address aligned; in bias_gelu_bwd_kernel it cannot (the row index comes
 * from a division of the block index), and dx went out as 2-byte stores
 * (tests/gpu/ptx_vectors.sh shows it). This one store is spelt in PTX. */
__device__ __forceinline__ uint32_t pack_word(const uint16_t *h) { return (uint32_t)h[0] | ((uint32_t)h[1] << 16); }
__device__ __forceinline__ uint32_t pack_word(const float *f) { return __float_as_uint(f[0]); }

template <class T, int V> __device__ __forceinline__ void store_pack(pack_t<T, V> *dst, const pack_t<T, V> &v) {
#if CUDA_PTX_STORES
    if constexpr (sizeof(T) * V == 16) {
        constexpr int per = 4 / (int)sizeof(T);   /* elements a 32-bit word */
        asm volatile("st.v4.b32 [%0], {%1, %2, %3, %4};" ::"l"(dst), "r"(pack_word(v.v)), "r"(pack_word(v.v + per)),
                     "r"(pack_word(v.v + 2 * per)), "r"(pack_word(v.v + 3 * per))
                     : "memory");
        return;
    }
#endif
    *dst = v;
}

static bool fused_aligned16(const void *p) { return ((uintptr_t)p & 15u) == 0; }

/* Elements per access for rows of cols elements at these pointers (NULL ones pass). */
template <class T> static int fused_width(int64_t cols, const void *a, const void *b, const void *c, const void *d) {
    const int v = 16 / (int)sizeof(T);
    bool ok = cols % v == 0;
    const void *ps[] = {a, b, c, d};
    for (const void *p : ps) ok = ok && (!p || fused_aligned16(p));
    return ok ? v : 1;
}

/* ---- bias + GELU, forward ---- */

template <class T, int V>
__global__ void bias_gelu_fwd_kernel(T *__restrict__ out, const T *__restrict__ x, const T *__restrict__ bias,
                                     int64_t n_packs, int64_t row_packs) {
    typedef pack_t<T, V> P;
    GRID_STRIDE(i, n_packs) {
        P xv = ((const P *)x)[i], bv = ((const P *)bias)[i % row_packs], r;
#pragma unroll
        for (int k = 0; k < V; k++) stf(&r.v[k], gelu(ldf(xv.v[k]) + ldf(bv.v[k])));
        ((P *)out)[i] = r;
    }
}

template <class T> static void bias_gelu_forward(T *out, const T *x, const T *bias, int64_t rows, int64_t cols) {
    if (rows <= 0 || cols <= 0) return;
    int64_t n = rows * cols;
    int v = fused_width<T>(cols, out, x, bias, NULL);
    void (*kernel)(T *, const T *, const T *, int64_t, int64_t) =
        v > 1 ? bias_gelu_fwd_kernel<T, 16 / sizeof(T)> : bias_gelu_fwd_kernel<T, 1>;
    LAUNCH(kernel, cuda_blocks(n / v, CUDA_THREADS), CUDA_THREADS, 0)(out, x, bias, n / v, cols / v);
    CUDA_CHECK_LAUNCH();
}

/* ---- bias + GELU, backward, with the bias gradient ----
 * Block (32, 8): threadIdx.x picks a pack of V columns of the block's tile
 * of 32 V columns, the 8 rows of threads stride over the block's chunk of
 * rows; their column sums meet in shared memory in row-lane order. */
#define GB_LANES 8
#define GB_PACKS 32

template <class T, int V>
__global__ void bias_gelu_bwd_kernel(T *__restrict__ dx, T *dbias, double *__restrict__ partial,
                                     const T *__restrict__ dout, const T *__restrict__ x,
                                     const T *__restrict__ bias, int64_t rows, int64_t cols, int64_t tiles,
                                     int64_t chunk_rows, int acc) {
    typedef pack_t<T, V> P;
    __shared__ double part[GB_LANES][GB_PACKS * V];
    int64_t tile = blockIdx.x % tiles, chunk = blockIdx.x / tiles;
    int64_t c0 = (tile * GB_PACKS + threadIdx.x) * V;   /* this thread's first column */
    int64_t r0 = chunk * chunk_rows, r1 = cuda_min64(r0 + chunk_rows, rows);
    double s[V];
#pragma unroll
    for (int k = 0; k < V; k++) s[k] = 0.0;
    if (c0 < cols) {
        P bv = *(const P *)(bias + c0);
        for (int64_t r = r0 + threadIdx.y; r < r1; r += GB_LANES) {
            int64_t at = r * cols + c0;   /* (r, c0) of (rows, cols) */
            P gv = *(const P *)(dout + at), xv = *(const P *)(x + at), d;
#pragma unroll
            for (int k = 0; k < V; k++) {
                stf(&d.v[k], ldf(gv.v[k]) * gelu_grad(ldf(xv.v[k]) + ldf(bv.v[k])));
                s[k] += (double)ldf(d.v[k]);   /* the sum of dx as stored */
            }
            store_pack((P *)(dx + at), d);
        }
    }
    if (!dbias) return;   /* (the same for every thread of the launch) */
#pragma unroll
    for (int k = 0; k < V; k++) part[threadIdx.y][threadIdx.x * V + k] = s[k];
    __syncthreads();
    if (threadIdx.y != 0 || c0 >= cols) return;
#pragma unroll
    for (int k = 0; k < V; k++) {
        double sum = 0.0;
        for (int l = 0; l < GB_LANES; l++) sum += part[l][threadIdx.x * V + k];
        int64_t j = c0 + k;
        if (partial) partial[chunk * cols + j] = sum;
        else stf(dbias + j, acc ? (float)((double)ldf(dbias[j]) + sum) : (float)sum);
    }
}

template <class T>
static void bias_gelu_backward(T *dx, T *dbias, const T *dout, const T *x, const T *bias, int64_t rows,
                               int64_t cols, int acc) {
    if (cols <= 0) return;
    if (rows <= 0) {   /* empty sums: 0, or nothing to add */
        if (dbias && !acc) CUDA_CHECK(cudaMemsetAsync(dbias, 0, (size_t)cols * sizeof(T), cuda_stream()));
        return;
    }
    int v = fused_width<T>(cols, dx, dout, x, bias);
    int64_t tiles = cuda_ceil_div(cols, (int64_t)GB_PACKS * v);
    /* chunks of rows so that some 4 blocks per SM run, each of 64 rows at least */
    int64_t want = cuda_ceil_div((int64_t)cuda_sm_count() * 4, tiles);
    int64_t chunks = cuda_min64(want, cuda_ceil_div(rows, 64));
    if (chunks < 1) chunks = 1;
    int64_t chunk_rows = cuda_ceil_div(rows, chunks);
    chunks = cuda_ceil_div(rows, chunk_rows);
    if (tiles * chunks >= ((int64_t)1 << 31))
        cuda_fail(__func__, __FILE__, __LINE__, "bias_gelu_backward", "more than 2^31 blocks");
    double *partial = dbias && chunks > 1 ? (double *)cuda_tmp_alloc((size_t)(chunks * cols) * sizeof(double)) : NULL;
    unsigned blocks = (unsigned)(tiles * chunks);
    void (*kernel)(T *, T *, double *, const T *, const T *, const T *, int64_t, int64_t, int64_t, int64_t, int) =
        v > 1 ? bias_gelu_bwd_kernel<T, 16 / sizeof(T)> : bias_gelu_bwd_kernel<T, 1>;
    LAUNCH(kernel, blocks, dim3(GB_PACKS, GB_LANES), 0)(dx, dbias, partial, dout, x, bias, rows, cols, tiles,
                                                        chunk_rows, acc);
    CUDA_CHECK_LAUNCH();
    if (partial) {
        cuda_sum_slices(dbias, partial, chunks, cols, acc);
        cuda_tmp_free(partial);
    }
}

/* ---- bias + residual ---- */

template <class T, int V>
__global__ void bias_residual_kernel(T *__restrict__ out, const T *__restrict__ x, const T *__restrict__ bias,
                                     const T *__restrict__ res, int64_t n_packs, int64_t row_packs) {
    typedef pack_t<T, V> P;
    GRID_STRIDE(i, n_packs) {
        P xv = ((const P *)x)[i], bv = ((const P *)bias)[i % row_packs], rv = ((const P *)res)[i], o;
#pragma unroll
        for (int k = 0; k < V; k++) stf(&o.v[k], ldf(rv.v[k]) + (ldf(xv.v[k]) + ldf(bv.v[k])));
        ((P *)out)[i] = o;
    }
}

template <class T>
static void bias_residual(T *out, const T *x, const T *bias, const T *res, int64_t rows, int64_t cols) {
    if (rows <= 0 || cols <= 0) return;
    int64_t n = rows * cols;
    int v = fused_width<T>(cols, out, x, bias, res);
    void (*kernel)(T *, const T *, const T *, const T *, int64_t, int64_t) =
        v > 1 ? bias_residual_kernel<T, 16 / sizeof(T)> : bias_residual_kernel<T, 1>;
    LAUNCH(kernel, cuda_blocks(n / v, CUDA_THREADS), CUDA_THREADS, 0)(out, x, bias, res, n / v, cols / v);
    CUDA_CHECK_LAUNCH();
}

/* ---- the table's entries ---- */

void cuda_bias_gelu_forward_f32(float *out, const float *x, const float *bias, int64_t rows, int64_t cols) {
    CUDA_ENTER();
    bias_gelu_forward(out, x, bias, rows, cols);
}
void cuda_bias_gelu_forward_bf16(uint16_t *out, const uint16_t *x, const uint16_t *bias, int64_t rows,
                                 int64_t cols) {
    CUDA_ENTER();
    bias_gelu_forward(out, x, bias, rows, cols);
}
void cuda_bias_gelu_backward_f32(float *dx, float *dbias, const float *dout, const float *x, const float *bias,
                                 int64_t rows, int64_t cols, int acc) {
    CUDA_ENTER();
    bias_gelu_backward(dx, dbias, dout, x, bias, rows, cols, acc);
}
void cuda_bias_gelu_backward_bf16(uint16_t *dx, uint16_t *dbias, const uint16_t *dout, const uint16_t *x,
                                  const uint16_t *bias, int64_t rows, int64_t cols, int acc) {
    CUDA_ENTER();
    bias_gelu_backward(dx, dbias, dout, x, bias, rows, cols, acc);
}
void cuda_bias_residual_f32(float *out, const float *x, const float *bias, const float *res, int64_t rows,
                            int64_t cols) {
    CUDA_ENTER();
    bias_residual(out, x, bias, res, rows, cols);
}
void cuda_bias_residual_bf16(uint16_t *out, const uint16_t *x, const uint16_t *bias, const uint16_t *res,
                             int64_t rows, int64_t cols) {
    CUDA_ENTER();
    bias_residual(out, x, bias, res, rows, cols);
}
