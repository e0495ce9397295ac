/* cuda_internal.h: the CUDA backend's shared declarations.
 *
 * Three parts:
 * 1. The C interface the rest of the engine uses (runtime.c, device.c,
 *    comm_nccl.c): start-up, status, the device's description and its
 *    compute stream. Plain C; compiles without CUDA headers.
 * 2. The random-number helpers (Philox4x32-10 and the float math of
 *    engine/cpu/random.c) as inline functions that compile for the host (C,
 *    C++) and the device alike, so a host test can check them bit for bit
 *    against the CPU kernels (tests/gpu/test_cuda_rng_host.c).
 * 3. For the .cu files only: the stream, the cuBLAS handle, the one error
 *    check, launch helpers and block reductions.
 *
 * FSDP_CUDA_EMU builds the same .cu sources as C++ for the host over a small
 * emulation of the CUDA runtime (tests/gpu/emu), so every kernel can be run
 * and checked on a machine without a GPU; the public names then get an emu_
 * prefix so that they never meet libfsdp's own.
 *
 * Memory and ordering: every kernel, memset and copy of this process's GPU
 * goes onto one compute stream. The engine's caching allocator (alloc.c)
 * hands a freed block out again without waiting for the GPU: that is safe
 * because the block's old readers and writers were enqueued on the same
 * stream before the new owner's kernels, so the stream runs them first.
 * Anything that uses the memory on another stream (NCCL's comm stream) must
 * order itself against the compute stream with events, as comm_nccl.c does.
 */
#ifndef FSDP_CUDA_INTERNAL_H
#define FSDP_CUDA_INTERNAL_H

#include "fsdp.h"
#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#ifdef FSDP_CUDA_EMU
#define cuda_backend_init emu_cuda_backend_init
#define cuda_unavailable_reason emu_cuda_unavailable_reason
#define cuda_last_status emu_cuda_last_status
#define cuda_device_info emu_cuda_device_info
#define cuda_device_ordinal emu_cuda_device_ordinal
#define cuda_compute_stream emu_cuda_compute_stream
#define cuda_device_kernels emu_cuda_device_kernels
#define cuda_attention_flash_smem_max emu_cuda_attention_flash_smem_max
#endif

/* .cu files under nvcc, or the same files built for the host emulation */
#if defined(__CUDACC__) || (defined(FSDP_CUDA_EMU) && defined(__cplusplus))
#define FSDP_CUDA_SOURCE 1
#ifdef FSDP_CUDA_EMU
#include "cuda_emu.h"
#else
#include <cuda_runtime.h>
#include <cublas_v2.h>
#endif
#endif

#if defined(__GNUC__)
#define FSDP_CUDA_EXPORT __attribute__((visibility("default")))
#else
#define FSDP_CUDA_EXPORT
#endif

/* ---------------------------------------------------------------------------
 * 1. The C interface.
 * ------------------------------------------------------------------------- */
