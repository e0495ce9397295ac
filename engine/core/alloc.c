/* alloc.c: a caching allocator per device, with statistics per tag.
 *
 * Freed blocks go to a free list of their size class and are handed out
 * again for requests of the same class, so the steady state of a training
 * loop makes no system calls. Classes are 64-byte steps up to 4 KiB, then
 * four steps per power of two (at most 25% slack) for activations and
 * scratch, whose sizes vary and gain from reuse across sizes; parameters,
 * gradients and optimizer state (master and gradient shards, moments,
 * gathered units and flat gradients: a few sizes, repeated every step) get
 * 64 steps per power of two instead (under 1.6% slack). "current" counts blocks
 * in use, "reserved" blocks held from the system (in use + cached); the cap
 * bounds reserved, and the cache is emptied before a request is refused.
 * Each device has a backend table (raw alloc/free); the CUDA one plugs in
 * here. */
#include "internal.h"
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define N_COARSE 256               /* 64 small classes + 4 per power of two, 2^12 .. 2^60 */
#define FINE_STEPS 64
#define N_CLASSES (N_COARSE + FINE_STEPS * 49)

typedef struct free_block {
    void *ptr;
    int tag;                    /* reserved bytes stay with the tag that last held them */
    struct free_block *next;
} free_block;

typedef struct {
    pthread_mutex_t lock;
    const fsdp_device_kernels *backend;   /* raw alloc/free of the device, looked up on first use */
    int64_t current[FSDP_TAG_COUNT], peak[FSDP_TAG_COUNT], reserved[FSDP_TAG_COUNT];
    int64_t total_current, total_peak, total_reserved;
    int64_t cap;                /* 0 = none */
    free_block *free_lists[N_CLASSES];
} device_allocator;

static device_allocator allocators[FSDP_DEVICE_COUNT] = {
    [FSDP_DEVICE_CPU] = {.lock = PTHREAD_MUTEX_INITIALIZER},
    [FSDP_DEVICE_CUDA] = {.lock = PTHREAD_MUTEX_INITIALIZER},
    [FSDP_DEVICE_META] = {.lock = PTHREAD_MUTEX_INITIALIZER},
};

static _Thread_local int default_tag = FSDP_TAG_ACTIVATION;

/* Pinned host blocks (fsdp_alloc_pinned): their own free lists per device
 * whose host_alloc made them, counted with the CPU's blocks (its lock, its
 * statistics, its cap), so that statistics and plans see host memory whole. */
static free_block *pinned_lists[FSDP_DEVICE_COUNT][N_CLASSES];

int fsdp_default_tag(void) { return default_tag; }

/* Tags whose blocks persist or recur at a few exact sizes: rounded finely. */
static bool fine_tag(int tag) { return tag == FSDP_TAG_PARAM || tag == FSDP_TAG_GRAD || tag == FSDP_TAG_OPTIMIZER; }

/* Size class of n bytes for a tag and the rounded size it stands for. */
static int size_class(size_t n, int tag, size_t *rounded) {
    if (n == 0) n = 1;
    *rounded = n;
    if (n <= 4096) {
        size_t r = (n + 63) & ~(size_t)63;
        *rounded = r;
        return (int)(r / 64) - 1;           /* 0 .. 63 */
    }
    int lg = 63 - __builtin_clzll((unsigned long long)(n - 1));  /* 2^lg < n <= 2^(lg+1) */
    if (lg > 60) return N_CLASSES;          /* beyond any size */
    int steps = fine_tag(tag) ? FINE_STEPS : 4;
    size_t base = (size_t)1 << lg, step = base / (size_t)steps;
    size_t sub = (n - base + step - 1) / step;                  /* 1 .. steps */
    *rounded = base + sub * step;
    if (steps == 4) return lg < 60 ? 64 + (lg - 12) * 4 + (int)(sub - 1) : N_CLASSES;
    return N_COARSE + (lg - 12) * FINE_STEPS + (int)(sub - 1);
}

static void format_bytes(int64_t n, char *buf, size_t size) {
    const char *units[] = {"B", "KiB", "MiB", "GiB", "TiB"};
    double v = (double)n;
    int u = 0;
    while (v >= 1024 && u < 4) { v /= 1024; u++; }
    if (u == 0) snprintf(buf, size, "%lld B", (long long)n);
    else snprintf(buf, size, "%.2f %s", v, units[u]);
}

