/* comm_compress.c: the compressed reduce-scatter on the comm thread
 * (fsdp_reduce_scatter_compressed): compress each rank's part once, move
 * the parts by one all-to-all, decompress and add them in rank order.
 *
 * Wire layout of one part of n elements (every part of a collective has
 * the same size, so the all-to-all moves equal blocks):
 *   int8  nb = ceil(n / block) f32 scales, then n int8 values, the part
 *         padded to a multiple of 4 bytes; value = q * scale, scale =
 *         absmax / 127 of its block, q = round(v / scale) in [-127, 127];
 *   topk  k = ceil(density * n) int32 indices (within the part), then k
 *         f32 values: the entries of largest magnitude, ties to the lower
 *         index, so every rank selects alike whatever the order of work.
 * The owner's sum starts from zero and adds rank 0's part, then rank 1's,
 * ...: the same bits whatever order the parts arrived in. */
#include "comm_impl.h"
#include <math.h>
#include <stdlib.h>
#include <string.h>

enum { INT8_MAX_Q = 127 };

static int64_t blocks_of(int64_t n, int64_t block) { return (n + block - 1) / block; }

static int64_t topk_count(int64_t n, double density) {
    if (n <= 0) return 0;
    int64_t k = (int64_t)ceil(density * (double)n);
    return k < 1 ? 1 : k > n ? n : k;
}

int64_t comm_compress_part_bytes(int mode, int64_t n, int64_t block, double density) {
    if (mode == FSDP_COMPRESS_INT8) return 4 * blocks_of(n, block) + (n + 3) / 4 * 4;
    if (mode == FSDP_COMPRESS_TOPK) return 8 * topk_count(n, density);
    return 4 * n;
}

fsdp_status fsdp_compress_part_bytes(fsdp_compress mode, int64_t n, int64_t block, double density, int64_t *bytes) {
    if (!bytes) return fsdp_set_error(FSDP_ERR_INVALID, "fsdp_compress_part_bytes: bytes is NULL");
    if (mode != FSDP_COMPRESS_INT8 && mode != FSDP_COMPRESS_TOPK)
        return fsdp_set_error(FSDP_ERR_INVALID, "fsdp_compress_part_bytes: mode %d, expected int8 (1) or topk (2)",
                              (int)mode);
    if (n < 0 || block < 1 || (block & (block - 1)) || !(density > 0 && density <= 1))
        return fsdp_set_error(FSDP_ERR_INVALID, "fsdp_compress_part_bytes: n %lld, block %lld (a power of two), "
                              "density %g (in (0, 1])", (long long)n, (long long)block, density);
    *bytes = comm_compress_part_bytes(mode, n, block, density);
    return FSDP_OK;
}

/* ---- int8 blocks ---- */

/* One part: v (n) -> scales and values at out; with error feedback v is the
 * residual buffer holding src + residual, and keeps v - what was sent. */
static void int8_pack(char *out, float *v, const float *src, int64_t n, int64_t block, bool feedback) {
    int64_t nb = blocks_of(n, block);
    float *scales = (float *)out;
    int8_t *q = (int8_t *)(out + 4 * nb);
    const float *in = feedback ? v : src;
    for (int64_t b = 0; b < nb; b++) {
        int64_t lo = b * block, hi = lo + block < n ? lo + block : n;
        float amax = 0.0f;
        for (int64_t i = lo; i < hi; i++) {
            float a = fabsf(in[i]);
            amax = a > amax ? a : amax;
        }
        float scale = amax / (float)INT8_MAX_Q;
        scales[b] = scale;
        for (int64_t i = lo; i < hi; i++) {
            long r = scale > 0.0f ? lrintf(in[i] / scale) : 0;
            r = r > INT8_MAX_Q ? INT8_MAX_Q : r < -INT8_MAX_Q ? -INT8_MAX_Q : r;
            q[i] = (int8_t)r;
            if (feedback) v[i] = in[i] - (float)r * scale;
        }
    }
    memset(q + n, 0, (size_t)((n + 3) / 4 * 4 - n));
}

static void int8_add(float *acc, const char *part, int64_t n, int64_t block) {
    int64_t nb = blocks_of(n, block);
    const float *scales = (const float *)part;
    const int8_t *q = (const int8_t *)(part + 4 * nb);
    for (int64_t b = 0; b < nb; b++) {
        int64_t lo = b * block, hi = lo + block < n ? lo + block : n;
        float scale = scales[b];
        for (int64_t i = lo; i < hi; i++) acc[i] += (float)q[i] * scale;
    }
}

/* ---- top-k ---- */

