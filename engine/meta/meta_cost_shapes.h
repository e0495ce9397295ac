/* meta_cost_shapes.h: what a kernel's passes cost, for the counting
 * device's cost table (meta_device.c, its only includer): the bytes of
 * broadcast and strided operands, and the passes, partial sums and launches
 * of the kernels whose cost depends on their shape (norm and GELU
 * backward, flash attention's walk and L2, the embedding's sort). Each
 * mirrors what the CUDA kernel does; the comments say which. */
#ifndef FSDP_META_COST_SHAPES_H
#define FSDP_META_COST_SHAPES_H
#include "internal.h"
#include <stdbool.h>
#include <stdint.h>

/* ---- bytes of broadcast and strided operands ---- */

/* Elements a strided view over shape actually holds (dims of stride 0 are
 * read once: the broadcast value stays in cache). */
static int64_t distinct_elems(int ndim, const int64_t *shape, const int64_t *strides) {
    int64_t n = 1;
    for (int d = 0; d < ndim; d++)
        if (strides[d] != 0) n *= shape[d];
    return n;
}

static int64_t numel_of(int ndim, const int64_t *shape) {
    int64_t n = 1;
    for (int d = 0; d < ndim; d++) n *= shape[d];
    return n;
}

static size_t dtype_bytes(int dtype) { return fsdp_dtype_size(dtype); }

static int64_t sum_counts(const int64_t *counts, int n) {
    int64_t s = 0;
    for (int i = 0; i < n; i++) s += counts[i] > 0 ? counts[i] : 0;
    return s;
}

/* the elements of the tensors that have ptrs[i] (ptrs may be NULL) */
static int64_t sum_counts_with(const int64_t *counts, void *const *ptrs, int n) {
    int64_t s = 0;
    for (int i = 0; ptrs && i < n; i++) s += ptrs[i] && counts[i] > 0 ? counts[i] : 0;
    return s;
}

static int64_t nonempty(const int64_t *counts, int n) {
    int64_t k = 0;
    for (int i = 0; i < n; i++) k += counts[i] > 0;
    return k;
}

/* GPU operations of engine/cuda's sum_dim (reduce.cu): one kernel, and
 * a second that adds the slices when few outputs make it cut the reduced
 * dim; a memset for an empty reduction (nothing when it accumulates). */
static int64_t sum_dim_launches(int64_t outer, int64_t red, int64_t inner, int acc) {
    if (outer <= 0 || inner <= 0) return 0;
    if (red <= 0) return acc ? 0 : 1;
    if (inner == 1 && red <= 64) return 1;
    int64_t tiles = inner == 1 ? 1 : (inner + 31) / 32, items = outer * tiles, slices = 1;
    if (items < 512 && red >= 512) {
        slices = (512 + items - 1) / items;
        if (slices > red / 256) slices = red / 256;
    }
    int64_t len = (red + slices - 1) / slices;
    slices = (red + len - 1) / len;
    return slices > 1 ? 2 : 1;
}

/* ... and of its norm backward (norm.cu): with weight or bias
 * gradients and a row of at most 2048 columns, one kernel that writes dx
 * and the gradients' partial sums per chunk of rows (some 2 blocks per SM:
 * 132 SMs, the H200 tools/gpu-model prices; the partials in double, written
 * and read once), then one that adds the chunks; wider rows take the dx
 * kernel, a partial-sums kernel reading dout and x once more, and the
 * finish. Without those gradients, the dx kernel alone. */
static bool norm_bwd_fused(int64_t rows, int64_t cols, const void *dweight, const void *dbias) {
    return rows > 0 && cols > 0 && cols <= 2048 && (dweight || dbias);
}
static int64_t norm_bwd_reread(int64_t cols, const void *dweight, const void *dbias) {
    return (dweight || dbias) && cols > 2048;
}
static int64_t norm_bwd_partial_bytes(int64_t rows, int64_t cols, const void *dweight, const void *dbias) {
    if (!norm_bwd_fused(rows, cols, dweight, dbias)) return 0;
    int64_t chunks = 2 * 132 < (rows + 15) / 16 ? 2 * 132 : (rows + 15) / 16;
    int64_t len = (rows + chunks - 1) / chunks;
    chunks = (rows + len - 1) / len;
    return 8 * chunks * cols * ((dweight != NULL) + (dbias != NULL));
}
static int64_t norm_bwd_launches(int64_t rows, int64_t cols, const void *dweight, const void *dbias, int acc) {
    if (cols <= 0) return 0;
    if (norm_bwd_fused(rows, cols, dweight, dbias)) return 2;
    int64_t n = rows > 0;
    int64_t grads = (dweight != NULL) + (dbias != NULL);
    if (grads == 0) return n;
    if (rows <= 0) return n + (acc ? 0 : grads);
    return n + 2;
}

/* Rows of K and V the flash attention (attention_flash.cu) reads: each
 * query tile of 64 rows walks the key tiles up to its diagonal (causal) or
 * all of them; the backward's dQ kernel walks the same, its dK, dV kernel
 * walks the query tiles from its diagonal on (or all): as many rows. */
static int64_t flash_walked_rows(int64_t T, int causal) {
    int64_t n = (T + 63) / 64;
    return causal ? 32 * n * (n - 1) + T : n * T;
}

