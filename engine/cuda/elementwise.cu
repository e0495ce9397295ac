/* elementwise.cu: dtype casts, strided copies, fill, broadcasting
 * binary ops, scale / add-scalar / axpy. Same semantics as engine/cpu
 * cast.c, copy.c and elementwise.c.
 *
 * Strided problems are planned on the host as on the CPU (size-1 dims
 * dropped, dims contiguous in every operand merged) and passed to the kernel
 * by value; each thread unravels its flat index over the merged shape. */
#include "cuda_internal.h"

#define MAXD 8   /* the engine's FSDP_MAX_DIMS; merging never adds dims */

/* ---- casts ---- */

/* (bf16 <-> f32 and float -> integer: convert.h, shared with the CPU) */

__global__ void cast_f32_to_bf16_kernel(uint16_t *out, const float *in, int64_t n) {
    GRID_STRIDE(i, n) out[i] = f32_to_bf16(in[i]);
}
__global__ void cast_bf16_to_f32_kernel(float *out, const uint16_t *in, int64_t n) {
    GRID_STRIDE(i, n) out[i] = bf16_to_f32(in[i]);
}

/* Any pair: floats are read as double (exact for f32, bf16), integers as
 * int64 (exact for i32, i64, u16). */
__global__ void cast_any_kernel(void *out, int out_dt, const void *in, int in_dt, int64_t n) {
    bool in_float = in_dt == FSDP_F32 || in_dt == FSDP_BF16;
    GRID_STRIDE(i, n) {
        double f = 0.0;
        int64_t k = 0;
        switch (in_dt) {
        case FSDP_F32: f = ((const float *)in)[i]; break;
        case FSDP_BF16: f = bf16_to_f32(((const uint16_t *)in)[i]); break;
        case FSDP_I32: k = ((const int32_t *)in)[i]; break;
        case FSDP_I64: k = ((const int64_t *)in)[i]; break;
        default: k = ((const uint16_t *)in)[i]; break;
        }
        switch (out_dt) {
        case FSDP_F32: ((float *)out)[i] = in_float ? (float)f : (float)k; break;
        case FSDP_BF16: ((uint16_t *)out)[i] = f32_to_bf16(in_float ? (float)f : (float)k); break;
        case FSDP_I32: ((int32_t *)out)[i] = in_float ? f_to_i32(f) : (int32_t)k; break;
        case FSDP_I64: ((int64_t *)out)[i] = in_float ? f_to_i64(f) : k; break;
        case FSDP_U16: ((uint16_t *)out)[i] = in_float ? f_to_u16(f) : (uint16_t)k; break;   /* ints wrap, as C */
        default: break;
        }
    }
}

static size_t dtype_bytes(int dt) {
    switch (dt) {
    case FSDP_F32: case FSDP_I32: return 4;
    case FSDP_I64: return 8;
    default: return 2;
    }
}

void cuda_cast_any(void *out, int out_dtype, const void *in, int in_dtype, int64_t n) {
    CUDA_ENTER();
    if (n <= 0) return;
    if (out_dtype == in_dtype) {
        CUDA_CHECK(cudaMemcpyAsync(out, in, (size_t)n * dtype_bytes(in_dtype), cudaMemcpyDeviceToDevice,
                                   cuda_stream()));
        return;
    }
    unsigned blocks = cuda_blocks(n, CUDA_THREADS);
    if (in_dtype == FSDP_F32 && out_dtype == FSDP_BF16)
        LAUNCH(cast_f32_to_bf16_kernel, blocks, CUDA_THREADS, 0)((uint16_t *)out, (const float *)in, n);
    else if (in_dtype == FSDP_BF16 && out_dtype == FSDP_F32)
        LAUNCH(cast_bf16_to_f32_kernel, blocks, CUDA_THREADS, 0)((float *)out, (const uint16_t *)in, n);
    else
        LAUNCH(cast_any_kernel, blocks, CUDA_THREADS, 0)(out, out_dtype, in, in_dtype, n);
    CUDA_CHECK_LAUNCH();
}

/* ---- N-d indexing ---- */

/* A merged strided problem: shape and two operands' strides, in elements. */
struct nd_plan {
    int nd;                    /* 1 .. MAXD */
    int small;                 /* numel < 2^31: 32-bit index arithmetic */
    int64_t shape[MAXD];
    int64_t s0[MAXD], s1[MAXD];
};

/* Offsets of flat index i (row-major over shape) in the two operands. The
 * loop is unrolled over MAXD with a guard, so the plan stays in the
 * parameter bank rather than being copied to local memory. */
