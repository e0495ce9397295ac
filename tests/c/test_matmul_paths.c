/* test_matmul_paths.c: every way a CPU matmul can run, against the double
 * reference (ref_matmul): OpenBLAS f32, oneDNN f32, the engine's f32 choice,
 * and bf16 buffers through cpu_matmul_bf16 (oneDNN's bf16 matmul, or the
 * widening OpenBLAS fallback). Batched, transposed, shared and gapped
 * operands, alpha/beta, K = 0, at awkward sizes, with 1 and 3 threads.
 *
 * ctest runs it again with oneDNN limited to other CPUs (DNNL_MAX_CPU_ISA:
 * AVX-512 without its bf16 instructions, AVX2) and without oneDNN
 * (FSDP_NO_DNNL=1), so every fallback is checked on this machine.
 *
 * Tolerances (bounds):
 * - f32: a K-term dot product errs by at most K * 2^-24 * sum_k |a_ik b_kj|
 *   (gamma_K), plus one rounding of beta*C and alpha; we allow (K+2) * 2^-24;
 * - bf16: the inputs are exact bf16 values, products are exact in f32 and
 *   accumulate in f32 (the same gamma_K term, doubled for the pairwise dot
 *   products of the bf16 instructions), then C is rounded once to bf16:
 *   2^-8 relative on top. */
#include "cpu_kernels.h"
#include "ref_basic.h"
#include "testutil.h"
#include <math.h>
#include <stdlib.h>
#include <string.h>

static test_rng rng;
static int nthreads;
/* what went through cpu_matmul_f32 / cpu_matmul_bf16 (FSDP_MATMUL_STATS must count it) */
static int64_t engine_calls;
static double engine_flop;

#define EPS_F32 (1.0 / 16777216.0)
#define RTOL_BF16 (1.0 / 256.0)

enum { PATH_BLAS, PATH_DNNL, PATH_ENGINE, PATH_BF16, PATH_COUNT };
static const char *path_names[] = {"OpenBLAS f32", "oneDNN f32", "engine f32", "engine bf16"};

static void *xmalloc(size_t n) {
    void *p = malloc(n ? n : 1);
    if (!p) { fprintf(stderr, "out of memory\n"); exit(1); }
    return p;
}

