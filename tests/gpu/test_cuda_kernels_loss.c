/* test_cuda_kernels_loss.c: the embedding, the cross-entropy (f32 and bf16
 * logits, the one-pass online forward), and the vocabulary-chunked
 * classifier and embedding slices.
 * Tolerances: the embedding bit for bit both ways (the same order of adds;
 * the bf16 gradient by sorted ids also within bf16's rounding of a double sum);
 * cross-entropy rtol 1e-5, atol 1e-6; see each test for the rest. */
#include "cuda_kernels_check.h"

/* ---- embedding, cross-entropy ---- */

void test_embedding(void) {
    int64_t cs[][3] = {{1, 1, 1}, {13, 50, 7}, {1000, 300, 65}, {5, 2000, 33}, {70000, 100, 3}, BIG({50257, 8192, 768})};
    for (size_t i = 0; i < sizeof cs / sizeof cs[0]; i++) {
        int64_t V = cs[i][0], n = cs[i][1], dim = cs[i][2];
        int64_t *ids = halloc((size_t)n * sizeof(int64_t));
        for (int64_t k = 0; k < n; k++) ids[k] = (int64_t)(test_rng_uniform(&rng) * (double)V) % V;
        float *table = hrand(V * dim, 1), *dout = hrand(n * dim, 1);
        float *want = hnan(n * dim), *wdt = hnan(V * dim);
        C->embedding_forward_f32(want, ids, n, table, dim);
        C->embedding_backward_f32(wdt, V, ids, n, dout, dim);
        int64_t *dids = dup_bytes(ids, (size_t)n * sizeof(int64_t));
        float *dtab = dupf(table, V * dim), *ddout = dupf(dout, n * dim), *gout = dnan(n * dim), *gdt = dnan(V * dim);
        G->embedding_forward_f32(gout, dids, n, dtab, dim);
        G->embedding_backward_f32(gdt, V, dids, n, ddout, dim);
        char name[96];
        snprintf(name, sizeof name, "embedding_forward_f32 V %lld n %lld dim %lld", (long long)V, (long long)n,
                 (long long)dim);
        check_bits(name, back(gout, n * dim), want, (size_t)(n * dim) * sizeof(float));
        snprintf(name, sizeof name, "embedding_backward_f32 V %lld n %lld dim %lld", (long long)V, (long long)n,
                 (long long)dim);
        check_bits(name, back(gdt, V * dim), wdt, (size_t)(V * dim) * sizeof(float));
        /* a bf16 table: the picked rows bit for bit (the host's gather of the same bits) */
        if (G->embedding_forward_bf16) {
            uint16_t *t16 = halloc((size_t)(V * dim) * sizeof(uint16_t)), *w16 = halloc((size_t)(n * dim) * 2);
            for (int64_t k = 0; k < V * dim; k++) t16[k] = f32_to_bf16(table[k]);
            for (int64_t r = 0; r < n; r++) memcpy(w16 + r * dim, t16 + ids[r] * dim, (size_t)dim * 2);
            uint16_t *h16 = halloc((size_t)(n * dim) * 2);
            for (int64_t k = 0; k < n * dim; k++) h16[k] = 0x7fc1;   /* a NaN where nothing was written */
            uint16_t *dt16 = dup_bytes(t16, (size_t)(V * dim) * 2), *g16 = dup_bytes(h16, (size_t)(n * dim) * 2);
            G->embedding_forward_bf16(g16, dids, n, dt16, dim);
            snprintf(name, sizeof name, "embedding_forward_bf16 V %lld n %lld dim %lld", (long long)V, (long long)n,
                     (long long)dim);
            G->copy_to_host(h16, g16, (size_t)(n * dim) * 2);
            check_bits(name, h16, w16, (size_t)(n * dim) * 2);
        }
        free_case();
    }
}

/* The embedding's gradient by sorted ids (embedding_backward_acc_bf16,
 * _acc_f32, embedding_backward_bf16): bit for bit the CPU's (each id's rows
 * added in position order onto the old row, bf16 rounded once), and within
 * the bf16 rounding of a double-precision sum. Cases: one token, a prime
 * vocabulary, ids that repeat, all ids equal, more than one sort tile (1024
 * positions) and not a power of two of them, more than one merge pass (over
 * 16 tiles), rows of 16 bytes (vector accesses) and not, buffers off 16-byte
 * alignment. */