static void release_cache_locked(device_allocator *a) {
    if (a == &allocators[FSDP_DEVICE_CPU]) {   /* the pinned blocks are host blocks too */
        for (int d = 0; d < FSDP_DEVICE_COUNT; d++) {
            const fsdp_device_kernels *k = device_kernels(d);
            for (int c = 0; c < N_CLASSES; c++) {
                free_block *b = pinned_lists[d][c];
                while (b) {
                    free_block *next = b->next;
                    if (k && k->host_free) k->host_free(b->ptr);
                    free(b);
                    b = next;
                }
                pinned_lists[d][c] = NULL;
            }
        }
    }
    for (int c = 0; c < N_CLASSES; c++) {
        free_block *b = a->free_lists[c];
        while (b) {
            free_block *next = b->next;
            a->backend->raw_free(b->ptr);
            free(b);
            b = next;
        }
        a->free_lists[c] = NULL;
    }
    /* after emptying, reserved equals current */
    for (int t = 0; t < FSDP_TAG_COUNT; t++) a->reserved[t] = a->current[t];
    a->total_reserved = a->total_current;
}

static bool valid_device(int device) { return device >= 0 && device < FSDP_DEVICE_COUNT; }

/* Under the lock: a cached block of class c for tag, or NULL (its reserved
 * bytes move from the tag that cached it to this one). */
static void *take_cached_locked(device_allocator *a, free_block **lists, int c, int tag, size_t rounded) {
    free_block *b = lists[c];
    if (!b) return NULL;
    lists[c] = b->next;
    void *ptr = b->ptr;
    a->reserved[b->tag] -= (int64_t)rounded;
    a->reserved[tag] += (int64_t)rounded;
    free(b);
    return ptr;
}

/* Under the lock: a block handed out, counted (fresh: newly reserved too). */
static void count_taken_locked(device_allocator *a, int tag, size_t rounded, bool fresh) {
    if (fresh) {
        a->reserved[tag] += (int64_t)rounded;
        a->total_reserved += (int64_t)rounded;
    }
    a->current[tag] += (int64_t)rounded;
    if (a->current[tag] > a->peak[tag]) a->peak[tag] = a->current[tag];
    a->total_current += (int64_t)rounded;
    if (a->total_current > a->total_peak) a->total_peak = a->total_current;
}

/* A block given back: cached in lists[class], or, with no room to cache it,
 * released by raw_free (NULL: nothing to call). */
static void give_back(device_allocator *a, free_block **lists, int tag, void *ptr, size_t nbytes,
                      void (*raw_free)(void *)) {
    size_t rounded;
    int c = size_class(nbytes, tag, &rounded);
    free_block *b = malloc(sizeof *b);
    pthread_mutex_lock(&a->lock);
    a->current[tag] -= (int64_t)rounded;
    a->total_current -= (int64_t)rounded;
    if (b) {
        b->ptr = ptr;
        b->tag = tag;
        b->next = lists[c];
        lists[c] = b;
    } else {
        if (raw_free) raw_free(ptr);
        a->reserved[tag] -= (int64_t)rounded;
        a->total_reserved -= (int64_t)rounded;
    }
    pthread_mutex_unlock(&a->lock);
}

