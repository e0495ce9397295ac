/* random.c: counter-based random numbers (Philox4x32-10, Salmon et al.,
 * "Parallel random numbers: as easy as 1, 2, 3", SC'11).
 * Element i of a buffer takes counter (offset + i), so its value depends only
 * on (seed, stream, offset + i): a rank initializing its shard [offset,
 * offset + n) of a parameter gets exactly that slice of the full tensor, and
 * any split over threads gives the same bits.
 * Words: key = (seed low, seed high), counter = (counter low, counter high,
 * stream low, stream high). */
#include "cpu_kernels.h"
#include <math.h>

#define PHILOX_M0 0xD2511F53u
#define PHILOX_M1 0xCD9E8D57u
#define PHILOX_W0 0x9E3779B9u   /* golden ratio */
#define PHILOX_W1 0xBB67AE85u   /* sqrt(3) - 1 */
#define RNG_GRAIN 4096
#define DROPOUT_STREAM 0xd50

static inline void philox_round(uint32_t c[4], uint32_t k0, uint32_t k1) {
    uint64_t p0 = (uint64_t)PHILOX_M0 * c[0], p1 = (uint64_t)PHILOX_M1 * c[2];
    uint32_t hi0 = (uint32_t)(p0 >> 32), lo0 = (uint32_t)p0;
    uint32_t hi1 = (uint32_t)(p1 >> 32), lo1 = (uint32_t)p1;
    uint32_t n0 = hi1 ^ c[1] ^ k0, n2 = hi0 ^ c[3] ^ k1;
    c[0] = n0; c[1] = lo1; c[2] = n2; c[3] = lo0;
}

/* The reference form, one counter at a time (checked against the Random123
 * known answers; the block form below is checked against it). */
void cpu_philox4x32(uint64_t seed, uint64_t stream, uint64_t counter, uint32_t out[4]) {
    uint32_t c[4] = {(uint32_t)counter, (uint32_t)(counter >> 32), (uint32_t)stream, (uint32_t)(stream >> 32)};
    uint32_t k0 = (uint32_t)seed, k1 = (uint32_t)(seed >> 32);
    for (int r = 0; r < 10; r++) {
        philox_round(c, k0, k1);
        k0 += PHILOX_W0;   /* the key bump after the last round is unused */
        k1 += PHILOX_W1;
    }
    out[0] = c[0]; out[1] = c[1]; out[2] = c[2]; out[3] = c[3];
}

/* u in [0, 1) from the top 24 bits: exactly representable in float. */
static inline float uniform24(uint32_t w) { return (float)(w >> 8) * (1.0f / 16777216.0f); }

/* Philox over BLOCK consecutive counters at once, lane by lane, so the
 * compiler vectorizes it; the scalar version is one long dependency chain of
 * 20 multiplies per element. Lanes are 64-bit words holding 32-bit values:
 * a 64-bit product then has the high and low halves the round needs, which
 * the vectorizer handles where it does not handle a 32x32->64 widening.
 * BLOCK is large enough that GCC does not fully unroll the lane loop (which
 * would leave it nothing to vectorize). */
#define BLOCK 64
typedef struct { uint32_t w0[BLOCK], w1[BLOCK]; } philox_words;   /* the two words we use */

static void philox_block(uint64_t seed, uint64_t stream, uint64_t counter, philox_words *out) {
    uint64_t c0[BLOCK], c1[BLOCK], c2[BLOCK], c3[BLOCK];
    for (int j = 0; j < BLOCK; j++) {
        uint64_t ctr = counter + (uint64_t)j;
        c0[j] = ctr & 0xffffffffu; c1[j] = ctr >> 32;
        c2[j] = stream & 0xffffffffu; c3[j] = stream >> 32;
    }
    uint64_t k0 = (uint32_t)seed, k1 = (uint32_t)(seed >> 32);
    for (int r = 0; r < 10; r++) {
        for (int j = 0; j < BLOCK; j++) {
            uint64_t p0 = PHILOX_M0 * c0[j], p1 = PHILOX_M1 * c2[j];   /* exact: both < 2^32 */
            uint64_t n0 = (p1 >> 32) ^ c1[j] ^ k0, n2 = (p0 >> 32) ^ c3[j] ^ k1;
            c1[j] = p1 & 0xffffffffu; c3[j] = p0 & 0xffffffffu;
            c0[j] = n0; c2[j] = n2;
        }
        k0 = (k0 + PHILOX_W0) & 0xffffffffu;
        k1 = (k1 + PHILOX_W1) & 0xffffffffu;
    }
    for (int j = 0; j < BLOCK; j++) { out->w0[j] = (uint32_t)c0[j]; out->w1[j] = (uint32_t)c1[j]; }
}

