/* test_cuda_kernels_attention.c: attention forward and backward in f32
 * (rtol 1e-4, atol 1e-4: the flash tiling and exp differ), from a packed
 * bf16 qkv on the batched GEMMs, and the bf16 flash kernels (their
 * tolerances: above each test). */
#include "cuda_kernels_check.h"

/* ---- attention ---- */

void test_attention(void) {
    int64_t cs[][4] = {{1, 1, 1, 1}, {2, 3, 17, 8}, {1, 2, 70, 64}, {1, 1, 33, 128},
                       {1, 1, 5, 200}, {1, 1, 9, 520}, {2, 1, 40, 3}, BIG({2, 4, 257, 64}, {1, 2, 1024, 64})};
    for (size_t i = 0; i < sizeof cs / sizeof cs[0]; i++)
        for (int causal = 0; causal < 2; causal++) {
            int64_t B = cs[i][0], H = cs[i][1], T = cs[i][2], D = cs[i][3], n = B * H * T * D, nl = B * H * T;
            float scale = 1.0f / sqrtf((float)D);
            float *q = hrand(n, 1), *k = hrand(n, 1), *v = hrand(n, 1), *dout = hrand(n, 1);
            float *o = hnan(n), *lse = hnan(nl);
            C->attention_forward_f32(o, lse, q, k, v, B, H, T, D, causal, scale);
            float *dq = hnan(n), *dk = hnan(n), *dv = hnan(n);
            C->attention_backward_f32(dq, dk, dv, dout, q, k, v, o, lse, B, H, T, D, causal, scale);
            float *gq = dupf(q, n), *gk = dupf(k, n), *gv = dupf(v, n), *gdo = dupf(dout, n);
            float *go = dnan(n), *glse = dnan(nl);
            G->attention_forward_f32(go, glse, gq, gk, gv, B, H, T, D, causal, scale);
            float *co = dupf(o, n), *clse = dupf(lse, nl), *gdq = dnan(n), *gdk = dnan(n), *gdv = dnan(n);
            G->attention_backward_f32(gdq, gdk, gdv, gdo, gq, gk, gv, co, clse, B, H, T, D, causal, scale);
            char tag[64], name[128];
            snprintf(tag, sizeof tag, "(%lld, %lld, %lld, %lld)%s", (long long)B, (long long)H, (long long)T,
                     (long long)D, causal ? " causal" : "");
            snprintf(name, sizeof name, "attention_forward_f32 out %s", tag);
            check_f(name, back(go, n), o, n, 1e-4, 1e-4, -1);
            snprintf(name, sizeof name, "attention_forward_f32 lse %s", tag);
            check_f(name, back(glse, nl), lse, nl, 1e-4, 1e-4, -1);
            snprintf(name, sizeof name, "attention_backward_f32 dq %s", tag);
            check_f(name, back(gdq, n), dq, n, 1e-4, 1e-4, -1);
            snprintf(name, sizeof name, "attention_backward_f32 dk %s", tag);
            check_f(name, back(gdk, n), dk, n, 1e-4, 1e-4, -1);
            snprintf(name, sizeof name, "attention_backward_f32 dv %s", tag);
            check_f(name, back(gdv, n), dv, n, 1e-4, 1e-4, -1);
            free_case();
        }
}

/* Attention from a packed bf16 qkv (B, T, 3C) on the tensor cores, against
 * the CPU's f32 attention on the same (bf16) values unpacked to (B, H, T, D).
 * Tolerance: probabilities and dS are rounded to bf16 (2^-9 relative) before
 * their products and every result is rounded to bf16 once, so
 *   out: |err| <= 2^-7 (|want| + max|v|),
 *   dq, dk, dv: |err| <= 2^-6 (|want| + max|want|)
 * (a few roundings of 2^-9 each, with room for their sums; a wrong index,
 * mask or transpose is off by O(1)). */
static void unpack_heads(float *dst, const uint16_t *src, int64_t B, int64_t H, int64_t T, int64_t D, int64_t ld,
                         int64_t col0) {   /* dst (B, H, T, D) from columns col0 + h D of src (B, T, ld) */
    for (int64_t b = 0; b < B; b++)
        for (int64_t h = 0; h < H; h++)
            for (int64_t t = 0; t < T; t++)
                for (int64_t d = 0; d < D; d++)
                    dst[((b * H + h) * T + t) * D + d] = bf16_to_f32(src[(b * T + t) * ld + col0 + h * D + d]);
}

