/* attention_flash.cu: fused (flash-style) attention on the tensor
 * cores, straight from the packed qkv buffer of a fused projection.
 *
 * qkv (B, T, 3C) holds, per token, the heads of q, then of k, then of v
 * (head h at columns h D, C + h D, 2C + h D; C = H D), as for
 * attention_gemm.cu; out (B, T, C) and dqkv (B, T, 3C) are laid out
 * the same way. Unlike the GEMM path no (T, T) matrix ever reaches device
 * memory: scores, probabilities and their gradients live in shared memory,
 * one 64 x 64 tile at a time, and only lse (B, H, T) f32 is kept for the
 * backward.
 *
 * A block of 4 warps takes one (batch*head, tile of 64 rows); each warp owns
 * 16 of the rows. Products run on nvcuda::wmma 16x16x16 fragments, bf16
 * operands from shared memory, f32 accumulators. Row-wise work (the softmax,
 * its backward) is done by ordinary threads on tiles stored to shared memory
 * (a lane pair per row, each lane half of it), never on the fragments'
 * registers, whose layout CUDA does not specify: so the code is the same on
 * any GPU with bf16 tensor cores (sm_80 on) and on the host emulation. A
 * GPU that cannot give a block the shared memory of the largest head dim
 * (sm_86, sm_89: 99 KiB) runs the GEMM path instead (cuda_device.cu).
 *
 * Forward (s = scale), per query tile, for each key tile up to the diagonal
 * (causal) or T:
 *   S = s Q K^T                    (16, 64) per warp, f32
 *   m' = max(m, rowmax S), P = exp(S - m') in bf16, l = l e^(m - m') + rowsum P
 *   O = O e^(m - m') + P V         (16, D) f32 in shared memory
 * then out = O / l (bf16) and lse = m + log l. The exps are taken in base 2
 * with log2(e) folded into the scale (m and the backward's lse too): one
 * ex2 instruction each on a GPU.
 * Backward, with Drow_i = dO_i . O_i and
 * P = exp(s Q K^T - lse), dS = s P (dO V^T - Drow) recomputed tile by tile:
 *   Drow, dQ = dS K                a kernel per query tile, walking key tiles
 *                                  (Drow of its rows first, from the dO tile it
 *                                  holds anyway; stored for the next kernel)
 *   dV = P^T dO, dK = dS^T Q       a kernel per key tile, walking query tiles
 * Block b takes head b / tiles: the blocks of one (batch, head) are adjacent
 * in the grid and run together, so the rows they read again and again (k, v;
 * q, dO, lse, Drow) come from L2 after the first (tools/gpu_model.lua's L2
 * rule, engine/meta/meta_device.c's counts).
 * Every output element is summed by one warp in a fixed order, with no
 * atomics: results repeat bit for bit.
 *
 * Covered: D a multiple of 16 up to 128, any T >= 1 and B H, 16-byte
 * aligned qkv, out, dout, dqkv (the op layer checks, and falls back to the
 * GEMM path otherwise). CPU reference: engine/cpu/attention.c (f32) on the
 * unpacked q, k, v. */
#include "cuda_internal.h"
#include <mma.h>

using namespace nvcuda;

#define FA_TILE 64                    /* query rows and key rows per block tile */
#define FA_WARPS 4                    /* warps per block; each owns 16 rows */
#define FA_THREADS (FA_WARPS * 32)
#define FA_LDF (FA_TILE + 4)          /* f32 (16, 64) tiles: row stride in floats */
#define FA_LDP (FA_TILE + 8)          /* bf16 (16, 64) tiles: row stride in elements */
/* exps in base 2 (one MUFU.EX2 on a GPU): e^(s x - m) = 2^(s log2(e) x - m log2(e)) */
#define FA_LOG2E 1.4426950408889634f
#define FA_LN2 0.6931471805599453f

/* bf16 (64, D) tiles: rows padded by 8 elements, which keeps every fragment
 * 32-byte aligned and moves consecutive rows to other banks */
