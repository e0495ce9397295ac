/* attention.cu: scaled dot-product attention over (B, H, T, D) with an
 * optional causal mask, fused flash-style, as engine/cpu/attention.c.
 *
 * A block of 256 threads takes one (batch*head, tile of BT rows). Tiles of
 * Q, K, V sit in shared memory (rows padded to D + 1 floats, so that threads
 * reading different rows hit different banks); the BT x BT scores of a tile
 * pair are the only score storage, so no (T, T) matrix ever exists.
 * Accumulators (a BT x D tile) are spread over the threads, ATT_ACC
 * registers each: element e = tid + 256 s of the tile is row e / D, column
 * e % D. BT is 32 for D <= 128 and halves as D grows (BT * D <= 4096).
 *
 * Forward: online softmax over key tiles (running max m and sum l per query
 * row; a new max rescales what was summed before), out = (P V) / l, and
 * lse = m + log l is saved.
 * Backward, with P = exp(scale Q K^T - lse) recomputed tile by tile and
 * Drow_i = dO_i . O_i: dV = P^T dO, dS = scale P (dO V^T - Drow),
 * dK = dS^T Q, dQ = dS K. One kernel owns a key tile and walks the query
 * tiles (dK, dV), another owns a query tile and walks the key tiles (dQ):
 * every output element is summed by one thread in a fixed order, with no
 * atomics, so results repeat bit for bit. */
#include "cuda_internal.h"

#define ATT_THREADS 256
#define ATT_ACC 16                            /* accumulator registers per thread */
#define ATT_MAX_TILE (ATT_THREADS * ATT_ACC)  /* BT * D */
#define ATT_MAX_D ATT_MAX_TILE                /* BT = 1 */

struct att_shape {
    int64_t T;
    int D, bt;          /* head dim, tile rows */
    int64_t tiles;      /* ceil(T / bt) */
    int causal;
    float scale;
};

/* Rows [r0, r0 + bt) of a (T, D) matrix into a (bt, D + 1) shared tile; rows past T are zeros. */
__device__ __forceinline__ void load_tile(float *dst, const float *src, int64_t r0, const att_shape &a) {
    int D = a.D, ld = D + 1;
    for (int e = threadIdx.x; e < a.bt * D; e += ATT_THREADS) {
        int r = e / D, d = e - r * D;
        dst[r * ld + d] = r0 + r < a.T ? src[(r0 + r) * D + d] : 0.0f;
    }
}

/* x[r] . y[c] over D, rows of padded tiles */
__device__ __forceinline__ float tile_dot(const float *x, const float *y, int D) {
    float acc = 0.0f;
    for (int d = 0; d < D; d++) acc += x[d] * y[d];
    return acc;
}

/* Walks this thread's accumulator slots: s-th slot is element tid + 128 s
 * of a (bt, D) tile, i.e. row r, column d; BODY runs for slots inside the tile. */
#define FOR_SLOTS(a, s, r, d, ...)                                          \
    do {                                                                    \
        int r = (int)threadIdx.x / (a).D, d = (int)threadIdx.x % (a).D;     \
        const int rstep_ = ATT_THREADS / (a).D, dstep_ = ATT_THREADS % (a).D; \
        _Pragma("unroll") for (int s = 0; s < ATT_ACC; s++) {               \
            if (r < (a).bt) { __VA_ARGS__; }                                \
            d += dstep_;                                                    \
            r += rstep_;                                                    \
            if (d >= (a).D) { d -= (a).D; r++; }                            \
        }                                                                   \
    } while (0)

/* Is key j hidden from query i? (keys past T, or after i under the causal mask) */
__device__ __forceinline__ bool masked(int64_t i, int64_t j, const att_shape &a) {
    return j >= a.T || (a.causal && j > i);
}

/* ---- forward ---- */

