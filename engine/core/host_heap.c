/* host_heap.c: the CPU's raw blocks in memory that the other ranks of the
 * host can read (the one-host collectives, comm_shm.c).
 *
 * The memory is this rank's segment of an MPI shared-memory window
 * (MPI_Win_allocate_shared over the ranks of the host, made by comm_shm.c
 * and handed here whole: host_heap_adopt). MPI reserves it at its full size;
 * pages come as they are touched, as in ordinary memory. The caching
 * allocator (alloc.c) takes its CPU blocks from here while the heap is on;
 * a peer reads a rank's buffers where they lie. Only this process writes
 * into its segment.
 *
 * Layout: the first HOST_HEAP_CONTROL bytes are the owner's control area
 * (a header and the mailboxes of comm_shm.c), then blocks. A block is a
 * 64-byte header (its size) and the data after it, 64-byte aligned. Freed
 * blocks go to a sorted list of free ranges, merged with their neighbours,
 * and the whole pages inside a freed range go back to the system
 * (madvise's MADV_REMOVE), as free() would return them. The caching
 * allocator frees raw blocks only when it empties its cache, so none of
 * this is on a step's path. A full heap is not an error: the request goes
 * to aligned_alloc and that block is private (its collectives go through
 * MPI). Once the window is gone (host_heap_disown, at finalize) the heap
 * hands out nothing and ignores frees of its old blocks. */
#include "internal.h"
#include <errno.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#define BLOCK_HEADER 64
#define BLOCK_MAGIC 0x6b6f6c62u   /* "blok" */

typedef struct { uint64_t off, len; } heap_range;

static pthread_mutex_t g_mu = PTHREAD_MUTEX_INITIALIZER;
static char *g_base;          /* NULL: never on */
static bool g_on;             /* false once disowned */
static uint64_t g_size;       /* reserved bytes, control area included */
static uint64_t g_top;        /* first never-used byte */
static heap_range *g_free;    /* sorted by offset, no two touching */
static int g_n_free, g_cap_free;
static long g_page;

static uint64_t round_up(uint64_t n, uint64_t a) { return (n + a - 1) / a * a; }

fsdp_status host_heap_adopt(void *base, uint64_t size) {
    pthread_mutex_lock(&g_mu);
    if (g_base) {
        pthread_mutex_unlock(&g_mu);
        return fsdp_set_error(FSDP_ERR_STATE, "host heap: adopted once already");
    }
    g_page = sysconf(_SC_PAGESIZE);
    if (g_page <= 0) g_page = 4096;
    /* whole pages only: what MADV_REMOVE gives back must be the heap's alone */
    uintptr_t a = (uintptr_t)base, pg = (uintptr_t)g_page, b = (a + pg - 1) / pg * pg;
    size = size > (uint64_t)(b - a) ? (size - (uint64_t)(b - a)) / pg * pg : 0;
    base = (void *)b;
    if (size <= HOST_HEAP_CONTROL) {
        pthread_mutex_unlock(&g_mu);
        return fsdp_set_error(FSDP_ERR_INVALID, "host heap: %llu whole pages' bytes at %p: expected more than %llu", (unsigned long long)size, base,
                              (unsigned long long)HOST_HEAP_CONTROL);
    }
    g_base = base;
    g_size = size;
    g_top = HOST_HEAP_CONTROL;
    g_on = true;
    host_heap_header *h = (host_heap_header *)(void *)g_base;
    h->magic = HOST_HEAP_MAGIC;
    h->pid = (int64_t)getpid();
    h->size = size;
    pthread_mutex_unlock(&g_mu);
    return FSDP_OK;
}

void host_heap_disown(void) {
    pthread_mutex_lock(&g_mu);
    g_on = false;
    pthread_mutex_unlock(&g_mu);
}

bool host_heap_on(void) {
    pthread_mutex_lock(&g_mu);
    bool on = g_on;
    pthread_mutex_unlock(&g_mu);
    return on;
}

/* Inserts r into the sorted free list, merged with touching neighbours;
 * returns the merged range. false: no memory for the list (r is lost to
 * the heap, not to correctness). */