template <int D> struct fa_dims {
    static constexpr int ldh = D + 8;                         /* bf16 (64, D) tiles */
    static constexpr int ldo = (D > FA_TILE ? D : FA_TILE) + 4;   /* f32 (16, max(D, 64)) tiles */
    static constexpr size_t tile_h = (size_t)FA_TILE * ldh * 2;   /* bytes of a (64, D) bf16 tile */
    static constexpr size_t warp_f = (size_t)16 * FA_LDF * 4;     /* a warp's (16, 64) f32 tile */
    static constexpr size_t warp_o = (size_t)16 * ldo * 4;        /* a warp's (16, max(D, 64)) f32 tile */
    static constexpr size_t warp_p = (size_t)16 * FA_LDP * 2;     /* a warp's (16, 64) bf16 tile */
    /* forward: Q, K, V tiles; per warp S, O (f32) and P (bf16) */
    static constexpr size_t fwd = 3 * tile_h + FA_WARPS * (warp_f + warp_o + warp_p);
    /* backward (either kernel): four bf16 tiles, lse and Drow of 64 rows; per
     * warp two f32 tiles (S or the output's staging, dP) and two bf16 ones */
    static constexpr size_t bwd = 4 * tile_h + 2 * FA_TILE * 4 + FA_WARPS * (warp_o + warp_f + 2 * warp_p);
};

typedef wmma::fragment<wmma::matrix_a, 16, 16, 16, __nv_bfloat16, wmma::row_major> fa_frag_a;
typedef wmma::fragment<wmma::matrix_b, 16, 16, 16, __nv_bfloat16, wmma::row_major> fa_frag_b;
/* B = X^T for a row-major X in memory: X's rows are B's columns */
typedef wmma::fragment<wmma::matrix_b, 16, 16, 16, __nv_bfloat16, wmma::col_major> fa_frag_bt;
typedef wmma::fragment<wmma::accumulator, 16, 16, 16, float> fa_frag_c;

__device__ __forceinline__ const __nv_bfloat16 *fa_h(const uint16_t *p) { return (const __nv_bfloat16 *)p; }

/* the block's dynamic shared memory, 128-byte aligned (wmma needs 32) */
#define FA_SMEM() CUDA_DYN_SMEM_128()

/* 8 bf16, one 16-byte access */
struct __align__(16) fa_vec8 {
    uint16_t h[8];
};

/* Rows [r0, r0 + 64) of a (T, D) matrix whose rows are ldg apart in device
 * memory into a (64, D + 8) shared tile; rows past T are zeros. */
template <int D>
__device__ __forceinline__ void fa_load_tile(uint16_t *dst, const uint16_t *src, int64_t ldg, int64_t r0, int64_t T) {
    constexpr int chunks = D / 8, ld = fa_dims<D>::ldh;
    for (int i = threadIdx.x; i < FA_TILE * chunks; i += FA_THREADS) {
        int r = i / chunks, c = (i - r * chunks) * 8;
        fa_vec8 v;
        if (r0 + r < T) {
            v = *(const fa_vec8 *)(src + (r0 + r) * ldg + c);
        } else {
#pragma unroll
            for (int k = 0; k < 8; k++) v.h[k] = 0;
        }
        *(fa_vec8 *)(dst + r * ld + c) = v;
    }
}

/* 64 floats of a (T) row vector from r0, times mul, into shared memory; 0 past T */
__device__ __forceinline__ void fa_load_rows(float *dst, const float *src, int64_t r0, int64_t T, float mul) {
    for (int i = threadIdx.x; i < FA_TILE; i += FA_THREADS) dst[i] = r0 + i < T ? src[r0 + i] * mul : 0.0f;
}

/* A warp's (16, 64) f32 tile out (row stride ldout) = A (16, K) B^T, with
 * A's rows at a (row stride lda) and B's 64 rows at b (row stride ldb),
 * both bf16 in shared memory, K a multiple of 16. */
