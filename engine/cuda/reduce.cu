/* reduce.cu: sums, as engine/cpu/reduce.c: everything accumulates in
 * double. Work is cut into pieces whose boundaries depend only on the sizes
 * (never on the GPU model or timing), and partial sums are combined in a
 * fixed order with no atomics, so a result is the same bit for bit run
 * after run. sum_all and sumsq return a value, so they wait for the GPU. */
#include "cuda_internal.h"
#include <stdlib.h>

/* ---- sum_all, sumsq: per-block partials, then one block adds them in order ---- */

#define FLAT_MAX_BLOCKS 1024
#define FLAT_PER_THREAD 16   /* elements per thread before adding another block */

__global__ void flat_partial_kernel(double *partial, const float *in, int64_t n, int square) {
    __shared__ double scratch[32];
    double acc = 0.0;
    GRID_STRIDE(i, n) {
        double v = in[i];
        acc += square ? v * v : v;
    }
    acc = block_sum_d(acc, scratch);
    if (threadIdx.x == 0) partial[blockIdx.x] = acc;
}

/* out[0] = sum of partial[0, n), one block */
__global__ void flat_final_kernel(double *out, const double *partial, int n) {
    __shared__ double scratch[32];
    double acc = 0.0;
    for (int i = threadIdx.x; i < n; i += blockDim.x) acc += partial[i];
    acc = block_sum_d(acc, scratch);
    if (threadIdx.x == 0) out[0] = acc;
}

static double flat_reduce(const float *in, int64_t n, int square) {
    if (n <= 0) return 0.0;
    int64_t want = cuda_ceil_div(n, (int64_t)CUDA_THREADS * FLAT_PER_THREAD);
    int blocks = (int)cuda_min64(want, FLAT_MAX_BLOCKS);
    double *tmp = (double *)cuda_tmp_alloc((size_t)(blocks + 1) * sizeof(double));   // partials, then the total
    LAUNCH(flat_partial_kernel, blocks, CUDA_THREADS, 0)(tmp, in, n, square);
    CUDA_CHECK_LAUNCH();
    LAUNCH(flat_final_kernel, 1, CUDA_THREADS, 0)(tmp + blocks, tmp, blocks);
    CUDA_CHECK_LAUNCH();
    double result = 0.0;
    CUDA_CHECK(cudaMemcpyAsync(&result, tmp + blocks, sizeof result, cudaMemcpyDeviceToHost, cuda_stream()));
    cuda_tmp_free(tmp);
    CUDA_CHECK(cudaStreamSynchronize(cuda_stream()));
    return result;
}

double cuda_sum_all_f32(const float *in, int64_t n) {
    CUDA_ENTER();
    return flat_reduce(in, n, 0);
}

double cuda_sumsq_f32(const float *in, int64_t n) {
    CUDA_ENTER();
    return flat_reduce(in, n, 1);
}

/* ---- sumsq over many tensors: a few launches, one value back ----
 * The tensors go SQ_GROUP at a time in a struct argument (kernel parameter
 * space, no copy to the device); tensor k of a group owns its blocks
 * [block0, block0 + ceil(n / SQ_PER_BLOCK)), block b finds its tensor by a
 * search over block0 and sums its chunk into partial[b]. The partials of
 * all groups are then added in block order by flat_final_kernel. */
#define SQ_PER_BLOCK ((int64_t)CUDA_THREADS * FLAT_PER_THREAD)
#define SQ_GROUP 14

struct sq_group {
    const float *p[SQ_GROUP];
    int64_t n[SQ_GROUP], block0[SQ_GROUP];
    int count;
};

/* the emulation opens the memory a kernel reaches through a struct argument */
[[maybe_unused]] static inline void emu_kernel_ptrs(const sq_group &g, emu_ptr_list &list) {
    for (int k = 0; k < g.count; k++) list.add(g.p[k]);
}

__global__ void sumsq_group_kernel(double *partial, sq_group g) {
    __shared__ double scratch[32];
    int k = 0;
    while (k + 1 < g.count && g.block0[k + 1] <= (int64_t)blockIdx.x) k++;
    int64_t start = ((int64_t)blockIdx.x - g.block0[k]) * SQ_PER_BLOCK;
    int64_t end = cuda_min64(start + SQ_PER_BLOCK, g.n[k]);
    double acc = 0.0;
    for (int64_t i = start + threadIdx.x; i < end; i += blockDim.x) {
        double v = g.p[k][i];
        acc += v * v;
    }
    acc = block_sum_d(acc, scratch);
    if (threadIdx.x == 0) partial[blockIdx.x] = acc;
}

