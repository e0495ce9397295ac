/* cuda_emu.h: just enough of CUDA (device built-ins, the runtime API the
 * backend calls, cuBLAS's strided batched sgemm) to compile the .cu files of engine/cuda
 * as plain C++ and run every kernel on the host, so that the CUDA kernels
 * are checked against the CPU ones on machines without a GPU
 * (tests/gpu/test_cuda_kernels*.c built with FSDP_CUDA_EMU).
 *
 * What it models, and checks:
 * - A launch runs its blocks one after another; the threads of a block are
 *   fibers (ucontext) switched only at barriers, so __shared__ (a static
 *   here) is the block's shared memory. __syncthreads, __syncwarp and the
 *   shuffles are real barriers: a thread that reaches a different barrier
 *   than its block or warp, or exits while others wait, is reported (the
 *   divergent-barrier bugs that hang or corrupt on a GPU).
 * - Tensor cores: nvcuda::wmma's 16x16x16 bf16 fragments (include/mma.h),
 *   warp-collective, with the result of the real operation.
 * - Launch limits: threads per block, grid dims, dynamic shared memory above
 *   48 KiB only after cudaFuncSetAttribute.
 * - Device memory is a separate address range: every pointer argument of a
 *   kernel, cuBLAS call or copy must lie in it (a host pointer passed to a
 *   kernel is caught); each allocation ends at an inaccessible page (reads
 *   past the end fault); freed memory is never reused and becomes
 *   inaccessible (use after free faults); new memory is filled with NaN
 *   bytes (reads of unwritten memory show).
 * - Alignment: the .cu sources are built with -fsanitize=alignment in trap
 *   mode, so an access through a pointer not aligned for its type (a
 *   16-byte vector at an odd element offset, a double at a 4-byte boundary
 *   of shared memory), which a GPU stops with "misaligned address", ends in
 *   a report naming the kernel (cuda_emu.cpp's SIGILL handler).
 * - Order: FSDP_EMU_ORDER=reverse runs a grid's blocks and a block's threads
 *   between barriers last to first instead of first to last, so a kernel
 *   that depends on either order (which a GPU does not keep) shows it.
 * - The host guard: device memory is inaccessible (PROT_NONE) to host code;
 *   only a running device op (a kernel: the allocations of its pointer
 *   arguments; a copy, memset, cuBLAS call or NCCL collective: its buffers)
 *   opens it, so a host read or write of device memory faults, and the
 *   handler names the access, the allocation, the last op and a backtrace.
 *   A new runtime, cuBLAS(Lt) or NCCL call that touches device memory wraps
 *   that access in emu_op_begin/emu_op_end (cuda_runtime.h) with its
 *   buffers, as the existing ones do.
 * - cuBLAS: column-major semantics and its leading-dimension rules;
 *   cuBLASLt: the epilogues, layout, alignment and workspace rules the
 *   engine relies on (include/cublasLt.h, cublaslt_emu.cpp).
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
/* A warp-collective call (the wmma operations of include/mma.h): a barrier
 * of the warp that every one of its 32 lanes must reach at the same call;
 * lanes at different collective calls, a lane that exits instead, or a
 * partial warp are reported. */
void emu_warp_collective(const char *what);
int emu_lane(void);   /* threadIdx's lane in its warp, 0..31 */
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
    const char *name;   /* the kernel's name, for the host guard's reports */
};
/* Checks the configuration (returns false and sets the last error when bad),
 * then runs body in every thread of every block. */
void emu_run(const emu_launch_cfg &cfg, const std::function<void()> &body);
/* A pointer argument of a kernel must be NULL or device memory. */
void emu_check_device_ptr(const void *p, const char *what);
/* [p, p + n) must lie inside one live device allocation (a library call's
 * buffer, as cuBLASLt's emulation checks them). */
void emu_check_device_range(const void *p, size_t n, const char *what);
enum { EMU_MAX_KERNEL_PTRS = 320 };   /* AdamW's group: 56 tensors of 5 pointers */

/* Ends the process: a kernel with more than EMU_MAX_KERNEL_PTRS pointers. */
[[noreturn]] void emu_fail_kernel_ptrs(void);

/* The device memory a kernel may touch: the allocations its pointer
 * arguments point into (the host guard opens those, and only those, while
 * it runs). A kernel that takes pointers inside a struct argument teaches
 * the emulation with an overload of emu_kernel_ptrs for that struct, adding
 * each pointer with list.add(p). */
struct emu_ptr_list {
    const void *p[EMU_MAX_KERNEL_PTRS];
    int n = 0;
    void add(const void *q) {
        emu_check_device_ptr(q, "kernel argument");
        if (n == EMU_MAX_KERNEL_PTRS) emu_fail_kernel_ptrs();
        p[n++] = q;
    }
};
template <class T> inline void emu_kernel_ptrs(const T &v, emu_ptr_list &list) {
    if constexpr (std::is_pointer<T>::value) list.add((const void *)v);
}

template <class F> struct emu_launcher;
template <class... P> struct emu_launcher<void (*)(P...)> {
    void (*kernel)(P...);
    emu_launch_cfg cfg;
    /* the kernel's own parameter types: arguments convert as in a call */
    void operator()(P... args) const {
        emu_ptr_list ptrs;
        (emu_kernel_ptrs(args, ptrs), ...);
        int op = emu_op_begin("kernel", cfg.name, ptrs.p, ptrs.n);
        emu_run(cfg, [&]() { kernel(args...); });
        emu_op_end(op);
    }
};
/* LAUNCH(kernel, ...) of cuda_internal.h passes the kernel's name */
template <class... P>
emu_launcher<void (*)(P...)> emu_make_launcher(void (*kernel)(P...), dim3 grid, dim3 block, size_t smem,
                                               const char *name = "a kernel") {
    return emu_launcher<void (*)(P...)>{kernel, emu_launch_cfg{grid, block, smem, (const void *)kernel, name}};
}

#endif