template <int K>
__device__ __forceinline__ void fa_abt(float *out, int ldout, const uint16_t *a, int lda, const uint16_t *b, int ldb) {
    fa_frag_a fa[K / 16];
#pragma unroll
    for (int kk = 0; kk < K / 16; kk++) wmma::load_matrix_sync(fa[kk], fa_h(a + kk * 16), lda);
#pragma unroll
    for (int n = 0; n < FA_TILE / 16; n++) {
        fa_frag_c acc;
        wmma::fill_fragment(acc, 0.0f);
#pragma unroll
        for (int kk = 0; kk < K / 16; kk++) {
            fa_frag_bt fb;
            wmma::load_matrix_sync(fb, fa_h(b + n * 16 * ldb + kk * 16), ldb);
            wmma::mma_sync(acc, fa[kk], fb, acc);
        }
        wmma::store_matrix_sync(out + n * 16, acc, ldout, wmma::mem_row_major);
    }
}

/* acc[dn] += P (16, 64) X (64, D): P a warp's bf16 (16, FA_LDP) tile, X a
 * bf16 (64, D + 8) tile, both in shared memory */
template <int D>
__device__ __forceinline__ void fa_px(fa_frag_c *acc, const uint16_t *p, const uint16_t *x) {
    constexpr int ld = fa_dims<D>::ldh;
#pragma unroll
    for (int kk = 0; kk < FA_TILE / 16; kk++) {
        fa_frag_a fa;
        wmma::load_matrix_sync(fa, fa_h(p + kk * 16), FA_LDP);
#pragma unroll
        for (int dn = 0; dn < D / 16; dn++) {
            fa_frag_b fb;
            wmma::load_matrix_sync(fb, fa_h(x + kk * 16 * ld + dn * 16), ld);
            wmma::mma_sync(acc[dn], fa, fb, acc[dn]);
        }
    }
}

/* Rows [row0, row0 + 16) of a warp's (16, D) f32 tile (stride ldo) scaled by
 * mul (per row: the lane pair's value) to bf16 columns [0, D) of dst rows
 * (row stride ldg), rows below T only. Lane pair per row, half each. */
template <int D>
__device__ __forceinline__ void fa_store_rows(uint16_t *dst, int64_t ldg, const float *tile, int64_t row0, int64_t T,
                                              float mul) {
    const int lane = threadIdx.x & 31, r = lane >> 1, half = lane & 1;
    constexpr int ldo = fa_dims<D>::ldo;
    if (row0 + r >= T) return;
    const float *src = tile + r * ldo + half * (D / 2);
    uint16_t *out = dst + (row0 + r) * ldg + half * (D / 2);
#pragma unroll
    for (int c = 0; c < D / 2; c += 8) {
        fa_vec8 v;
#pragma unroll
        for (int k = 0; k < 8; k++) v.h[k] = f32_to_bf16(src[c + k] * mul);
        *(fa_vec8 *)(out + c) = v;
    }
}

/* Block b of a launch over (B H) x tiles: heavy tiles (late rows under the
 * causal mask) first, so the last wave is short. */
__device__ __forceinline__ void fa_block(int64_t tiles, int64_t *bh, int64_t *tile, int heavy_last) {
    int64_t b = blockIdx.x;
    *bh = b / tiles;
    int64_t t = b - *bh * tiles;
    *tile = heavy_last ? tiles - 1 - t : t;
}

/* ---- forward ---- */

