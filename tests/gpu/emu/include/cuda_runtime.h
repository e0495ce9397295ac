/* cuda_runtime.h (emulation): the part of the CUDA runtime API the engine
 * calls, for C and C++, implemented on the host by tests/gpu/emu/cuda_emu.cpp.
 * Every name is an emu_ symbol behind a macro, so the emulation can sit in
 * one process next to a real libcudart without either taking the other's
 * calls.
 *
 * Streams: the stream made by cudaStreamCreateWithFlags (the engine's compute
 * stream) runs its work at once, in the calling thread. A stream made with a
 * priority (the engine's comm stream) runs its work late, in order, on a
 * thread of its own that waits a little before each item; events recorded on
 * it complete when the work before them has run (cudaEventQuery answers
 * cudaErrorNotReady until then), and cudaStreamWaitEvent from the compute
 * stream blocks until they have. Code that reads a collective's output
 * without ordering itself after the collective reads stale memory, as it
 * could on a GPU. cudaFree waits for every stream (as CUDA's does);
 * cudaFreeAsync on the compute stream frees at once, so late work that
 * still uses the memory faults. */
#ifndef FSDP_EMU_CUDA_RUNTIME_H
#define FSDP_EMU_CUDA_RUNTIME_H

#include <stddef.h>
#include <stdint.h>

#define CUDART_VERSION 12000   /* what the engine may assume; not a real runtime */

