/* cuda_emu.cpp: the host emulation of CUDA described in cuda_emu.h. */
#include "cuda_emu.h"
#include <map>
#include <stdio.h>
#include <stdlib.h>
#include <sys/mman.h>
#include <ucontext.h>
#include <unistd.h>
#include <vector>

/* ---- failures: a bug in the code under test, reported and fatal ---- */

[[noreturn]] static void emu_fail(const char *what) {
    fprintf(stderr, "cuda_emu: %s\n", what);
    fflush(stderr);
    abort();
}

static cudaError_t g_last = cudaSuccess;
static long long g_launches;
static int g_device_count = 1;
static const int g_sm_count = 2;   /* small, so grid-stride loops go round */

static cudaError_t set_error(cudaError_t e, const char *why) {
    fprintf(stderr, "cuda_emu: %s\n", why);
    if (g_last == cudaSuccess) g_last = e;
    return e;
}

extern "C" void emu_set_device_count(int n) { g_device_count = n; }
extern "C" int emu_device_count(void) { return g_device_count; }
extern "C" long long emu_launch_count(void) { return g_launches; }

/* ---- device memory: its own address range, guard pages, no reuse ---- */

static const size_t REGION = (size_t)1 << 36;   /* 64 GiB of address space, reserved only */
static char *g_region, *g_bump;
static size_t g_page;

struct emu_alloc {
    char *base;        /* first page */
    size_t pages;      /* accessible pages (a guard page follows) */
    size_t n;          /* bytes asked for */
    bool live;
};
static std::map<uintptr_t, emu_alloc> g_allocs;   /* by user pointer */

