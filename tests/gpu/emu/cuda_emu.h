/* cuda_emu.h: just enough of CUDA (device built-ins, the runtime API the
 * backend calls, cuBLAS's strided batched sgemm) to compile the .cu files of engine/cuda
 * as plain C++ and run every kernel on the host, so that the CUDA kernels
 * are checked against the CPU ones on machines without a GPU
 * (tests/gpu/test_cuda_kernels.c built with FSDP_CUDA_EMU).
 *
 * What it models, and checks:
 * - A launch runs its blocks one after another; the threads of a block are
 *   fibers (ucontext) switched only at barriers, so __shared__ (a static
 *   here) is the block's shared memory. __syncthreads, __syncwarp and the
 *   shuffles are real barriers: a thread that reaches a different barrier
 *   than its block or warp, or exits while others wait, is reported (the
 *   divergent-barrier bugs that hang or corrupt on a GPU).
 * - Launch limits: threads per block, grid dims, dynamic shared memory above
 *   48 KiB only after cudaFuncSetAttribute.
 * - Device memory is a separate address range: every pointer argument of a
 *   kernel, cuBLAS call or copy must lie in it (a host pointer passed to a
 *   kernel is caught); each allocation ends at an inaccessible page (reads
 *   past the end fault); freed memory is never reused and becomes
 *   inaccessible (use after free faults); new memory is filled with NaN
 *   bytes (reads of unwritten memory show).
 * - cuBLAS: column-major semantics and its leading-dimension rules.
 * - Streams and events: see include/cuda_runtime.h (a comm stream runs its
 *   work late); NCCL: include/nccl.h.
 * Not modelled: warp-synchronous code without barriers, timing, memory
 * ordering between blocks (blocks are serial), register or static shared
 * memory limits (ptxas -v reports those). */
#ifndef FSDP_CUDA_EMU_H
#define FSDP_CUDA_EMU_H

#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>
#include <functional>
#include <type_traits>

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __shared__ static
#define __launch_bounds__(...)

/* ---- built-ins ---- */
struct uint3 {
    unsigned x, y, z;
};
struct dim3 {
    unsigned x, y, z;
    dim3(unsigned x_ = 1, unsigned y_ = 1, unsigned z_ = 1) : x(x_), y(y_), z(z_) {}
};
uint3 emu_thread_idx(void);
uint3 emu_block_idx(void);
dim3 emu_block_dim(void);
dim3 emu_grid_dim(void);
#define threadIdx (emu_thread_idx())
#define blockIdx (emu_block_idx())
#define blockDim (emu_block_dim())
#define gridDim (emu_grid_dim())

void __syncthreads(void);
void __syncwarp(unsigned mask = 0xffffffffu);
/* The value of another lane of this warp: lane arg (IDX), lane ^ arg (XOR),
 * lane + arg or its own past 31 (DOWN). Every lane of the warp must call. */
enum { EMU_SHFL_IDX, EMU_SHFL_XOR, EMU_SHFL_DOWN };
void emu_shuffle(const void *mine, void *out, size_t size, int mode, int arg, unsigned mask);
template <class T> T __shfl_xor_sync(unsigned mask, T v, int lane_mask) {
    T r;
    emu_shuffle(&v, &r, sizeof v, EMU_SHFL_XOR, lane_mask, mask);
    return r;
}
template <class T> T __shfl_down_sync(unsigned mask, T v, unsigned delta) {
    T r;
    emu_shuffle(&v, &r, sizeof v, EMU_SHFL_DOWN, (int)delta, mask);
    return r;
}
template <class T> T __shfl_sync(unsigned mask, T v, int src) {
    T r;
    emu_shuffle(&v, &r, sizeof v, EMU_SHFL_IDX, src, mask);
    return r;
}
/* fibers switch only at barriers, so a read-modify-write is atomic */
template <class T> T atomicAdd(T *p, T v) {
    T old = *p;
    *p = old + v;
    return old;
}

static inline float __uint_as_float(uint32_t u) {
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}
static inline uint32_t __float_as_uint(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    return u;
}
/* built with -ffp-contract=off: these stay separate roundings */
static inline float __fmul_rn(float a, float b) { return a * b; }
static inline float __fadd_rn(float a, float b) { return a + b; }

void *emu_dyn_smem(void);

/* ---- runtime API and cuBLAS: C declarations shared with the engine's C files ---- */
#include "cuda_runtime.h"
#include "cublas_v2.h"

/* ---- launches: kernel<<<grid, block, smem>>>(args) ---- */
struct emu_launch_cfg {
    dim3 grid, block;
    size_t smem;
    const void *fn;
};
/* Checks the configuration (returns false and sets the last error when bad),
 * then runs body in every thread of every block. */
void emu_run(const emu_launch_cfg &cfg, const std::function<void()> &body);
/* A pointer argument of a kernel must be NULL or device memory. */
void emu_check_device_ptr(const void *p, const char *what);

template <class T> inline void emu_check_arg(const T &v) {
    if constexpr (std::is_pointer<T>::value) emu_check_device_ptr((const void *)v, "kernel argument");
}

template <class F> struct emu_launcher;
template <class... P> struct emu_launcher<void (*)(P...)> {
    void (*kernel)(P...);
    emu_launch_cfg cfg;
    /* the kernel's own parameter types: arguments convert as in a call */
    void operator()(P... args) const {
        (emu_check_arg(args), ...);
        emu_run(cfg, [&]() { kernel(args...); });
    }
};
template <class... P>
emu_launcher<void (*)(P...)> emu_make_launcher(void (*kernel)(P...), dim3 grid, dim3 block, size_t smem) {
    return emu_launcher<void (*)(P...)>{kernel, emu_launch_cfg{grid, block, smem, (const void *)kernel}};
}

#endif