/* The k-th largest of a[0..n) (1 <= k <= n), reordering a. */
static float kth_largest(float *a, int64_t n, int64_t k) {
    int64_t lo = 0, hi = n - 1, want = k - 1;
    while (lo < hi) {
        float x = a[lo], y = a[lo + (hi - lo) / 2], z = a[hi];
        float pivot = x < y ? (y < z ? y : x < z ? z : x) : (x < z ? x : y < z ? z : y);   /* median of three */
        int64_t i = lo, j = hi;
        while (i <= j) {   /* descending: larger ones to the left */
            while (a[i] > pivot) i++;
            while (a[j] < pivot) j--;
            if (i <= j) {
                float t = a[i];
                a[i++] = a[j];
                a[j--] = t;
            }
        }
        if (want <= j) hi = j;
        else if (want >= i) lo = i;
        else return a[want];
    }
    return a[want];
}

/* A magnitude for selection: NaN counts as the largest (it is sent, and the
 * reduction shows it). */
static float magnitude(float x) { return isnan(x) ? INFINITY : fabsf(x); }

static void topk_pack(char *out, float *v, const float *src, int64_t n, int64_t k, bool feedback, float *mags) {
    int32_t *idx = (int32_t *)out;
    float *val = (float *)(out + 4 * k);
    const float *in = feedback ? v : src;
    for (int64_t i = 0; i < n; i++) mags[i] = magnitude(in[i]);
    float t = kth_largest(mags, n, k);
    int64_t m = 0;
    for (int64_t i = 0; i < n && m < k; i++)
        if (magnitude(in[i]) > t) idx[m++] = (int32_t)i;
    int64_t above = m;
    for (int64_t i = 0; i < n && m < k; i++)   /* ties at the threshold: the lowest indices */
        if (magnitude(in[i]) == t) idx[m++] = (int32_t)i;
    if (above > 0 && m > above) {   /* keep indices ascending: merge the two runs */
        int32_t *tmp = (int32_t *)mags;   /* mags is no longer needed */
        int64_t a = 0, b = above, o = 0;
        while (a < above && b < m) tmp[o++] = idx[a] < idx[b] ? idx[a++] : idx[b++];
        while (a < above) tmp[o++] = idx[a++];
        while (b < m) tmp[o++] = idx[b++];
        memcpy(idx, tmp, (size_t)m * sizeof *idx);
    }
    for (int64_t j = 0; j < k; j++) {
        val[j] = in[idx[j]];
        if (feedback) v[idx[j]] = 0.0f;   /* sent whole: nothing of it left */
    }
}

static void topk_add(float *acc, const char *part, int64_t k) {
    const int32_t *idx = (const int32_t *)part;
    const float *val = (const float *)(part + 4 * k);
    for (int64_t j = 0; j < k; j++) acc[idx[j]] += val[j];
}

/* ---- the collective ---- */

fsdp_status comm_compress_pack(void *send, const float *src, float *res, int mode, int64_t n, int size, int64_t block,
                               double density) {
    int64_t k = topk_count(n, density);
    int64_t part = comm_compress_part_bytes(mode, n, block, density);
    float *mags = NULL;
    if (mode == FSDP_COMPRESS_TOPK) FSDP_TRY(fsdp_alloc(FSDP_DEVICE_CPU, FSDP_TAG_COMM, (size_t)n * 4, (void **)&mags));
    bool feedback = res != NULL;
    if (feedback)
        for (int64_t i = 0; i < n * size; i++) res[i] += src[i];
    for (int r = 0; r < size; r++) {
        char *out = (char *)send + (int64_t)r * part;
        float *v = feedback ? res + (int64_t)r * n : NULL;
        const float *s = src + (int64_t)r * n;
        if (mode == FSDP_COMPRESS_INT8) int8_pack(out, v, s, n, block, feedback);
        else topk_pack(out, v, s, n, k, feedback, mags);
    }
    if (mags) fsdp_free(FSDP_DEVICE_CPU, FSDP_TAG_COMM, mags, (size_t)n * 4);
    return FSDP_OK;
}

/* On the comm thread: the parts packed at issue (w->src) to their owners
 * (w->t_recv), then this rank's sum in rank order into dst. */
fsdp_status comm_compress_run(fsdp_work *w, bool touch) {
    if (!touch) return FSDP_OK;
    fsdp_comm *c = w->comm;
    int size = c->size, mode = w->compress;
    int64_t n = w->n, block = w->compress_block;
    int64_t k = topk_count(n, w->density);
    int64_t part = comm_compress_part_bytes(mode, n, block, w->density);
    char *recv = tensor_data(w->t_recv);
    FSDP_TRY(c->be->all_to_all(c, recv, w->src, part));
    float *dst = w->dst;
    memset(dst, 0, (size_t)n * sizeof *dst);
    for (int r = 0; r < size; r++) {
        const char *in = recv + (int64_t)r * part;
        if (mode == FSDP_COMPRESS_INT8) int8_add(dst, in, n, block);
        else topk_add(dst, in, k);
    }
    if (w->op == FSDP_REDUCE_AVG && size > 1)
        for (int64_t i = 0; i < n; i++) dst[i] /= (float)size;
    return FSDP_OK;
}