#ifdef __cplusplus
extern "C" {
#endif

/* Brings up GPU local_rank for this process: with no CUDA device at all
 * (cudaGetDeviceCount fails or finds none) it registers nothing and returns
 * FSDP_OK (the engine runs on the CPU; cuda_unavailable_reason() says why);
 * with fewer devices than local_rank + 1 it fails with FSDP_ERR_DEVICE.
 * Otherwise it selects the device, makes the compute stream and the cuBLAS
 * handle, registers the CUDA kernel table and makes CUDA the default device
 * unless the environment says FSDP_DEVICE=cpu. Calling it again is a no-op. */
FSDP_CUDA_EXPORT fsdp_status cuda_backend_init(int local_rank);
/* Why CUDA is not in use ("no GPU: cudaGetDeviceCount: ..."), or NULL when it is. */
FSDP_CUDA_EXPORT const char *cuda_unavailable_reason(void);
/* FSDP_OK, or the first CUDA failure of the process (message set). */
FSDP_CUDA_EXPORT fsdp_status cuda_last_status(void);
/* available: 1 when the table is registered; desc: "cuda:0 NVIDIA H200 (132
 * SMs, 139 GiB)", or the reason CUDA is not available. */
FSDP_CUDA_EXPORT fsdp_status cuda_device_info(int *available, char *desc, int64_t size);
/* The CUDA device this process uses, or -1 before cuda_backend_init succeeded. */
FSDP_CUDA_EXPORT int cuda_device_ordinal(void);
/* The most dynamic shared memory a flash attention block asks for (its
 * largest head dim's); a GPU that cannot give it gets no flash entries. */
FSDP_CUDA_EXPORT size_t cuda_attention_flash_smem_max(void);
/* cuBLASLt's workspace (bytes; 0 until the first fused GEMM, and with
 * FSDP_CUDA_EPILOGUES=0), counted by the engine allocator under tag other. */
FSDP_CUDA_EXPORT size_t cuda_lt_workspace_bytes(void);
/* The plans matmul_epilogue_bf16 keeps: how many now, and the most it
 * keeps (n <= 0: the default, 256); setting it destroys every plan. */
FSDP_CUDA_EXPORT int cuda_lt_plans(void);
FSDP_CUDA_EXPORT void cuda_lt_set_plan_limit(int n);
#if defined(FSDP_CUDA_SOURCE) || defined(CUDART_VERSION)
/* The stream every kernel of this process runs on (NULL before start-up). */
FSDP_CUDA_EXPORT cudaStream_t cuda_compute_stream(void);
#endif

#ifdef __cplusplus
}
#endif

/* FSDP_CUDA_EPILOGUES: 1 (or unset: the default) keeps matmul_epilogue_bf16,
 * cuBLASLt's fused epilogues, in the CUDA table; 0 leaves it out, so the op
 * layer composes the unfused kernels (A/B runs; the counting device follows
 * it too). 1 or 0, or -1 for anything else (start-up then fails, naming it). */
static inline int cuda_epilogues_wanted(const char **value) {
    const char *v = getenv("FSDP_CUDA_EPILOGUES");
    if (value) *value = v;
    if (!v || !*v || strcmp(v, "1") == 0) return 1;
    return strcmp(v, "0") == 0 ? 0 : -1;
}

/* ---------------------------------------------------------------------------
 * 2. Random numbers, shared by the host and the device.
 *
 * The same counter/key layout and the same float operations as
 * engine/cpu/random.c: element i of a buffer takes counter (offset + i);
 * key = (seed low, seed high), counter = (counter low, counter high, stream
 * low, stream high); values use the counter's first two output words.
 *
 * Bitwise agreement with the CPU: uniform and dropout values are exact
 * functions of those words and the same roundings, so they match bit for
 * bit. The CPU build (-O3 -march=native) contracts `low + span * u` and
 * `mean + std * z` into fused multiply-adds, so these helpers use fmaf()
 * there explicitly (on a CPU without FMA the CPU values would differ by up
 * to 1 ulp). Normal values: the CPU takes glibc's logf and cosf, which are
 * faithfully but not correctly rounded (up to 0.82 and 0.56 ulp); the
 * device computes log and cos in double and rounds once, i.e. correctly.
 * Bitwise agreement would mean copying glibc's internals (which differ with
 * its version and with the CPU's FMA support), so normal values agree bit
 * for bit except where glibc's rounding is the other one: about 0.8% of
 * them with glibc 2.36 on x86-64, by at most 3 ulp (the host test
 * tests/gpu/test_cuda_rng_host.c measures both on the machine it runs on).
 * ------------------------------------------------------------------------- */
#ifdef FSDP_CUDA_SOURCE
#define FSDP_HD static __host__ __device__ __forceinline__
#else
#define FSDP_HD static inline
#endif

#define FSDP_PHILOX_M0 0xD2511F53u
#define FSDP_PHILOX_M1 0xCD9E8D57u
#define FSDP_PHILOX_W0 0x9E3779B9u
#define FSDP_PHILOX_W1 0xBB67AE85u
#define FSDP_DROPOUT_STREAM 0xd50u

