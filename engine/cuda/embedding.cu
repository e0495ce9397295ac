/* embedding.cu: the embedding's row gather (forward) and scatter-add
 * (backward), with the semantics of engine/cpu/embedding.c. No atomics on
 * floats: every sum is taken in position order, so results repeat bit for
 * bit and equal the CPU's.
 *
 * Two backwards:
 * - embedding_backward_f32 zero-fills an f32 table and lets warps of id
 *   classes walk the ids in order (no scratch memory).
 * - The gradient added where it is kept (embedding_backward_acc_bf16,
 *   _acc_f32, and embedding_backward_bf16 after a memset) groups the
 *   positions by id first: the (id, position) pairs are sorted on the
 *   device, then each id's dout rows are summed in f32 registers in
 *   position order onto the row's old value and stored once (bf16: one
 *   rounding per element, as the CPU's). Only the rows of the ids are read
 *   and written: no f32 table, no second pass, no tape add. */
#include "cuda_internal.h"

/* Blocks for one block per row (rows beyond the grid loop). */
static unsigned emb_row_blocks(int64_t rows) { return (unsigned)cuda_min64(rows, (int64_t)1 << 30); }

#define FOR_ROWS(r, rows) for (int64_t r = blockIdx.x; r < (rows); r += gridDim.x)

/* ---- forward ---- */

/* out (n, dim) [i] = table (V, dim) [ids[i]]; T float or bf16 (copied as it is) */
template <class T>
__global__ void embedding_fwd_kernel(T *out, const int64_t *ids, int64_t n, const T *table, int64_t dim) {
    FOR_ROWS(i, n) {
        const T *src = table + ids[i] * dim;
        for (int64_t j = threadIdx.x; j < dim; j += blockDim.x) out[i * dim + j] = src[j];
    }
}

/* ---- backward over id classes (f32, a table of zeros first) ---- */

/* dtable[ids[i], j] += dout[i, j] for i in order, without atomics: the
 * vocabulary is split into R classes by a hash of the id, and warp (class c,
 * tile of 32 columns) walks all ids in order, adding the rows of its class
 * into its columns. No two warps touch one element, and each element gets
 * its terms in the order of i, as on the CPU, so the result is the CPU's bit
 * for bit. Block (32, 8): 8 classes by 32 columns; grid (column tiles, R / 8).
 * The ids go through shared memory a chunk at a time, with their classes. */
#define EMB_CHUNK 1024

__device__ __forceinline__ int emb_class(int64_t id, int log2_classes) {
    return (int)(((uint32_t)id * 0x9E3779B1u) >> (32 - log2_classes));
}

__global__ void embedding_bwd_kernel(float *dtable, const int64_t *ids, int64_t n, const float *dout, int64_t dim,
                                     int log2_classes) {
    __shared__ int64_t s_id[EMB_CHUNK];
    __shared__ int s_class[EMB_CHUNK];
    int tid = cuda_linear_tid();
    int cls = (int)(blockIdx.y * blockDim.y + threadIdx.y);
    int64_t j = (int64_t)blockIdx.x * 32 + threadIdx.x;
    for (int64_t c0 = 0; c0 < n; c0 += EMB_CHUNK) {
        int len = (int)cuda_min64(EMB_CHUNK, n - c0);
        __syncthreads();   /* the previous chunk is done with */
        for (int k = tid; k < len; k += cuda_block_threads()) {
            int64_t id = ids[c0 + k];
            s_id[k] = id;
            s_class[k] = emb_class(id, log2_classes);
        }
        __syncthreads();
        if (j < dim)
            for (int k = 0; k < len; k++)
                if (s_class[k] == cls) dtable[s_id[k] * dim + j] += dout[(c0 + k) * dim + j];
    }
}

/* ---- backward by sorted ids ----
 *
 * 1. Sort the keys (id, position) of the n positions: tiles of EMB_TILE
 *    keys in shared memory (each key goes to its rank, the count of the
 *    tile's keys below it), then groups of EMB_WAYS sorted runs merged into
 *    one, pass after pass (one pass up to EMB_WAYS tiles: GPT-2's 16 x
 *    1024 tokens): a key's place in its group's run is its index in its own
 *    run plus the count of keys below it in each other run of the group
 *    (binary searches, side by side). Keys are unique, so the order is the
 *    same whatever the threads' timing: by id, and within an id by
 *    position.
 * 2. Block (range of EMB_RANGE sorted keys, slice of columns) takes every id
 *    whose first key lies in its range (an id's keys may run past the range
 *    end; its start lies in exactly one range): acc = old row, plus each of
 *    the id's dout rows in position order, in f32, stored once.
 *
 * Scratch: two key buffers, 32 bytes a position (cuda_tmp_alloc), freed in
 * stream order. */
#define EMB_TILE 1024
#define EMB_RANGE 32
#define EMB_WAYS 16
#define EMB_UNROLL 8   /* dout rows of one id loaded at once */