__device__ __forceinline__ void nd_offsets(const nd_plan &p, int64_t i, int64_t *o0, int64_t *o1) {
    int64_t a = 0, b = 0, rem = i;
#pragma unroll
    for (int k = MAXD - 1; k > 0; k--) {
        if (k < p.nd) {
            int64_t q = p.small ? (int64_t)((uint32_t)rem / (uint32_t)p.shape[k]) : rem / p.shape[k];
            int64_t idx = rem - q * p.shape[k];
            a += idx * p.s0[k];
            b += idx * p.s1[k];
            rem = q;
        }
    }
    *o0 = a + rem * p.s0[0];
    *o1 = b + rem * p.s1[0];
}

/* Drops size-1 dims and merges a dim into the previous kept one when it
 * steps exactly over it in the reference layout (s_ref, the contiguous
 * output for binary ops or dst for copies) and in both operands. Returns
 * numel; *nd = 0 for a single element. */
static int64_t plan_dims(nd_plan *p, int ndim, const int64_t *shape, const int64_t *s0, const int64_t *s1) {
    int64_t numel = 1;
    int nd = 0;
    for (int k = 0; k < ndim; k++) {
        numel *= shape[k];
        if (shape[k] == 1) continue;
        if (nd > 0 && p->s0[nd - 1] == s0[k] * shape[k] && p->s1[nd - 1] == s1[k] * shape[k]) {
            p->shape[nd - 1] *= shape[k];
            p->s0[nd - 1] = s0[k];
            p->s1[nd - 1] = s1[k];
            continue;
        }
        if (nd == MAXD) cuda_fail(__func__, __FILE__, __LINE__, "plan_dims", "more than 8 dims after merging");
        p->shape[nd] = shape[k];
        p->s0[nd] = s0[k];
        p->s1[nd] = s1[k];
        nd++;
    }
    p->nd = nd;
    p->small = numel < ((int64_t)1 << 31);
    return numel;
}

/* ---- strided copy ---- */

/* dst[plan(i) in s0] = src[plan(i) in s1], elem bytes each */
__global__ void copy_strided_kernel(char *dst, const char *src, nd_plan p, int64_t numel, int elem) {
    GRID_STRIDE(i, numel) {
        int64_t od, os;
        nd_offsets(p, i, &od, &os);
        switch (elem) {
        case 1: dst[od] = src[os]; break;
        case 2: ((uint16_t *)dst)[od] = ((const uint16_t *)src)[os]; break;
        case 4: ((uint32_t *)dst)[od] = ((const uint32_t *)src)[os]; break;
        case 8: ((uint64_t *)dst)[od] = ((const uint64_t *)src)[os]; break;
        default:
            for (int b = 0; b < elem; b++) dst[od * elem + b] = src[os * elem + b];
        }
    }
}

void cuda_copy_strided(void *dst, const int64_t *dst_strides, const void *src, const int64_t *src_strides, int ndim,
                       const int64_t *shape, size_t elem_size) {
    CUDA_ENTER();
    nd_plan p;
    int64_t numel = plan_dims(&p, ndim, shape, dst_strides, src_strides);
    if (numel <= 0) return;
    if (p.nd == 0 || (p.nd == 1 && p.s0[0] == 1 && p.s1[0] == 1)) {   /* one element, or one contiguous run */
        CUDA_CHECK(cudaMemcpyAsync(dst, src, (size_t)numel * elem_size, cudaMemcpyDeviceToDevice, cuda_stream()));
        return;
    }
    LAUNCH(copy_strided_kernel, cuda_blocks(numel, CUDA_THREADS), CUDA_THREADS, 0)((char *)dst, (const char *)src, p,
                                                                                 numel, (int)elem_size);
    CUDA_CHECK_LAUNCH();
}

__global__ void fill_kernel(float *out, float v, int64_t n) {
    GRID_STRIDE(i, n) out[i] = v;
}

void cuda_fill_f32(float *out, float v, int64_t n) {
    CUDA_ENTER();
    if (n <= 0) return;
    LAUNCH(fill_kernel, cuda_blocks(n, CUDA_THREADS), CUDA_THREADS, 0)(out, v, n);
    CUDA_CHECK_LAUNCH();
}

/* ---- binary ops with broadcasting ---- */

__device__ __forceinline__ float binary_op(int op, float x, float y) {
    switch (op) {
    case FSDP_ADD: return x + y;
    case FSDP_SUB: return x - y;
    case FSDP_MUL: return x * y;
    default: return x / y;
    }
}