template <int D>
__global__ void __launch_bounds__(FA_THREADS) fa_forward_kernel(uint16_t *__restrict__ out, float *__restrict__ lse,
                                                                const uint16_t *__restrict__ qkv, int64_t H, int64_t T,
                                                                int64_t tiles, int causal, float scale) {
    typedef fa_dims<D> dims;
    constexpr int ldh = dims::ldh, ldo = dims::ldo;
    const int64_t C = H * D, ld3 = 3 * C;
    int64_t bh, tile;
    fa_block(tiles, &bh, &tile, causal);
    const int64_t b = bh / H, h = bh - b * H, q0 = tile * FA_TILE;
    const uint16_t *qg = qkv + b * T * ld3 + h * D, *kg = qg + C, *vg = qg + 2 * C;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;

    unsigned char *sm = FA_SMEM();
    uint16_t *Qs = (uint16_t *)sm;                                      // (64, ldh)
    uint16_t *Ks = (uint16_t *)(sm + dims::tile_h);                     // (64, ldh)
    uint16_t *Vs = (uint16_t *)(sm + 2 * dims::tile_h);                 // (64, ldh)
    unsigned char *wp = sm + 3 * dims::tile_h + warp * (dims::warp_f + dims::warp_o + dims::warp_p);
    float *Sw = (float *)wp;                                            // (16, FA_LDF) this warp's scores
    float *Ow = (float *)(wp + dims::warp_f);                           // (16, ldo) its output rows
    uint16_t *Pw = (uint16_t *)(wp + dims::warp_f + dims::warp_o);      // (16, FA_LDP) its probabilities

    fa_load_tile<D>(Qs, qg, ld3, q0, T);
    for (int i = lane; i < 16 * ldo; i += 32) Ow[i] = 0.0f;
    /* a lane pair per query row: row r, columns [32 half, 32 half + 32) of
     * a score tile and [D/2 half, D/2 half + D/2) of the output */
    const int r = lane >> 1, half = lane & 1;
    const int64_t qi = q0 + warp * 16 + r;
    float m = -INFINITY, l = 0.0f;   // running max (base 2: of log2(e) s S) and sum of this row
    const float scale2 = scale * FA_LOG2E;
    const int64_t kend = causal ? cuda_min64(T, q0 + FA_TILE) : T;
    for (int64_t k0 = 0; k0 < kend; k0 += FA_TILE) {
        __syncthreads();   // the last tile's readers are done (and Q is loaded)
        fa_load_tile<D>(Ks, kg, ld3, k0, T);
        fa_load_tile<D>(Vs, vg, ld3, k0, T);
        __syncthreads();
        fa_abt<D>(Sw, FA_LDF, Qs + warp * 16 * ldh, ldh, Ks, ldh);   // S = Q K^T
        __syncwarp();
        float *srow = Sw + r * FA_LDF + half * 32;
        float mx = -INFINITY;
        for (int c = 0; c < 32; c++) {
            int64_t kj = k0 + half * 32 + c;
            float x = kj < T && (!causal || kj <= qi) ? scale2 * srow[c] : -INFINITY;
            srow[c] = x;
            mx = fmaxf(mx, x);
        }
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
        const float mnew = fmaxf(m, mx);
        /* mnew is finite from the first tile on (key 0 is seen by every row) */
        const float alpha = mnew == -INFINITY ? 1.0f : exp2f(m - mnew);
        uint16_t *prow = Pw + r * FA_LDP + half * 32;
        float sum = 0.0f;
        for (int c = 0; c < 32; c++) {
            uint16_t p = f32_to_bf16(mnew == -INFINITY ? 0.0f : exp2f(srow[c] - mnew));
            prow[c] = p;
            sum += bf16_to_f32(p);   // the sum of what P V multiplies
        }
        sum += __shfl_xor_sync(0xffffffffu, sum, 1);
        l = l * alpha + sum;
        m = mnew;
        float *orow = Ow + r * ldo + half * (D / 2);
        for (int c = 0; c < D / 2; c++) orow[c] *= alpha;
        __syncwarp();
        fa_frag_c acc[D / 16];
#pragma unroll
        for (int dn = 0; dn < D / 16; dn++) wmma::load_matrix_sync(acc[dn], Ow + dn * 16, ldo, wmma::mem_row_major);
        fa_px<D>(acc, Pw, Vs);   // O += P V
#pragma unroll
        for (int dn = 0; dn < D / 16; dn++) wmma::store_matrix_sync(Ow + dn * 16, acc[dn], ldo, wmma::mem_row_major);
        __syncwarp();
    }
    fa_store_rows<D>(out + b * T * C + h * D, C, Ow, q0 + warp * 16, T, 1.0f / l);
    if (half == 0 && qi < T) lse[bh * T + qi] = (m + log2f(l)) * FA_LN2;   // natural log
}

/* ---- backward ---- */

/* Drow = dO . O of a warp's 16 query rows [row0, row0 + 16): dO from the
 * block's shared (64, D + 8) tile (this warp's rows at dos), O straight from
 * device memory (row stride ldg); a lane pair per row, each lane half of
 * the D columns in order, then the pair's sum: f32 sums of the bf16 values,
 * the same every run. Into drow_s[r] (0 past T) and drow_g[row0 + r]. */