static void run(int path, const char *tag, int64_t batch, int64_t M, int64_t N, int64_t K, int ta, int tb,
                float alpha, float beta, int64_t sa, int64_t sb, int64_t sc) {
    int bf16 = path == PATH_BF16;
    int64_t na = (batch - 1) * sa + M * K, nb = (batch - 1) * sb + K * N, nc = (batch - 1) * sc + M * N;
    float *a = xmalloc(na * sizeof *a), *b = xmalloc(nb * sizeof *b), *c = xmalloc(nc * sizeof *c);
    uint16_t *a16 = xmalloc(na * 2), *b16 = xmalloc(nb * 2), *c16 = xmalloc(nc * 2);
    double *da = xmalloc(na * sizeof *da), *db = xmalloc(nb * sizeof *db), *dc = xmalloc(nc * sizeof *dc);
    double *bound = xmalloc(nc * sizeof *bound);
    test_fill_nonzero(&rng, a, na, 1.0f);
    test_fill_nonzero(&rng, b, nb, 1.0f);
    test_fill_nonzero(&rng, c, nc, 1.0f);
    if (bf16) {   /* exact bf16 inputs */
        cpu_cast_f32_to_bf16(a16, a, na); cpu_cast_bf16_to_f32(a, a16, na);
        cpu_cast_f32_to_bf16(b16, b, nb); cpu_cast_bf16_to_f32(b, b16, nb);
        cpu_cast_f32_to_bf16(c16, c, nc); cpu_cast_bf16_to_f32(c, c16, nc);
    }
    ref_to_double(dc, c, nc);
    if (beta == 0.0f) {   /* beta = 0 must overwrite, NaN included */
        for (int64_t i = 0; i < nc; i++) c[i] = NAN;
        for (int64_t i = 0; i < nc; i++) c16[i] = 0x7fc0;
    }
    ref_to_double(da, a, na);
    ref_to_double(db, b, nb);
    for (int64_t i = 0; i < na; i++) da[i] = fabs(da[i]);
    for (int64_t i = 0; i < nb; i++) db[i] = fabs(db[i]);
    for (int64_t i = 0; i < nc; i++) bound[i] = beta == 0.0f ? 0.0 : fabs(dc[i]);
    ref_matmul(bound, da, db, batch, M, N, K, ta, tb, fabs(alpha), fabs(beta), sa, sb, sc);
    ref_to_double(da, a, na);
    ref_to_double(db, b, nb);
    ref_matmul(dc, da, db, batch, M, N, K, ta, tb, alpha, beta, sa, sb, sc);
    for (int64_t i = 0; i < nc; i++)
        bound[i] = (double)(K + 2) * (bf16 ? 2 : 1) * EPS_F32 * bound[i] + (bf16 ? RTOL_BF16 * fabs(dc[i]) : 0);

    int rc = 0;
    switch (path) {
    case PATH_BLAS: cpu_matmul_f32_blas(c, a, b, batch, M, N, K, ta, tb, alpha, beta, sa, sb, sc); break;
    case PATH_DNNL: rc = cpu_matmul_dnnl(0, c, a, b, batch, M, N, K, ta, tb, alpha, beta, sa, sb, sc); break;
    case PATH_ENGINE: cpu_matmul_f32(c, a, b, batch, M, N, K, ta, tb, alpha, beta, sa, sb, sc); break;
    default:
        cpu_matmul_bf16(c16, a16, b16, batch, M, N, K, ta, tb, alpha, beta, sa, sb, sc);
        cpu_cast_bf16_to_f32(c, c16, nc);
    }
    if (path == PATH_ENGINE || path == PATH_BF16) {
        engine_calls++;
        engine_flop += 2.0 * batch * M * N * K;
    }
    int64_t wrong = 0;
    if (rc == 0)
        for (int64_t bi = 0; bi < batch; bi++)   /* only the batch's C blocks are defined */
            for (int64_t i = 0; i < M * N; i++) {
                int64_t j = bi * sc + i;
                double err = fabs((double)c[j] - dc[j]);
                if (!(err <= bound[j])) {
                    if (wrong < 3)
                        fprintf(stderr, "  %s %s b%lld [%lld]: got %.9g want %.9g bound %.3g\n", path_names[path], tag,
                                (long long)bi, (long long)i, (double)c[j], dc[j], bound[j]);
                    wrong++;
                }
            }
    test_check(rc == 0 && wrong == 0,
               "%s %s batch %lld M %lld N %lld K %lld ta %d tb %d alpha %g beta %g strides %lld %lld %lld "
               "[threads %d]: rc %d, %lld wrong",
               path_names[path], tag, (long long)batch, (long long)M, (long long)N, (long long)K, ta, tb,
               (double)alpha, (double)beta, (long long)sa, (long long)sb, (long long)sc, nthreads, rc,
               (long long)wrong);
    free(a); free(b); free(c); free(a16); free(b16); free(c16); free(da); free(db); free(dc); free(bound);
}

