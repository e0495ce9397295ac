/* hash.c: XXH64, the 64-bit xxHash (as its specification defines it:
 * four 64-bit lanes over 32-byte stripes, a multiply-rotate round per
 * 8-byte word, an avalanche at the end), one-shot and streaming. Every
 * input bit reaches every output bit, unlike FNV over words; the digests
 * equal those of the reference xxhsum, so a checkpoint's files can be
 * checked with standard tools. Little-endian loads (the engine's hosts). */
#include "internal.h"

#include <stdlib.h>
#include <string.h>

#define P1 0x9E3779B185EBCA87ULL
#define P2 0xC2B2AE3D27D4EB4FULL
#define P3 0x165667B19E3779F9ULL
#define P4 0x85EBCA77C2B2AE63ULL
#define P5 0x27D4EB2F165667C5ULL

struct fsdp_hasher {
    uint64_t seed;
    uint64_t v[4];          /* the lanes */
    uint64_t total;         /* bytes so far */
    uint8_t buf[32];        /* a partial stripe */
    int nbuf;
};

static inline uint64_t rotl(uint64_t x, int r) { return (x << r) | (x >> (64 - r)); }
static inline uint64_t load64(const uint8_t *p) {
    uint64_t v;
    memcpy(&v, p, 8);
    return v;
}
static inline uint32_t load32(const uint8_t *p) {
    uint32_t v;
    memcpy(&v, p, 4);
    return v;
}

/* One 8-byte word into a lane. */
static inline uint64_t round64(uint64_t acc, uint64_t w) { return rotl(acc + w * P2, 31) * P1; }
static inline uint64_t merge(uint64_t h, uint64_t v) { return (h ^ round64(0, v)) * P1 + P4; }

static void lanes_init(uint64_t v[4], uint64_t seed) {
    v[0] = seed + P1 + P2;
    v[1] = seed + P2;
    v[2] = seed;
    v[3] = seed - P1;
}

/* Whole stripes of p[0, n), n a multiple of 32. */
static void stripes(uint64_t v[4], const uint8_t *p, size_t n) {
    uint64_t a = v[0], b = v[1], c = v[2], d = v[3];
    for (size_t i = 0; i < n; i += 32) {
        a = round64(a, load64(p + i));
        b = round64(b, load64(p + i + 8));
        c = round64(c, load64(p + i + 16));
        d = round64(d, load64(p + i + 24));
    }
    v[0] = a, v[1] = b, v[2] = c, v[3] = d;
}

/* The digest from the lanes (when total >= 32) and the tail of < 32 bytes. */
static uint64_t finish(const uint64_t v[4], uint64_t seed, uint64_t total, const uint8_t *tail, size_t n) {
    uint64_t h;
    if (total >= 32) {
        h = rotl(v[0], 1) + rotl(v[1], 7) + rotl(v[2], 12) + rotl(v[3], 18);
        for (int i = 0; i < 4; i++) h = merge(h, v[i]);
    } else {
        h = seed + P5;
    }
    h += total;
    size_t i = 0;
    for (; i + 8 <= n; i += 8) h = rotl(h ^ round64(0, load64(tail + i)), 27) * P1 + P4;
    if (i + 4 <= n) {
        h = rotl(h ^ ((uint64_t)load32(tail + i) * P1), 23) * P2 + P3;
        i += 4;
    }
    for (; i < n; i++) h = rotl(h ^ (tail[i] * P5), 11) * P1;
    h ^= h >> 33;
    h *= P2;
    h ^= h >> 29;
    h *= P3;
    h ^= h >> 32;
    return h;
}

fsdp_status fsdp_hash64(const void *data, int64_t n, uint64_t seed, uint64_t *out) {
    if (!out || n < 0 || (n > 0 && !data))
        return fsdp_set_error(FSDP_ERR_INVALID, "fsdp_hash64: bad arguments (%lld bytes at %p)", (long long)n, data);
    const uint8_t *p = data;
    uint64_t v[4];
    lanes_init(v, seed);
    size_t whole = (size_t)n & ~(size_t)31;
    stripes(v, p, whole);
    *out = finish(v, seed, (uint64_t)n, p + whole, (size_t)n - whole);
    return FSDP_OK;
}

fsdp_status fsdp_hasher_new(fsdp_hasher **out, uint64_t seed) {
    if (!out) return fsdp_set_error(FSDP_ERR_INVALID, "fsdp_hasher_new: out is NULL");
    fsdp_hasher *h = malloc(sizeof *h);
    if (!h) return fsdp_set_error(FSDP_ERR_OOM, "fsdp_hasher_new: out of memory");
    *out = h;
    return fsdp_hasher_reset(h, seed);
}

fsdp_status fsdp_hasher_reset(fsdp_hasher *h, uint64_t seed) {
    if (!h) return fsdp_set_error(FSDP_ERR_INVALID, "fsdp_hasher_reset: hasher is NULL");
    h->seed = seed;
    lanes_init(h->v, seed);
    h->total = 0;
    h->nbuf = 0;
    return FSDP_OK;
}

fsdp_status fsdp_hasher_update(fsdp_hasher *h, const void *data, int64_t n) {
    if (!h || n < 0 || (n > 0 && !data))
        return fsdp_set_error(FSDP_ERR_INVALID, "fsdp_hasher_update: bad arguments (%lld bytes at %p)", (long long)n,
                              data);
    const uint8_t *p = data;
    size_t left = (size_t)n;
    h->total += (uint64_t)n;
    if (h->nbuf > 0) {   /* complete the partial stripe first */
        size_t take = 32 - (size_t)h->nbuf < left ? 32 - (size_t)h->nbuf : left;
        memcpy(h->buf + h->nbuf, p, take);
        h->nbuf += (int)take;
        p += take;
        left -= take;
        if (h->nbuf < 32) return FSDP_OK;
        stripes(h->v, h->buf, 32);
        h->nbuf = 0;
    }
    size_t whole = left & ~(size_t)31;
    stripes(h->v, p, whole);
    memcpy(h->buf, p + whole, left - whole);
    h->nbuf = (int)(left - whole);
    return FSDP_OK;
}

fsdp_status fsdp_hasher_digest(fsdp_hasher *h, uint64_t *out) {
    if (!h || !out) return fsdp_set_error(FSDP_ERR_INVALID, "fsdp_hasher_digest: NULL argument");
    *out = finish(h->v, h->seed, h->total, h->buf, (size_t)h->nbuf);
    return FSDP_OK;
}

fsdp_status fsdp_hasher_free(fsdp_hasher *h) {
    free(h);
    return FSDP_OK;
}