/* Philox4x32-10 of (seed, stream, counter); the first two output words. */
FSDP_HD void fsdp_philox2(uint64_t seed, uint64_t stream, uint64_t counter, uint32_t *w0, uint32_t *w1) {
    uint32_t c0 = (uint32_t)counter, c1 = (uint32_t)(counter >> 32);
    uint32_t c2 = (uint32_t)stream, c3 = (uint32_t)(stream >> 32);
    uint32_t k0 = (uint32_t)seed, k1 = (uint32_t)(seed >> 32);
    for (int r = 0; r < 10; r++) {
        uint64_t p0 = (uint64_t)FSDP_PHILOX_M0 * c0, p1 = (uint64_t)FSDP_PHILOX_M1 * c2;
        uint32_t n0 = (uint32_t)(p1 >> 32) ^ c1 ^ k0, n2 = (uint32_t)(p0 >> 32) ^ c3 ^ k1;
        c1 = (uint32_t)p1;
        c3 = (uint32_t)p0;
        c0 = n0;
        c2 = n2;
        k0 += FSDP_PHILOX_W0;
        k1 += FSDP_PHILOX_W1;
    }
    *w0 = c0;
    *w1 = c1;
}

/* u in [0, 1) from the top 24 bits: exactly representable in float. */
FSDP_HD float fsdp_rng_u24(uint32_t w) { return (float)(w >> 8) * (1.0f / 16777216.0f); }

/* Box-Muller, as random.c: u1 in (0, 1], u2 in [0, 1),
 * mean + std * sqrtf(-2 logf(u1)) * cosf(2 pi u2). */
FSDP_HD float fsdp_rng_normal(uint32_t w0, uint32_t w1, float mean, float std) {
    const float two_pi = 6.28318530717958647692f;
    float u1 = ((float)w0 + 1.0f) * (1.0f / 4294967296.0f);
    float u2 = fsdp_rng_u24(w1);
    float r = sqrtf(-2.0f * (float)log((double)u1));
    float c = (float)cos((double)(two_pi * u2));
    return fmaf(std, r * c, mean);
}

/* low + span * u, kept below high (rounding may reach it); below_high is
 * nextafterf(high, low). */
FSDP_HD float fsdp_rng_uniform(uint32_t w0, float low, float span, float high, float below_high) {
    float v = fmaf(span, fsdp_rng_u24(w0), low);
    return v < high || !(span > 0) ? v : below_high;
}

/* keep iff u >= p; scale = 1 / (1 - p). */
FSDP_HD float fsdp_rng_dropout(uint32_t w0, float x, float p, float scale) {
    return fsdp_rng_u24(w0) >= p ? x * scale : 0.0f;
}

/* ---------------------------------------------------------------------------
 * 3. For the .cu files.
 * ------------------------------------------------------------------------- */
#ifdef FSDP_CUDA_SOURCE