static void test_path(int path) {
    static const int64_t sizes[] = {1, 7, 31, 97};
    for (int t = 0; t < 4; t++) {
        int ta = t >> 1, tb = t & 1;
        for (int i = 0; i < 4; i++)
            for (int j = 0; j < 4; j++)
                for (int k = 0; k < 4; k++) {
                    int odd = (i + j + k) & 1;   /* alternate plain and alpha/beta */
                    run(path, "single", 1, sizes[i], sizes[j], sizes[k], ta, tb, odd ? 0.5f : 1.0f,
                        odd ? -0.75f : 0.0f, 0, 0, 0);
                }
    }
    static const int64_t shp[][3] = {{7, 13, 31}, {64, 97, 13}, {1, 31, 7}, {13, 1, 97}};
    for (int s = 0; s < 4; s++) {
        int64_t M = shp[s][0], N = shp[s][1], K = shp[s][2];
        for (int t = 0; t < 4; t++) {
            int ta = t >> 1, tb = t & 1;
            run(path, "batched", 3, M, N, K, ta, tb, 1.0f, 0.0f, M * K, K * N, M * N);
            run(path, "shared B", 5, M, N, K, ta, tb, 1.0f, 0.0f, M * K, 0, M * N);
            run(path, "shared B a/b", 3, M, N, K, ta, tb, 0.5f, 1.0f, M * K, 0, M * N);
            run(path, "shared A", 3, M, N, K, ta, tb, 1.0f, 0.0f, 0, K * N, M * N);
            run(path, "gaps", 3, M, N, K, ta, tb, 1.0f, 0.5f, M * K + 5, K * N + 3, M * N + 7);
        }
    }
    if (path != PATH_DNNL) {   /* oneDNN has no empty inner dimension; the callers handle K = 0 */
        run(path, "K=0", 2, 7, 13, 0, 0, 0, 1.0f, 0.5f, 0, 0, 7 * 13);
        run(path, "K=0 beta 0", 1, 7, 13, 0, 1, 1, 1.0f, 0.0f, 0, 0, 0);
    }
    /* GPT-2-like shapes, large enough to use every thread: attention scores
     * (batched, B^T), a head matmul (B^T) and a weight gradient (A^T) */
    run(path, "scores", 6, 64, 64, 64, 0, 1, 0.125f, 0.0f, 64 * 64, 64 * 64, 64 * 64);
    run(path, "head", 1, 64, 509, 768, 0, 1, 1.0f, 0.0f, 0, 0, 0);
    run(path, "weight grad", 1, 768, 96, 256, 1, 0, 1.0f, 1.0f, 0, 0, 0);
    /* a wide B read as stored (N >= 2560): oneDNN f32 reorders it first */
    for (int ta = 0; ta < 2; ta++) {
        run(path, "wide B", 1, 5, 2600, 37, ta, 0, 1.0f, 0.0f, 0, 0, 0);
        run(path, "wide B a/b", 1, 3, 3072, 61, ta, 0, 0.5f, 1.0f, 0, 0, 0);
        run(path, "wide B^T", 1, 5, 2600, 37, ta, 1, 1.0f, 0.0f, 0, 0, 0);
    }
    run(path, "wide B batched", 2, 3, 2600, 29, 0, 0, 1.0f, 0.0f, 3 * 29, 29 * 2600, 3 * 2600);
    /* a deep K (K >= 16384 and 16 x M, N): oneDNN f32 sums products over K chunks of 4096, the last
     * shorter (20011) or whole (16384); with beta, transposes or a batch it does not split */
    run(path, "deep K", 1, 3, 5, 20011, 0, 0, 0.5f, 0.0f, 0, 0, 0);
    run(path, "deep K whole chunks", 1, 7, 2, 16384, 0, 0, 1.0f, 0.0f, 0, 0, 0);
    run(path, "deep K beta", 1, 3, 5, 20011, 0, 0, 1.0f, -0.75f, 0, 0, 0);
    run(path, "deep K B^T", 1, 3, 5, 20011, 0, 1, 1.0f, 0.0f, 0, 0, 0);
    run(path, "deep K A^T", 1, 3, 5, 20011, 1, 0, 1.0f, 0.0f, 0, 0, 0);
}

int main(void) {
    test_rng_seed(&rng, 20261201);
    int have_dnnl = cpu_matmul_dnnl_available();
    printf("oneDNN: %s; bf16 matmul implementation: %s\n", have_dnnl ? "yes" : "no",
           cpu_matmul_dnnl_impl(1, 64, 64, 64));
    static const int thread_counts[] = {1, 3};
    for (int t = 0; t < 2; t++) {
        nthreads = thread_counts[t];
        cpu_threads_set(nthreads);
        for (int p = 0; p < PATH_COUNT; p++)
            if (p != PATH_DNNL || have_dnnl) test_path(p);
    }
    /* without oneDNN the direct call says so rather than computing anything */
    if (!have_dnnl) {
        float a = 1, b = 1, c = 5;
        test_check(cpu_matmul_dnnl(0, &c, &a, &b, 1, 1, 1, 1, 0, 0, 1, 0, 0, 0, 0) != 0 && c == 5,
                   "cpu_matmul_dnnl without oneDNN returns non-zero and leaves C alone");
    }
    /* FSDP_MATMUL_STATS=1 (its own ctest variant): every engine call counted once, with its FLOPs */
    int64_t calls;
    double flop, seconds;
    cpu_matmul_stats_totals(&calls, &flop, &seconds);
    const char *st = getenv("FSDP_MATMUL_STATS");
    if (st && atoi(st) > 0)
        test_check(calls == engine_calls && fabs(flop - engine_flop) <= 1e-9 * engine_flop && seconds > 0,
                   "FSDP_MATMUL_STATS counted %lld calls, %.0f FLOP, %.3g s (made: %lld calls, %.0f FLOP)",
                   (long long)calls, flop, seconds, (long long)engine_calls, engine_flop);
    else
        test_check(calls == 0 && flop == 0 && seconds == 0, "without FSDP_MATMUL_STATS nothing is counted");
    return test_summary();
}