template <int D>
__device__ __forceinline__ void fa_drow_rows(float *drow_s, float *drow_g, const uint16_t *dos, const uint16_t *og,
                                             int64_t ldg, int64_t row0, int64_t T) {
    const int lane = threadIdx.x & 31, r = lane >> 1, half = lane & 1;
    constexpr int ldh = fa_dims<D>::ldh;
    float acc = 0.0f;
    if (row0 + r < T) {
        const uint16_t *dorow = dos + r * ldh + half * (D / 2), *orow = og + (row0 + r) * ldg + half * (D / 2);
#pragma unroll
        for (int c = 0; c < D / 2; c += 8) {
            fa_vec8 o = *(const fa_vec8 *)(orow + c);
#pragma unroll
            for (int k = 0; k < 8; k++) acc += bf16_to_f32(dorow[c + k]) * bf16_to_f32(o.h[k]);
        }
    }
    acc += __shfl_xor_sync(0xffffffffu, acc, 1);
    if (half == 0) {
        drow_s[r] = acc;
        if (row0 + r < T) drow_g[row0 + r] = acc;
    }
}

/* P = exp(s S - lse) and dS = s P (dP - Drow) on a warp's (16, 64) tiles
 * (lse_q in base 2: log2(e) lse)
 * of raw scores S (row stride lds) and dP (FA_LDF), written bf16 to P (when
 * not NULL) and dS (FA_LDP). KEY_ROWS: rows are keys row0 + r and columns
 * queries col0 + c (the dK, dV kernel's S^T), else rows are queries and
 * columns keys; lse_q and drow_q are indexed by the tile-local query. 0
 * where the key is hidden from the query or either lies past T. */
template <bool KEY_ROWS>
__device__ __forceinline__ void fa_softmax_grad(uint16_t *P, uint16_t *dS, const float *S, int lds, const float *dP,
                                                const float *lse_q, const float *drow_q, int64_t row0, int64_t col0,
                                                int64_t T, int causal, float scale) {
    const int lane = threadIdx.x & 31, r = lane >> 1, c0 = (lane & 1) * 32;
    for (int c = c0; c < c0 + 32; c++) {
        const int64_t qi = KEY_ROWS ? col0 + c : row0 + r, kj = KEY_ROWS ? row0 + r : col0 + c;
        const int ql = KEY_ROWS ? c : r;
        const bool seen = qi < T && kj < T && (!causal || kj <= qi);
        const float p = seen ? exp2f(scale * FA_LOG2E * S[r * lds + c] - lse_q[ql]) : 0.0f;
        const float ds = scale * p * (dP[r * FA_LDF + c] - drow_q[ql]);
        if (P) P[r * FA_LDP + c] = f32_to_bf16(p);
        dS[r * FA_LDP + c] = f32_to_bf16(ds);
    }
}

/* Shared memory of both backward kernels: the four (64, D) bf16 tiles
 * (A, B: the tiles the block owns; X, Y: the tiles it walks), lse and Drow
 * of 64 query rows, and per warp the f32 tiles F (scores, then the output's
 * staging; max(D, 64) wide) and G (dP), the bf16 tiles P and dS. */
template <int D> struct fa_bwd_smem {
    uint16_t *A, *B, *X, *Y, *P, *dS;
    float *lse, *drow, *F, *G;
    __device__ __forceinline__ fa_bwd_smem(unsigned char *sm, int warp) {
        typedef fa_dims<D> dims;
        A = (uint16_t *)sm;
        B = (uint16_t *)(sm + dims::tile_h);
        X = (uint16_t *)(sm + 2 * dims::tile_h);
        Y = (uint16_t *)(sm + 3 * dims::tile_h);
        lse = (float *)(sm + 4 * dims::tile_h);
        drow = lse + FA_TILE;
        unsigned char *wp = sm + 4 * dims::tile_h + 2 * FA_TILE * 4 +
                            warp * (dims::warp_o + dims::warp_f + 2 * dims::warp_p);
        F = (float *)wp;
        G = (float *)(wp + dims::warp_o);
        P = (uint16_t *)(wp + dims::warp_o + dims::warp_f);
        dS = (uint16_t *)(wp + dims::warp_o + dims::warp_f + dims::warp_p);
    }
};