struct emb_key {
    int64_t id, pos;
};

__device__ __forceinline__ bool emb_key_less(const emb_key &a, const emb_key &b) {
    return a.id < b.id || (a.id == b.id && a.pos < b.pos);
}

/* out[tile start + rank] = key: tile blockIdx.x of the n positions sorted */
__global__ void emb_sort_tile_kernel(emb_key *__restrict__ out, const int64_t *__restrict__ ids, int64_t n) {
    __shared__ emb_key s_key[EMB_TILE];
    int64_t base = (int64_t)blockIdx.x * EMB_TILE;
    int len = (int)cuda_min64(EMB_TILE, n - base), t = (int)threadIdx.x;
    if (t < len) s_key[t] = emb_key{ids[base + t], base + t};
    __syncthreads();
    if (t < len) {
        emb_key k = s_key[t];
        int rank = 0;
        for (int j = 0; j < len; j++) rank += emb_key_less(s_key[j], k);
        out[base + rank] = k;
    }
}

/* Runs of len sorted keys of in (n, the last run shorter), merged in groups
 * of EMB_WAYS consecutive runs into out. The searches step down by powers
 * of two (below[r]: the count of run r's keys below k so far), all runs at
 * each step, so their loads are in flight together. */
__global__ void emb_merge_kernel(emb_key *__restrict__ out, const emb_key *__restrict__ in, int64_t n, int64_t len) {
    GRID_STRIDE(i, n) {
        emb_key k = in[i];
        int64_t run = i / len, first = run - run % EMB_WAYS, below[EMB_WAYS], size[EMB_WAYS];
#pragma unroll
        for (int r = 0; r < EMB_WAYS; r++) {
            int64_t start = (first + r) * len;
            size[r] = first + r == run || start >= n ? 0 : cuda_min64(len, n - start);
            below[r] = 0;
        }
        int64_t step = 1;
        while (step * 2 <= len) step *= 2;
        for (; step > 0; step /= 2)
#pragma unroll
            for (int r = 0; r < EMB_WAYS; r++) {
                int64_t at = below[r] + step;   /* the keys [0, at) of run r are below k? */
                if (at <= size[r] && emb_key_less(in[(first + r) * len + at - 1], k)) below[r] = at;
            }
        int64_t place = first * len + (i - run * len);
        for (int r = 0; r < EMB_WAYS; r++) place += below[r];
        out[place] = k;
    }
}

/* V elements of T in one access (16 bytes, or one element) */
template <class T, int V> struct alignas(sizeof(T) * V) emb_pack {
    T v[V];
};

/* dtable (vocab, dim) rows of the ids += their dout (n, dim) rows, keys sorted;
 * column pack p of a row: elements p V .. p V + V - 1 */
template <class T, int V>
__global__ void emb_accumulate_kernel(T *__restrict__ dtable, const emb_key *__restrict__ keys, int64_t n,
                                      const T *__restrict__ dout, int64_t dim) {
    typedef emb_pack<T, V> P;
    int64_t packs = dim / V, begin = (int64_t)blockIdx.x * EMB_RANGE, end = cuda_min64(begin + EMB_RANGE, n);
    /* an id that started in the range before belongs to that range's block */
    if (begin > 0) {
        int64_t prev = keys[begin - 1].id;
        while (begin < end && keys[begin].id == prev) begin++;
    }
    for (int64_t p = (int64_t)blockIdx.y * blockDim.x + threadIdx.x; p < packs; p += (int64_t)gridDim.y * blockDim.x)
        for (int64_t s = begin; s < end;) {
            int64_t id = keys[s].id;
            P *row = (P *)(dtable + id * dim) + p;
            P old = *row, out;
            float acc[V];
            for (int v = 0; v < V; v++) acc[v] = ldf(old.v[v]);
            /* past end too: the id is this block's. EMB_UNROLL rows at a time,
             * all loaded before any is added, so a frequent id's rows are in
             * flight together rather than one latency each; the adds keep
             * position order. The id's keys are contiguous, so the rows that
             * belong to it are a prefix of the EMB_UNROLL. */
            while (s < n && keys[s].id == id) {
                P d[EMB_UNROLL];
                bool mine[EMB_UNROLL];
#pragma unroll
                for (int u = 0; u < EMB_UNROLL; u++) {
                    mine[u] = s + u < n && keys[s + u].id == id;
                    if (mine[u]) d[u] = ((const P *)(dout + keys[s + u].pos * dim))[p];
                }
#pragma unroll
                for (int u = 0; u < EMB_UNROLL; u++)
                    if (mine[u]) {
                        for (int v = 0; v < V; v++) acc[v] += ldf(d[u].v[v]);
                        s++;
                    }
            }
            for (int v = 0; v < V; v++) stf(&out.v[v], acc[v]);
            *row = out;
        }
}

static bool emb_aligned16(const void *p) { return ((uintptr_t)p & 15u) == 0; }

