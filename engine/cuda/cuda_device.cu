/* cuda_device.cu: the CUDA kernel table, device memory, the compute stream,
 * the one error path, and start-up (cuda_backend_init).
 *
 * raw_alloc/raw_free are plain cudaMalloc/cudaFree: the engine's caching
 * allocator (engine/core/alloc.c) keeps freed blocks and reuses them, which
 * is safe without waiting for the GPU because all kernels run in order on
 * one compute stream (see cuda_internal.h). */
#include "cuda_internal.h"
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static int g_device = -1;             /* the ordinal this process uses */
static int g_sm_count = 1;
static size_t g_total_mem;
static char g_name[256];
static cudaStream_t g_stream;
static cublasHandle_t g_cublas;
static int g_pools;                   /* cudaMallocAsync available */
static char g_reason[512] = "not initialized: fsdp_runtime_init has not run";
static __thread int t_entered;        /* this thread has selected g_device */
static __thread const char *t_op;     /* the table entry this thread is in */

static pthread_mutex_t g_fail_lock = PTHREAD_MUTEX_INITIALIZER;
static fsdp_status g_sticky = FSDP_OK;
static char g_sticky_msg[1024];

cudaStream_t cuda_stream(void) { return g_stream; }
cublasHandle_t cuda_cublas(void) { return g_cublas; }
int cuda_sm_count(void) { return g_sm_count; }

extern "C" cudaStream_t cuda_compute_stream(void) { return g_stream; }
extern "C" int cuda_device_ordinal(void) { return g_device; }

void cuda_enter_thread(const char *op) {
    t_op = op;
    if (t_entered) return;
    CUDA_CHECK(cudaSetDevice(g_device));
    t_entered = 1;
}

void cuda_fail(const char *op, const char *file, int line, const char *call, const char *msg) {
    /* the table entry (cuda_matmul_f32 -> matmul_f32), and the function that failed when it is another */
    const char *entry = t_op ? t_op : op;
    if (strncmp(entry, "cuda_", 5) == 0) entry += 5;
    char where[160] = "";
    if (t_op && strcmp(t_op, op) != 0) snprintf(where, sizeof where, " (in %s)", op);
    char buf[1024];
    snprintf(buf, sizeof buf, "fatal CUDA error on cuda:%d (%s), op %s%s: %s:%d: %s failed: %s", g_device,
             g_name[0] ? g_name : "?", entry, where, file, line, call, msg);
    pthread_mutex_lock(&g_fail_lock);
    if (g_sticky == FSDP_OK) {
        g_sticky = FSDP_ERR_DEVICE;
        snprintf(g_sticky_msg, sizeof g_sticky_msg, "%s", buf);
    }
    pthread_mutex_unlock(&g_fail_lock);
    int rank = 0, world = 1;
    fsdp_runtime_rank(&rank, &world);
    fprintf(stderr,
            "fsdp-lua (rank %d): %s\n(kernels run asynchronously, so a fault may come from an earlier op; "
            "CUDA_LAUNCH_BLOCKING=1 reports it where it happens)\n",
            rank, buf);
    fflush(stderr);
    fflush(stdout);
    if (world > 1) fsdp_runtime_abort(NULL, 134);   /* MPI_Abort: the whole job ends */
    abort();
}

extern "C" fsdp_status cuda_last_status(void) {
    pthread_mutex_lock(&g_fail_lock);
    fsdp_status st = g_sticky;
    if (st != FSDP_OK) fsdp_set_error(st, "%s", g_sticky_msg);
    pthread_mutex_unlock(&g_fail_lock);
    return st;
}

/* ---- memory ---- */

/* Temporaries (reductions' partials, counters) come from a small cache of
 * their own, so that a step in the steady state allocates nothing: a block
 * freed goes back to the cache and is handed out again to a later request
 * of its size class (powers of two from 256 bytes). That is safe without
 * waiting, because every user of a temporary is a kernel on the compute
 * stream, which runs them in order. Only when the cache is full does a
 * block go back to CUDA (cudaFreeAsync with pools; else cudaFree, which
 * waits for the whole device). Not counted by the engine allocator's
 * statistics (fsdp.memory), as cuBLASLt's workspace is not. */
enum { TMP_SLOTS = 64 };
typedef struct {
    void *ptr;
    size_t bytes;   /* the class's size */
    bool in_use;
} tmp_block;
static tmp_block g_tmp[TMP_SLOTS];
static pthread_mutex_t g_tmp_lock = PTHREAD_MUTEX_INITIALIZER;