void test_embedding_backward_sorted(void) {
    /* V, n, dim, ids (0 random, 1 all equal, 2 from 3 values), element offset of the buffers */
    int64_t cs[][5] = {{1, 1, 1, 0, 0},     {97, 1, 64, 0, 0},     {13, 50, 7, 0, 0},      {1009, 3000, 16, 0, 0},
                       {5, 2049, 8, 1, 0},  {50257, 1100, 24, 0, 0}, {7, 4099, 3, 2, 0},   {31, 1025, 16, 2, 1},
                       {101, 700, 40, 1, 0}, {10007, 17000, 2, 0, 0}, {3, 16385, 1, 2, 0},
                       BIG({50257, 16384, 768, 0, 0})};
    for (size_t c = 0; c < sizeof cs / sizeof cs[0]; c++) {
        int64_t V = cs[c][0], n = cs[c][1], dim = cs[c][2], mode = cs[c][3], off = cs[c][4];
        int64_t *ids = halloc((size_t)n * sizeof(int64_t));
        for (int64_t k = 0; k < n; k++) {
            int64_t r = (int64_t)(test_rng_uniform(&rng) * (double)V) % V;
            ids[k] = mode == 1 ? V / 2 : mode == 2 ? (r % 3) * (V / 3) : r;
        }
        int64_t tn = V * dim, dn = n * dim;
        float *tf = hrand(tn, 1), *df = hrand(dn, 1);
        uint16_t *t16 = halloc((size_t)tn * 2), *d16 = halloc((size_t)dn * 2);
        for (int64_t k = 0; k < tn; k++) t16[k] = f32_to_bf16(tf[k]);
        for (int64_t k = 0; k < dn; k++) d16[k] = f32_to_bf16(df[k]);
        int64_t *dids = dup_bytes(ids, (size_t)n * sizeof(int64_t));
        char name[128];
        char tag[80];
        snprintf(tag, sizeof tag, "V %lld n %lld dim %lld ids %s%s", (long long)V, (long long)n, (long long)dim,
                 mode == 1 ? "all equal" : mode == 2 ? "3 values" : "random", off ? " unaligned" : "");

        /* bf16, added onto a table that holds values */
        uint16_t *want = halloc((size_t)tn * 2), *got = halloc((size_t)tn * 2);
        memcpy(want, t16, (size_t)tn * 2);
        C->embedding_backward_acc_bf16(want, ids, n, d16, dim);
        uint16_t *gt = (uint16_t *)dalloc((size_t)(tn + off) * 2) + off, *gd = (uint16_t *)dalloc((size_t)(dn + off) * 2) + off;
        G->copy_from_host(gt, t16, (size_t)tn * 2);
        G->copy_from_host(gd, d16, (size_t)dn * 2);
        G->embedding_backward_acc_bf16(gt, dids, n, gd, dim);
        G->copy_to_host(got, gt, (size_t)tn * 2);
        snprintf(name, sizeof name, "embedding_backward_acc_bf16 %s", tag);
        check_bits(name, got, want, (size_t)tn * 2);
        /* against double: old + sum of the id's rows, within bf16's rounding (2^-9 relative)
         * plus f32 accumulation (2^-24 per add of the terms' magnitudes) */
        double *ref = calloc((size_t)tn, sizeof(double)), *mag = calloc((size_t)tn, sizeof(double));
        int64_t *cnt = calloc((size_t)V, sizeof(int64_t));
        if (!ref || !mag || !cnt) abort();
        for (int64_t k = 0; k < tn; k++) {
            ref[k] = bf16_to_f32(t16[k]);
            mag[k] = fabs(ref[k]);
        }
        for (int64_t i = 0; i < n; i++) {
            cnt[ids[i]]++;
            for (int64_t j = 0; j < dim; j++) {
                double d = bf16_to_f32(d16[i * dim + j]);
                ref[ids[i] * dim + j] += d;
                mag[ids[i] * dim + j] += fabs(d);
            }
        }
        float *gotf = halloc((size_t)tn * sizeof(float)), *reff = halloc((size_t)tn * sizeof(float));
        double *bound = calloc((size_t)tn, sizeof(double));
        if (!bound) abort();
        for (int64_t k = 0; k < tn; k++) {
            gotf[k] = bf16_to_f32(got[k]);
            reff[k] = (float)ref[k];
            bound[k] = fabs(ref[k]) * 0x1p-8 + (double)(cnt[k / dim] + 1) * 0x1p-24 * mag[k];
        }
        snprintf(name, sizeof name, "embedding_backward_acc_bf16 vs double %s", tag);
        check_bound(name, gotf, reff, bound, tn, 1.0);
        /* the same inputs again: the same bits (no order that timing decides) */
        G->copy_from_host(gt, t16, (size_t)tn * 2);
        G->embedding_backward_acc_bf16(gt, dids, n, gd, dim);
        uint16_t *again = halloc((size_t)tn * 2);
        G->copy_to_host(again, gt, (size_t)tn * 2);
        snprintf(name, sizeof name, "embedding_backward_acc_bf16 run twice %s", tag);
        check_bits(name, again, got, (size_t)tn * 2);

        /* bf16, overwriting a table of NaNs: zeros where no id points */
        uint16_t *w2 = halloc((size_t)tn * 2);
        C->embedding_backward_bf16(w2, V, ids, n, d16, dim);
        for (int64_t k = 0; k < tn; k++) got[k] = 0x7fc1;
        G->copy_from_host(gt, got, (size_t)tn * 2);
        G->embedding_backward_bf16(gt, V, dids, n, gd, dim);
        G->copy_to_host(got, gt, (size_t)tn * 2);
        snprintf(name, sizeof name, "embedding_backward_bf16 %s", tag);
        check_bits(name, got, w2, (size_t)tn * 2);

        /* f32, added onto a table that holds values */
        float *wf = hcopy(tf, tn);
        C->embedding_backward_acc_f32(wf, ids, n, df, dim);
        float *gtf = (float *)dalloc((size_t)(tn + off) * 4) + off, *gdf = (float *)dalloc((size_t)(dn + off) * 4) + off;
        G->copy_from_host(gtf, tf, (size_t)tn * 4);
        G->copy_from_host(gdf, df, (size_t)dn * 4);
        G->embedding_backward_acc_f32(gtf, dids, n, gdf, dim);
        snprintf(name, sizeof name, "embedding_backward_acc_f32 %s", tag);
        check_bits(name, back(gtf, tn), wf, (size_t)tn * 4);
        free(ref);
        free(mag);
        free(cnt);
        free(bound);
        free_case();
    }
}