/* The L2 rule for the flash kernels (stated in tools/gpu_model.lua): their
 * block b takes head b / tiles, so the blocks of one (batch, head) are
 * adjacent in the grid and run together; every re-read a block makes is of
 * its own head's q, k, v, dO, lse or Drow. When the heads that the blocks in
 * flight touch fit in half the H200's 50 MB L2, a head's rows come from DRAM
 * once per kernel and every further read of them from L2.
 *
 * Blocks in flight: 132 SMs times the blocks shared memory lets one SM hold
 * (228 KiB an SM, 1 KiB of it the runtime's; at most 16 blocks of 128
 * threads; registers may allow fewer, so this is the larger, cautious count),
 * and, since causal blocks of one head finish at different times, the live
 * blocks are taken to span twice that many grid indices, plus one head on
 * either side. The shared memory per block is attention_flash.cu's
 * fa_dims (keep them in step). */
#define FLASH_L2_BYTES (50ll << 20)
#define FLASH_SMS 132
static int64_t flash_smem(int64_t D, int backward) {
    int64_t tile_h = 64 * (D + 8) * 2, warp_f = 16 * 68 * 4, warp_o = 16 * ((D > 64 ? D : 64) + 4) * 4;
    int64_t warp_p = 16 * 72 * 2;
    return backward ? 4 * tile_h + 2 * 64 * 4 + 4 * (warp_o + warp_f + 2 * warp_p)
                    : 3 * tile_h + 4 * (warp_f + warp_o + warp_p);
}
static bool flash_l2_holds(int64_t BH, int64_t T, int64_t D, int backward) {
    int64_t per_sm = (227ll << 10) / flash_smem(D, backward);
    if (per_sm > 16) per_sm = 16;
    if (per_sm < 1) per_sm = 1;
    int64_t tiles = (T + 63) / 64, window = 2 * FLASH_SMS * per_sm;
    int64_t heads = (window + tiles - 1) / tiles + 2;
    if (heads > BH) heads = BH;
    /* a head's rows: q, k, v (forward); q, k, v, dO, O, lse, Drow (backward) */
    int64_t head_bytes = backward ? 5 * 2 * T * D + 2 * 4 * T : 3 * 2 * T * D;
    return heads * head_bytes <= FLASH_L2_BYTES / 2;
}
/* Bytes of the reads counted in the entries' bytes read that the rule above
 * serves from L2: every read of a walked row after the first, per kernel. */
static int64_t flash_fwd_l2(int64_t B, int64_t H, int64_t T, int64_t D, int causal) {
    if (!flash_l2_holds(B * H, T, D, 0)) return 0;
    return B * H * 2 * 2 * D * (flash_walked_rows(T, causal) - T);   // k, v
}
static int64_t flash_bwd_l2(int64_t B, int64_t H, int64_t T, int64_t D, int causal) {
    if (!flash_l2_holds(B * H, T, D, 1)) return 0;
    /* the dQ kernel's k, v and the dK, dV kernel's q, dO, lse, Drow */
    return B * H * (flash_walked_rows(T, causal) - T) * ((2 * 2 * D + 2 * 4) + 2 * 2 * D);
}

/* ... and of its bias + GELU backward (fused.cu): one kernel over
 * tiles of 32 packs of columns (16 bytes a pack when cols allows) by chunks
 * of rows, some 4 blocks per SM (132 SMs: the H200 tools/gpu-model prices),
 * then one that adds the chunks' partial bias sums (double, written and read
 * once); a memset for an empty, non-accumulating bias sum. */
static int64_t gelu_bwd_chunks(int64_t rows, int64_t cols, int64_t elem) {
    int64_t v = cols % (16 / elem) == 0 ? 16 / elem : 1, tiles = (cols + 32 * v - 1) / (32 * v);
    int64_t want = (132 * 4 + tiles - 1) / tiles, most = (rows + 63) / 64, chunks = want < most ? want : most;
    if (chunks < 1) chunks = 1;
    int64_t len = (rows + chunks - 1) / chunks;
    return (rows + len - 1) / len;
}
static int64_t gelu_bwd_partial_bytes(int64_t rows, int64_t cols, int64_t elem, const void *dbias) {
    if (!dbias || rows <= 0 || cols <= 0) return 0;
    int64_t chunks = gelu_bwd_chunks(rows, cols, elem);
    return chunks > 1 ? 8 * chunks * cols : 0;
}
static int64_t gelu_bwd_launches(int64_t rows, int64_t cols, int64_t elem, const void *dbias, int acc) {
    if (cols <= 0) return 0;
    if (rows <= 0) return dbias && !acc;
    return 1 + (dbias && gelu_bwd_chunks(rows, cols, elem) > 1);
}

/* ... and of its embedding backward by sorted ids (embedding.cu): the
 * ids read once into (id, position) keys of 16 bytes sorted in tiles of
 * 1024, then one merge pass per sixteenfold of the run length up to n (each
 * reads and writes the n keys; its binary searches re-read keys from L2, not
 * counted), then one pass that reads the sorted keys, every dout row once
 * and the old row of each distinct id, and writes that row back. The ids
 * are not seen here, so every position is taken as a distinct id: an upper
 * bound on the rows read and written. */
static int64_t emb_merge_passes(int64_t n) {
    int64_t passes = 0;
    for (int64_t len = 1024; len < n; len *= 16) passes++;
    return passes;
}
static bool emb_sorted_runs(int64_t n, int64_t dim) { return n > 0 && dim > 0; }
#define EMB_SORTED_READ(n, dim, elem)                                                                            \
    (emb_sorted_runs(n, dim) ? 8 * (n) + 16 * (n) * (emb_merge_passes(n) + 1) + 2 * (elem) * (n) * (dim) : 0)
#define EMB_SORTED_WRITTEN(n, dim, elem)                                                                         \
    (emb_sorted_runs(n, dim) ? 16 * (n) * (emb_merge_passes(n) + 1) + (elem) * (n) * (dim) : 0)
#define EMB_SORTED_LAUNCHES(n, dim) (emb_sorted_runs(n, dim) ? 2 + emb_merge_passes(n) : 0)

#endif