#ifdef __cplusplus
extern "C" {
#endif

typedef enum cudaError {
    cudaSuccess = 0,
    cudaErrorInvalidValue = 1,
    cudaErrorMemoryAllocation = 2,
    cudaErrorInvalidConfiguration = 9,
    cudaErrorNoDevice = 100,
    cudaErrorInvalidDevice = 101,
    cudaErrorInvalidResourceHandle = 400,
    cudaErrorNotReady = 600,
} cudaError_t;

typedef struct emu_stream_s *cudaStream_t;
typedef struct emu_event_s *cudaEvent_t;
typedef struct emu_pool_s *cudaMemPool_t;

typedef enum cudaMemcpyKind {
    cudaMemcpyHostToHost = 0,
    cudaMemcpyHostToDevice = 1,
    cudaMemcpyDeviceToHost = 2,
    cudaMemcpyDeviceToDevice = 3,
    cudaMemcpyDefault = 4
} cudaMemcpyKind;
typedef enum cudaDeviceAttr {
    cudaDevAttrMaxSharedMemoryPerBlockOptin = 97,
    cudaDevAttrMemoryPoolsSupported = 115
} cudaDeviceAttr;
typedef enum cudaMemPoolAttr { cudaMemPoolAttrReleaseThreshold = 4 } cudaMemPoolAttr;
typedef enum cudaFuncAttribute { cudaFuncAttributeMaxDynamicSharedMemorySize = 8 } cudaFuncAttribute;
#define cudaStreamNonBlocking 0x01
#define cudaHostAllocDefault 0x00
#define cudaHostAllocPortable 0x01
#define cudaHostAllocMapped 0x02
#define cudaHostAllocWriteCombined 0x04
#define cudaEventDisableTiming 0x02

typedef struct cudaDeviceProp {
    char name[256];
    int multiProcessorCount;
    size_t totalGlobalMem;
} cudaDeviceProp;

#define cudaGetErrorString emu_cudaGetErrorString
#define cudaGetLastError emu_cudaGetLastError
#define cudaGetDeviceCount emu_cudaGetDeviceCount
#define cudaSetDevice emu_cudaSetDevice
#define cudaGetDevice emu_cudaGetDevice
#define cudaGetDeviceProperties emu_cudaGetDeviceProperties
#define cudaDeviceGetAttribute emu_cudaDeviceGetAttribute
#define cudaDeviceGetDefaultMemPool emu_cudaDeviceGetDefaultMemPool
#define cudaMemPoolSetAttribute emu_cudaMemPoolSetAttribute
#define cudaDeviceGetStreamPriorityRange emu_cudaDeviceGetStreamPriorityRange
#define cudaStreamCreateWithFlags emu_cudaStreamCreateWithFlags
#define cudaStreamCreateWithPriority emu_cudaStreamCreateWithPriority
#define cudaStreamSynchronize emu_cudaStreamSynchronize
#define cudaStreamWaitEvent emu_cudaStreamWaitEvent
#define cudaEventCreateWithFlags emu_cudaEventCreateWithFlags
#define cudaEventRecord emu_cudaEventRecord
#define cudaEventQuery emu_cudaEventQuery
#define cudaEventSynchronize emu_cudaEventSynchronize
#define cudaEventDestroy emu_cudaEventDestroy
#define cudaMalloc emu_cudaMalloc
#define cudaFree emu_cudaFree
#define cudaMallocAsync emu_cudaMallocAsync
#define cudaFreeAsync emu_cudaFreeAsync
#define cudaMemsetAsync emu_cudaMemsetAsync
#define cudaMemcpyAsync emu_cudaMemcpyAsync
#define cudaFuncSetAttribute emu_cudaFuncSetAttribute
#define cudaHostAlloc emu_cudaHostAlloc
#define cudaMallocHost emu_cudaMallocHost
#define cudaFreeHost emu_cudaFreeHost

const char *cudaGetErrorString(cudaError_t e);
cudaError_t cudaGetLastError(void);
cudaError_t cudaGetDeviceCount(int *n);
cudaError_t cudaSetDevice(int d);
cudaError_t cudaGetDevice(int *d);
cudaError_t cudaGetDeviceProperties(cudaDeviceProp *p, int d);
cudaError_t cudaDeviceGetAttribute(int *v, cudaDeviceAttr a, int d);
cudaError_t cudaDeviceGetDefaultMemPool(cudaMemPool_t *p, int d);
cudaError_t cudaMemPoolSetAttribute(cudaMemPool_t p, cudaMemPoolAttr a, void *v);
cudaError_t cudaDeviceGetStreamPriorityRange(int *least, int *greatest);
cudaError_t cudaStreamCreateWithFlags(cudaStream_t *s, unsigned flags);
cudaError_t cudaStreamCreateWithPriority(cudaStream_t *s, unsigned flags, int priority);
cudaError_t cudaStreamSynchronize(cudaStream_t s);
cudaError_t cudaStreamWaitEvent(cudaStream_t s, cudaEvent_t e, unsigned flags);
cudaError_t cudaEventCreateWithFlags(cudaEvent_t *e, unsigned flags);
cudaError_t cudaEventRecord(cudaEvent_t e, cudaStream_t s);
cudaError_t cudaEventQuery(cudaEvent_t e);
cudaError_t cudaEventSynchronize(cudaEvent_t e);
cudaError_t cudaEventDestroy(cudaEvent_t e);
cudaError_t cudaMalloc(void **p, size_t n);
cudaError_t cudaFree(void *p);
cudaError_t cudaMallocAsync(void **p, size_t n, cudaStream_t s);
cudaError_t cudaFreeAsync(void *p, cudaStream_t s);
cudaError_t cudaMemsetAsync(void *p, int v, size_t n, cudaStream_t s);
cudaError_t cudaMemcpyAsync(void *dst, const void *src, size_t n, cudaMemcpyKind kind, cudaStream_t s);
cudaError_t cudaFuncSetAttribute(const void *fn, cudaFuncAttribute a, int v);
/* Pinned (page-locked) host memory: host-readable; copies from and to it
 * are asynchronous, copies from and to pageable memory are not. */
cudaError_t cudaHostAlloc(void **p, size_t n, unsigned flags);
cudaError_t cudaMallocHost(void **p, size_t n);
cudaError_t cudaFreeHost(void *p);

/* ---- test controls ---- */
void emu_set_device_count(int n);   /* what cudaGetDeviceCount reports (default: $FSDP_EMU_GPUS, else 1) */
int emu_device_count(void);
long long emu_launch_count(void);
long long emu_late_runs(void);      /* work items a late stream ran */
/* Allocation calls so far: cudaMalloc, cudaFree, cudaMallocAsync,
 * cudaFreeAsync, cudaHostAlloc (and cudaMallocHost), cudaFreeHost. */
void emu_memory_calls(long long out[6]);
int emu_is_pinned(const void *p, size_t n);   /* [p, p + n) lies in one cudaHostAlloc block */
/* Runs fn(arg) on stream s in its order (at once on the compute stream). */
cudaError_t emu_stream_enqueue(cudaStream_t s, void (*fn)(void *), void *arg);

/* ---- the host guard (cuda_emu.h) ----
 * A device op (kind "kernel", "cuBLAS", "NCCL", ...; name: which one) opens
 * the allocations that ptrs[0..n) point into (host and NULL pointers are
 * skipped) until emu_op_end; the returned slot names it in fault reports.
 * Ops on several threads may hold one allocation open at once. */
int emu_op_begin(const char *kind, const char *name, const void *const *ptrs, int n);
void emu_op_end(int slot);
long long emu_ops_run(void);   /* device ops begun so far */

#ifdef __cplusplus
}
#endif

#endif