fsdp_status fsdp_alloc(int device, int tag, size_t nbytes, void **out) {
    if (!valid_device(device)) return fsdp_set_error(FSDP_ERR_DEVICE, "alloc: no device %d", device);
    if (tag < 0 || tag >= FSDP_TAG_COUNT) return fsdp_set_error(FSDP_ERR_INVALID, "alloc: unknown tag %d", tag);
    device_allocator *a = &allocators[device];
    if (!a->backend) a->backend = device_kernels(device);
    if (!a->backend)
        return fsdp_set_error(FSDP_ERR_DEVICE, "alloc: device %s is not built into this engine, or has no hardware",
                              fsdp_device_name(device));
    size_t rounded;
    int c = size_class(nbytes, tag, &rounded);
    if (c >= N_CLASSES) return fsdp_set_error(FSDP_ERR_OOM, "alloc: %zu bytes is beyond any size", nbytes);
    pthread_mutex_lock(&a->lock);
    void *ptr = take_cached_locked(a, a->free_lists, c, tag, rounded);
    bool fresh = !ptr;
    if (fresh) {
        if (a->cap > 0 && a->total_reserved + (int64_t)rounded > a->cap) release_cache_locked(a);
        if (a->cap > 0 && a->total_reserved + (int64_t)rounded > a->cap) {
            char req[32], cap[32], used[32];
            format_bytes((int64_t)nbytes, req, sizeof req);
            format_bytes(a->cap, cap, sizeof cap);
            format_bytes(a->total_current, used, sizeof used);
            pthread_mutex_unlock(&a->lock);
            return fsdp_set_error(FSDP_ERR_OOM,
                                  "out of memory: allocating %s (tag %s) on %s would exceed the cap of %s "
                                  "(%s already in use)",
                                  req, fsdp_tag_name(tag), fsdp_device_name(device), cap, used);
        }
        ptr = a->backend->raw_alloc(rounded);
        if (!ptr) {
            release_cache_locked(a);
            ptr = a->backend->raw_alloc(rounded);
        }
        if (!ptr) {
            char req[32], used[32];
            format_bytes((int64_t)nbytes, req, sizeof req);
            format_bytes(a->total_current, used, sizeof used);
            pthread_mutex_unlock(&a->lock);
            return fsdp_set_error(FSDP_ERR_OOM, "out of memory: the system refused %s (tag %s) on %s (%s in use)",
                                  req, fsdp_tag_name(tag), fsdp_device_name(device), used);
        }
    }
    count_taken_locked(a, tag, rounded, fresh);
    pthread_mutex_unlock(&a->lock);
    *out = ptr;
    return FSDP_OK;
}

void fsdp_free(int device, int tag, void *ptr, size_t nbytes) {
    if (!ptr || !valid_device(device)) return;
    device_allocator *a = &allocators[device];
    give_back(a, a->free_lists, tag, ptr, nbytes, a->backend ? a->backend->raw_free : NULL);
}

fsdp_status fsdp_alloc_pinned(int accel, int tag, size_t nbytes, void **out) {
    if (!valid_device(accel)) return fsdp_set_error(FSDP_ERR_DEVICE, "alloc_pinned: no device %d", accel);
    if (tag < 0 || tag >= FSDP_TAG_COUNT) return fsdp_set_error(FSDP_ERR_INVALID, "alloc_pinned: unknown tag %d", tag);
    const fsdp_device_kernels *k = device_kernels(accel);
    if (!k || !k->host_alloc)
        return fsdp_set_error(FSDP_ERR_UNSUPPORTED, "alloc_pinned: device %s has no pinned host memory",
                              fsdp_device_name(accel));
    device_allocator *a = &allocators[FSDP_DEVICE_CPU];
    size_t rounded;
    int c = size_class(nbytes, tag, &rounded);
    if (c >= N_CLASSES) return fsdp_set_error(FSDP_ERR_OOM, "alloc_pinned: %zu bytes is beyond any size", nbytes);
    pthread_mutex_lock(&a->lock);
    void *ptr = take_cached_locked(a, pinned_lists[accel], c, tag, rounded);
    bool fresh = !ptr;
    if (fresh) {
        if (a->cap > 0 && a->total_reserved + (int64_t)rounded > a->cap) {
            char req[32], cap[32];
            format_bytes((int64_t)nbytes, req, sizeof req);
            format_bytes(a->cap, cap, sizeof cap);
            pthread_mutex_unlock(&a->lock);
            return fsdp_set_error(FSDP_ERR_OOM, "out of memory: pinned host memory of %s (tag %s) for %s would "
                                  "exceed the host's cap of %s", req, fsdp_tag_name(tag), fsdp_device_name(accel), cap);
        }
        ptr = k->host_alloc(rounded);
        if (!ptr) {
            char req[32];
            format_bytes((int64_t)nbytes, req, sizeof req);
            pthread_mutex_unlock(&a->lock);
            return fsdp_set_error(FSDP_ERR_OOM, "out of memory: %s refused %s of pinned host memory (tag %s)",
                                  fsdp_device_name(accel), req, fsdp_tag_name(tag));
        }
    }
    count_taken_locked(a, tag, rounded, fresh);
    pthread_mutex_unlock(&a->lock);
    *out = ptr;
    return FSDP_OK;
}

