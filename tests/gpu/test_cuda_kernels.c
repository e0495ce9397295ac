/* test_cuda_kernels.c: every entry of the CUDA kernel table against the
 * CPU table's entry of the same name, on random non-zero inputs of awkward
 * sizes (1, odd, prime, a few thousand), then a few ops end to end through
 * the public API with tensors on the GPU. This file holds the start-up
 * checks, the end-to-end ops and main; the kernels are tested by family,
 * each file with its tolerances at the top:
 *   test_cuda_kernels_memory.c       copies, zero, casts, strided copies, fill, random init, dropout
 *   test_cuda_kernels_matmul.c       the batched GEMMs, f32 and bf16
 *   test_cuda_kernels_elementwise.c  binary ops, scale, axpy, reductions (f32 and bf16)
 *   test_cuda_kernels_nn.c           activations, softmax, norms, the fused bias entries (f32 and bf16)
 *   test_cuda_kernels_loss.c         embedding, cross-entropy, the vocabulary-chunked classifier
 *   test_cuda_kernels_attention.c    attention f32, packed bf16 on GEMMs, flash
 *   test_cuda_kernels_optim.c        AdamW (one tensor, many), SGD
 *   test_cuda_kernels_bench.c        --bench and --flash
 * sharing cuda_kernels_check.h (buffers, comparisons, the bf16 rule).
 *
 * Built twice (tests/gpu/CMakeLists.txt):
 * - test_cuda_kernels: the real CUDA backend. Without a GPU it prints
 *   "SKIPPED: <why>" and exits 77, which ctest reports as skipped.
 * - test_cuda_kernels_emu (FSDP_CUDA_EMU): the same .cu sources compiled for
 *   the host over tests/gpu/emu, which runs each kernel's threads as fibers
 *   with real barriers and checks launches and pointers: the kernels' logic
 *   is checked on every machine, the GPU build then checks the hardware.
 *
 * Flags: --init-only (start-up checks only), --fault (a failing op must end
 * the process with a message naming device and op), --bench (time per call
 * of the main kernels at GPT-2 small sizes; toy sizes in the emulation),
 * --flash B H T D (the flash attention once at that shape, for a profiler). */
#include "cuda_kernels_check.h"
#include <string.h>

#ifdef FSDP_CUDA_EMU
void emu_set_device_count(int n);
#define MODE "emulated CUDA"
#else
#define MODE "CUDA"
#endif

/* ---- ops end to end through the public API, CUDA tensors vs CPU tensors ---- */

static fsdp_tensor *tensor(int device, int ndim, const int64_t *shape, const float *data, int64_t n) {
    fsdp_tensor *t = NULL;
    if (fsdp_tensor_from_data(&t, FSDP_F32, ndim, shape, data, n * (int64_t)sizeof(float), device, FSDP_TAG_OTHER) !=
        FSDP_OK) {
        fprintf(stderr, "fsdp_tensor_from_data: %s\n", fsdp_last_error());
        exit(1);
    }
    return t;
}

/* y = layernorm(gelu(x @ w)) with its mean, on one device; the values of y and sum(y) */
static int run_model(int device, const float *x, const float *w, float *y, double *sum) {
    int64_t xs[2] = {5, 17}, ws[2] = {17, 9};
    fsdp_tensor *tx = tensor(device, 2, xs, x, 85), *tw = tensor(device, 2, ws, w, 153), *h = NULL, *a = NULL,
                *r = NULL, *s = NULL;
    int ok = fsdp_matmul(&h, tx, tw, 0, 0) == FSDP_OK && fsdp_gelu(&a, h) == FSDP_OK &&
             fsdp_layernorm(&r, a, NULL, NULL, 1e-5) == FSDP_OK && fsdp_sum(&s, r, 0, NULL, 0) == FSDP_OK &&
             fsdp_tensor_to_data(r, y, 45 * (int64_t)sizeof(float)) == FSDP_OK && fsdp_tensor_item(s, sum) == FSDP_OK;
    if (!ok) fprintf(stderr, "op on %s failed: %s\n", device ? "cuda" : "cpu", fsdp_last_error());
    fsdp_tensor *all[] = {tx, tw, h, a, r, s};
    for (int i = 0; i < 6; i++)
        if (all[i]) fsdp_tensor_release(all[i]);
    return ok;
}

static void test_ops_end_to_end(void) {
    float *x = hrand(85, 1), *w = hrand(153, 1), yc[45], yg[45];
    double sc = 0, sg = 0;
    int okc = run_model(FSDP_DEVICE_CPU, x, w, yc, &sc), okg = run_model(FSDP_DEVICE_CUDA, x, w, yg, &sg);
    test_check(okc && okg, "matmul -> gelu -> layernorm -> sum through the public API on both devices");
    if (okc && okg) {
        check_f("ops end to end: layernorm(gelu(x @ w))", yg, yc, 45, 1e-5, 1e-5, -1);
        test_check(fabs(sg - sc) <= 1e-4, "ops end to end: sum %.9g on cuda, %.9g on cpu", sg, sc);
    }
    free_case();
}

/* ---- start-up ---- */

/* A CUDA failure inside a table entry ends the process with a message
 * naming the device and the op (here: a matmul too large for cuBLAS). */
static int fault(void) {
    float *c = dalloc(sizeof(float)), *a = dalloc(sizeof(float)), *b = dalloc(sizeof(float));
    G->matmul_f32(c, a, b, 1, (int64_t)1 << 32, 1, 1, 0, 0, 1.0f, 0.0f, 0, 0, 0);
    printf("still alive after a fatal error\n");
    return 1;
}

