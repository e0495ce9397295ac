/* test_cuda_rng_host.c: the CUDA backend's random-number helpers
 * (cuda_internal.h, compiled here for the host, the same code the GPU runs)
 * against the CPU kernels of engine/cpu/random.c:
 *   Philox words:      equal to cpu_philox4x32's.
 *   uniform, dropout:  bit for bit.
 *   normal:            bit for bit except where glibc's logf or cosf are not
 *                      correctly rounded (the device's are): with glibc 2.36
 *                      on x86-64 about 0.8% of values, by at most 3 ulp.
 *                      Checked: at most 4 ulp, fewer than 2% (both printed).
 * Runs on any machine: it needs no GPU. So the GPU's parameter init and
 * dropout masks are the CPU's, which is what lets a model initialized on
 * either device start from the same values. */
#include "cpu_kernels.h"
#include "cuda_internal.h"
#include "testutil.h"
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static int64_t ulp_diff(float a, float b) {
    int32_t i, j;
    memcpy(&i, &a, sizeof i);
    memcpy(&j, &b, sizeof j);
    int64_t ki = i < 0 ? (int64_t)INT32_MIN - i : i, kj = j < 0 ? (int64_t)INT32_MIN - j : j;
    return llabs(ki - kj);
}

/* host versions of the GPU kernels' loops (random.cu) */
static void host_normal(float *out, int64_t n, float mean, float std, uint64_t seed, uint64_t stream, int64_t offset) {
    for (int64_t i = 0; i < n; i++) {
        uint32_t w0, w1;
        fsdp_philox2(seed, stream, (uint64_t)(offset + i), &w0, &w1);
        out[i] = fsdp_rng_normal(w0, w1, mean, std);
    }
}
static void host_uniform(float *out, int64_t n, float low, float high, uint64_t seed, uint64_t stream,
                         int64_t offset) {
    float span = high - low, below = nextafterf(high, low);
    for (int64_t i = 0; i < n; i++) {
        uint32_t w0, w1;
        fsdp_philox2(seed, stream, (uint64_t)(offset + i), &w0, &w1);
        out[i] = fsdp_rng_uniform(w0, low, span, high, below);
    }
}
static void host_dropout(float *out, const float *x, int64_t n, float p, uint64_t seed, int64_t offset) {
    float scale = 1.0f / (1.0f - p);
    for (int64_t i = 0; i < n; i++) {
        uint32_t w0, w1;
        fsdp_philox2(seed, FSDP_DROPOUT_STREAM, (uint64_t)(offset + i), &w0, &w1);
        out[i] = p <= 0.0f ? x[i] : fsdp_rng_dropout(w0, x[i], p, scale);
    }
}

int main(void) {
    const int64_t n = 1 << 20;
    float *want = malloc((size_t)n * sizeof(float)), *got = malloc((size_t)n * sizeof(float));
    float *x = malloc((size_t)n * sizeof(float));
    if (!want || !got || !x) return 1;
    test_rng rng;
    test_rng_seed(&rng, 7);
    test_fill_nonzero(&rng, x, n, 3.0f);

    /* Philox words, including counters and streams with high words set */
    uint64_t seeds[] = {0, 1, 0xfedcba9876543210ull}, streams[] = {0, 3, 0xffffffff00000001ull};
    uint64_t counters[] = {0, 1, 0xffffffffull, 0x100000000ull, 0xfffffffffffffffeull};
    int philox_wrong = 0;
    for (int a = 0; a < 3; a++)
        for (int b = 0; b < 3; b++)
            for (int c = 0; c < 5; c++) {
                uint32_t ref[4], w0, w1;
                cpu_philox4x32(seeds[a], streams[b], counters[c], ref);
                fsdp_philox2(seeds[a], streams[b], counters[c], &w0, &w1);
                philox_wrong += w0 != ref[0] || w1 != ref[1];
            }
    test_check(philox_wrong == 0, "philox: %d of 45 counters give other words than cpu_philox4x32", philox_wrong);

    struct { uint64_t seed, stream; int64_t offset; } cs[] = {
        {0, 0, 0}, {1234, 7, 5}, {0xfedcba9876543210ull, 0x100000007ull, ((int64_t)1 << 33) + 11}};
    int64_t normal_differ = 0, normal_total = 0, normal_max_ulp = 0;
    for (int k = 0; k < 3; k++) {
        uint64_t seed = cs[k].seed, stream = cs[k].stream;
        int64_t off = cs[k].offset;
        cpu_init_uniform_f32(want, n, -0.1f, 0.3f, seed, stream, off);
        host_uniform(got, n, -0.1f, 0.3f, seed, stream, off);
        test_check(memcmp(want, got, (size_t)n * sizeof(float)) == 0, "uniform case %d: not bit for bit", k);
        cpu_init_uniform_f32(want, n, -3.0f, 1e-3f, seed, stream, off);
        host_uniform(got, n, -3.0f, 1e-3f, seed, stream, off);
        test_check(memcmp(want, got, (size_t)n * sizeof(float)) == 0, "uniform (-3, 1e-3) case %d: not bit for bit", k);

        float means[] = {0.0f, 0.5f}, stds[] = {1.0f, 0.02f};
        for (int m = 0; m < 2; m++) {
            cpu_init_normal_f32(want, n, means[m], stds[m], seed, stream, off);
            host_normal(got, n, means[m], stds[m], seed, stream, off);
            for (int64_t i = 0; i < n; i++) {
                int64_t u = ulp_diff(want[i], got[i]);
                normal_differ += u != 0;
                if (u > normal_max_ulp) normal_max_ulp = u;
            }
            normal_total += n;
        }

        float ps[] = {0.0f, 0.1f, 0.5f, 0.999f};
        for (int p = 0; p < 4; p++) {
            cpu_dropout_f32(want, x, n, ps[p], seed, off);
            host_dropout(got, x, n, ps[p], seed, off);
            test_check(memcmp(want, got, (size_t)n * sizeof(float)) == 0, "dropout p %g case %d: not bit for bit",
                       ps[p], k);
        }
    }
    printf("normal: %lld of %lld values differ from the CPU's, by at most %lld ulp\n", (long long)normal_differ,
           (long long)normal_total, (long long)normal_max_ulp);
    test_check(normal_max_ulp <= 4, "normal: differs by %lld ulp (at most 4 expected)", (long long)normal_max_ulp);
    test_check(normal_differ * 50 < normal_total, "normal: %lld of %lld values differ (fewer than 2%% expected)",
               (long long)normal_differ, (long long)normal_total);
    free(want);
    free(got);
    free(x);
    return test_summary();
}
