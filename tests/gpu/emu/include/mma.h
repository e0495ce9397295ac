/* mma.h (emulation): the part of CUDA's nvcuda::wmma the engine's kernels
 * use, on the host: 16x16x16 tiles, bf16 (__nv_bfloat16) operands in
 * row- or column-major memory, f32 accumulators.
 *
 * On a GPU a fragment is spread over the 32 lanes of a warp in a layout
 * CUDA does not specify. Here every lane's fragment holds the whole tile,
 * row-major; kernels that touch fragments only through the layout-agnostic
 * calls (load, store, mma, fill, and element-wise work applied alike to
 * every x[i]) compute the same on both.
 *
 * What it checks, as a GPU requires:
 * - load_matrix_sync, store_matrix_sync and mma_sync are warp-collective:
 *   all 32 lanes of the warp must make the same call (a barrier of the warp;
 *   lanes at another call, lanes that exited, a partial warp are reported).
 * - the pointer is 256-bit aligned and ldm a multiple of 16 bytes, at least
 *   a row (row-major) or a column (column-major) long.
 * - a store writes, from each lane, only a share of the tile (element i from
 *   lane i mod 32, as each lane holds only part of it on a GPU), so a lane
 *   that reads the tile back before a __syncwarp sees what it would on a
 *   GPU: other lanes' elements not written yet.
 * The product: bf16 inputs (their products are exact in f32), f32
 * accumulation in k order, one f32 rounding per add. The tensor cores add
 * in an order and with internal rounding NVIDIA does not document, so a GPU
 * may differ from this in the last bits of each sum. */
#ifndef FSDP_EMU_MMA_H
#define FSDP_EMU_MMA_H

#include "cuda_emu.h"
#include "convert.h"
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <type_traits>

/* bf16 as CUDA's cuda_bf16.h names it: the bits of the top half of an f32 */
struct __nv_bfloat16 {
    uint16_t bits;
};