void test_cross_entropy(void) {
    int64_t cs[][3] = {{1, 1, 1}, {7, 13, 13}, {5, 1000, 997}, {3, 50304, 50257}, {40, 17, 16}, BIG({64, 50304, 50257})};
    const int64_t ignore = -100;
    for (size_t i = 0; i < sizeof cs / sizeof cs[0]; i++) {
        int64_t N = cs[i][0], V = cs[i][1], valid = cs[i][2];
        int64_t *t = halloc((size_t)N * sizeof(int64_t));
        for (int64_t k = 0; k < N; k++)
            t[k] = k % 4 == 3 ? ignore : (int64_t)(test_rng_uniform(&rng) * (double)valid) % valid;
        float *x = hrand(N * V, 8), *losses = hnan(N), *lse = hnan(N);
        int64_t count = C->cross_entropy_forward_f32(losses, lse, x, t, N, V, valid, ignore);
        int64_t *dt = dup_bytes(t, (size_t)N * sizeof(int64_t));
        float *dx = dupf(x, N * V), *gl = dnan(N), *glse = dnan(N);
        int64_t gcount = G->cross_entropy_forward_f32(gl, glse, dx, dt, N, V, valid, ignore);
        char name[96];
        snprintf(name, sizeof name, "cross_entropy_forward_f32 (%lld, %lld) valid %lld", (long long)N, (long long)V,
                 (long long)valid);
        test_check(gcount == count, "%s: count %lld, want %lld", name, (long long)gcount, (long long)count);
        check_f(name, back(gl, N), losses, N, 1e-5, 1e-6, -1);
        snprintf(name, sizeof name, "cross_entropy_forward_f32 lse (%lld, %lld)", (long long)N, (long long)V);
        check_f(name, back(glse, N), lse, N, 1e-5, 1e-6, -1);
        /* the rows alone (the count known to the caller): the same losses and lse */
        float *rl = dnan(N), *rlse = dnan(N);
        G->cross_entropy_rows_f32(rl, rlse, dx, dt, N, V, valid, ignore);
        snprintf(name, sizeof name, "cross_entropy_rows_f32 (%lld, %lld) valid %lld", (long long)N, (long long)V,
                 (long long)valid);
        check_f(name, back(rl, N), losses, N, 1e-5, 1e-6, -1);
        check_f(name, back(rlse, N), lse, N, 1e-5, 1e-6, -1);
        /* bf16 logits: against the CPU's bf16 forward on the same bits */
        uint16_t *xb = halloc((size_t)(N * V) * sizeof(uint16_t));
        for (int64_t k = 0; k < N * V; k++) xb[k] = f32_to_bf16(x[k]);
        float *bl = hnan(N), *blse = hnan(N), *gbl = dnan(N), *gblse = dnan(N);
        C->cross_entropy_forward_bf16(bl, blse, xb, t, N, V, valid, ignore);
        G->cross_entropy_rows_bf16(gbl, gblse, dup_bytes(xb, (size_t)(N * V) * sizeof(uint16_t)), dt, N, V, valid, ignore);
        snprintf(name, sizeof name, "cross_entropy_rows_bf16 (%lld, %lld) valid %lld", (long long)N, (long long)V,
                 (long long)valid);
        check_f(name, back(gbl, N), bl, N, 1e-5, 1e-6, -1);
        check_f(name, back(gblse, N), blse, N, 1e-5, 1e-6, -1);
        /* the gradient of the mean loss (1), on each side's device; each row gets 1 / count */
        int64_t div = count ? count : 1;
        float dloss = 1.0f / (float)div, one = 1.0f, *gone = dupf(&one, 1);
        float *wdx = hnan(N * V), *clse = dupf(lse, N), *gdx = dnan(N * V);
        C->cross_entropy_backward_f32(wdx, x, lse, t, N, V, valid, ignore, &one, div);
        G->cross_entropy_backward_f32(gdx, dx, clse, dt, N, V, valid, ignore, gone, div);
        snprintf(name, sizeof name, "cross_entropy_backward_f32 (%lld, %lld) valid %lld", (long long)N, (long long)V,
                 (long long)valid);
        check_f(name, back(gdx, N * V), wdx, N * V, 1e-5, 1e-6, dloss);
        free_case();
    }
}