/* The packed attention's results, out (B, T, C) and dqkv (B, T, 3C) bf16
 * on the host, as (B, H, T, D) f32 tensors each */
typedef struct {
    float *o, *dq, *dk, *dv;
} attn_unpacked;

static attn_unpacked unpack_attention(const uint16_t *o16, const uint16_t *dqkv16, int64_t B, int64_t H, int64_t T,
                                      int64_t D) {
    int64_t n = B * H * T * D, C = H * D;
    attn_unpacked u = {halloc((size_t)n * 4), halloc((size_t)n * 4), halloc((size_t)n * 4), halloc((size_t)n * 4)};
    unpack_heads(u.o, o16, B, H, T, D, C, 0);
    unpack_heads(u.dq, dqkv16, B, H, T, D, 3 * C, 0);
    unpack_heads(u.dk, dqkv16, B, H, T, D, 3 * C, C);
    unpack_heads(u.dv, dqkv16, B, H, T, D, 3 * C, 2 * C);
    return u;
}

static uint16_t *bf16_rand(int64_t n) {
    float *x = hrand(n, 1);
    uint16_t *h = halloc((size_t)n * 2);
    for (int64_t i = 0; i < n; i++) h[i] = f32_to_bf16(x[i]);
    return h;
}

void test_attention_qkv(void) {
    test_check(G->attention_qkv_forward_bf16 && G->attention_qkv_backward_bf16, "CUDA has the packed attention");
    if (!G->attention_qkv_forward_bf16 || !G->attention_qkv_backward_bf16) return;
    const fsdp_device_kernels *C_ = C;   /* the CPU table; C below is the width */
    int64_t cs[][4] = {{1, 1, 1, 1}, {2, 3, 17, 8}, {1, 2, 33, 16}, {2, 2, 9, 5}, {1, 1, 40, 3},
                       BIG({2, 4, 257, 64}, {2, 12, 1024, 64})};
    for (size_t i = 0; i < sizeof cs / sizeof cs[0]; i++)
        for (int causal = 0; causal < 2; causal++) {
            int64_t B = cs[i][0], H = cs[i][1], T = cs[i][2], D = cs[i][3], C = H * D, n = B * H * T * D;
            int64_t nqkv = B * T * 3 * C, ntt = B * H * T * T, nl = B * H * T;
            float scale = 1.0f / sqrtf((float)D);
            uint16_t *qkv = bf16_rand(nqkv), *dout16 = bf16_rand(B * T * C);
            float *q = halloc((size_t)n * 4), *k = halloc((size_t)n * 4), *v = halloc((size_t)n * 4);
            float *dout = halloc((size_t)n * 4);
            unpack_heads(q, qkv, B, H, T, D, 3 * C, 0);
            unpack_heads(k, qkv, B, H, T, D, 3 * C, C);
            unpack_heads(v, qkv, B, H, T, D, 3 * C, 2 * C);
            unpack_heads(dout, dout16, B, H, T, D, C, 0);
            float *o = hnan(n), *lse = hnan(nl), *dq = hnan(n), *dk = hnan(n), *dv = hnan(n);
            C_->attention_forward_f32(o, lse, q, k, v, B, H, T, D, causal, scale);
            C_->attention_backward_f32(dq, dk, dv, dout, q, k, v, o, lse, B, H, T, D, causal, scale);
            uint16_t *gqkv = dup_bytes(qkv, (size_t)nqkv * 2), *gdout = dup_bytes(dout16, (size_t)B * T * C * 2);
            uint16_t *gout = (uint16_t *)dnan(B * T * C), *probs = dalloc((size_t)ntt * 2);
            uint16_t *gdqkv = (uint16_t *)dnan(nqkv), *dscores = dalloc((size_t)ntt * 2);
            float *scores = dnan(ntt), *dprobs = dnan(ntt);
            G->attention_qkv_forward_bf16(gout, probs, scores, gqkv, B, H, T, D, causal, scale);
            G->attention_qkv_backward_bf16(gdqkv, dprobs, dscores, gdout, gqkv, probs, B, H, T, D, causal, scale);
            /* results unpacked the same way: (B, H, T, D) */
            float *got_o = back_bf16(gout, B * T * C), *got_dqkv = back_bf16(gdqkv, nqkv);
            uint16_t *o16 = halloc((size_t)B * T * C * 2), *dqkv16 = halloc((size_t)nqkv * 2);
            for (int64_t j = 0; j < B * T * C; j++) o16[j] = f32_to_bf16(got_o[j]);
            for (int64_t j = 0; j < nqkv; j++) dqkv16[j] = f32_to_bf16(got_dqkv[j]);
            attn_unpacked g = unpack_attention(o16, dqkv16, B, H, T, D);
            float *go = g.o, *gdq = g.dq, *gdk = g.dk, *gdv = g.dv;
            char tag[64], name[128];
            snprintf(tag, sizeof tag, "(%lld, %lld, %lld, %lld)%s", (long long)B, (long long)H, (long long)T,
                     (long long)D, causal ? " causal" : "");
            snprintf(name, sizeof name, "attention_qkv_forward_bf16 out %s", tag);
            check_f(name, go, o, n, 1.0 / 128, 1.0 / 128, 1.0);
            snprintf(name, sizeof name, "attention_qkv_backward_bf16 dq %s", tag);
            check_f(name, gdq, dq, n, 1.0 / 64, 1.0 / 64, -1);
            snprintf(name, sizeof name, "attention_qkv_backward_bf16 dk %s", tag);
            check_f(name, gdk, dk, n, 1.0 / 64, 1.0 / 64, -1);
            snprintf(name, sizeof name, "attention_qkv_backward_bf16 dv %s", tag);
            check_f(name, gdv, dv, n, 1.0 / 64, 1.0 / 64, -1);
            free_case();
        }
}