namespace nvcuda {
namespace wmma {

struct matrix_a {};
struct matrix_b {};
struct accumulator {};
struct row_major {};
struct col_major {};
enum layout_t { mem_row_major, mem_col_major };

/* rows and columns of a fragment's tile (A: M x K, B: K x N, C: M x N) */
template <class Use, int M, int N, int K> struct emu_tile;
template <int M, int N, int K> struct emu_tile<matrix_a, M, N, K> {
    enum { rows = M, cols = K };
};
template <int M, int N, int K> struct emu_tile<matrix_b, M, N, K> {
    enum { rows = K, cols = N };
};
template <int M, int N, int K> struct emu_tile<accumulator, M, N, K> {
    enum { rows = M, cols = N };
};

template <class Use, int M, int N, int K, class T, class Layout = void> struct fragment {
    static_assert(M == 16 && N == 16 && K == 16, "the emulation has the 16x16x16 shape only");
    static_assert(std::is_same<Use, accumulator>::value ? std::is_same<T, float>::value
                                                        : std::is_same<T, __nv_bfloat16>::value,
                  "the emulation has bf16 operands and f32 accumulators only");
    static_assert(std::is_same<Use, accumulator>::value == std::is_same<Layout, void>::value,
                  "operand fragments have a layout, accumulators none");
    enum { rows = emu_tile<Use, M, N, K>::rows, cols = emu_tile<Use, M, N, K>::cols, num_elements = rows * cols };
    T x[num_elements];   // the whole tile, row-major, in every lane
};

static inline float emu_value(__nv_bfloat16 v) { return bf16_to_f32(v.bits); }
static inline float emu_value(float v) { return v; }

[[noreturn]] static inline void emu_wmma_fail(const char *what, const char *why, const void *p, unsigned ldm) {
    fprintf(stderr, "cuda_emu: %s: %s (pointer %p, ldm %u)\n", what, why, p, ldm);
    fflush(stderr);
    abort();
}

/* CUDA's requirements on a tile in memory */
static inline void emu_wmma_check(const char *what, const void *p, unsigned ldm, size_t elem, unsigned min_ldm) {
    if (!p) emu_wmma_fail(what, "NULL pointer", p, ldm);
    if ((uintptr_t)p % 32 != 0) emu_wmma_fail(what, "pointer not 256-bit aligned", p, ldm);
    if ((ldm * elem) % 16 != 0) emu_wmma_fail(what, "ldm not a multiple of 16 bytes", p, ldm);
    if (ldm < min_ldm) emu_wmma_fail(what, "ldm shorter than a row (row-major) or column (column-major)", p, ldm);
}

template <class Use, int M, int N, int K, class T, class Layout>
inline void fill_fragment(fragment<Use, M, N, K, T, Layout> &f, const T &v) {
    for (int i = 0; i < f.num_elements; i++) f.x[i] = v;
}

/* operands: the layout is the fragment's */
template <class Use, int M, int N, int K, class T, class Layout>
inline void load_matrix_sync(fragment<Use, M, N, K, T, Layout> &f, const T *p, unsigned ldm) {
    static_assert(!std::is_same<Use, accumulator>::value, "an accumulator's load takes a layout_t");
    typedef fragment<Use, M, N, K, T, Layout> F;
    const bool row = std::is_same<Layout, row_major>::value;
    emu_wmma_check("wmma::load_matrix_sync", p, ldm, sizeof(T), row ? F::cols : F::rows);
    emu_warp_collective("wmma::load_matrix_sync");
    for (int r = 0; r < F::rows; r++)
        for (int c = 0; c < F::cols; c++) f.x[r * F::cols + c] = row ? p[(size_t)r * ldm + c] : p[(size_t)c * ldm + r];
}

template <int M, int N, int K>
inline void load_matrix_sync(fragment<accumulator, M, N, K, float> &f, const float *p, unsigned ldm, layout_t l) {
    emu_wmma_check("wmma::load_matrix_sync", p, ldm, sizeof(float), l == mem_row_major ? N : M);
    emu_warp_collective("wmma::load_matrix_sync");
    for (int r = 0; r < M; r++)
        for (int c = 0; c < N; c++) f.x[r * N + c] = l == mem_row_major ? p[(size_t)r * ldm + c] : p[(size_t)c * ldm + r];
}

template <int M, int N, int K>
inline void store_matrix_sync(float *p, const fragment<accumulator, M, N, K, float> &f, unsigned ldm, layout_t l) {
    emu_wmma_check("wmma::store_matrix_sync", p, ldm, sizeof(float), l == mem_row_major ? N : M);
    emu_warp_collective("wmma::store_matrix_sync");
    for (int i = emu_lane(); i < M * N; i += 32) {   // this lane's share
        int r = i / N, c = i % N;
        if (l == mem_row_major) p[(size_t)r * ldm + c] = f.x[i];
        else p[(size_t)c * ldm + r] = f.x[i];
    }
}

/* d = a b + c */
template <int M, int N, int K, class LA, class LB>
inline void mma_sync(fragment<accumulator, M, N, K, float> &d, const fragment<matrix_a, M, N, K, __nv_bfloat16, LA> &a,
                     const fragment<matrix_b, M, N, K, __nv_bfloat16, LB> &b,
                     const fragment<accumulator, M, N, K, float> &c) {
    emu_warp_collective("wmma::mma_sync");
    float out[M * N];
    for (int i = 0; i < M; i++)
        for (int j = 0; j < N; j++) {
            float acc = c.x[i * N + j];
            for (int k = 0; k < K; k++) acc += emu_value(a.x[i * K + k]) * emu_value(b.x[k * N + j]);
            out[i * N + j] = acc;
        }
    for (int i = 0; i < M * N; i++) d.x[i] = out[i];
}

}   // namespace wmma
}   // namespace nvcuda

#endif