double cuda_sumsq_many_f32(const float *const *ptrs, const int64_t *counts, int n) {
    CUDA_ENTER();
    int64_t blocks = 0;
    for (int i = 0; i < n; i++)
        if (counts[i] > 0) blocks += cuda_ceil_div(counts[i], SQ_PER_BLOCK);
    if (blocks == 0) return 0.0;
    if (blocks > INT32_MAX) cuda_fail(__func__, __FILE__, __LINE__, "sumsq_many", "more than 2^31 - 1 blocks");
    double *partial = (double *)cuda_tmp_alloc((size_t)(blocks + 1) * sizeof(double));   // partials, then the total
    int64_t done = 0;   /* blocks launched so far: this group's partials start there */
    sq_group g;
    g.count = 0;
    for (int i = 0; i <= n; i++) {
        bool flush = i == n || g.count == SQ_GROUP;
        if (flush && g.count > 0) {
            int64_t gb = g.block0[g.count - 1] + cuda_ceil_div(g.n[g.count - 1], SQ_PER_BLOCK);
            LAUNCH(sumsq_group_kernel, (unsigned)gb, CUDA_THREADS, 0)(partial + done, g);
            CUDA_CHECK_LAUNCH();
            done += gb;
            g.count = 0;
        }
        if (i == n || counts[i] <= 0) continue;
        int64_t b0 = g.count ? g.block0[g.count - 1] + cuda_ceil_div(g.n[g.count - 1], SQ_PER_BLOCK) : 0;
        g.p[g.count] = ptrs[i];
        g.n[g.count] = counts[i];
        g.block0[g.count] = b0;
        g.count++;
    }
    LAUNCH(flat_final_kernel, 1, CUDA_THREADS, 0)(partial + blocks, partial, (int)blocks);
    CUDA_CHECK_LAUNCH();
    double result = 0.0;
    CUDA_CHECK(cudaMemcpyAsync(&result, partial + blocks, sizeof result, cudaMemcpyDeviceToHost, cuda_stream()));
    cuda_tmp_free(partial);
    CUDA_CHECK(cudaStreamSynchronize(cuda_stream()));
    return result;
}

/* ---- partial sums over slices, added in slice order ---- */

/* Stores a sum, or with acc adds it to what out holds (one rounding). */
template <class T> __device__ __forceinline__ void put_sum(T *out, double s, int acc) {
    stf(out, acc ? (float)((double)ldf(*out) + s) : (float)s);
}

template <class T>
__global__ void sum_slices_kernel(T *out, const double *partial, int64_t slices, int64_t n, int acc) {
    GRID_STRIDE(i, n) {
        double s = 0.0;
        for (int64_t k = 0; k < slices; k++) s += partial[k * n + i];
        put_sum(out + i, s, acc);
    }
}

template <class T> static void sum_slices(T *out, const double *partial, int64_t slices, int64_t n, int acc) {
    if (n <= 0) return;
    LAUNCH(sum_slices_kernel<T>, cuda_blocks(n, CUDA_THREADS), CUDA_THREADS, 0)(out, partial, slices, n, acc);
    CUDA_CHECK_LAUNCH();
}
void cuda_sum_slices(float *out, const double *partial, int64_t slices, int64_t n, int acc) {
    sum_slices(out, partial, slices, n, acc);
}
void cuda_sum_slices(uint16_t *out, const double *partial, int64_t slices, int64_t n, int acc) {
    sum_slices(out, partial, slices, n, acc);
}

/* ---- sum_dim: in (outer, red, inner) -> out (outer, inner) ----
 * red is cut into `slices` of slice_len rows when there are few outputs to
 * spread over the GPU; slice s of output o writes partial[(s, o, j)], and
 * sum_slices adds the slices. With one slice the kernels write out directly.
 * bf16 in and out: the same sums in double, one rounding at the end. */

/* inner == 1, short rows: a thread per output. */
template <class T> __global__ void rowsum_thread_kernel(T *out, const T *in, int64_t outer, int64_t red, int acc) {
    GRID_STRIDE(o, outer) {
        const T *row = in + o * red;   // (red)
        double s = 0.0;
        for (int64_t r = 0; r < red; r++) s += ldf(row[r]);
        put_sum(out + o, s, acc);
    }
}

/* inner == 1: a block per (slice, output row); grid = slices * outer. */
template <class T>
__global__ void rowsum_block_kernel(T *out, double *partial, const T *in, int64_t outer, int64_t red,
                                    int64_t slice_len, int acc) {
    __shared__ double scratch[32];
    int64_t o = blockIdx.x % outer, s = blockIdx.x / outer;
    int64_t r0 = s * slice_len, r1 = cuda_min64(r0 + slice_len, red);
    const T *row = in + o * red;   // (red)
    double acc_sum = 0.0;
    for (int64_t r = r0 + threadIdx.x; r < r1; r += blockDim.x) acc_sum += ldf(row[r]);
    acc_sum = block_sum_d(acc_sum, scratch);
    if (threadIdx.x == 0) {
        if (partial) partial[s * outer + o] = acc_sum;
        else put_sum(out + o, acc_sum, acc);
    }
}