/* Flash attention (attention_flash.cu) against attention in double
 * precision on the same bf16 values, and against the GEMM path above.
 * Tolerance (bf16): P is rounded to bf16 (2^-9 relative) before P V and
 * every result once more, so
 *   out:  |err| <= 2^-8 (|want| + max|v|)  (twice the bound: f32 sums)
 *   lse:  |err| <= 2^-8                    (l sums the rounded P: 2^-9)
 *   dq, dk, dv: |err| <= 2^-6 (|want| + max|want|)  (dS rounded to bf16, O
 *   to bf16 in Drow = dO . O, then sums of them; as the GEMM path's bound)
 * A wrong mask, index or transpose is off by O(1). The GEMM path and the
 * flash path agree within the sum of their bounds, and the flash backward
 * repeats bit for bit (no atomics). */
static void ref_attention(double *o, double *lse, double *dq, double *dk, double *dv, const float *q, const float *k,
                          const float *v, const float *dout, int64_t BH, int64_t T, int64_t D, int causal,
                          double scale) {   /* (BH, T, D) each; lse (BH, T) */
    double *p = malloc((size_t)T * sizeof(double)), *dp = malloc((size_t)T * sizeof(double));
    for (int64_t i = 0; i < BH * T * D; i++) dq[i] = dk[i] = dv[i] = 0.0;
    for (int64_t bh = 0; bh < BH; bh++) {
        const float *Q = q + bh * T * D, *K = k + bh * T * D, *V = v + bh * T * D, *dO = dout + bh * T * D;
        double *O = o + bh * T * D, *dQ = dq + bh * T * D, *dK = dk + bh * T * D, *dV = dv + bh * T * D;
        for (int64_t i = 0; i < T; i++) {
            int64_t seen = causal ? i + 1 : T;
            double mx = -INFINITY, sum = 0.0, drow = 0.0;
            for (int64_t j = 0; j < seen; j++) {
                double s = 0.0;
                for (int64_t d = 0; d < D; d++) s += (double)Q[i * D + d] * K[j * D + d];
                p[j] = scale * s;
                if (p[j] > mx) mx = p[j];
            }
            for (int64_t j = 0; j < seen; j++) sum += (p[j] = exp(p[j] - mx));
            lse[bh * T + i] = mx + log(sum);
            for (int64_t d = 0; d < D; d++) {
                double acc = 0.0;
                for (int64_t j = 0; j < seen; j++) acc += p[j] / sum * V[j * D + d];
                O[i * D + d] = acc;
            }
            for (int64_t j = 0; j < seen; j++) {
                p[j] /= sum;
                double x = 0.0;
                for (int64_t d = 0; d < D; d++) x += (double)dO[i * D + d] * V[j * D + d];
                dp[j] = x;
                drow += p[j] * x;
            }
            for (int64_t j = 0; j < seen; j++) {
                double ds = scale * p[j] * (dp[j] - drow);
                for (int64_t d = 0; d < D; d++) {
                    dQ[i * D + d] += ds * K[j * D + d];
                    dK[j * D + d] += ds * Q[i * D + d];
                    dV[j * D + d] += p[j] * dO[i * D + d];
                }
            }
        }
    }
    free(p);
    free(dp);
}