/* out (contiguous) [i] = a[plan(i) in s0] op b[plan(i) in s1] */
template <class T>
__global__ void binary_kernel(int op, T *__restrict__ out, const T *__restrict__ a, const T *__restrict__ b,
                              nd_plan p, int64_t numel) {
    GRID_STRIDE(i, numel) {
        int64_t oa, ob;
        nd_offsets(p, i, &oa, &ob);
        stf(out + i, binary_op(op, ldf(a[oa]), ldf(b[ob])));
    }
}

/* same shape, both contiguous */
template <class T>
__global__ void binary_contig_kernel(int op, T *__restrict__ out, const T *__restrict__ a, const T *__restrict__ b,
                                     int64_t n) {
    GRID_STRIDE(i, n) stf(out + i, binary_op(op, ldf(a[i]), ldf(b[i])));
}

/* bf16, same shape, contiguous, 16-byte aligned: 8 elements per 16-byte
 * load and store. alignas(16) is what makes them one access: a struct of
 * uint16_t alone has alignment 2, and nvcc then moves it as 8 separate
 * 2-byte loads (its PTX showed ld.global.u16 x 8) */
struct alignas(16) bf16x8 {
    uint16_t h[8];
};
static_assert(sizeof(bf16x8) == 16 && alignof(bf16x8) == 16, "bf16x8 is one 16-byte access");

__global__ void binary_contig_bf16x8_kernel(int op, bf16x8 *__restrict__ out, const bf16x8 *__restrict__ a,
                                            const bf16x8 *__restrict__ b, int64_t n8) {
    GRID_STRIDE(i, n8) {
        bf16x8 x = a[i], y = b[i], r;
#pragma unroll
        for (int k = 0; k < 8; k++) r.h[k] = f32_to_bf16(binary_op(op, bf16_to_f32(x.h[k]), bf16_to_f32(y.h[k])));
        out[i] = r;
    }
}

static bool aligned16(const void *p) { return ((uintptr_t)p & 15u) == 0; }

template <class T>
static void binary_launch(int op, T *out, const T *a, const int64_t *a_strides, const T *b, const int64_t *b_strides,
                          int ndim, const int64_t *shape) {
    if (op < 0 || op > 3) return;   /* the op layer checks */
    nd_plan p;
    int64_t numel = plan_dims(&p, ndim, shape, a_strides, b_strides);
    if (numel <= 0) return;
    if (p.nd == 0) {   /* one element */
        p.nd = 1;
        p.shape[0] = 1;
        p.s0[0] = p.s1[0] = 0;
    }
    unsigned blocks = cuda_blocks(numel, CUDA_THREADS);
    if (p.nd == 1 && p.s0[0] == 1 && p.s1[0] == 1) {
        if (sizeof(T) == 2 && numel % 8 == 0 && aligned16(out) && aligned16(a) && aligned16(b))
            LAUNCH(binary_contig_bf16x8_kernel, cuda_blocks(numel / 8, CUDA_THREADS), CUDA_THREADS, 0)(
                op, (bf16x8 *)out, (const bf16x8 *)a, (const bf16x8 *)b, numel / 8);
        else
            LAUNCH(binary_contig_kernel<T>, blocks, CUDA_THREADS, 0)(op, out, a, b, numel);
    } else {
        LAUNCH(binary_kernel<T>, blocks, CUDA_THREADS, 0)(op, out, a, b, p, numel);
    }
    CUDA_CHECK_LAUNCH();
}

void cuda_binary_f32(int op, float *out, const float *a, const int64_t *a_strides, const float *b,
                     const int64_t *b_strides, int ndim, const int64_t *shape) {
    CUDA_ENTER();
    binary_launch(op, out, a, a_strides, b, b_strides, ndim, shape);
}

void cuda_binary_bf16(int op, uint16_t *out, const uint16_t *a, const int64_t *a_strides, const uint16_t *b,
                      const int64_t *b_strides, int ndim, const int64_t *shape) {
    CUDA_ENTER();
    binary_launch(op, out, a, a_strides, b, b_strides, ndim, shape);
}

/* ---- scalar ops and axpy ---- */

template <class T> __global__ void scale_kernel(T *out, const T *a, float s, int64_t n) {
    GRID_STRIDE(i, n) stf(out + i, ldf(a[i]) * s);
}
template <class T> __global__ void add_scalar_kernel(T *out, const T *a, float s, int64_t n) {
    GRID_STRIDE(i, n) stf(out + i, ldf(a[i]) + s);
}
template <class T> __global__ void axpy_kernel(T *__restrict__ y, const T *__restrict__ x, float alpha, int64_t n) {
    GRID_STRIDE(i, n) stf(y + i, ldf(y[i]) + alpha * ldf(x[i]));
}
/* bf16 y += alpha x, 8 elements per 16-byte access */
__global__ void axpy_bf16x8_kernel(bf16x8 *__restrict__ y, const bf16x8 *__restrict__ x, float alpha, int64_t n8) {
    GRID_STRIDE(i, n8) {
        bf16x8 a = y[i], b = x[i];
#pragma unroll
        for (int k = 0; k < 8; k++) a.h[k] = f32_to_bf16(bf16_to_f32(a.h[k]) + alpha * bf16_to_f32(b.h[k]));
        y[i] = a;
    }
}