/* ---- the vocabulary-chunked classifier and embedding (slice geometry: engine/cpu/classifier.c) ---- */

void test_classifier(void) {
    /* N, blocks, rows per run, table rows between runs, valid rows */
    int64_t cs[][5] = {{1, 1, 1, 1, 1}, {5, 1, 10, 97, 97}, {7, 1, 7, 96, 89}, {5, 3, 4, 33, 97}, {9, 7, 1, 2, 11},
                       {3, 8, 517, 6288, 50257}};
    const int64_t ignore = -100;
    for (size_t c = 0; c < sizeof cs / sizeof cs[0]; c++) {
        int64_t N = cs[c][0], blocks = cs[c][1], br = cs[c][2], stride = cs[c][3], valid = cs[c][4];
        int64_t R = blocks * br, row0 = stride > br ? stride - br : 0;   /* the last slice of each run */
        int64_t *t = halloc((size_t)N * sizeof(int64_t));
        for (int64_t k = 0; k < N; k++)
            t[k] = k % 4 == 3 ? ignore : (int64_t)(test_rng_uniform(&rng) * (double)valid) % valid;
        float *x = hrand(N * R, 8), *m = halloc((size_t)N * sizeof(float)), *s = hrand(N, 1), *tl = hrand(N, 1);
        for (int64_t k = 0; k < N; k++) {   /* a first slice (where it has real rows), and one after others */
            bool first = k % 2 && row0 < valid;
            m[k] = first ? -INFINITY : 1.5f;
            s[k] = first ? 0.0f : fabsf(s[k]);
        }
        int64_t *dt = dup_bytes(t, (size_t)N * sizeof(int64_t));
        float *dx = dupf(x, N * R), *gm = dupf(m, N), *gs = dupf(s, N), *gtl = dupf(tl, N);
        C->classifier_lse_f32(m, s, tl, x, t, N, blocks, br, stride, row0, valid, ignore);
        G->classifier_lse_f32(gm, gs, gtl, dx, dt, N, blocks, br, stride, row0, valid, ignore);
        char name[128];
        snprintf(name, sizeof name, "classifier_lse_f32 N %lld, %lld runs of %lld (stride %lld, valid %lld)",
                 (long long)N, (long long)blocks, (long long)br, (long long)stride, (long long)valid);
        check_f(name, back(gm, N), m, N, 0, 0, 0);
        check_f(name, back(gs, N), s, N, 1e-5, 0, 0);
        check_f(name, back(gtl, N), tl, N, 0, 0, 0);
        float *lse = hnan(N), *losses = hnan(N), *glse = dnan(N), *gl = dnan(N);
        int64_t count = C->classifier_finish_f32(lse, losses, m, s, tl, t, N, ignore);
        float *cm = dupf(m, N), *cs_ = dupf(s, N), *ctl = dupf(tl, N);
        int64_t gcount = G->classifier_finish_f32(glse, gl, cm, cs_, ctl, dt, N, ignore);
        test_check(gcount == count, "%s: count %lld, want %lld", name, (long long)gcount, (long long)count);
        check_f(name, back(glse, N), lse, N, 1e-6, 1e-6, -1);
        check_f(name, back(gl, N), losses, N, 1e-6, 1e-6, -1);
        float one = 1.0f, *gone = dupf(&one, 1), *want = hnan(N * R), *clse = dupf(lse, N), *gdx = dnan(N * R);
        C->classifier_dlogits_f32(want, x, lse, t, N, blocks, br, stride, row0, valid, ignore, &one, count);
        G->classifier_dlogits_f32(gdx, dx, clse, dt, N, blocks, br, stride, row0, valid, ignore, gone, count);
        snprintf(name, sizeof name, "classifier_dlogits_f32 N %lld, %lld runs of %lld", (long long)N,
                 (long long)blocks, (long long)br);
        check_f(name, back(gdx, N * R), want, N * R, 1e-5, 1e-6, count ? 1.0 / (double)count : 1.0);
        /* the embedding: rows of the slice picked and scattered back */
        int64_t dim = c % 2 ? 3 : 40, n = N * 3 + 1;
        int64_t *ids = halloc((size_t)n * sizeof(int64_t));
        for (int64_t k = 0; k < n; k++) ids[k] = (int64_t)(test_rng_uniform(&rng) * (double)(blocks * stride));
        ids[0] = row0;   /* one in the slice for sure */
        float *rows = hrand(R * dim, 1), *dout = hrand(n * dim, 1), *out = hrand(n * dim, 1);
        int64_t *dids = dup_bytes(ids, (size_t)n * sizeof(int64_t));
        float *grows = dupf(rows, R * dim), *gdout = dupf(dout, n * dim), *gout = dupf(out, n * dim);
        float *dr = hnan(R * dim), *gdr = dnan(R * dim);
        C->embedding_slice_forward_f32(out, ids, n, rows, dim, blocks, br, stride, row0);
        G->embedding_slice_forward_f32(gout, dids, n, grows, dim, blocks, br, stride, row0);
        C->embedding_slice_backward_f32(dr, ids, n, dout, dim, blocks, br, stride, row0);
        G->embedding_slice_backward_f32(gdr, dids, n, gdout, dim, blocks, br, stride, row0);
        snprintf(name, sizeof name, "embedding_slice_forward_f32 n %lld dim %lld", (long long)n, (long long)dim);
        check_bits(name, back(gout, n * dim), out, (size_t)(n * dim) * sizeof(float));
        snprintf(name, sizeof name, "embedding_slice_backward_f32 n %lld dim %lld", (long long)n, (long long)dim);
        check_bits(name, back(gdr, R * dim), dr, (size_t)(R * dim) * sizeof(float));
        free_case();
    }
}

