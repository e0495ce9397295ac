/* test_emu_wmma.cpp: the emulation's nvcuda::wmma (tests/gpu/emu/include/mma.h)
 * computes what the tensor cores compute and refuses what a GPU would
 * not run correctly.
 *
 * - mma_sync on bf16 tiles loaded row- and column-major, with an f32
 *   accumulator loaded from memory, against the product in double (within
 *   the f32 roundings of the 16 adds); stores in both layouts.
 * - a lane reading a stored tile before __syncwarp sees other lanes'
 *   elements unwritten, after it sees them all (as on a GPU, where each
 *   lane holds only part of the tile).
 * - in child processes, each must end in the emulation's report: lanes at
 *   different collective calls, a lane that exits while the others wait, a
 *   partial warp, a pointer not 256-bit aligned, an ldm not a multiple of 16
 *   bytes. */
#include "cuda_emu.h"
#include "emu_child.h"
#include <mma.h>
#include <math.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

using namespace nvcuda;

static int failures;

static void check(bool ok, const char *what) {
    printf("%s: %s\n", ok ? "ok" : "FAILED", what);
    if (!ok) failures++;
}

typedef wmma::fragment<wmma::matrix_a, 16, 16, 16, __nv_bfloat16, wmma::row_major> frag_a;
typedef wmma::fragment<wmma::matrix_b, 16, 16, 16, __nv_bfloat16, wmma::col_major> frag_bt;
typedef wmma::fragment<wmma::accumulator, 16, 16, 16, float> frag_c;

/* d (16, 16) row-major = a (16, 16) row-major b (given as b^T, row-major,
 * i.e. b column-major) + c (column-major in memory); dt = the same, stored
 * column-major */
__global__ void mma_kernel(float *d, float *dt, const __nv_bfloat16 *a, const __nv_bfloat16 *bt, const float *c) {
    frag_a fa;
    frag_bt fb;
    frag_c acc;
    wmma::load_matrix_sync(fa, a, 16);
    wmma::load_matrix_sync(fb, bt, 16);
    wmma::load_matrix_sync(acc, c, 16, wmma::mem_col_major);
    wmma::mma_sync(acc, fa, fb, acc);
    wmma::store_matrix_sync(d, acc, 16, wmma::mem_row_major);
    wmma::store_matrix_sync(dt, acc, 16, wmma::mem_col_major);
}

/* seen[0]: elements of a stored tile lane 0 reads right after the store,
 * seen[1]: after a __syncwarp (each counts the elements equal to 1) */
__global__ void share_kernel(float *tile, float *seen) {
    frag_c acc;
    wmma::fill_fragment(acc, 1.0f);
    wmma::store_matrix_sync(tile, acc, 16, wmma::mem_row_major);
    int lane = emu_lane();
    float before = 0.0f;
    if (lane == 0)
        for (int i = 0; i < 256; i++) before += tile[i] == 1.0f;
    __syncwarp();
    float after = 0.0f;
    if (lane == 0) {
        for (int i = 0; i < 256; i++) after += tile[i] == 1.0f;
        seen[0] = before;
        seen[1] = after;
    }
}

/* the misuses, each a kernel of one warp (or less) */
__global__ void split_kernel(float *out, const __nv_bfloat16 *a) {   // lane 5 stores while the rest load
    frag_a fa;
    frag_c acc;
    wmma::fill_fragment(acc, 0.0f);
    if (emu_lane() == 5) wmma::store_matrix_sync(out, acc, 16, wmma::mem_row_major);
    else wmma::load_matrix_sync(fa, a, 16);
}
__global__ void exit_kernel(float *out, const __nv_bfloat16 *a) {   // lane 7 leaves before the mma
    if (emu_lane() == 7) return;
    frag_a fa;
    frag_bt fb;
    frag_c acc;
    wmma::fill_fragment(acc, 0.0f);
    wmma::load_matrix_sync(fa, a, 16);
    wmma::load_matrix_sync(fb, a, 16);
    wmma::mma_sync(acc, fa, fb, acc);
    wmma::store_matrix_sync(out, acc, 16, wmma::mem_row_major);
}
__global__ void load_kernel(float *out, const __nv_bfloat16 *a, int offset, unsigned ldm) {
    frag_a fa;
    wmma::load_matrix_sync(fa, a + offset, ldm);
    (void)out;
}

template <class K, class... A> static void launch(K kernel, unsigned threads, A... args) {
    emu_make_launcher(kernel, dim3(1), dim3(threads), 0, "test kernel")(args...);
}

static uint16_t bf16_of(float f) { return f32_to_bf16(f); }

/* Runs fn in a child; true when it died of SIGABRT with `want` in its stderr. */
static bool dies_with(void (*fn)(void), const char *want) {
    char buf[4096];
    int status = run_child(fn, buf, sizeof buf);
    bool ok = status >= 0 && WIFSIGNALED(status) && WTERMSIG(status) == SIGABRT && strstr(buf, want);
    if (!ok) fprintf(stderr, "  child said: %s", buf);
    return ok;
}