static size_t tmp_class(size_t nbytes) {
    size_t c = 256;
    while (c < nbytes) c <<= 1;
    return c;
}

static void tmp_release(void *ptr) {
    if (g_pools) {
        CUDA_CHECK(cudaFreeAsync(ptr, g_stream));
    } else {   /* cudaFree is not stream-ordered: let the stream's users finish first */
        CUDA_CHECK(cudaStreamSynchronize(g_stream));
        CUDA_CHECK(cudaFree(ptr));
    }
}

void *cuda_tmp_alloc(size_t nbytes) {
    size_t bytes = tmp_class(nbytes ? nbytes : 1);
    pthread_mutex_lock(&g_tmp_lock);
    int empty = -1;
    for (int i = 0; i < TMP_SLOTS; i++) {
        if (g_tmp[i].ptr && !g_tmp[i].in_use && g_tmp[i].bytes == bytes) {
            g_tmp[i].in_use = true;
            pthread_mutex_unlock(&g_tmp_lock);
            return g_tmp[i].ptr;
        }
        if (!g_tmp[i].ptr && !g_tmp[i].in_use && empty < 0) empty = i;
    }
    if (empty >= 0) g_tmp[empty] = tmp_block{NULL, bytes, true};   /* claimed before the unlock */
    pthread_mutex_unlock(&g_tmp_lock);
    void *p = NULL;
    if (g_pools) CUDA_CHECK(cudaMallocAsync(&p, bytes, g_stream));
    else CUDA_CHECK(cudaMalloc(&p, bytes));
    if (empty >= 0) {
        pthread_mutex_lock(&g_tmp_lock);
        g_tmp[empty].ptr = p;
        pthread_mutex_unlock(&g_tmp_lock);
    }
    return p;
}

void cuda_tmp_free(void *ptr) {
    if (!ptr) return;
    pthread_mutex_lock(&g_tmp_lock);
    for (int i = 0; i < TMP_SLOTS; i++) {
        if (g_tmp[i].ptr == ptr) {
            g_tmp[i].in_use = false;
            pthread_mutex_unlock(&g_tmp_lock);
            return;
        }
    }
    pthread_mutex_unlock(&g_tmp_lock);
    tmp_release(ptr);   /* the cache was full when it was made */
}

void *cuda_raw_alloc(size_t nbytes) {
    CUDA_ENTER();
    void *p = NULL;
    cudaError_t e = cudaMalloc(&p, nbytes ? nbytes : 1);
    if (e == cudaErrorMemoryAllocation) {   /* the allocator empties its cache and retries, or reports OOM */
        (void)cudaGetLastError();
        return NULL;
    }
    CUDA_CHECK(e);
    return p;
}

void cuda_raw_free(void *ptr) {
    CUDA_ENTER();
    if (ptr) CUDA_CHECK(cudaFree(ptr));
}

void cuda_zero(void *dst, size_t nbytes) {
    CUDA_ENTER();
    if (nbytes) CUDA_CHECK(cudaMemsetAsync(dst, 0, nbytes, g_stream));
}

/* From pageable host memory: cudaMemcpyAsync stages the bytes before it
 * returns, so the caller may reuse host_src at once. */
void cuda_copy_from_host(void *dst, const void *host_src, size_t nbytes) {
    CUDA_ENTER();
    if (nbytes) CUDA_CHECK(cudaMemcpyAsync(dst, host_src, nbytes, cudaMemcpyHostToDevice, g_stream));
}

void cuda_copy_to_host(void *host_dst, const void *src, size_t nbytes) {
    CUDA_ENTER();
    if (!nbytes) return;
    CUDA_CHECK(cudaMemcpyAsync(host_dst, src, nbytes, cudaMemcpyDeviceToHost, g_stream));
    CUDA_CHECK(cudaStreamSynchronize(g_stream));
}

void cuda_synchronize(void) {
    CUDA_ENTER();
    CUDA_CHECK(cudaStreamSynchronize(g_stream));
}

/* ---- pinned host memory ----
 * Copies from and to page-locked memory are DMA transfers that
 * cudaMemcpyAsync enqueues and returns from at once; from pageable memory
 * it stages the bytes through a driver buffer first, and to pageable memory
 * it returns only when they have arrived. A fence is an event recorded on
 * the compute stream after the copy. */