/* Cross-entropy, forward in one pass (online max and sum per thread), against
 * a double reference on the same values: rows of one element, a prime
 * vocabulary, rows of a multiple of 16 bytes with a tail of padding (the
 * 16-byte path) and the same rows one element off 16 bytes (the element
 * path), logits that rise along the row (a new max at every element), huge
 * logits (exp would overflow without the max taken out), a -inf logit,
 * targets at both ends, ignored rows and a batch of only ignored rows. The
 * backward, f32 and bf16, against the double formula on the lse given. */
static void ce_reference(double *loss, double *lse, const float *x, const int64_t *t, int64_t N, int64_t V,
                         int64_t valid, int64_t ignore) {
    for (int64_t n = 0; n < N; n++) {
        const float *r = x + n * V;
        double m = -INFINITY, s = 0;
        for (int64_t j = 0; j < valid; j++) m = fmax(m, r[j]);
        for (int64_t j = 0; j < valid; j++) s += exp((double)r[j] - m);
        lse[n] = m + log(s);
        loss[n] = t[n] == ignore ? 0.0 : lse[n] - r[t[n]];
    }
}

void test_cross_entropy_online(void) {
    /* N, V, valid, kind (0 random, 1 rising, 2 huge, 3 a -inf logit), all rows ignored */
    int64_t cs[][5] = {{1, 1, 1, 0, 0},    {5, 1, 1, 2, 0},      {4, 1009, 1009, 0, 0}, {6, 64, 61, 0, 0},
                       {6, 64, 61, 1, 0},  {3, 1009, 1009, 2, 0}, {5, 48, 48, 3, 0},    {4, 64, 61, 0, 1},
                       {3, 4096, 4093, 1, 0}};
    const int64_t ignore = -100;
    for (size_t c = 0; c < sizeof cs / sizeof cs[0]; c++) {
        int64_t N = cs[c][0], V = cs[c][1], valid = cs[c][2], kind = cs[c][3], none = cs[c][4];
        for (int off = 0; off < 2; off++) {   /* off 1: logits one element off 16 bytes */
            float *x = hrand(N * V, 8);
            for (int64_t n = 0; n < N; n++)
                for (int64_t j = 0; j < V; j++) {
                    float *v = &x[n * V + j];
                    if (kind == 1) *v = 0.01f * (float)j + 0.001f * *v;
                    if (kind == 2) *v = 8.0e4f + 1.0e3f * *v;
                    if (kind == 3 && j == 1 + n % (valid - 1)) *v = -INFINITY;
                }
            round_bf16_host(x, N * V);   /* the same values for the f32 and the bf16 kernels */
            int64_t *t = halloc((size_t)N * sizeof(int64_t)), count = 0;
            for (int64_t n = 0; n < N; n++) {
                t[n] = none || n % 4 == 3 ? ignore : n % 3 == 0 ? 0 : n % 3 == 1 ? valid - 1 : (valid - 1) / 2;
                if (kind == 3 && t[n] != ignore && t[n] == 1 + n % (valid - 1)) t[n] = 0;
                count += t[n] != ignore;
            }
            double *wl = halloc((size_t)N * sizeof(double)), *wlse = halloc((size_t)N * sizeof(double));
            ce_reference(wl, wlse, x, t, N, V, valid, ignore);
            float *wlf = halloc((size_t)N * sizeof(float)), *wlsef = halloc((size_t)N * sizeof(float));
            for (int64_t n = 0; n < N; n++) wlf[n] = (float)wl[n], wlsef[n] = (float)wlse[n];
            int64_t *dt = dup_bytes(t, (size_t)N * sizeof(int64_t));
            float *dxb = dupf(hnan(N * V + 4), N * V + 4), *dx = dxb + off;
            G->copy_from_host(dx, x, (size_t)(N * V) * sizeof(float));
            uint16_t *xb = halloc((size_t)(N * V + 8) * 2);
            for (int64_t k = 0; k < N * V; k++) xb[off + k] = f32_to_bf16(x[k]);
            uint16_t *dxhb = dup_bytes(xb, (size_t)(N * V + 8) * 2), *dxh = dxhb + off;
            char name[128];
            const char *kinds[] = {"random", "rising", "huge", "-inf"};
            for (int variant = 0; variant < 4; variant++) {   /* f32, f32 rows, bf16, bf16 rows */
                float *gl = dnan(N), *glse = dnan(N);
                int64_t gcount = count;
                if (variant == 0) gcount = G->cross_entropy_forward_f32(gl, glse, dx, dt, N, V, valid, ignore);
                if (variant == 1) G->cross_entropy_rows_f32(gl, glse, dx, dt, N, V, valid, ignore);
                if (variant == 2) gcount = G->cross_entropy_forward_bf16(gl, glse, dxh, dt, N, V, valid, ignore);
                if (variant == 3) G->cross_entropy_rows_bf16(gl, glse, dxh, dt, N, V, valid, ignore);
                snprintf(name, sizeof name, "cross_entropy %s (%lld, %lld) valid %lld %s off %d",
                         (const char *[]){"forward_f32", "rows_f32", "forward_bf16", "rows_bf16"}[variant],
                         (long long)N, (long long)V, (long long)valid, kinds[kind], off);
                test_check(gcount == count, "%s: count %lld, want %lld", name, (long long)gcount, (long long)count);
                check_f(name, back(gl, N), wlf, N, 1e-5, 1e-5, 1);
                check_f(name, back(glse, N), wlsef, N, 1e-6, 1e-5, 1);
            }
            /* the backward on the reference lse (as f32): g (exp(x - lse) - [j == t]), 0 past valid and on ignored rows */
            int64_t div = count ? count : 1;
            float one = 1.0f, *gone = dupf(&one, 1), *dlse = dupf(wlsef, N);
            float *want = halloc((size_t)(N * V) * sizeof(float));
            for (int64_t n = 0; n < N; n++)
                for (int64_t j = 0; j < V; j++) {
                    double d = 0;
                    if (t[n] != ignore && j < valid)
                        d = (exp((double)x[n * V + j] - (double)wlsef[n]) - (j == t[n])) / (double)div;
                    want[n * V + j] = (float)d;
                }
            float *gdx = dnan(N * V);
            uint16_t *gdxh = dnan16(N * V);
            G->cross_entropy_backward_f32(gdx, dx, dlse, dt, N, V, valid, ignore, gone, count);
            G->cross_entropy_backward_bf16(gdxh, dxh, dlse, dt, N, V, valid, ignore, gone, count);
            snprintf(name, sizeof name, "cross_entropy_backward_f32 (%lld, %lld) valid %lld %s off %d", (long long)N,
                     (long long)V, (long long)valid, kinds[kind], off);
            check_f(name, back(gdx, N * V), want, N * V, 1e-5, 1e-6, 1.0 / (double)div);
            snprintf(name, sizeof name, "cross_entropy_backward_bf16 (%lld, %lld) valid %lld %s off %d", (long long)N,
                     (long long)V, (long long)valid, kinds[kind], off);
            check_f(name, back_bf16(gdxh, N * V), want, N * V, ULP16, 1e-6, 1.0 / (double)div);
            /* the fused kernel: the losses of the forward, dlogits over the logits (in place), against the
             * reference and bit for bit against the rows kernel followed by the backward on its lse */
            for (int bf = 0; bf < 2; bf++) {
                float *fl = dnan(N), *rl = dnan(N), *rlse = dnan(N);
                float *hx = hnan(N * V + 4);
                memcpy(hx + off, x, (size_t)(N * V) * sizeof(float));
                void *fx = bf ? (void *)(dup_bytes(xb, (size_t)(N * V + 8) * 2)) : (void *)dupf(hx, N * V + 4);
                void *fxo = bf ? (void *)((uint16_t *)fx + off) : (void *)((float *)fx + off);
                void *bdx = bf ? (void *)dnan16(N * V) : (void *)dnan(N * V);
                if (bf) {
                    G->cross_entropy_fused_bf16(fl, fxo, dt, N, V, valid, ignore, count);
                    G->cross_entropy_rows_bf16(rl, rlse, dxh, dt, N, V, valid, ignore);
                    G->cross_entropy_backward_bf16(bdx, dxh, rlse, dt, N, V, valid, ignore, gone, count);
                } else {
                    G->cross_entropy_fused_f32(fl, fxo, dt, N, V, valid, ignore, count);
                    G->cross_entropy_rows_f32(rl, rlse, dx, dt, N, V, valid, ignore);
                    G->cross_entropy_backward_f32(bdx, dx, rlse, dt, N, V, valid, ignore, gone, count);
                }
                snprintf(name, sizeof name, "cross_entropy_fused_%s (%lld, %lld) valid %lld %s off %d",
                         bf ? "bf16" : "f32", (long long)N, (long long)V, (long long)valid, kinds[kind], off);
                check_f(name, back(fl, N), wlf, N, 1e-5, 1e-5, 1);
                check_bits(name, back(fl, N), back(rl, N), (size_t)N * sizeof(float));
                float *got = bf ? back_bf16(fxo, N * V) : back(fxo, N * V);
                check_f(name, got, want, N * V, bf ? ULP16 : 1e-5, 1e-6, 1.0 / (double)div);
                size_t es = bf ? 2 : 4, bytes = (size_t)(N * V) * es;
                unsigned char *hf = halloc(bytes), *hb = halloc(bytes);
                G->copy_to_host(hf, fxo, bytes);
                G->copy_to_host(hb, bdx, bytes);
                check_bits(name, hf, hb, bytes);
            }
            free_case();
        }
    }
}