/* dK, dV of one key tile: walks the query tiles that see it (Drow from the
 * dQ kernel, which runs first) */
template <int D>
__global__ void __launch_bounds__(FA_THREADS) fa_dkdv_kernel(uint16_t *__restrict__ dqkv, const uint16_t *__restrict__ dout,
                                                             const uint16_t *__restrict__ qkv,
                                                             const float *__restrict__ lse,
                                                             const float *__restrict__ drow, int64_t H, int64_t T,
                                                             int64_t tiles, int causal, float scale) {
    constexpr int ldh = fa_dims<D>::ldh, ldo = fa_dims<D>::ldo;
    const int64_t C = H * D, ld3 = 3 * C;
    int64_t bh, tile;
    fa_block(tiles, &bh, &tile, 0);   // causal: early key tiles walk the most query tiles
    const int64_t b = bh / H, h = bh - b * H, k0 = tile * FA_TILE;
    const uint16_t *qg = qkv + b * T * ld3 + h * D, *kg = qg + C, *vg = qg + 2 * C, *dog = dout + b * T * C + h * D;
    const int warp = threadIdx.x >> 5;
    fa_bwd_smem<D> s(FA_SMEM(), warp);   // A = K, B = V, X = Q, Y = dO
    fa_load_tile<D>(s.A, kg, ld3, k0, T);
    fa_load_tile<D>(s.B, vg, ld3, k0, T);
    fa_frag_c dk[D / 16], dv[D / 16];
#pragma unroll
    for (int dn = 0; dn < D / 16; dn++) {
        wmma::fill_fragment(dk[dn], 0.0f);
        wmma::fill_fragment(dv[dn], 0.0f);
    }
    const int64_t krow = k0 + warp * 16;
    for (int64_t i0 = causal ? k0 : 0; i0 < T; i0 += FA_TILE) {
        __syncthreads();   // the last tile's readers are done (and K, V are loaded)
        fa_load_tile<D>(s.X, qg, ld3, i0, T);
        fa_load_tile<D>(s.Y, dog, C, i0, T);
        fa_load_rows(s.lse, lse + bh * T, i0, T, FA_LOG2E);   // base 2
        fa_load_rows(s.drow, drow + bh * T, i0, T, 1.0f);
        __syncthreads();
        fa_abt<D>(s.F, ldo, s.A + warp * 16 * ldh, ldh, s.X, ldh);   // S^T = K Q^T   (16 keys, 64 queries)
        fa_abt<D>(s.G, FA_LDF, s.B + warp * 16 * ldh, ldh, s.Y, ldh);   // dP^T = V dO^T
        __syncwarp();
        fa_softmax_grad<true>(s.P, s.dS, s.F, ldo, s.G, s.lse, s.drow, krow, i0, T, causal, scale);
        __syncwarp();
        fa_px<D>(dv, s.P, s.Y);    // dV += P^T dO
        fa_px<D>(dk, s.dS, s.X);   // dK += dS^T Q
    }
    uint16_t *drows = dqkv + b * T * ld3 + h * D;
#pragma unroll
    for (int dn = 0; dn < D / 16; dn++) wmma::store_matrix_sync(s.F + dn * 16, dk[dn], ldo, wmma::mem_row_major);
    __syncwarp();
    fa_store_rows<D>(drows + C, ld3, s.F, krow, T, 1.0f);
    __syncwarp();
#pragma unroll
    for (int dn = 0; dn < D / 16; dn++) wmma::store_matrix_sync(s.F + dn * 16, dv[dn], ldo, wmma::mem_row_major);
    __syncwarp();
    fa_store_rows<D>(drows + 2 * C, ld3, s.F, krow, T, 1.0f);
}