static __nv_bfloat16 *g_a;   /* a (16, 16) bf16 tile in device memory */
static float *g_out;

static void misuse_split(void) { launch(split_kernel, 32, g_out, (const __nv_bfloat16 *)g_a); }
static void misuse_exit(void) { launch(exit_kernel, 32, g_out, (const __nv_bfloat16 *)g_a); }
static void misuse_partial(void) { launch(exit_kernel, 16, g_out, (const __nv_bfloat16 *)g_a); }
static void misuse_align(void) { launch(load_kernel, 32, g_out, (const __nv_bfloat16 *)g_a, 8, 16u); }
static void misuse_ldm(void) { launch(load_kernel, 32, g_out, (const __nv_bfloat16 *)g_a, 0, 12u); }

int main(void) {
    cudaSetDevice(0);
    /* values with few significant bits, so the sum's roundings are small but present */
    uint16_t ha[256], hbt[256];
    float fa[256], fbt[256], hc[256];
    for (int i = 0; i < 256; i++) {
        ha[i] = bf16_of((float)((i * 37) % 29 - 14) / 8.0f + 1.0f / 256.0f);
        hbt[i] = bf16_of((float)((i * 53) % 31 - 15) / 16.0f);
        fa[i] = bf16_to_f32(ha[i]);
        fbt[i] = bf16_to_f32(hbt[i]);
        hc[i] = (float)(i % 7) * 0.25f - 0.5f;
    }
    void *a, *bt, *c, *d, *dt, *tile, *seen;
    cudaMalloc(&a, 512);
    cudaMalloc(&bt, 512);
    cudaMalloc(&c, 1024);
    cudaMalloc(&d, 1024);
    cudaMalloc(&dt, 1024);
    cudaMalloc(&tile, 1024);
    cudaMalloc(&seen, 32);
    cudaMemcpyAsync(a, ha, 512, cudaMemcpyHostToDevice, 0);
    cudaMemcpyAsync(bt, hbt, 512, cudaMemcpyHostToDevice, 0);
    cudaMemcpyAsync(c, hc, 1024, cudaMemcpyHostToDevice, 0);
    launch(mma_kernel, 64, (float *)d, (float *)dt, (const __nv_bfloat16 *)a, (const __nv_bfloat16 *)bt,
           (const float *)c);
    float hd[256], hdt[256];
    cudaMemcpyAsync(hd, d, 1024, cudaMemcpyDeviceToHost, 0);
    cudaMemcpyAsync(hdt, dt, 1024, cudaMemcpyDeviceToHost, 0);
    int wrong = 0, transposed = 0;
    for (int i = 0; i < 16; i++)
        for (int j = 0; j < 16; j++) {
            double want = hc[j * 16 + i], mag = fabs(want);   // c column-major
            for (int k = 0; k < 16; k++) {
                want += (double)fa[i * 16 + k] * fbt[j * 16 + k];   // b[k][j] = bt[j][k]
                mag += fabs((double)fa[i * 16 + k] * fbt[j * 16 + k]);
            }
            wrong += !(fabs(hd[i * 16 + j] - want) <= 16 * mag * 0x1p-24);
            transposed += hdt[j * 16 + i] != hd[i * 16 + j];
        }
    check(wrong == 0, "mma_sync: bf16 a (row-major), b (column-major), c (column-major): the product within f32 sums");
    check(transposed == 0, "store_matrix_sync: the column-major store is the row-major one transposed");

    launch(share_kernel, 32, (float *)tile, (float *)seen);
    float hs[2];
    cudaMemcpyAsync(hs, seen, 8, cudaMemcpyDeviceToHost, 0);
    check(hs[0] == 8.0f && hs[1] == 256.0f,
          "a stored tile read before __syncwarp: only the reading lane's 8 elements; after: all 256");

    g_a = (__nv_bfloat16 *)a;
    g_out = (float *)d;
    check(dies_with(misuse_split, "different warp-collective calls: lane 0 at wmma::load_matrix_sync, lane 5 at "
                                  "wmma::store_matrix_sync"),
          "lanes at different collective calls are reported");
    check(dies_with(misuse_exit, "some lanes exited while others wait"), "a lane that exits before a collective call is reported");
    check(dies_with(misuse_partial, "wmma::load_matrix_sync in a partial warp"), "a partial warp is reported");
    check(dies_with(misuse_align, "wmma::load_matrix_sync: pointer not 256-bit aligned"), "a misaligned tile is reported");
    check(dies_with(misuse_ldm, "wmma::load_matrix_sync: ldm not a multiple of 16 bytes"), "a bad ldm is reported");
    printf(failures ? "%d FAILED\n" : "all passed\n", failures);
    return failures ? 1 : 0;
}