void *cuda_host_alloc(size_t nbytes) {
    CUDA_ENTER();
    void *p = NULL;
    cudaError_t e = cudaHostAlloc(&p, nbytes ? nbytes : 1, cudaHostAllocDefault);
    if (e == cudaErrorMemoryAllocation) {   /* the allocator reports it as out of memory */
        (void)cudaGetLastError();
        return NULL;
    }
    CUDA_CHECK(e);
    return p;
}

void cuda_host_free(void *ptr) {
    CUDA_ENTER();
    if (ptr) CUDA_CHECK(cudaFreeHost(ptr));
}

static void *fence_after_copy(void) {
    cudaEvent_t ev = NULL;
    CUDA_CHECK(cudaEventCreateWithFlags(&ev, cudaEventDisableTiming));
    CUDA_CHECK(cudaEventRecord(ev, g_stream));
    return (void *)ev;
}

void *cuda_copy_from_host_async(void *dst, const void *pinned_src, size_t nbytes) {
    CUDA_ENTER();
    if (nbytes) CUDA_CHECK(cudaMemcpyAsync(dst, pinned_src, nbytes, cudaMemcpyHostToDevice, g_stream));
    return fence_after_copy();
}

void *cuda_copy_to_host_async(void *pinned_dst, const void *src, size_t nbytes) {
    CUDA_ENTER();
    if (nbytes) CUDA_CHECK(cudaMemcpyAsync(pinned_dst, src, nbytes, cudaMemcpyDeviceToHost, g_stream));
    return fence_after_copy();
}

int cuda_fence_wait(void *fence, int block) {
    CUDA_ENTER();
    cudaEvent_t ev = (cudaEvent_t)fence;
    if (!ev) return 1;
    if (block) {
        CUDA_CHECK(cudaEventSynchronize(ev));
    } else {
        cudaError_t e = cudaEventQuery(ev);
        if (e == cudaErrorNotReady) return 0;
        CUDA_CHECK(e);
    }
    CUDA_CHECK(cudaEventDestroy(ev));
    return 1;
}

/* C++20 designated initializers: in the struct's order, or it does not compile. */
extern "C" const fsdp_device_kernels cuda_device_kernels = {
    .name = "cuda",
#define FSDP_KERNEL(ret, name, params, has) FSDP_ON_CUDA_##has(.name = cuda_##name, )
#include "kernels.def"
};

/* ---- start-up ---- */

/* Start-up failures return an error instead of ending the process. */
#define INIT_CHECK(call)                                                                                    \
    do {                                                                                                    \
        cudaError_t e_ = (call);                                                                            \
        if (e_ != cudaSuccess)                                                                              \
            return fsdp_set_error(FSDP_ERR_DEVICE, "%s:%d: %s failed on cuda:%d: %s", __FILE__, __LINE__, #call, \
                                  local_rank, cudaGetErrorString(e_));                                      \
    } while (0)
#define INIT_CHECK_BLAS(call)                                                                               \
    do {                                                                                                    \
        cublasStatus_t s_ = (call);                                                                         \
        if (s_ != CUBLAS_STATUS_SUCCESS)                                                                    \
            return fsdp_set_error(FSDP_ERR_DEVICE, "%s:%d: %s failed on cuda:%d: %s", __FILE__, __LINE__, #call, \
                                  local_rank, cublasGetStatusString(s_));                                   \
    } while (0)

static bool cuda_host_like(void) { return false; }
static const device_backend cuda_backend = {cuda_device_info, cuda_host_like};