/* f32 y += alpha x with x bf16, widened in registers (a group of one's bf16
 * flat gradient into its f32 gradient shard); one FMA per element, as the
 * CPU's cpu_axpy_f32_bf16. 16-byte accesses: 8 bf16 of x, 2 x 4 f32 of y. */
struct alignas(16) f32x4 {
    float v[4];
};
static_assert(sizeof(f32x4) == 16 && alignof(f32x4) == 16, "f32x4 is one 16-byte access");
__global__ void axpy_f32_bf16_kernel(float *__restrict__ y, const uint16_t *__restrict__ x, float alpha, int64_t n) {
    GRID_STRIDE(i, n) y[i] = fmaf(alpha, bf16_to_f32(x[i]), y[i]);
}
__global__ void axpy_f32_bf16x8_kernel(f32x4 *__restrict__ y, const bf16x8 *__restrict__ x, float alpha,
                                       int64_t n8) {
    GRID_STRIDE(i, n8) {
        bf16x8 b = x[i];
        f32x4 lo = y[2 * i], hi = y[2 * i + 1];
#pragma unroll
        for (int k = 0; k < 4; k++) {
            lo.v[k] = fmaf(alpha, bf16_to_f32(b.h[k]), lo.v[k]);
            hi.v[k] = fmaf(alpha, bf16_to_f32(b.h[4 + k]), hi.v[k]);
        }
        y[2 * i] = lo;
        y[2 * i + 1] = hi;
    }
}

#define SCALAR_ENTRY(name, kernel, T, params, args)                                     \
    void name params {                                                                  \
        CUDA_ENTER();                                                                   \
        if (n <= 0) return;                                                             \
        LAUNCH(kernel<T>, cuda_blocks(n, CUDA_THREADS), CUDA_THREADS, 0) args;          \
        CUDA_CHECK_LAUNCH();                                                            \
    }
SCALAR_ENTRY(cuda_scale_f32, scale_kernel, float, (float *out, const float *a, float s, int64_t n), (out, a, s, n))
SCALAR_ENTRY(cuda_add_scalar_f32, add_scalar_kernel, float, (float *out, const float *a, float s, int64_t n),
             (out, a, s, n))
SCALAR_ENTRY(cuda_axpy_f32, axpy_kernel, float, (float *y, const float *x, float alpha, int64_t n), (y, x, alpha, n))
SCALAR_ENTRY(cuda_scale_bf16, scale_kernel, uint16_t, (uint16_t *out, const uint16_t *a, float s, int64_t n),
             (out, a, s, n))
SCALAR_ENTRY(cuda_add_scalar_bf16, add_scalar_kernel, uint16_t, (uint16_t *out, const uint16_t *a, float s, int64_t n),
             (out, a, s, n))

void cuda_axpy_bf16(uint16_t *y, const uint16_t *x, float alpha, int64_t n) {
    CUDA_ENTER();
    if (n <= 0) return;
    if (n % 8 == 0 && aligned16(y) && aligned16(x))
        LAUNCH(axpy_bf16x8_kernel, cuda_blocks(n / 8, CUDA_THREADS), CUDA_THREADS, 0)((bf16x8 *)y, (const bf16x8 *)x,
                                                                                     alpha, n / 8);
    else
        LAUNCH(axpy_kernel<uint16_t>, cuda_blocks(n, CUDA_THREADS), CUDA_THREADS, 0)(y, x, alpha, n);
    CUDA_CHECK_LAUNCH();
}

void cuda_axpy_f32_bf16(float *y, const uint16_t *x, float alpha, int64_t n) {
    CUDA_ENTER();
    if (n <= 0) return;
    if (n % 8 == 0 && aligned16(y) && aligned16(x))
        LAUNCH(axpy_f32_bf16x8_kernel, cuda_blocks(n / 8, CUDA_THREADS), CUDA_THREADS, 0)((f32x4 *)y,
                                                                                         (const bf16x8 *)x, alpha,
                                                                                         n / 8);
    else
        LAUNCH(axpy_f32_bf16_kernel, cuda_blocks(n, CUDA_THREADS), CUDA_THREADS, 0)(y, x, alpha, n);
    CUDA_CHECK_LAUNCH();
}
