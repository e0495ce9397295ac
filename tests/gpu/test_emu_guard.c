/* test_emu_guard.c: the host guard of the CUDA emulation (tests/gpu/emu)
 * is on, catches host code touching device memory, and stays out of the way
 * of device ops on two threads at once.
 *
 *   test_emu_guard              legitimate use: kernels, copies, and an op on
 *                               the comm stream's thread holding a buffer
 *                               open while the compute thread's kernels open
 *                               and close the same buffer; then a child
 *                               process shows the buffer is closed again
 *   test_emu_guard --host-read  a planted host read of a device buffer: the
 *                               process must die in the guard's report
 *   test_emu_guard --host-write the same for a write
 *   test_emu_guard --during-op  a host read of one buffer while the comm
 *                               thread holds another open: still caught
 * (ctest checks the reports of the last three; tests/gpu/CMakeLists.txt) */
#include "cuda_runtime.h"
#include "device.h"
#include "fsdp.h"
#include "internal.h"
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

static const fsdp_device_kernels *G;
static int failures;

static void check(int ok, const char *what) {
    printf("%s: %s\n", ok ? "ok" : "FAILED", what);
    if (!ok) failures++;
}

/* volatile: the planted accesses must happen */
__attribute__((noinline)) float plant_host_read(const float *device_buf) { return ((const volatile float *)device_buf)[0]; }
__attribute__((noinline)) void plant_host_write(float *device_buf) { ((volatile float *)device_buf)[0] = 1.0f; }

/* Runs fn(buf) in a child process; 1 when the child died of SIGSEGV. */
static int faults_in_child(float (*fn)(const float *), const float *buf) {
    fflush(stdout);
    pid_t pid = fork();
    if (pid == 0) {
        if (!freopen("/dev/null", "w", stderr)) _exit(3);   /* the report is checked by the other cases */
        volatile float v = fn(buf);
        (void)v;
        _exit(0);
    }
    int status = 0;
    waitpid(pid, &status, 0);
    return WIFSIGNALED(status) && WTERMSIG(status) == SIGSEGV;
}

/* ---- an op on the comm stream's thread that holds a buffer open ---- */
struct hold {
    float *buf;
    atomic_int opened, kernels_done, mismatches;
    int want_kernels;
};

static void hold_open(void *arg) {
    struct hold *h = arg;
    const void *p = h->buf;
    int op = emu_op_begin("NCCL", "test hold", &p, 1);
    atomic_store(&h->opened, 1);
    /* the compute thread's kernels on the same buffer begin and end meanwhile */
    while (atomic_load(&h->kernels_done) < h->want_kernels) usleep(100);
    /* still open to this op: a guard that closed it under us would fault here */
    for (int i = 0; i < 16; i++) h->buf[i] = 7.0f;
    emu_op_end(op);
}

static void hold_until(void *arg) {
    struct hold *h = arg;
    const void *p = h->buf;
    int op = emu_op_begin("NCCL", "test hold", &p, 1);
    atomic_store(&h->opened, 1);
    while (atomic_load(&h->kernels_done) == 0) usleep(100);   /* never: the main thread dies first */
    emu_op_end(op);
}

int main(int argc, char **argv) {
    const char *mode = argc > 1 ? argv[1] : "";
    int rank = 0, world = 1;
    if (fsdp_runtime_init(&rank, &world) != FSDP_OK) {
        fprintf(stderr, "fsdp_runtime_init: %s\n", fsdp_last_error());
        return 1;
    }
    G = device_kernels(FSDP_DEVICE_CUDA);
    if (!G) {
        fprintf(stderr, "no emulated CUDA device\n");
        return 1;
    }
    float *a = G->raw_alloc(16 * sizeof(float)), *b = G->raw_alloc(16 * sizeof(float));
    G->fill_f32(a, 3.0f, 16);
    G->fill_f32(b, 5.0f, 16);
    G->synchronize();

    if (strcmp(mode, "--host-read") == 0) {
        printf("read %g: the guard is off\n", (double)plant_host_read(a));
        return 1;
    }
    if (strcmp(mode, "--host-write") == 0) {
        plant_host_write(a);
        printf("wrote: the guard is off\n");
        return 1;
    }
    cudaStream_t comm;
    if (cudaStreamCreateWithPriority(&comm, cudaStreamNonBlocking, -1) != cudaSuccess) return 1;
    if (strcmp(mode, "--during-op") == 0) {
        static struct hold h;
        h.buf = a;
        emu_stream_enqueue(comm, hold_until, &h);
        while (!atomic_load(&h.opened)) usleep(100);
        printf("read %g: the guard is off\n", (double)plant_host_read(b));
        return 1;
    }

    /* legitimate use */
    float host[16];
    long long ops0 = emu_ops_run();
    G->copy_to_host(host, a, sizeof host);
    int all3 = 1;
    for (int i = 0; i < 16; i++) all3 &= host[i] == 3.0f;
    check(all3, "a kernel's output comes back through a copy");
    check(emu_ops_run() > ops0, "copies count as device ops");
    check(faults_in_child(plant_host_read, a), "a host read of device memory faults (child process)");

    static struct hold h;
    h.buf = a;
    h.want_kernels = 50;
    emu_stream_enqueue(comm, hold_open, &h);
    while (!atomic_load(&h.opened)) usleep(100);
    check(faults_in_child(plant_host_read, b), "while the comm thread holds a, a host read of b faults");
    for (int i = 0; i < h.want_kernels; i++) {   /* each opens and closes a (and b) around the comm op */
        G->axpy_f32(b, a, 0.0f, 16);
        G->scale_f32(b, b, 1.0f, 16);
        atomic_fetch_add(&h.kernels_done, 1);
    }
    cudaStreamSynchronize(comm);
    G->copy_to_host(host, a, sizeof host);
    int all7 = 1;
    for (int i = 0; i < 16; i++) all7 &= host[i] == 7.0f;
    check(all7, "the comm thread's op wrote a while the compute thread's kernels used it (no fault)");
    check(faults_in_child(plant_host_read, a), "after both, a is closed to the host again");
    G->raw_free(a);
    G->raw_free(b);
    printf("%s\n", failures ? "FAILED" : "all passed");
    return failures ? 1 : 0;
}