/* Drow and dQ of one query tile: walks the key tiles it sees */
template <int D>
__global__ void __launch_bounds__(FA_THREADS) fa_dq_kernel(uint16_t *__restrict__ dqkv, float *__restrict__ drow,
                                                           const uint16_t *__restrict__ dout,
                                                           const uint16_t *__restrict__ qkv,
                                                           const uint16_t *__restrict__ out,
                                                           const float *__restrict__ lse, int64_t H, int64_t T,
                                                           int64_t tiles, int causal, float scale) {
    constexpr int ldh = fa_dims<D>::ldh, ldo = fa_dims<D>::ldo;
    const int64_t C = H * D, ld3 = 3 * C;
    int64_t bh, tile;
    fa_block(tiles, &bh, &tile, causal);
    const int64_t b = bh / H, h = bh - b * H, q0 = tile * FA_TILE;
    const uint16_t *qg = qkv + b * T * ld3 + h * D, *kg = qg + C, *vg = qg + 2 * C, *dog = dout + b * T * C + h * D;
    const int warp = threadIdx.x >> 5;
    fa_bwd_smem<D> s(FA_SMEM(), warp);   // A = Q, B = dO, X = K, Y = V
    fa_load_tile<D>(s.A, qg, ld3, q0, T);
    fa_load_tile<D>(s.B, dog, C, q0, T);
    fa_load_rows(s.lse, lse + bh * T, q0, T, FA_LOG2E);   // base 2
    __syncthreads();   // the dO tile is loaded
    const int64_t qrow = q0 + warp * 16;
    fa_drow_rows<D>(s.drow + warp * 16, drow + bh * T, s.B + warp * 16 * ldh, out + b * T * C + h * D, C, qrow, T);
    __syncwarp();
    fa_frag_c dq[D / 16];
#pragma unroll
    for (int dn = 0; dn < D / 16; dn++) wmma::fill_fragment(dq[dn], 0.0f);
    const int64_t kend = causal ? cuda_min64(T, q0 + FA_TILE) : T;
    for (int64_t k0 = 0; k0 < kend; k0 += FA_TILE) {
        __syncthreads();
        fa_load_tile<D>(s.X, kg, ld3, k0, T);
        fa_load_tile<D>(s.Y, vg, ld3, k0, T);
        __syncthreads();
        fa_abt<D>(s.F, ldo, s.A + warp * 16 * ldh, ldh, s.X, ldh);      // S = Q K^T    (16 queries, 64 keys)
        fa_abt<D>(s.G, FA_LDF, s.B + warp * 16 * ldh, ldh, s.Y, ldh);   // dP = dO V^T
        __syncwarp();
        fa_softmax_grad<false>(NULL, s.dS, s.F, ldo, s.G, s.lse + warp * 16, s.drow + warp * 16, qrow, k0, T, causal,
                               scale);
        __syncwarp();
        fa_px<D>(dq, s.dS, s.X);   // dQ += dS K
    }
#pragma unroll
    for (int dn = 0; dn < D / 16; dn++) wmma::store_matrix_sync(s.F + dn * 16, dq[dn], ldo, wmma::mem_row_major);
    __syncwarp();
    fa_store_rows<D>(dqkv + b * T * ld3 + h * D, ld3, s.F, qrow, T, 1.0f);
}

/* ---- launches ---- */

static bool fa_aligned16(const void *p) { return ((uintptr_t)p & 15u) == 0; }

/* Dynamic shared memory beyond the default 48 KiB must be asked for per kernel. */
static void fa_allow_smem(const void *kernel, size_t bytes, size_t *allowed) {
    if (bytes <= 48 * 1024 || bytes <= *allowed) return;
    CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)bytes));
    *allowed = bytes;
}

/* The op layer sends only covered shapes (attention_flash_covers, device.h);
 * anything else here is a bug of the caller, and fatal. */
static int64_t fa_check(const char *op, int64_t B, int64_t H, int64_t T, int64_t D, const void *const *ptrs, int n) {
    if (!attention_flash_covers(B, H, T, D))
        cuda_fail(op, __FILE__, __LINE__, "attention_flash", "shape not covered by the flash kernels");
    for (int i = 0; i < n; i++)
        if (!fa_aligned16(ptrs[i])) cuda_fail(op, __FILE__, __LINE__, "attention_flash", "buffer not 16-byte aligned");
    return cuda_ceil_div(T, FA_TILE);
}