__global__ void __launch_bounds__(ATT_THREADS) attn_fwd_kernel(float *out, float *lse, const float *q, const float *k,
                                                               const float *v, att_shape a) {
    const int D = a.D, BT = a.bt, ld = D + 1, lds = BT + 1;
    float *Qs = CUDA_DYN_SMEM();      // (BT, ld)
    float *Ks = Qs + BT * ld;         // (BT, ld)
    float *Vs = Ks + BT * ld;         // (BT, ld)
    float *S = Vs + BT * ld;          // (BT, lds) scores, then probabilities
    float *row_m = S + BT * lds;      // (BT) running max of the scores
    float *row_l = row_m + BT;        // (BT) running sum of exp(score - max)
    float *row_a = row_l + BT;        // (BT) this tile's rescale of the old sums
    int64_t bh = blockIdx.x / a.tiles, i0 = (blockIdx.x % a.tiles) * BT;
    size_t head = (size_t)bh * a.T * D;
    int tid = threadIdx.x;
    load_tile(Qs, q + head, i0, a);
    if (tid < BT) {
        row_m[tid] = -INFINITY;
        row_l[tid] = 0.0f;
    }
    float acc[ATT_ACC];
#pragma unroll
    for (int s = 0; s < ATT_ACC; s++) acc[s] = 0.0f;
    int64_t kend = a.causal ? cuda_min64(a.T, i0 + BT) : a.T;   /* keys any row of the tile sees */
    for (int64_t j0 = 0; j0 < kend; j0 += BT) {
        __syncthreads();   /* the previous tile's K, V, S are no longer read */
        load_tile(Ks, k + head, j0, a);
        load_tile(Vs, v + head, j0, a);
        __syncthreads();
        for (int e = tid; e < BT * BT; e += ATT_THREADS) {
            int r = e / BT, c = e - r * BT;
            S[r * lds + c] = masked(i0 + r, j0 + c, a) ? -INFINITY : a.scale * tile_dot(Qs + r * ld, Ks + c * ld, D);
        }
        __syncthreads();
        if (tid < BT) {   /* online softmax, a thread per query row */
            float *row = S + tid * lds, old = row_m[tid], mx = old;
            for (int c = 0; c < BT; c++) mx = fmaxf(mx, row[c]);
            float alpha = old == -INFINITY ? 0.0f : expf(old - mx), sum = 0.0f;
            for (int c = 0; c < BT; c++) {
                float p = row[c] == -INFINITY ? 0.0f : expf(row[c] - mx);
                row[c] = p;
                sum += p;
            }
            row_l[tid] = row_l[tid] * alpha + sum;
            row_m[tid] = mx;
            row_a[tid] = alpha;
        }
        __syncthreads();
        FOR_SLOTS(a, s, r, d, {
            float o = acc[s] * row_a[r];
            const float *p = S + r * lds;
            for (int c = 0; c < BT; c++) o += p[c] * Vs[c * ld + d];
            acc[s] = o;
        });
    }
    __syncthreads();
    FOR_SLOTS(a, s, r, d, {
        if (i0 + r < a.T) out[head + (size_t)(i0 + r) * D + d] = acc[s] * (1.0f / row_l[r]);
    });
    if (tid < BT && i0 + tid < a.T) lse[(size_t)bh * a.T + i0 + tid] = row_m[tid] + logf(row_l[tid]);
}

/* ---- backward ---- */

/* drow (rows) = sum_d dout * out, a warp per row */
__global__ void attn_drow_kernel(float *drow, const float *dout, const float *o, int64_t rows, int D) {
    int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, wpb = blockDim.x >> 5;
    for (int64_t r = (int64_t)blockIdx.x * wpb + warp; r < rows; r += (int64_t)gridDim.x * wpb) {
        float acc = 0.0f;
        for (int d = lane; d < D; d += 32) acc += dout[r * D + d] * o[r * D + d];
        acc = warp_sum_f(acc);
        if (lane == 0) drow[r] = acc;
    }
}

/* P[r][c] and dS[r][c] of query tile i0 against key tile j0, from shared
 * tiles of Q, dO (query rows) and K, V (key rows); 0 where masked. */
__device__ __forceinline__ void probs_and_dscores(float *P, float *dS, const float *Qs, const float *dOs,
                                                  const float *Ks, const float *Vs, const float *lse_s,
                                                  const float *drow_s, int64_t i0, int64_t j0, const att_shape &a) {
    const int D = a.D, BT = a.bt, ld = D + 1, lds = BT + 1;
    for (int e = threadIdx.x; e < BT * BT; e += ATT_THREADS) {
        int r = e / BT, c = e - r * BT;
        float p = 0.0f, ds = 0.0f;
        if (i0 + r < a.T && !masked(i0 + r, j0 + c, a)) {
            p = expf(a.scale * tile_dot(Qs + r * ld, Ks + c * ld, D) - lse_s[r]);
            float dp = tile_dot(dOs + r * ld, Vs + c * ld, D);
            ds = a.scale * p * (dp - drow_s[r]);
        }
        if (P) P[r * lds + c] = p;
        dS[r * lds + c] = ds;
    }
}

/* lse and drow of query rows [i0, i0 + bt) into shared memory (0 past T) */
__device__ __forceinline__ void load_row_stats(float *lse_s, float *drow_s, const float *lse, const float *drow,
                                               int64_t i0, const att_shape &a) {
    int tid = threadIdx.x;
    if (tid < a.bt) {
        lse_s[tid] = i0 + tid < a.T ? lse[i0 + tid] : 0.0f;
        drow_s[tid] = i0 + tid < a.T ? drow[i0 + tid] : 0.0f;
    }
}

