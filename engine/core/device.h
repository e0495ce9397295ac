/* device.h: the kernel table of a device.
 *
 * The op layer checks arguments and stages dtypes; the table does the work.
 * The entries, what each does and which backends have it are listed once,
 * in kernels.def; a device's kernels run in order on its
 * compute stream, and the entries that return a value (sums, counts) wait
 * for it. The CPU table (engine/cpu/cpu_device.c) is always there; the CUDA
 * table registers itself when the CUDA backend is built and a GPU exists. */
#ifndef FSDP_DEVICE_H
#define FSDP_DEVICE_H

#include "fsdp.h"
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

/* What matmul_epilogue_bf16 does after the product P = alpha op(A) op(B) + beta C, all row-major:
 * op(A) (M, K), op(B) (K, N), C and D (M, N); C is read only when beta != 0 and may equal D. */
enum fsdp_epilogue {
    FSDP_EPILOGUE_BIAS = 1,      /* D = P + bias[n]                                   bias (N)        */
    FSDP_EPILOGUE_GELU_AUX_BIAS, /* aux = P + bias[n]; D = gelu(aux), tanh form       bias (N), aux (M, N) */
    FSDP_EPILOGUE_DGELU_BGRAD,   /* D = P * gelu'(aux); dbias[n] = sum_m D[m, n]      aux (M, N), dbias (N) */
    FSDP_EPILOGUE_BGRAD_A,       /* D = P; dbias[m] = sum_k op(A)[m, k]               dbias (M)       */
    FSDP_EPILOGUE_GELU_BIAS,     /* D = gelu(P + bias[n]), no GELU input kept         bias (N)        */
};
/* (gelu: the tanh form of engine/core/gelu.h. cuBLASLt's GELU epilogue is that form too: PyTorch's
 * addmm with a GELU activation runs that epilogue, and where it cannot, gelu(approximate="tanh").)
 * The operands are packed (leading dimensions: the rows' lengths), one matrix, no batch. */

/* Which backends have an entry (kernels.def's last field): FSDP_ON_CPU_<has>(x)
 * is x where the CPU has it, nothing where not; FSDP_ON_CUDA_<has> the same for CUDA. */
#define FSDP_ON_CPU_ALL(...) __VA_ARGS__
#define FSDP_ON_CPU_ALL_OPT(...) __VA_ARGS__
#define FSDP_ON_CPU_CUDA_OPT(...)
#define FSDP_ON_CUDA_ALL(...) __VA_ARGS__
#define FSDP_ON_CUDA_ALL_OPT(...) __VA_ARGS__
#define FSDP_ON_CUDA_CUDA_OPT(...) __VA_ARGS__

/* The table: one member per line of kernels.def, in its order. */
typedef struct fsdp_device_kernels {
    const char *name;
#define FSDP_KERNEL(ret, name, params, has) ret(*name) params;
#include "kernels.def"
} fsdp_device_kernels;

/* cuBLASLt's workspace (cuBLAS's own size on Hopper: room for its split-K
 * algorithms). The CUDA matmul_epilogue_bf16 takes it from the engine's
 * allocator, tag other, at its first call that runs, and holds it for the
 * process, so fsdp.memory and the planner count it; the counting device
 * does the same at its first such call after each fsdp_meta_mimic. When it
 * does not fit (a cap), the entry returns 0: the unfused ops run. */
#define FSDP_EPILOGUE_WORKSPACE_BYTES ((size_t)32 << 20)

/* What the CUDA matmul_epilogue_bf16 fuses (engine/cuda/matmul_lt.cu), so
 * that the counting device takes the path a GPU takes: M, N, K from 1 to
 * 2^31 - 1; every buffer it touches (a, b, d, c when beta != 0, bias, aux,
 * dbias) 16-byte aligned, the alignment its cuBLASLt algorithms are chosen
 * for; with a GELU input (aux), N divisible by 8 (cuBLASLt's rule for the
 * aux leading dimension, here N: the rows of the column-major D); for
 * BGRAD_A, alpha 1 (its bias gradient is of op(A), unscaled). The device
 * may still find no algorithm and return 0. */
static inline int matmul_epilogue_covers(const void *d, const void *a, const void *b, const void *c, int64_t M,
                                         int64_t N, int64_t K, float alpha, float beta, int epilogue,
                                         const void *bias, const void *aux, const void *dbias) {
    if (M < 1 || N < 1 || K < 1 || M > INT32_MAX || N > INT32_MAX || K > INT32_MAX) return 0;
    int gelu = epilogue == FSDP_EPILOGUE_GELU_AUX_BIAS || epilogue == FSDP_EPILOGUE_DGELU_BGRAD;   /* with aux */
    int with_bias = epilogue == FSDP_EPILOGUE_BIAS || epilogue == FSDP_EPILOGUE_GELU_AUX_BIAS ||
                    epilogue == FSDP_EPILOGUE_GELU_BIAS;
    int with_dbias = epilogue == FSDP_EPILOGUE_DGELU_BGRAD || epilogue == FSDP_EPILOGUE_BGRAD_A;
    const void *bufs[7] = {d, a, b, beta != 0.0f ? c : NULL, with_bias ? bias : NULL, gelu ? aux : NULL,
                           with_dbias ? dbias : NULL};
    for (int i = 0; i < 7; i++)
        if ((uintptr_t)bufs[i] % 16 != 0) return 0;
    if (gelu && N % 8 != 0) return 0;
    if (epilogue == FSDP_EPILOGUE_BGRAD_A && alpha != 1.0f) return 0;
    return epilogue >= FSDP_EPILOGUE_BIAS && epilogue <= FSDP_EPILOGUE_GELU_BIAS;
}

/* The shapes of attention_flash_*_bf16: head dim D a multiple of 16 up to
 * 128, any T, B, H >= 1, with element offsets within int64 and at most
 * 2^31 - 1 blocks of 64 rows. */
static inline int attention_flash_covers(int64_t B, int64_t H, int64_t T, int64_t D) {
    if (B < 1 || H < 1 || T < 1 || D < 16 || D > 128 || D % 16 != 0) return 0;
    if (B > INT64_MAX / H / T / (3 * D)) return 0;
    int64_t tiles = (T + 63) / 64;
    return H <= INT32_MAX / tiles && B <= INT32_MAX / tiles / H;
}

/* The table of a device, or NULL when it is not built or has no hardware. */
const fsdp_device_kernels *device_kernels(int device);
/* Makes a device's table available (a backend, at load or at start-up). */
void device_register(int device, const fsdp_device_kernels *k);

/* What a backend says of its device, registered at load (a constructor)
 * whether or not the device is usable: info answers fsdp_device_info
 * (*available, a one-line description in desc of size bytes); host_like
 * says whether host code may read and write the device's memory in place
 * (the CPU, and the meta device while it mimics the CPU). */
typedef struct device_backend {
    fsdp_status (*info)(int *available, char *desc, int64_t size);
    bool (*host_like)(void);
} device_backend;
void device_register_backend(int device, const device_backend *b);

#endif