template <int D>
static void fa_forward(uint16_t *out, float *lse, const uint16_t *qkv, int64_t BH, int64_t H, int64_t T,
                       int64_t tiles, int causal, float scale) {
    static size_t allowed;
    const size_t smem = fa_dims<D>::fwd;
    fa_allow_smem((const void *)fa_forward_kernel<D>, smem, &allowed);
    LAUNCH(fa_forward_kernel<D>, (unsigned)(BH * tiles), FA_THREADS, smem)(out, lse, qkv, H, T, tiles, causal, scale);
    CUDA_CHECK_LAUNCH();
}

template <int D>
static void fa_backward(uint16_t *dqkv, float *drow, const uint16_t *dout, const uint16_t *qkv, const uint16_t *out,
                        const float *lse, int64_t BH, int64_t H, int64_t T, int64_t tiles, int causal, float scale) {
    static size_t allowed_kv, allowed_q;
    const size_t smem = fa_dims<D>::bwd;
    fa_allow_smem((const void *)fa_dkdv_kernel<D>, smem, &allowed_kv);
    fa_allow_smem((const void *)fa_dq_kernel<D>, smem, &allowed_q);
    /* Drow and dQ first: the dK, dV kernel reads Drow of every query tile */
    LAUNCH(fa_dq_kernel<D>, (unsigned)(BH * tiles), FA_THREADS, smem)(dqkv, drow, dout, qkv, out, lse, H, T, tiles,
                                                                        causal, scale);
    CUDA_CHECK_LAUNCH();
    LAUNCH(fa_dkdv_kernel<D>, (unsigned)(BH * tiles), FA_THREADS, smem)(dqkv, dout, qkv, lse, drow, H, T, tiles,
                                                                          causal, scale);
    CUDA_CHECK_LAUNCH();
}

#define FA_HEAD_DIMS(X) X(16) X(32) X(48) X(64) X(80) X(96) X(112) X(128)

/* The most dynamic shared memory a block of these kernels asks for (the
 * largest head dim's), which the backend checks against the device */
size_t cuda_attention_flash_smem_max(void) {
    size_t most = 0;
#define FA_SMEM_MAX(d) most = fa_dims<d>::fwd > most ? fa_dims<d>::fwd : most; \
                       most = fa_dims<d>::bwd > most ? fa_dims<d>::bwd : most;
    FA_HEAD_DIMS(FA_SMEM_MAX)
#undef FA_SMEM_MAX
    return most;
}

/* out (B, T, C) bf16, lse (B, H, T) f32; qkv (B, T, 3C) bf16 */
void cuda_attention_flash_forward_bf16(uint16_t *out, float *lse, const uint16_t *qkv, int64_t B, int64_t H,
                                       int64_t T, int64_t D, int causal, float scale) {
    CUDA_ENTER();
    const void *ptrs[] = {out, qkv};
    int64_t tiles = fa_check(__func__, B, H, T, D, ptrs, 2);
    switch (D) {
#define FA_FWD_CASE(d)                                                                      case d: fa_forward<d>(out, lse, qkv, B * H, H, T, tiles, causal != 0, scale); break;
        FA_HEAD_DIMS(FA_FWD_CASE)
#undef FA_FWD_CASE
    }
}

/* dqkv (B, T, 3C) every element written; drow (B, H, T) f32 scratch;
 * dout, out (B, T, C); lse from the forward */
void cuda_attention_flash_backward_bf16(uint16_t *dqkv, float *drow, const uint16_t *dout, const uint16_t *qkv,
                                        const uint16_t *out, const float *lse, int64_t B, int64_t H, int64_t T,
                                        int64_t D, int causal, float scale) {
    CUDA_ENTER();
    const void *ptrs[] = {dqkv, dout, qkv, out};
    int64_t tiles = fa_check(__func__, B, H, T, D, ptrs, 4);
    switch (D) {
#define FA_BWD_CASE(d)                                                                                          case d: fa_backward<d>(dqkv, drow, dout, qkv, out, lse, B * H, H, T, tiles, causal != 0, scale); break;
        FA_HEAD_DIMS(FA_BWD_CASE)
#undef FA_BWD_CASE
    }
}