extern "C" fsdp_status cuda_backend_init(int local_rank) {
    if (g_device >= 0) return FSDP_OK;
    device_register_backend(FSDP_DEVICE_CUDA, &cuda_backend);   /* says why when there is no GPU */
    int n = 0;
    cudaError_t e = cudaGetDeviceCount(&n);
    if (e != cudaSuccess) {
        snprintf(g_reason, sizeof g_reason, "no GPU: cudaGetDeviceCount: %s", cudaGetErrorString(e));
        (void)cudaGetLastError();
        return FSDP_OK;
    }
    if (n <= 0) {
        snprintf(g_reason, sizeof g_reason, "no GPU: cudaGetDeviceCount found no device");
        return FSDP_OK;
    }
    if (local_rank < 0 || local_rank >= n) {
        snprintf(g_reason, sizeof g_reason, "rank with local rank %d has no GPU: this node has %d", local_rank, n);
        return fsdp_set_error(FSDP_ERR_DEVICE, "rank with local rank %d has no GPU: this node has %d", local_rank, n);
    }
    const char *epi_value = NULL;
    int epilogues = cuda_epilogues_wanted(&epi_value);
    if (epilogues < 0)
        return fsdp_set_error(FSDP_ERR_INVALID, "cuda:%d start-up: FSDP_CUDA_EPILOGUES is \"%s\", expected 1 (the "
                              "default: cuBLASLt's fused epilogues) or 0 (none)", local_rank, epi_value);
    INIT_CHECK(cudaSetDevice(local_rank));
    cudaDeviceProp prop;
    INIT_CHECK(cudaGetDeviceProperties(&prop, local_rank));
    snprintf(g_name, sizeof g_name, "%s", prop.name);
    g_sm_count = prop.multiProcessorCount > 0 ? prop.multiProcessorCount : 1;
    g_total_mem = prop.totalGlobalMem;
    INIT_CHECK(cudaStreamCreateWithFlags(&g_stream, cudaStreamNonBlocking));
    INIT_CHECK_BLAS(cublasCreate(&g_cublas));
    INIT_CHECK_BLAS(cublasSetStream(g_cublas, g_stream));
    /* Plain f32 products, so results match the CPU's to f32 rounding;
     * FSDP_CUDA_TF32=1 allows TF32 tensor cores (10-bit mantissa inputs). */
    const char *tf32 = getenv("FSDP_CUDA_TF32");
    INIT_CHECK_BLAS(cublasSetMathMode(g_cublas, tf32 && strcmp(tf32, "1") == 0 ? CUBLAS_TF32_TENSOR_OP_MATH
                                                                               : CUBLAS_DEFAULT_MATH));
    const char *lt_failed = epilogues ? cuda_lt_init() : NULL;   /* (no workspace for an entry left out) */
    if (lt_failed) return fsdp_set_error(FSDP_ERR_DEVICE, "%s on cuda:%d", lt_failed, local_rank);
    int pools = 0;
    INIT_CHECK(cudaDeviceGetAttribute(&pools, cudaDevAttrMemoryPoolsSupported, local_rank));
    if (pools) {   /* keep freed temporaries in the pool rather than giving them back at every sync */
        cudaMemPool_t pool;
        INIT_CHECK(cudaDeviceGetDefaultMemPool(&pool, local_rank));
        uint64_t keep = 256ull << 20;
        INIT_CHECK(cudaMemPoolSetAttribute(pool, cudaMemPoolAttrReleaseThreshold, &keep));
    }
    g_pools = pools;
    g_device = local_rank;
    t_entered = 1;
    g_reason[0] = 0;
    int smem_optin = 0;
    INIT_CHECK(cudaDeviceGetAttribute(&smem_optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, local_rank));
    static fsdp_device_kernels table;
    table = cuda_device_kernels;
    if ((size_t)smem_optin < cuda_attention_flash_smem_max()) {
        /* too little shared memory per block for the flash kernels: bf16 attention takes the GEMM path */
        table.attention_flash_forward_bf16 = NULL;
        table.attention_flash_backward_bf16 = NULL;
    }
    if (!epilogues) table.matmul_epilogue_bf16 = NULL;
    device_register(FSDP_DEVICE_CUDA, &table);
    const char *want = getenv("FSDP_DEVICE");
    if (!(want && strcmp(want, "cpu") == 0)) return fsdp_set_default_device(FSDP_DEVICE_CUDA);
    return FSDP_OK;
}

extern "C" const char *cuda_unavailable_reason(void) { return g_device >= 0 ? NULL : g_reason; }

extern "C" fsdp_status cuda_device_info(int *available, char *desc, int64_t size) {
    if (!available) return fsdp_set_error(FSDP_ERR_INVALID, "fsdp_device_info: available is NULL");
    *available = g_device >= 0;
    if (!desc || size <= 0) return FSDP_OK;
    if (g_device >= 0)
        snprintf(desc, (size_t)size, "cuda:%d %s (%d SMs, %.0f GiB)", g_device, g_name, g_sm_count,
                 (double)g_total_mem / (double)(1ull << 30));
    else
        snprintf(desc, (size_t)size, "%s", g_reason);
    return FSDP_OK;
}