/* no arguments: everything; --init-only: start-up checks only; --fault: see
 * fault(); --bench: time the kernels at GPT-2 sizes (on a GPU); --flash B H
 * T D: see flash_once */
int main(int argc, char **argv) {
    const char *arg = argc > 1 ? argv[1] : "";
    int init_only = strcmp(arg, "--init-only") == 0, do_fault = strcmp(arg, "--fault") == 0;
    int do_bench = strcmp(arg, "--bench") == 0, do_flash = strcmp(arg, "--flash") == 0;
    C = device_kernels(FSDP_DEVICE_CPU);
    cpu_threads_set(1);
    test_rng_seed(&rng, 20240611);
#ifdef FSDP_CUDA_EMU
    /* no device at all: nothing registered, a reason, FSDP_OK */
    emu_set_device_count(0);
    fsdp_status st0 = cuda_backend_init(0);
    const char *why = cuda_unavailable_reason();
    test_check(st0 == FSDP_OK && why && strncmp(why, "no GPU: cudaGetDeviceCount: ", 28) == 0,
               "no GPU: status %d, reason \"%s\"", (int)st0, why ? why : "(null)");
    int avail0 = -1;
    char desc0[256] = "";
    fsdp_status sti = cuda_device_info(&avail0, desc0, sizeof desc0);
    test_check(sti == FSDP_OK && avail0 == 0 && strcmp(desc0, why ? why : "") == 0, "no GPU: device info %d \"%s\"",
               avail0, desc0);
    test_check(device_kernels(FSDP_DEVICE_CUDA) == NULL, "no GPU: nothing registered");
    emu_set_device_count(2);
#endif
    /* a local rank beyond the node's GPUs is an error naming both */
    fsdp_status st = cuda_backend_init(1000);
    const char *reason = cuda_unavailable_reason();
    if (st == FSDP_OK && reason) {
        printf("SKIPPED: %s\n", reason);
        return 77;
    }
    test_check(st == FSDP_ERR_DEVICE && strstr(fsdp_last_error(), "rank with local rank 1000 has no GPU: this node has"),
               "local rank 1000: status %d, message \"%s\"", (int)st, fsdp_last_error());
#ifdef FSDP_CUDA_EMU
    st = cuda_backend_init(1);
#else
    st = cuda_backend_init(0);
#endif
    if (st != FSDP_OK || cuda_unavailable_reason()) {
        printf("FAILED: cuda_backend_init: %s\n", st != FSDP_OK ? fsdp_last_error() : cuda_unavailable_reason());
        return 1;
    }
    G = device_kernels(FSDP_DEVICE_CUDA);
    test_check(G != NULL, "the CUDA table is registered");
    if (!G) return test_summary();
    int avail = 0, def = -1;
    char desc[256] = "";
    cuda_device_info(&avail, desc, sizeof desc);
#ifndef FSDP_CUDA_EMU
    int pub_avail = 0;
    char pub_desc[256] = "";
    fsdp_device_info(FSDP_DEVICE_CUDA, &pub_avail, pub_desc, sizeof pub_desc);
    test_check(pub_avail == 1 && strcmp(pub_desc, desc) == 0, "fsdp_device_info(cuda): %d \"%s\"", pub_avail, pub_desc);
#endif
    fsdp_default_device(&def);
    const char *want_dev = getenv("FSDP_DEVICE");
    int want_def = want_dev && strcmp(want_dev, "cpu") == 0 ? FSDP_DEVICE_CPU : FSDP_DEVICE_CUDA;
    test_check(avail == 1 && strncmp(desc, "cuda:", 5) == 0, "device info: %d \"%s\"", avail, desc);
    test_check(def == want_def, "default device %d, want %d", def, want_def);
    printf("%s: %s\n", MODE, desc);
    if (do_fault) return fault();
    if (do_flash) return flash_once(argc, argv);
#ifdef FSDP_CUDA_EMU
    if (do_bench) return bench(1);   /* the emulation's times mean nothing: toy sizes, to run the code */
#else
    if (do_bench) return bench(0);
#endif
#ifdef FSDP_CUDA_EMU
    {   /* the flash entries are there only where a block can have their shared memory */
        const char *optin = getenv("FSDP_EMU_SMEM_OPTIN");
        int small = optin && *optin && (size_t)strtoull(optin, NULL, 10) < cuda_attention_flash_smem_max();
        test_check((G->attention_flash_forward_bf16 == NULL) == small && (G->attention_flash_backward_bf16 == NULL) == small,
                   "flash entries with %s bytes of opt-in shared memory (the kernels need %zu): %s", optin ? optin : "the default",
                   cuda_attention_flash_smem_max(), G->attention_flash_forward_bf16 ? "registered" : "absent");
    }
#endif
    if (init_only) return test_summary();

    test_memory();
    test_cast();
    test_copy_strided();
    test_fill();
    test_matmul();
    test_binary();
    test_scalar_ops();
    test_sum_dim();
    test_sum_all();
    test_sumsq_many();
    test_activations();
    test_softmax();
    test_norms();
    test_embedding();
    test_embedding_backward_sorted();
    test_cross_entropy();
    test_cross_entropy_online();
    test_classifier();
    test_attention();
    test_attention_qkv();
    test_attention_flash();
    test_bf16_elementwise();
    test_bf16_nn();
    test_fused();
    test_random();
    test_optim();
    test_adamw_many();
    test_ops_end_to_end();
    G->synchronize();
    fsdp_status last = cuda_last_status();
    test_check(last == FSDP_OK, "no CUDA error recorded: %s", last == FSDP_OK ? "" : fsdp_last_error());
    return test_summary();
}