/* A block per (batch*head, key tile j0): dV = P^T dO and dK = dS^T Q over all query tiles. */
__global__ void __launch_bounds__(ATT_THREADS, 2) attn_bwd_dkdv_kernel(float *dk, float *dv, const float *dout,
                                                                    const float *q, const float *k, const float *v,
                                                                    const float *lse, const float *drow,
                                                                    att_shape a) {
    const int D = a.D, BT = a.bt, ld = D + 1, lds = BT + 1;
    float *Ks = CUDA_DYN_SMEM();      // (BT, ld)
    float *Vs = Ks + BT * ld;         // (BT, ld)
    float *Qs = Vs + BT * ld;         // (BT, ld)
    float *dOs = Qs + BT * ld;        // (BT, ld)
    float *P = dOs + BT * ld;         // (BT, lds) [query r][key c]
    float *dS = P + BT * lds;         // (BT, lds)
    float *lse_s = dS + BT * lds;     // (BT)
    float *drow_s = lse_s + BT;       // (BT)
    int64_t bh = blockIdx.x / a.tiles, j0 = (blockIdx.x % a.tiles) * BT;
    size_t head = (size_t)bh * a.T * D;
    load_tile(Ks, k + head, j0, a);
    load_tile(Vs, v + head, j0, a);
    float acc_k[ATT_ACC], acc_v[ATT_ACC];   /* slots over (key row, d) */
#pragma unroll
    for (int s = 0; s < ATT_ACC; s++) acc_k[s] = acc_v[s] = 0.0f;
    /* under the causal mask, queries before j0 see none of these keys */
    for (int64_t i0 = a.causal ? j0 : 0; i0 < a.T; i0 += BT) {
        __syncthreads();   /* the previous query tile is no longer read */
        load_tile(Qs, q + head, i0, a);
        load_tile(dOs, dout + head, i0, a);
        load_row_stats(lse_s, drow_s, lse + (size_t)bh * a.T, drow + (size_t)bh * a.T, i0, a);
        __syncthreads();
        probs_and_dscores(P, dS, Qs, dOs, Ks, Vs, lse_s, drow_s, i0, j0, a);
        __syncthreads();
        FOR_SLOTS(a, s, c, d, {
            float sv = acc_v[s], sk = acc_k[s];
            for (int r = 0; r < BT; r++) {
                sv += P[r * lds + c] * dOs[r * ld + d];
                sk += dS[r * lds + c] * Qs[r * ld + d];
            }
            acc_v[s] = sv;
            acc_k[s] = sk;
        });
    }
    FOR_SLOTS(a, s, c, d, {
        if (j0 + c < a.T) {
            size_t at = head + (size_t)(j0 + c) * D + d;
            dk[at] = acc_k[s];
            dv[at] = acc_v[s];
        }
    });
}

/* A block per (batch*head, query tile i0): dQ = dS K over the key tiles it sees. */
__global__ void __launch_bounds__(ATT_THREADS) attn_bwd_dq_kernel(float *dq, const float *dout, const float *q,
                                                                  const float *k, const float *v, const float *lse,
                                                                  const float *drow, att_shape a) {
    const int D = a.D, BT = a.bt, ld = D + 1, lds = BT + 1;
    float *Qs = CUDA_DYN_SMEM();      // (BT, ld)
    float *dOs = Qs + BT * ld;        // (BT, ld)
    float *Ks = dOs + BT * ld;        // (BT, ld)
    float *Vs = Ks + BT * ld;         // (BT, ld)
    float *dS = Vs + BT * ld;         // (BT, lds)
    float *lse_s = dS + BT * lds;     // (BT)
    float *drow_s = lse_s + BT;       // (BT)
    int64_t bh = blockIdx.x / a.tiles, i0 = (blockIdx.x % a.tiles) * BT;
    size_t head = (size_t)bh * a.T * D;
    load_tile(Qs, q + head, i0, a);
    load_tile(dOs, dout + head, i0, a);
    load_row_stats(lse_s, drow_s, lse + (size_t)bh * a.T, drow + (size_t)bh * a.T, i0, a);
    float acc[ATT_ACC];   /* slots over (query row, d) */
#pragma unroll
    for (int s = 0; s < ATT_ACC; s++) acc[s] = 0.0f;
    int64_t kend = a.causal ? cuda_min64(a.T, i0 + BT) : a.T;
    for (int64_t j0 = 0; j0 < kend; j0 += BT) {
        __syncthreads();
        load_tile(Ks, k + head, j0, a);
        load_tile(Vs, v + head, j0, a);
        __syncthreads();
        probs_and_dscores(NULL, dS, Qs, dOs, Ks, Vs, lse_s, drow_s, i0, j0, a);
        __syncthreads();
        FOR_SLOTS(a, s, r, d, {
            float sq = acc[s];
            for (int c = 0; c < BT; c++) sq += dS[r * lds + c] * Ks[c * ld + d];
            acc[s] = sq;
        });
    }
    FOR_SLOTS(a, s, r, d, {
        if (i0 + r < a.T) dq[head + (size_t)(i0 + r) * D + d] = acc[s];
    });
}