template <class T>
static void embedding_backward_sorted(T *dtable, const int64_t *ids, int64_t n, const T *dout, int64_t dim) {
    if (n <= 0 || dim <= 0) return;
    emb_key *scratch = (emb_key *)cuda_tmp_alloc((size_t)n * 2 * sizeof(emb_key)), *a = scratch, *b = scratch + n;
    LAUNCH(emb_sort_tile_kernel, (unsigned)cuda_ceil_div(n, EMB_TILE), EMB_TILE, 0)(a, ids, n);
    CUDA_CHECK_LAUNCH();
    for (int64_t len = EMB_TILE; len < n; len *= EMB_WAYS) {
        LAUNCH(emb_merge_kernel, cuda_blocks(n, CUDA_THREADS), CUDA_THREADS, 0)(b, a, n, len);
        CUDA_CHECK_LAUNCH();
        emb_key *t = a;
        a = b;
        b = t;
    }
    const int wide = 16 / (int)sizeof(T);
    int v = dim % wide == 0 && emb_aligned16(dtable) && emb_aligned16(dout) ? wide : 1;
    int64_t packs = dim / v;
    int threads = (int)cuda_min64(256, cuda_ceil_div(packs, 32) * 32);
    dim3 grid((unsigned)cuda_ceil_div(n, EMB_RANGE), (unsigned)cuda_min64(65535, cuda_ceil_div(packs, threads)));
    void (*kernel)(T *, const emb_key *, int64_t, const T *, int64_t) =
        v > 1 ? emb_accumulate_kernel<T, 16 / sizeof(T)> : emb_accumulate_kernel<T, 1>;
    LAUNCH(kernel, grid, threads, 0)(dtable, a, n, dout, dim);
    CUDA_CHECK_LAUNCH();
    cuda_tmp_free(scratch);
}

/* ---- the table's entries ---- */

void cuda_embedding_forward_f32(float *out, const int64_t *ids, int64_t n, const float *table, int64_t dim) {
    CUDA_ENTER();
    if (n <= 0 || dim <= 0) return;
    LAUNCH(embedding_fwd_kernel<float>, emb_row_blocks(n), cuda_row_threads(dim), 0)(out, ids, n, table, dim);
    CUDA_CHECK_LAUNCH();
}

void cuda_embedding_forward_bf16(uint16_t *out, const int64_t *ids, int64_t n, const uint16_t *table, int64_t dim) {
    CUDA_ENTER();
    if (n <= 0 || dim <= 0) return;
    LAUNCH(embedding_fwd_kernel<uint16_t>, emb_row_blocks(n), cuda_row_threads(dim), 0)(out, ids, n, table, dim);
    CUDA_CHECK_LAUNCH();
}

void cuda_embedding_backward_f32(float *dtable, int64_t vocab, const int64_t *ids, int64_t n, const float *dout,
                                 int64_t dim) {
    CUDA_ENTER();
    if (dim <= 0 || vocab <= 0) return;
    CUDA_CHECK(cudaMemsetAsync(dtable, 0, (size_t)(vocab * dim) * sizeof(float), cuda_stream()));
    if (n <= 0) return;
    /* Classes: 8 .. 128, fewer when the vocabulary is small. More classes
     * mean more warps scanning the ids, fewer mean longer chains of adds per
     * warp; 128 balances them for GPT-2-sized batches. */
    int log2_classes = 3;
    while (log2_classes < 7 && ((int64_t)1 << log2_classes) < vocab) log2_classes++;
    int64_t tiles = cuda_ceil_div(dim, 32);
    dim3 grid((unsigned)tiles, (unsigned)((1 << log2_classes) / 8));
    LAUNCH(embedding_bwd_kernel, grid, dim3(32, 8), 0)(dtable, ids, n, dout, dim, log2_classes);
    CUDA_CHECK_LAUNCH();
}

void cuda_embedding_backward_acc_bf16(uint16_t *dtable, const int64_t *ids, int64_t n, const uint16_t *dout,
                                      int64_t dim) {
    CUDA_ENTER();
    embedding_backward_sorted(dtable, ids, n, dout, dim);
}

void cuda_embedding_backward_acc_f32(float *dtable, const int64_t *ids, int64_t n, const float *dout, int64_t dim) {
    CUDA_ENTER();
    embedding_backward_sorted(dtable, ids, n, dout, dim);
}

/* dtable (vocab, dim) overwritten: zeros (bf16 0 is all zero bits), then each id's sum added */
void cuda_embedding_backward_bf16(uint16_t *dtable, int64_t vocab, const int64_t *ids, int64_t n,
                                  const uint16_t *dout, int64_t dim) {
    CUDA_ENTER();
    if (dim <= 0 || vocab <= 0) return;
    CUDA_CHECK(cudaMemsetAsync(dtable, 0, (size_t)(vocab * dim) * sizeof(uint16_t), cuda_stream()));
    embedding_backward_sorted(dtable, ids, n, dout, dim);
}