static bool free_insert(heap_range r, heap_range *merged) {
    int i = 0;
    while (i < g_n_free && g_free[i].off < r.off) i++;
    bool with_prev = i > 0 && g_free[i - 1].off + g_free[i - 1].len == r.off;
    bool with_next = i < g_n_free && r.off + r.len == g_free[i].off;
    if (with_prev && with_next) {
        g_free[i - 1].len += r.len + g_free[i].len;
        memmove(g_free + i, g_free + i + 1, (size_t)(g_n_free - i - 1) * sizeof *g_free);
        g_n_free--;
        *merged = g_free[i - 1];
        return true;
    }
    if (with_prev) {
        g_free[i - 1].len += r.len;
        *merged = g_free[i - 1];
        return true;
    }
    if (with_next) {
        g_free[i].off = r.off;
        g_free[i].len += r.len;
        *merged = g_free[i];
        return true;
    }
    if (g_n_free == g_cap_free) {
        int cap = g_cap_free ? 2 * g_cap_free : 64;
        heap_range *n = realloc(g_free, (size_t)cap * sizeof *n);
        if (!n) return false;
        g_free = n;
        g_cap_free = cap;
    }
    memmove(g_free + i + 1, g_free + i, (size_t)(g_n_free - i) * sizeof *g_free);
    g_free[i] = r;
    g_n_free++;
    *merged = r;
    return true;
}

void *host_heap_alloc(size_t nbytes) {
    uint64_t need = round_up((uint64_t)nbytes + BLOCK_HEADER, 64);
    pthread_mutex_lock(&g_mu);
    if (!g_on) {
        pthread_mutex_unlock(&g_mu);
        return NULL;
    }
    uint64_t off = UINT64_MAX;
    for (int i = 0; i < g_n_free; i++) {   /* first fit */
        if (g_free[i].len < need) continue;
        off = g_free[i].off;
        g_free[i].off += need;
        g_free[i].len -= need;
        if (g_free[i].len == 0) {
            memmove(g_free + i, g_free + i + 1, (size_t)(g_n_free - i - 1) * sizeof *g_free);
            g_n_free--;
        }
        break;
    }
    if (off == UINT64_MAX) {
        if (g_size - g_top < need) {
            pthread_mutex_unlock(&g_mu);
            return NULL;   /* full: the caller takes private memory */
        }
        off = g_top;
        g_top += need;
    }
    uint64_t *h = (uint64_t *)(g_base + off);
    h[0] = BLOCK_MAGIC;
    h[1] = need;
    pthread_mutex_unlock(&g_mu);
    return g_base + off + BLOCK_HEADER;
}

bool host_heap_free(void *ptr) {
    pthread_mutex_lock(&g_mu);
    char *p = ptr;
    if (!g_base || p < g_base + HOST_HEAP_CONTROL + BLOCK_HEADER || p >= g_base + g_top) {
        pthread_mutex_unlock(&g_mu);
        return false;
    }
    if (!g_on) {   /* the window is gone, and the block with it */
        pthread_mutex_unlock(&g_mu);
        return true;
    }
    uint64_t off = (uint64_t)(p - g_base) - BLOCK_HEADER;
    uint64_t *h = (uint64_t *)(g_base + off);
    uint64_t len = h[1];
    if (h[0] != BLOCK_MAGIC || len < BLOCK_HEADER || off + len > g_top) {
        pthread_mutex_unlock(&g_mu);
        return true;   /* not a block this heap handed out: leave it rather than corrupt the lists */
    }
    h[0] = 0;
    heap_range merged;
    if (free_insert((heap_range){off, len}, &merged)) {
        /* give back the whole pages of the merged range that overlap this block */
        uint64_t pg = (uint64_t)g_page;
        uint64_t lo = round_up(merged.off, pg), hi = (merged.off + merged.len) / pg * pg;
        uint64_t blo = off / pg * pg, bhi = round_up(off + len, pg);
        if (lo < blo) lo = blo;
        if (hi > bhi) hi = bhi;
        if (hi > lo) (void)madvise(g_base + lo, hi - lo, MADV_REMOVE);
    }
    pthread_mutex_unlock(&g_mu);
    return true;
}

bool host_heap_locate(const void *ptr, uint64_t nbytes, int64_t *off) {
    const char *p = ptr;
    pthread_mutex_lock(&g_mu);
    bool in = g_on && p >= g_base + HOST_HEAP_CONTROL && p <= g_base + g_top &&
              nbytes <= (uint64_t)(g_base + g_top - p);
    if (in) *off = (int64_t)(p - g_base);
    pthread_mutex_unlock(&g_mu);
    return in;
}