static void region_init(void) {
    if (g_region) return;
    g_page = (size_t)sysconf(_SC_PAGESIZE);
    void *r = mmap(NULL, REGION, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (r == MAP_FAILED) emu_fail("cannot reserve the device address range");
    g_region = g_bump = (char *)r;
}

static bool in_region(const void *p) {
    return g_region && (const char *)p >= g_region && (const char *)p < g_region + REGION;
}

/* The live allocation holding [p, p + n), or NULL. */
static const emu_alloc *find_alloc(const void *p, size_t n) {
    auto it = g_allocs.upper_bound((uintptr_t)p);
    if (it == g_allocs.begin()) return NULL;
    --it;
    const emu_alloc &a = it->second;
    uintptr_t start = it->first, end = start + a.n;
    if ((uintptr_t)p < start || (uintptr_t)p + n > end || !a.live) return NULL;
    return &a;
}

void emu_check_device_ptr(const void *p, const char *what) {
    if (!p || in_region(p)) return;
    char buf[256];
    snprintf(buf, sizeof buf, "%s %p is not device memory (a host pointer given to the GPU?)", what, p);
    emu_fail(buf);
}

static void check_range(const void *p, size_t n, const char *what) {
    if (n == 0) return;
    if (!find_alloc(p, n)) {
        char buf[256];
        snprintf(buf, sizeof buf, "%s: [%p, +%zu) is not inside one live device allocation", what, p, n);
        emu_fail(buf);
    }
}

cudaError_t cudaMalloc(void **p, size_t n) {
    region_init();
    if (!p) return cudaErrorInvalidValue;
    size_t user = (n + 15) & ~(size_t)15;
    size_t pages = (user + g_page - 1) / g_page;
    if (pages == 0) pages = 1;
    if ((size_t)(g_bump - g_region) + (pages + 1) * g_page > REGION) return cudaErrorMemoryAllocation;
    char *base = g_bump;
    g_bump += (pages + 1) * g_page;
    if (mprotect(base, pages * g_page, PROT_READ | PROT_WRITE) != 0) return cudaErrorMemoryAllocation;
    char *ptr = base + pages * g_page - user;   /* flush against the guard page */
    memset(ptr, 0xff, user);                    /* NaN floats: unwritten memory shows */
    g_allocs[(uintptr_t)ptr] = emu_alloc{base, pages, n, true};
    *p = ptr;
    return cudaSuccess;
}

cudaError_t cudaFree(void *p) {
    if (!p) return cudaSuccess;
    auto it = g_allocs.find((uintptr_t)p);
    if (it == g_allocs.end() || !it->second.live) return set_error(cudaErrorInvalidValue, "cudaFree of a pointer it did not allocate");
    it->second.live = false;
    madvise(it->second.base, it->second.pages * g_page, MADV_DONTNEED);
    mprotect(it->second.base, it->second.pages * g_page, PROT_NONE);   /* use after free faults */
    return cudaSuccess;
}

cudaError_t cudaMallocAsync(void **p, size_t n, cudaStream_t) { return cudaMalloc(p, n); }
cudaError_t cudaFreeAsync(void *p, cudaStream_t) { return cudaFree(p); }

cudaError_t cudaMemsetAsync(void *p, int v, size_t n, cudaStream_t) {
    check_range(p, n, "cudaMemsetAsync");
    memset(p, v, n);
    return cudaSuccess;
}

cudaError_t cudaMemcpyAsync(void *dst, const void *src, size_t n, cudaMemcpyKind kind, cudaStream_t) {
    if (n == 0) return cudaSuccess;
    bool dd = kind == cudaMemcpyDeviceToDevice || kind == cudaMemcpyHostToDevice;
    bool sd = kind == cudaMemcpyDeviceToDevice || kind == cudaMemcpyDeviceToHost;
    if (kind == cudaMemcpyHostToHost || kind == cudaMemcpyDefault)
        return set_error(cudaErrorInvalidValue, "cudaMemcpyAsync: the backend names its copy directions");
    if (dd) check_range(dst, n, "cudaMemcpyAsync destination");
    else if (in_region(dst)) emu_fail("cudaMemcpyAsync: a device destination for a copy to the host");
    if (sd) check_range(src, n, "cudaMemcpyAsync source");
    else if (in_region(src)) emu_fail("cudaMemcpyAsync: a device source for a copy from the host");
    memmove(dst, src, n);
    return cudaSuccess;
}

/* ---- devices, streams, attributes ---- */

static struct emu_stream_s { int dummy; } g_stream_obj;
static struct emu_pool_s { int dummy; } g_pool_obj;
static struct emu_cublas_s { int dummy; } g_cublas_obj;
static std::map<const void *, int> g_smem_allowed;

const char *cudaGetErrorString(cudaError_t e) {
    switch (e) {
    case cudaSuccess: return "no error";
    case cudaErrorInvalidValue: return "invalid argument";
    case cudaErrorMemoryAllocation: return "out of memory";
    case cudaErrorInvalidConfiguration: return "invalid configuration argument";
    case cudaErrorNoDevice: return "no CUDA-capable device is detected (emulated)";
    case cudaErrorInvalidDevice: return "invalid device ordinal";
    }
    return "unknown error";
}

cudaError_t cudaGetLastError(void) {
    cudaError_t e = g_last;
    g_last = cudaSuccess;
    return e;
}

cudaError_t cudaGetDeviceCount(int *n) {
    *n = 0;
    if (g_device_count <= 0) return cudaErrorNoDevice;
    *n = g_device_count;
    return cudaSuccess;
}

cudaError_t cudaSetDevice(int d) { return d >= 0 && d < g_device_count ? cudaSuccess : cudaErrorInvalidDevice; }

cudaError_t cudaGetDeviceProperties(cudaDeviceProp *p, int d) {
    if (d < 0 || d >= g_device_count) return cudaErrorInvalidDevice;
    memset(p, 0, sizeof *p);
    snprintf(p->name, sizeof p->name, "CUDA emulation on the host");
    p->multiProcessorCount = g_sm_count;
    p->totalGlobalMem = (size_t)1 << 34;
    return cudaSuccess;
}

cudaError_t cudaDeviceGetAttribute(int *v, cudaDeviceAttr a, int) {
    *v = a == cudaDevAttrMemoryPoolsSupported ? 1 : 0;
    return cudaSuccess;
}
cudaError_t cudaDeviceGetDefaultMemPool(cudaMemPool_t *p, int) {
    *p = &g_pool_obj;
    return cudaSuccess;
}
cudaError_t cudaMemPoolSetAttribute(cudaMemPool_t, cudaMemPoolAttr, void *) { return cudaSuccess; }
cudaError_t cudaStreamCreateWithFlags(cudaStream_t *s, unsigned) {
    *s = &g_stream_obj;
    return cudaSuccess;
}
cudaError_t cudaStreamSynchronize(cudaStream_t) { return cudaSuccess; }

cudaError_t cudaFuncSetAttribute(const void *fn, cudaFuncAttribute a, int v) {
    if (a != cudaFuncAttributeMaxDynamicSharedMemorySize) return cudaErrorInvalidValue;
    if (v < 0 || v > 227 * 1024) return set_error(cudaErrorInvalidValue, "dynamic shared memory above 227 KiB");
    g_smem_allowed[fn] = v;
    return cudaSuccess;
}

/* ---- fibers ---- */

enum { F_READY, F_BLOCK_WAIT, F_WARP_WAIT, F_DONE };
struct emu_fiber {
    ucontext_t ctx;
    char *stack;
    int state;
    uint3 idx;
};
static const size_t STACK = 256 * 1024;
static std::vector<emu_fiber> g_fibers;
static ucontext_t g_sched;
static int g_cur = -1;            /* the running fiber, -1 outside kernels */
static unsigned g_nt;             /* threads of the running block */
static dim3 g_block_dim, g_grid_dim;
static uint3 g_block_idx;
static const std::function<void()> *g_body;
static std::vector<char> g_smem;
static unsigned char g_xslot[1024][16];

static void fiber_main(void) {
    (*g_body)();
    g_fibers[g_cur].state = F_DONE;
}   /* returns to g_sched through uc_link */

static void need_kernel(const char *what) {
    if (g_cur < 0) {
        char buf[128];
        snprintf(buf, sizeof buf, "%s outside a kernel", what);
        emu_fail(buf);
    }
}

uint3 emu_thread_idx(void) {
    need_kernel("threadIdx");
    return g_fibers[g_cur].idx;
}
uint3 emu_block_idx(void) { return g_block_idx; }
dim3 emu_block_dim(void) { return g_block_dim; }
dim3 emu_grid_dim(void) { return g_grid_dim; }
void *emu_dyn_smem(void) { return g_smem.data(); }

static void wait_at(int kind) {
    emu_fiber &f = g_fibers[g_cur];
    f.state = kind;
    swapcontext(&f.ctx, &g_sched);
}

void __syncthreads(void) {
    need_kernel("__syncthreads");
    wait_at(F_BLOCK_WAIT);
}

void __syncwarp(unsigned mask) {
    need_kernel("__syncwarp");
    if (mask != 0xffffffffu) emu_fail("__syncwarp with a partial mask is not emulated");
    wait_at(F_WARP_WAIT);
}

void emu_shuffle(const void *mine, void *out, size_t size, int mode, int arg, unsigned mask) {
    need_kernel("a shuffle");
    if (mask != 0xffffffffu) emu_fail("shuffles with a partial mask are not emulated");
    int t = g_cur, lane = t & 31, base = t - lane;
    if ((unsigned)base + 32 > g_nt) emu_fail("a shuffle in a partial warp (threads per block not a multiple of 32)");
    if (size > sizeof g_xslot[0]) emu_fail("a shuffle of more than 16 bytes");
    memcpy(g_xslot[t], mine, size);
    wait_at(F_WARP_WAIT);
    int src = mode == EMU_SHFL_XOR ? (lane ^ arg) & 31 : mode == EMU_SHFL_DOWN ? (lane + arg > 31 ? lane : lane + arg)
                                                                               : arg & 31;
    memcpy(out, g_xslot[base + src], size);
    wait_at(F_WARP_WAIT);
}

static void run_block(void) {
    unsigned n = g_nt;
    if (g_fibers.size() < n) g_fibers.resize(n);
    for (unsigned t = 0; t < n; t++) {
        emu_fiber &f = g_fibers[t];
        if (!f.stack) {
            f.stack = (char *)malloc(STACK);
            if (!f.stack) emu_fail("out of host memory for fiber stacks");
        }
        getcontext(&f.ctx);
        f.ctx.uc_stack.ss_sp = f.stack;
        f.ctx.uc_stack.ss_size = STACK;
        f.ctx.uc_link = &g_sched;
        makecontext(&f.ctx, fiber_main, 0);
        f.state = F_READY;
        f.idx = uint3{t % g_block_dim.x, (t / g_block_dim.x) % g_block_dim.y, t / (g_block_dim.x * g_block_dim.y)};
    }
    for (;;) {
        for (unsigned t = 0; t < n; t++)
            if (g_fibers[t].state == F_READY) {
                g_cur = (int)t;
                swapcontext(&g_sched, &g_fibers[t].ctx);
                g_cur = -1;
            }
        unsigned done = 0, at_block = 0;
        for (unsigned t = 0; t < n; t++) {
            done += g_fibers[t].state == F_DONE;
            at_block += g_fibers[t].state == F_BLOCK_WAIT;
        }
        if (done == n) return;
        if (at_block > 0 && at_block + done == n) {
            if (done > 0) emu_fail("__syncthreads: some threads of the block exited while others wait at it");
            for (unsigned t = 0; t < n; t++) g_fibers[t].state = F_READY;
            continue;
        }
        bool released = false;
        for (unsigned w = 0; w * 32 < n; w++) {
            unsigned lo = w * 32, hi = lo + 32 < n ? lo + 32 : n, waiting = 0, wdone = 0;
            for (unsigned t = lo; t < hi; t++) {
                waiting += g_fibers[t].state == F_WARP_WAIT;
                wdone += g_fibers[t].state == F_DONE;
            }
            if (waiting == 0 || waiting + wdone < hi - lo) continue;
            if (wdone > 0) emu_fail("a warp barrier or shuffle: some lanes exited while others wait");
            for (unsigned t = lo; t < hi; t++) g_fibers[t].state = F_READY;
            released = true;
        }
        if (!released)
            emu_fail("deadlock: the threads of a block wait at different barriers (__syncthreads in divergent code, "
                     "or a shuffle not reached by the whole warp)");
    }
}

void emu_run(const emu_launch_cfg &c, const std::function<void()> &body) {
    g_launches++;
    unsigned long long nt = (unsigned long long)c.block.x * c.block.y * c.block.z;
    if (nt == 0 || nt > 1024 || c.block.x > 1024 || c.block.y > 1024 || c.block.z > 64) {
        set_error(cudaErrorInvalidConfiguration, "launch: bad block size");
        return;
    }
    if (c.grid.x == 0 || c.grid.y == 0 || c.grid.z == 0 || c.grid.x > 2147483647u || c.grid.y > 65535 ||
        c.grid.z > 65535) {
        set_error(cudaErrorInvalidConfiguration, "launch: bad grid size");
        return;
    }
    if (c.smem > 48 * 1024) {
        auto it = g_smem_allowed.find(c.fn);
        if (it == g_smem_allowed.end() || (size_t)it->second < c.smem) {
            set_error(cudaErrorInvalidValue, "launch: dynamic shared memory above 48 KiB without cudaFuncSetAttribute");
            return;
        }
    }
    if (g_cur >= 0) emu_fail("a launch from inside a kernel");
    g_smem.assign(c.smem ? c.smem : 1, (char)0xff);
    g_block_dim = c.block;
    g_grid_dim = c.grid;
    g_nt = (unsigned)nt;
    g_body = &body;
    for (unsigned z = 0; z < c.grid.z; z++)
        for (unsigned y = 0; y < c.grid.y; y++)
            for (unsigned x = 0; x < c.grid.x; x++) {
                g_block_idx = uint3{x, y, z};
                run_block();
            }
    g_body = NULL;
}

/* ---- cuBLAS: column-major, double accumulation ---- */

cublasStatus_t cublasCreate(cublasHandle_t *h) {
    *h = &g_cublas_obj;
    return CUBLAS_STATUS_SUCCESS;
}
cublasStatus_t cublasSetStream(cublasHandle_t h, cudaStream_t) {
    return h ? CUBLAS_STATUS_SUCCESS : CUBLAS_STATUS_NOT_INITIALIZED;
}
cublasStatus_t cublasSetMathMode(cublasHandle_t h, cublasMath_t) {
    return h ? CUBLAS_STATUS_SUCCESS : CUBLAS_STATUS_NOT_INITIALIZED;
}
const char *cublasGetStatusString(cublasStatus_t s) {
    switch (s) {
    case CUBLAS_STATUS_SUCCESS: return "CUBLAS_STATUS_SUCCESS";
    case CUBLAS_STATUS_NOT_INITIALIZED: return "CUBLAS_STATUS_NOT_INITIALIZED";
    case CUBLAS_STATUS_INVALID_VALUE: return "CUBLAS_STATUS_INVALID_VALUE";
    }
    return "CUBLAS_STATUS_UNKNOWN";
}

cublasStatus_t cublasSgemmStridedBatched(cublasHandle_t h, cublasOperation_t ta, cublasOperation_t tb, int m, int n,
                                         int k, const float *alpha, const float *A, int lda, long long sa,
                                         const float *B, int ldb, long long sb, const float *beta, float *C, int ldc,
                                         long long sc, int batch) {
    if (!h) return CUBLAS_STATUS_NOT_INITIALIZED;
    int rows_a = ta == CUBLAS_OP_N ? m : k, rows_b = tb == CUBLAS_OP_N ? k : n;
    if (m < 0 || n < 0 || k < 0 || batch < 0 || lda < (rows_a > 1 ? rows_a : 1) || ldb < (rows_b > 1 ? rows_b : 1) ||
        ldc < (m > 1 ? m : 1))
        return CUBLAS_STATUS_INVALID_VALUE;
    emu_check_device_ptr(A, "cublas A");
    emu_check_device_ptr(B, "cublas B");
    emu_check_device_ptr(C, "cublas C");
    for (int b = 0; b < batch; b++) {
        const float *Ab = A + b * sa, *Bb = B + b * sb;
        float *Cb = C + b * sc;
        for (int j = 0; j < n; j++)
            for (int i = 0; i < m; i++) {
                double acc = 0.0;
                for (int l = 0; l < k; l++) {
                    double a = ta == CUBLAS_OP_N ? Ab[i + (size_t)l * lda] : Ab[l + (size_t)i * lda];
                    double bb = tb == CUBLAS_OP_N ? Bb[l + (size_t)j * ldb] : Bb[j + (size_t)l * ldb];
                    acc += a * bb;
                }
                float *c = Cb + i + (size_t)j * ldc;
                *c = *beta == 0.0f ? (float)(*alpha * acc) : (float)(*alpha * acc + (double)*beta * *c);
            }
    }
    return CUBLAS_STATUS_SUCCESS;
}