/* ---- launches ---- */

static att_shape make_shape(int64_t T, int64_t D, int causal, float scale) {
    att_shape a;
    a.T = T;
    a.D = (int)D;
    a.bt = 32;
    while (a.bt > 1 && (int64_t)a.bt * D > ATT_MAX_TILE) a.bt /= 2;
    a.tiles = cuda_ceil_div(T, a.bt);
    a.causal = causal;
    a.scale = scale;
    return a;
}

/* Dynamic shared memory beyond the default 48 KiB must be asked for per kernel. */
static void allow_smem(const void *kernel, size_t bytes, size_t *allowed) {
    if (bytes <= 48 * 1024 || bytes <= *allowed) return;
    CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)bytes));
    *allowed = bytes;
}

static unsigned att_blocks(int64_t BH, const att_shape &a) {
    int64_t blocks = BH * a.tiles;
    if (blocks >= ((int64_t)1 << 31)) cuda_fail("attention", __FILE__, __LINE__, "launch", "more than 2^31 blocks");
    return (unsigned)blocks;
}

static void check_head_dim(const char *op, int64_t D) {
    if (D > ATT_MAX_D) cuda_fail(op, __FILE__, __LINE__, "attention", "head dim above 4096 is not supported on CUDA");
}

void cuda_attention_forward_f32(float *out, float *lse, const float *q, const float *k, const float *v, int64_t B,
                                int64_t H, int64_t T, int64_t D, int causal, float scale) {
    CUDA_ENTER();
    if (B * H <= 0 || T <= 0 || D <= 0) return;
    check_head_dim(__func__, D);
    att_shape a = make_shape(T, D, causal, scale);
    size_t smem = (size_t)(3 * a.bt * (D + 1) + a.bt * (a.bt + 1) + 3 * a.bt) * sizeof(float);
    static size_t allowed;
    allow_smem((const void *)attn_fwd_kernel, smem, &allowed);
    LAUNCH(attn_fwd_kernel, att_blocks(B * H, a), ATT_THREADS, smem)(out, lse, q, k, v, a);
    CUDA_CHECK_LAUNCH();
}

void cuda_attention_backward_f32(float *dq, float *dk, float *dv, const float *dout, const float *q, const float *k,
                                 const float *v, const float *out, const float *lse, int64_t B, int64_t H, int64_t T,
                                 int64_t D, int causal, float scale) {
    CUDA_ENTER();
    if (B * H <= 0 || T <= 0 || D <= 0) return;
    check_head_dim(__func__, D);
    att_shape a = make_shape(T, D, causal, scale);
    int64_t rows = B * H * T;
    float *drow = (float *)cuda_tmp_alloc((size_t)rows * sizeof(float));   // (B, H, T)
    LAUNCH(attn_drow_kernel, (unsigned)cuda_min64(cuda_ceil_div(rows, 4), (int64_t)cuda_sm_count() * 16), 128, 0)(
        drow, dout, out, rows, (int)D);
    CUDA_CHECK_LAUNCH();
    unsigned blocks = att_blocks(B * H, a);
    size_t smem_kv = (size_t)(4 * a.bt * (D + 1) + 2 * a.bt * (a.bt + 1) + 2 * a.bt) * sizeof(float);
    static size_t allowed_kv;
    allow_smem((const void *)attn_bwd_dkdv_kernel, smem_kv, &allowed_kv);
    LAUNCH(attn_bwd_dkdv_kernel, blocks, ATT_THREADS, smem_kv)(dk, dv, dout, q, k, v, lse, drow, a);
    CUDA_CHECK_LAUNCH();
    size_t smem_q = (size_t)(4 * a.bt * (D + 1) + a.bt * (a.bt + 1) + 2 * a.bt) * sizeof(float);
    static size_t allowed_q;
    allow_smem((const void *)attn_bwd_dq_kernel, smem_q, &allowed_q);
    LAUNCH(attn_bwd_dq_kernel, blocks, ATT_THREADS, smem_q)(dq, dout, q, k, v, lse, drow, a);
    CUDA_CHECK_LAUNCH();
    cuda_tmp_free(drow);
}