/* inner > 1: block (32, 8) per (slice, output row, tile of 32 columns);
 * threadIdx.x picks the column, the 8 rows of threads stride over the
 * slice's rows, and their 8 sums are added in row order. */
#define COL_TILE 32
#define COL_LANES 8

template <class T>
__global__ void colsum_kernel(T *out, double *partial, const T *in, int64_t outer, int64_t red, int64_t inner,
                              int64_t tiles, int64_t slice_len, int acc) {
    __shared__ double part[COL_LANES][COL_TILE];
    int64_t t = blockIdx.x % tiles, rest = blockIdx.x / tiles;
    int64_t o = rest % outer, s = rest / outer;
    int64_t j = t * COL_TILE + threadIdx.x;
    int64_t r0 = s * slice_len, r1 = cuda_min64(r0 + slice_len, red);
    const T *slab = in + o * red * inner;   // (red, inner)
    double col = 0.0;
    if (j < inner)
        for (int64_t r = r0 + threadIdx.y; r < r1; r += COL_LANES) col += ldf(slab[r * inner + j]);
    part[threadIdx.y][threadIdx.x] = col;
    __syncthreads();
    if (threadIdx.y == 0 && j < inner) {
        double sum = 0.0;
        for (int k = 0; k < COL_LANES; k++) sum += part[k][threadIdx.x];
        if (partial) partial[(s * outer + o) * inner + j] = sum;
        else put_sum(out + o * inner + j, sum, acc);
    }
}

/* acc: out += the sums (one rounding each) instead of out = the sums */
template <class T> static void sum_dim(T *out, const T *in, int64_t outer, int64_t red, int64_t inner, int acc) {
    if (outer <= 0 || inner <= 0) return;
    if (red <= 0) {   /* empty sums: 0, or nothing to add */
        if (!acc) CUDA_CHECK(cudaMemsetAsync(out, 0, (size_t)(outer * inner) * sizeof(T), cuda_stream()));
        return;
    }
    if (inner == 1 && red <= 64) {
        LAUNCH(rowsum_thread_kernel<T>, cuda_blocks(outer, CUDA_THREADS), CUDA_THREADS, 0)(out, in, outer, red, acc);
        CUDA_CHECK_LAUNCH();
        return;
    }
    /* Outputs worth a block each; below 512 of them, cut red into slices of
     * at least 256 rows so that some 512 blocks run. */
    int64_t tiles = inner == 1 ? 1 : cuda_ceil_div(inner, COL_TILE);
    int64_t items = outer * tiles, slices = 1;
    if (items < 512 && red >= 512) slices = cuda_min64(cuda_ceil_div(512, items), red / 256);
    int64_t slice_len = cuda_ceil_div(red, slices);
    slices = cuda_ceil_div(red, slice_len);
    double *partial = slices > 1 ? (double *)cuda_tmp_alloc((size_t)(slices * outer * inner) * sizeof(double)) : NULL;
    int64_t blocks = slices * items;
    if (blocks >= ((int64_t)1 << 31)) cuda_fail(__func__, __FILE__, __LINE__, "sum_dim", "more than 2^31 blocks");
    if (inner == 1)
        LAUNCH(rowsum_block_kernel<T>, (unsigned)blocks, CUDA_THREADS, 0)(out, partial, in, outer, red, slice_len,
                                                                          acc);
    else
        LAUNCH(colsum_kernel<T>, (unsigned)blocks, dim3(COL_TILE, COL_LANES), 0)(out, partial, in, outer, red, inner,
                                                                                tiles, slice_len, acc);
    CUDA_CHECK_LAUNCH();
    if (partial) {
        sum_slices(out, partial, slices, outer * inner, acc);
        cuda_tmp_free(partial);
    }
}

void cuda_sum_dim_f32(float *out, const float *in, int64_t outer, int64_t red, int64_t inner) {
    CUDA_ENTER();
    sum_dim(out, in, outer, red, inner, 0);
}

void cuda_sum_dim_bf16(uint16_t *out, const uint16_t *in, int64_t outer, int64_t red, int64_t inner) {
    CUDA_ENTER();
    sum_dim(out, in, outer, red, inner, 0);
}

void cuda_sum_dim_acc_bf16(uint16_t *out, const uint16_t *in, int64_t outer, int64_t red, int64_t inner) {
    CUDA_ENTER();
    sum_dim(out, in, outer, red, inner, 1);
}