extern "C" {
#include "convert.h"
#include "device.h"
/* engine/core/internal.h, which C++ cannot include (stdatomic.h) */
fsdp_status fsdp_set_error(fsdp_status st, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
fsdp_status fsdp_alloc(int device, int tag, size_t nbytes, void **out);
const char *fsdp_device_name(int device);
}

/* The stream, handle and size of the device (cuda_device.cu). */
cudaStream_t cuda_stream(void);
cublasHandle_t cuda_cublas(void);
int cuda_sm_count(void);
/* Every table entry starts with CUDA_ENTER(): it names the op for error
 * messages and selects the device the first time a thread enters the table. */
void cuda_enter_thread(const char *op);
#define CUDA_ENTER() cuda_enter_thread(__func__)

/* A failed CUDA call inside a table entry is an unrecoverable device fault
 * (the entries return nothing, and a fault poisons the context): record it,
 * print file:line, the call, CUDA's message, the device and the op, and end
 * the process (the whole job under mpirun). */
#if defined(__GNUC__)
__attribute__((noreturn))
#endif
void cuda_fail(const char *op, const char *file, int line, const char *call, const char *msg);

#define CUDA_CHECK(call)                                                             \
    do {                                                                             \
        cudaError_t e_ = (call);                                                     \
        if (e_ != cudaSuccess) cuda_fail(__func__, __FILE__, __LINE__, #call, cudaGetErrorString(e_)); \
    } while (0)
#define CUBLAS_CHECK(call)                                                           \
    do {                                                                             \
        cublasStatus_t s_ = (call);                                                  \
        if (s_ != CUBLAS_STATUS_SUCCESS) cuda_fail(__func__, __FILE__, __LINE__, #call, cublasGetStatusString(s_)); \
    } while (0)
/* After a kernel launch: a bad configuration shows up here. */
#define CUDA_CHECK_LAUNCH() CUDA_CHECK(cudaGetLastError())

/* kernel<<<grid, block, shared bytes, compute stream>>>(args) */
#ifdef FSDP_CUDA_EMU
#define LAUNCH(kernel, grid, block, smem) emu_make_launcher(kernel, (grid), (block), (smem), #kernel)
#else
#define LAUNCH(kernel, grid, block, smem) kernel<<<(grid), (block), (smem), cuda_stream()>>>
#endif

/* Temporary device memory in stream order, for kernels on the compute
 * stream: reductions' partials, counters. Small, kept in a cache of its own
 * (cuda_device.cu: no cudaMalloc or cudaFree once a step has run); not
 * counted by the engine's allocator. */
void *cuda_tmp_alloc(size_t nbytes);
void cuda_tmp_free(void *ptr);

/* out[i] = (float) sum_s partial[s * n + i], s in order (reduce.cu);
 * bf16: rounded once more, to bf16; acc: out[i] += that sum instead. */
void cuda_sum_slices(float *out, const double *partial, int64_t slices, int64_t n, int acc = 0);
void cuda_sum_slices(uint16_t *out, const double *partial, int64_t slices, int64_t n, int acc = 0);

#define CUDA_THREADS 256

/* Blocks for a grid-stride loop over n items: enough to fill the GPU, no more. */
static inline unsigned cuda_blocks(int64_t n, int threads) {
    int64_t b = (n + threads - 1) / threads, cap = (int64_t)cuda_sm_count() * 8;
    if (b > cap) b = cap;
    return (unsigned)(b < 1 ? 1 : b);
}

FSDP_HD int64_t cuda_min64(int64_t a, int64_t b) { return a < b ? a : b; }
FSDP_HD int64_t cuda_ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

#define GRID_STRIDE(i, n)                                                             \
    for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < (n);          \
         i += (int64_t)gridDim.x * blockDim.x)

/* The dynamic shared memory of a launch. Its start is promised only the
 * alignment the extern array is declared with: 16 bytes here, since kernels
 * keep doubles (norm_bwd_fused_kernel) in it after static arrays of their
 * own, and a double on a 4-byte boundary faults ("misaligned address") on a
 * GPU. The emulation's window is 128-byte aligned and cannot show it. */
#ifdef FSDP_CUDA_EMU
#define CUDA_DYN_SMEM() ((float *)emu_dyn_smem())
#define CUDA_DYN_SMEM_128() ((unsigned char *)emu_dyn_smem())
#else
#define CUDA_DYN_SMEM() cuda_dyn_smem_()
__device__ __forceinline__ float *cuda_dyn_smem_(void) {
    extern __shared__ __align__(16) float fsdp_dyn_smem[];
    return fsdp_dyn_smem;
}
/* the same window, promised 128-byte alignment (wmma tiles need 32) */
#define CUDA_DYN_SMEM_128() cuda_dyn_smem_128_()
__device__ __forceinline__ unsigned char *cuda_dyn_smem_128_(void) {
    extern __shared__ __align__(128) unsigned char fsdp_dyn_smem_128[];
    return fsdp_dyn_smem_128;
}
#endif

/* What else the emulation does differently, so that no .cu file names it:
 * CUDA_PTX_STORES (1: inline PTX vector stores; the host has none);
 * FSDP_CUBLASLT_H (the cuBLASLt header: the emulation's own, or CUDA's);
 * __align__ (alignas on the host); and emu_ptr_list, through which a kernel
 * taking pointers inside a struct argument names them for the emulation's
 * memory guard (an overload of emu_kernel_ptrs; nothing on a GPU). */
#ifdef FSDP_CUDA_EMU
#define CUDA_PTX_STORES 0
#define FSDP_CUBLASLT_H "cublasLt.h"
#ifndef __align__
#define __align__(n) alignas(n)
#endif
#else
#define CUDA_PTX_STORES 1
#define FSDP_CUBLASLT_H <cublasLt.h>
struct emu_ptr_list {
    void add(const void *) {}
};
#endif

/* ---- bf16 in memory, f32 in registers ----
 * Kernels templated on the element type T (float or uint16_t holding bf16)
 * read with ldf and write with stf; for float both are the identity, so the
 * f32 entries compute exactly what they did before the bf16 ones existed. */
__device__ __forceinline__ float ldf(float x) { return x; }
__device__ __forceinline__ float ldf(uint16_t x) { return bf16_to_f32(x); }
__device__ __forceinline__ void stf(float *p, float v) { *p = v; }
__device__ __forceinline__ void stf(uint16_t *p, float v) { *p = f32_to_bf16(v); }

/* ---- warp and block reductions; blockDim.x * blockDim.y a multiple of 32 ----
 * The xor butterfly leaves every lane with the same value (each step adds
 * the same two numbers on both lanes), and the order is fixed, so results do
 * not depend on timing. The block versions start with a barrier so that the
 * scratch (32 slots) may be reused call after call; every thread of the
 * block must call them, and every thread gets the result. */
__device__ __forceinline__ double warp_sum_d(double v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}
__device__ __forceinline__ float warp_sum_f(float v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}
__device__ __forceinline__ float warp_max_f(float v) {
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}
__device__ __forceinline__ int cuda_linear_tid(void) { return (int)(threadIdx.y * blockDim.x + threadIdx.x); }
__device__ __forceinline__ int cuda_block_threads(void) { return (int)(blockDim.x * blockDim.y); }

__device__ __forceinline__ double block_sum_d(double v, double *scratch) {
    int t = cuda_linear_tid(), lane = t & 31, warp = t >> 5, nw = cuda_block_threads() >> 5;
    v = warp_sum_d(v);
    __syncthreads();
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    v = lane < nw ? scratch[lane] : 0.0;
    return warp_sum_d(v);
}
__device__ __forceinline__ float block_max_f(float v, float *scratch) {
    int t = cuda_linear_tid(), lane = t & 31, warp = t >> 5, nw = cuda_block_threads() >> 5;
    v = warp_max_f(v);
    __syncthreads();
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    v = lane < nw ? scratch[lane] : -INFINITY;
    return warp_max_f(v);
}

/* Row launches: one block per row, rows beyond the grid looped over. */
static inline unsigned cuda_row_blocks(int64_t rows) { return (unsigned)cuda_min64(rows, (int64_t)1 << 30); }
#define FOR_ROWS(r, rows) for (int64_t r = blockIdx.x; r < (rows); r += gridDim.x)

/* Threads per row for the row-wise kernels: a warp for short rows, up to 256. */
static inline int cuda_row_threads(int64_t cols) {
    int t = 32;
    while (t < 256 && t < cols) t *= 2;
    return t;
}

/* ---- the table's entries (kernels.def), declared as cuda_<name>; one
 * family per file, named as in engine/cpu (elementwise.cu, matmul.cu,
 * reduce.cu, fused.cu, activation.cu, softmax.cu, norm.cu, loss.cu,
 * embedding.cu, classifier.cu, the three attention files, random.cu,
 * optim.cu; memory and copies in cuda_device.cu) ---- */
#define FSDP_KERNEL(ret, name, params, has) FSDP_ON_CUDA_##has(ret cuda_##name params;)
#include "kernels.def"
/* matmul_lt.cu: the cuBLASLt handle and workspace (start-up: NULL, or
 * what failed), and the GEMM with a fused epilogue */
const char *cuda_lt_init(void);

#endif /* FSDP_CUDA_SOURCE */

#endif
