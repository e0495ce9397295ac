/* test_emu_align.cpp: the emulation refuses the misaligned accesses a GPU
 * faults on ("misaligned address"), which x86 would run.
 *
 * The engine's kernels are built for the emulation with the alignment check
 * (tests/gpu/CMakeLists.txt), and so is this file:
 * - a warp copying 16-byte vectors (8 bf16, as the elementwise and fused
 *   kernels move them) from a 16-byte aligned buffer, and a double kept at
 *   an 8-byte offset of dynamic shared memory, run and move their values;
 * - in child processes, the same vector copy from 2 bytes into the buffer
 *   (a bf16 view at an odd element offset) and the double at a 4-byte
 *   offset must each end in the emulation's report naming the kernel. */
#include "cuda_emu.h"
#include "emu_child.h"
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

static int failures;

static void check(bool ok, const char *what) {
    printf("%s: %s\n", ok ? "ok" : "FAILED", what);
    if (!ok) failures++;
}

struct alignas(16) vec8 {   /* 8 bf16: one 16-byte access */
    uint16_t h[8];
};

__global__ void vec_copy_kernel(vec8 *out, const vec8 *in) { out[threadIdx.x] = in[threadIdx.x]; }

/* a double at byte `offset` of the dynamic shared memory, written and read back */
__global__ void smem_double_kernel(double *out, int offset) {
    double *d = (double *)((char *)emu_dyn_smem() + offset);
    if (threadIdx.x == 0) *d = 1.5;
    __syncthreads();
    if (threadIdx.x == 0) out[0] = *d;
}

template <class K, class... A>
static void launch(K kernel, const char *name, unsigned threads, size_t smem, A... args) {
    emu_make_launcher(kernel, dim3(1), dim3(threads), smem, name)(args...);
}

static vec8 *g_in, *g_out;
static double *g_dout;

static void misaligned_vector(void) {
    launch(vec_copy_kernel, "vec_copy_kernel", 32, 0, g_out, (const vec8 *)((const char *)g_in + 2));
}
static void misaligned_double(void) { launch(smem_double_kernel, "smem_double_kernel", 32, 64, g_dout, 4); }

/* Runs fn in a child; true when it died (signal or failure exit) with every
 * string of want in its stderr. */
static bool dies_with(void (*fn)(void), const char *want1, const char *want2) {
    char buf[8192];
    int status = run_child(fn, buf, sizeof buf);
    if (status < 0) return false;
    bool died = WIFSIGNALED(status) || (WIFEXITED(status) && WEXITSTATUS(status) != 0);
    bool ok = died && strstr(buf, want1) && (!want2 || strstr(buf, want2));
    if (!ok) fprintf(stderr, "  child (%s) said: %s\n", died ? "died" : "exited 0", buf);
    return ok;
}

int main(void) {
    cudaSetDevice(0);
    uint16_t host[32 * 8 + 8];
    for (int i = 0; i < 32 * 8 + 8; i++) host[i] = (uint16_t)(i * 7 + 1);
    cudaMalloc((void **)&g_in, sizeof host);
    cudaMalloc((void **)&g_out, 32 * sizeof(vec8));
    cudaMalloc((void **)&g_dout, sizeof(double));
    cudaMemcpyAsync(g_in, host, sizeof host, cudaMemcpyHostToDevice, 0);

    launch(vec_copy_kernel, "vec_copy_kernel", 32, 0, g_out, (const vec8 *)g_in);
    uint16_t back[32 * 8];
    cudaMemcpyAsync(back, g_out, sizeof back, cudaMemcpyDeviceToHost, 0);
    check(memcmp(back, host, sizeof back) == 0, "16-byte vectors from a 16-byte aligned buffer: copied");

    launch(smem_double_kernel, "smem_double_kernel", 32, 64, g_dout, 8);
    double d = 0.0;
    cudaMemcpyAsync(&d, g_dout, sizeof d, cudaMemcpyDeviceToHost, 0);
    check(d == 1.5, "a double at an 8-byte offset of dynamic shared memory: kept");

#ifdef __SANITIZE_ADDRESS__
    const char *named_vec = NULL, *named_double = NULL;   /* UBSan's own report: no kernel name */
#else
    const char *named_vec = "kernel vec_copy_kernel (running) trapped", *named_double = "kernel smem_double_kernel";
#endif
    check(dies_with(misaligned_vector, "misaligned address", named_vec),
          "16-byte vectors 2 bytes into a buffer (an odd bf16 offset) are refused, naming the kernel");
    check(dies_with(misaligned_double, "misaligned address", named_double),
          "a double at a 4-byte offset of shared memory is refused, naming the kernel");
    printf(failures ? "%d FAILED\n" : "all passed\n", failures);
    return failures ? 1 : 0;
}