static float *to_f32(const double *x, int64_t n) {
    float *y = halloc((size_t)n * sizeof(float));
    for (int64_t i = 0; i < n; i++) y[i] = (float)x[i];
    return y;
}

static double max_abs(const float *x, int64_t n) {
    double m = 0.0;
    for (int64_t i = 0; i < n; i++) m = fabs(x[i]) > m ? fabs(x[i]) : m;
    return m;
}

void test_attention_flash(void) {
    test_check(G->attention_flash_forward_bf16 && G->attention_flash_backward_bf16, "CUDA has the flash attention");
    if (!G->attention_flash_forward_bf16 || !G->attention_flash_backward_bf16) return;
    /* shapes: covered and not */
    test_check(attention_flash_covers(1, 1, 1, 16) && attention_flash_covers(3, 5, 1000003, 128) &&
                   attention_flash_covers(1, 1, 17, 80),
               "flash covers D = 16, 80, 128 and any T");
    test_check(!attention_flash_covers(1, 1, 17, 8) && !attention_flash_covers(1, 1, 17, 72) &&
                   !attention_flash_covers(1, 1, 17, 144) && !attention_flash_covers(0, 1, 17, 64) &&
                   !attention_flash_covers(1, 1, 0, 64) && !attention_flash_covers((int64_t)1 << 30, 64, 1 << 12, 64),
               "flash refuses D = 8, 72, 144, an empty batch or sequence, more than 2^31 - 1 blocks");
    /* on a GPU also T = 257 and 1024 (the double reference on the host bounds the sizes) */
    int64_t cs[][4] = {{1, 1, 1, 16}, {1, 3, 17, 16}, {3, 1, 127, 64}, {1, 1, 65, 80}, {1, 2, 33, 128},
                       {1, 1, 200, 16}, BIG({2, 4, 257, 64}, {1, 2, 1024, 64})};
    for (size_t i = 0; i < sizeof cs / sizeof cs[0]; i++)
        for (int causal = 0; causal < 2; causal++) {
            int64_t B = cs[i][0], H = cs[i][1], T = cs[i][2], D = cs[i][3], C = H * D, n = B * H * T * D;
            int64_t nqkv = B * T * 3 * C, nl = B * H * T, ntt = B * H * T * T;
            float scale = 1.0f / sqrtf((float)D);
            uint16_t *qkv = bf16_rand(nqkv), *dout16 = bf16_rand(B * T * C);
            float *q = halloc((size_t)n * 4), *k = halloc((size_t)n * 4), *v = halloc((size_t)n * 4);
            float *dout = halloc((size_t)n * 4);
            unpack_heads(q, qkv, B, H, T, D, 3 * C, 0);
            unpack_heads(k, qkv, B, H, T, D, 3 * C, C);
            unpack_heads(v, qkv, B, H, T, D, 3 * C, 2 * C);
            unpack_heads(dout, dout16, B, H, T, D, C, 0);
            double *o = malloc((size_t)n * 8), *lse = malloc((size_t)nl * 8), *dq = malloc((size_t)n * 8);
            double *dk = malloc((size_t)n * 8), *dv = malloc((size_t)n * 8);
            ref_attention(o, lse, dq, dk, dv, q, k, v, dout, B * H, T, D, causal, scale);
            float *wo = to_f32(o, n), *wlse = to_f32(lse, nl), *wdq = to_f32(dq, n), *wdk = to_f32(dk, n);
            float *wdv = to_f32(dv, n);
            free(o);
            free(lse);
            free(dq);
            free(dk);
            free(dv);
            uint16_t *gqkv = dup_bytes(qkv, (size_t)nqkv * 2), *gdout = dup_bytes(dout16, (size_t)B * T * C * 2);
            uint16_t *gout = dnan16(B * T * C), *gdqkv = dnan16(nqkv), *gdqkv2 = dnan16(nqkv);
            float *glse = dnan(nl), *drow = dnan(nl);
            G->attention_flash_forward_bf16(gout, glse, gqkv, B, H, T, D, causal, scale);
            G->attention_flash_backward_bf16(gdqkv, drow, gdout, gqkv, gout, glse, B, H, T, D, causal, scale);
            G->attention_flash_backward_bf16(gdqkv2, drow, gdout, gqkv, gout, glse, B, H, T, D, causal, scale);
            uint16_t *o16 = halloc((size_t)B * T * C * 2), *dqkv16 = halloc((size_t)nqkv * 2);
            uint16_t *dqkv16b = halloc((size_t)nqkv * 2);
            G->copy_to_host(o16, gout, (size_t)B * T * C * 2);
            G->copy_to_host(dqkv16, gdqkv, (size_t)nqkv * 2);
            G->copy_to_host(dqkv16b, gdqkv2, (size_t)nqkv * 2);
            attn_unpacked g = unpack_attention(o16, dqkv16, B, H, T, D);
            float *go = g.o, *gdq = g.dq, *gdk = g.dk, *gdv = g.dv;
            char tag[64], name[160];
            snprintf(tag, sizeof tag, "(%lld, %lld, %lld, %lld)%s", (long long)B, (long long)H, (long long)T,
                     (long long)D, causal ? " causal" : "");
            snprintf(name, sizeof name, "attention_flash_forward_bf16 out %s", tag);
            check_f(name, go, wo, n, 1.0 / 256, 1.0 / 256, max_abs(v, n));
            snprintf(name, sizeof name, "attention_flash_forward_bf16 lse %s", tag);
            check_f(name, back(glse, nl), wlse, nl, 0.0, 1.0 / 256, 1.0);
            snprintf(name, sizeof name, "attention_flash_backward_bf16 dq %s", tag);
            check_f(name, gdq, wdq, n, 1.0 / 64, 1.0 / 64, -1);
            snprintf(name, sizeof name, "attention_flash_backward_bf16 dk %s", tag);
            check_f(name, gdk, wdk, n, 1.0 / 64, 1.0 / 64, -1);
            snprintf(name, sizeof name, "attention_flash_backward_bf16 dv %s", tag);
            check_f(name, gdv, wdv, n, 1.0 / 64, 1.0 / 64, -1);
            snprintf(name, sizeof name, "attention_flash_backward_bf16 %s repeats bit for bit", tag);
            check_bits(name, dqkv16b, dqkv16, (size_t)nqkv * 2);
            /* the GEMM path on the same inputs: within both bounds of each other */
            if (G->attention_qkv_forward_bf16 && G->attention_qkv_backward_bf16) {
                uint16_t *mout = dnan16(B * T * C), *probs = dalloc((size_t)ntt * 2), *dscores = dalloc((size_t)ntt * 2);
                uint16_t *mdqkv = dnan16(nqkv);
                float *scores = dnan(ntt), *dprobs = dnan(ntt);
                G->attention_qkv_forward_bf16(mout, probs, scores, gqkv, B, H, T, D, causal, scale);
                G->attention_qkv_backward_bf16(mdqkv, dprobs, dscores, gdout, gqkv, probs, B, H, T, D, causal, scale);
                float *mo = back_bf16(mout, B * T * C), *md = back_bf16(mdqkv, nqkv);
                float *fo = back_bf16(gout, B * T * C), *fd = back_bf16(gdqkv, nqkv);
                snprintf(name, sizeof name, "flash vs GEMM attention out %s", tag);
                check_f(name, fo, mo, B * T * C, 1.0 / 128 + 1.0 / 256, 1.0 / 128 + 1.0 / 256, max_abs(v, n));
                snprintf(name, sizeof name, "flash vs GEMM attention dqkv %s", tag);
                check_f(name, fd, md, nqkv, 1.0 / 32, 1.0 / 32, -1);
            }
            free_case();
        }
}