void fsdp_free_pinned(int accel, int tag, void *ptr, size_t nbytes) {
    if (!ptr || !valid_device(accel)) return;
    const fsdp_device_kernels *k = device_kernels(accel);
    give_back(&allocators[FSDP_DEVICE_CPU], pinned_lists[accel], tag, ptr, nbytes, k ? k->host_free : NULL);
}

fsdp_status fsdp_mem_stats(fsdp_device device, fsdp_tag tag, int64_t *current, int64_t *peak, int64_t *reserved) {
    if (!valid_device(device)) return fsdp_set_error(FSDP_ERR_DEVICE, "fsdp_mem_stats: no device %d", device);
    if (tag < -1 || tag >= FSDP_TAG_COUNT)
        return fsdp_set_error(FSDP_ERR_INVALID, "fsdp_mem_stats: unknown tag %d (expected -1 .. %d)", tag,
                              FSDP_TAG_COUNT - 1);
    device_allocator *a = &allocators[device];
    pthread_mutex_lock(&a->lock);
    if (current) *current = tag < 0 ? a->total_current : a->current[tag];
    if (peak) *peak = tag < 0 ? a->total_peak : a->peak[tag];
    if (reserved) *reserved = tag < 0 ? a->total_reserved : a->reserved[tag];
    pthread_mutex_unlock(&a->lock);
    return FSDP_OK;
}

fsdp_status fsdp_mem_reset_peak(fsdp_device device) {
    if (!valid_device(device)) return fsdp_set_error(FSDP_ERR_DEVICE, "fsdp_mem_reset_peak: no device %d", device);
    device_allocator *a = &allocators[device];
    pthread_mutex_lock(&a->lock);
    for (int t = 0; t < FSDP_TAG_COUNT; t++) a->peak[t] = a->current[t];
    a->total_peak = a->total_current;
    pthread_mutex_unlock(&a->lock);
    return FSDP_OK;
}

fsdp_status fsdp_mem_set_cap(fsdp_device device, int64_t cap_bytes) {
    if (!valid_device(device)) return fsdp_set_error(FSDP_ERR_DEVICE, "fsdp_mem_set_cap: no device %d", device);
    if (cap_bytes < 0)
        return fsdp_set_error(FSDP_ERR_INVALID, "fsdp_mem_set_cap: cap %lld is negative (0 means no cap)",
                              (long long)cap_bytes);
    device_allocator *a = &allocators[device];
    pthread_mutex_lock(&a->lock);
    a->cap = cap_bytes;
    if (cap_bytes > 0 && a->total_reserved > cap_bytes) release_cache_locked(a);
    pthread_mutex_unlock(&a->lock);
    return FSDP_OK;
}

fsdp_status fsdp_mem_get_cap(fsdp_device device, int64_t *cap_bytes) {
    if (!valid_device(device)) return fsdp_set_error(FSDP_ERR_DEVICE, "fsdp_mem_get_cap: no device %d", device);
    if (!cap_bytes) return fsdp_set_error(FSDP_ERR_INVALID, "fsdp_mem_get_cap: out is NULL");
    *cap_bytes = allocators[device].cap;
    return FSDP_OK;
}

fsdp_status fsdp_mem_empty_cache(fsdp_device device) {
    if (!valid_device(device)) return fsdp_set_error(FSDP_ERR_DEVICE, "fsdp_mem_empty_cache: no device %d", device);
    device_allocator *a = &allocators[device];
    if (!a->backend) return FSDP_OK;
    pthread_mutex_lock(&a->lock);
    release_cache_locked(a);
    pthread_mutex_unlock(&a->lock);
    return FSDP_OK;
}

fsdp_status fsdp_mem_set_default_tag(fsdp_tag tag, int *previous) {
    if (tag < 0 || tag >= FSDP_TAG_COUNT)
        return fsdp_set_error(FSDP_ERR_INVALID, "fsdp_mem_set_default_tag: unknown tag %d", tag);
    if (previous) *previous = default_tag;
    default_tag = tag;
    return FSDP_OK;
}