typedef struct {
    float *out;
    const float *x;
    float a, b;          /* normal: mean, std; uniform: low, high; dropout: p, 1/(1-p) */
    uint64_t seed, stream;
    int64_t offset;
} rng_ctx;

/* Walks [begin, end) in blocks of counters; element i always gets the words
 * of counter offset + i, whatever the block boundaries. */
#define FOR_BLOCKS(c, begin, end, stream, BODY)                                                 \
    for (int64_t i0 = begin; i0 < end; i0 += BLOCK) {                                            \
        philox_words w;                                                                          \
        philox_block((c)->seed, stream, (uint64_t)((c)->offset + i0), &w);                       \
        int len = end - i0 < BLOCK ? (int)(end - i0) : BLOCK;                                    \
        for (int j = 0; j < len; j++) { int64_t i = i0 + j; BODY; }                              \
    }

/* Box-Muller on the counter's first two words: u1 in (0, 1] keeps the log
 * finite (the tails reach 6.66 sigma), u2 in [0, 1). Float math: these are
 * initial weights, and logf/cosf are several times faster than log/cos. */
static void normal_range(void *p, int64_t begin, int64_t end) {
    rng_ctx *c = p;
    const float two_pi = 6.28318530717958647692f;
    FOR_BLOCKS(c, begin, end, c->stream, {
        float u1 = ((float)w.w0[j] + 1.0f) * (1.0f / 4294967296.0f);
        float u2 = uniform24(w.w1[j]);
        float z = sqrtf(-2.0f * logf(u1)) * cosf(two_pi * u2);
        c->out[i] = c->a + c->b * z;
    })
}

static void uniform_range(void *p, int64_t begin, int64_t end) {
    rng_ctx *c = p;
    float low = c->a, high = c->b, span = high - low;
    float below_high = nextafterf(high, low);
    FOR_BLOCKS(c, begin, end, c->stream, {
        float v = low + span * uniform24(w.w0[j]);
        c->out[i] = v < high || !(span > 0) ? v : below_high;   /* rounding may reach high */
    })
}

/* keep iff u >= p, so P(keep) = 1 - p up to the 2^-24 grid. */
static void dropout_range(void *p, int64_t begin, int64_t end) {
    rng_ctx *c = p;
    float prob = c->a, scale = c->b;
    FOR_BLOCKS(c, begin, end, DROPOUT_STREAM, {
        c->out[i] = uniform24(w.w0[j]) >= prob ? c->x[i] * scale : 0.0f;
    })
}

void cpu_init_normal_f32(float *out, int64_t n, float mean, float std, uint64_t seed, uint64_t stream, int64_t offset) {
    rng_ctx c = {.out = out, .a = mean, .b = std, .seed = seed, .stream = stream, .offset = offset};
    cpu_parallel_for(n, RNG_GRAIN, normal_range, &c);
}

void cpu_init_uniform_f32(float *out, int64_t n, float low, float high, uint64_t seed, uint64_t stream, int64_t offset) {
    rng_ctx c = {.out = out, .a = low, .b = high, .seed = seed, .stream = stream, .offset = offset};
    cpu_parallel_for(n, RNG_GRAIN, uniform_range, &c);
}

void cpu_dropout_f32(float *out, const float *x, int64_t n, float p, uint64_t seed, int64_t offset) {
    if (n <= 0) return;
    if (p <= 0.0f) {   /* identity: x * 1 is exact, parallel, and fine when out == x */
        cpu_scale_f32(out, x, 1.0f, n);
        return;
    }
    /* x * (1/(1-p)) rather than x / (1-p): a multiply, within 1 ulp of the division */
    rng_ctx c = {.out = out, .x = x, .a = p, .b = 1.0f / (1.0f - p), .seed = seed, .offset = offset};
    cpu_parallel_for(n, RNG_GRAIN, dropout_range, &c);
}
