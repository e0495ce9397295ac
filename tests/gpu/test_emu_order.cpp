/* test_emu_order.cpp: FSDP_EMU_ORDER=reverse runs the blocks of a grid and
 * the threads of a block between barriers last to first, so that a kernel
 * depending on the order (which a GPU does not promise) shows it.
 *
 * In child processes, one per order (the order is read once a process):
 * - a block of 64 threads, each writing its shared slot and then reading
 *   its neighbour's without a barrier between: the values read differ
 *   between the two orders (the race is seen);
 * - the same with __syncthreads between: the same values in both orders;
 * - a grid of 8 blocks each recording the block that ran before it: the
 *   orders differ (blocks run last to first);
 * - FSDP_EMU_ORDER=sideways is refused, named. */
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

enum { N = 64, BLOCKS = 8 };

/* out[t] = the neighbour's slot as thread t sees it (-1: not written yet) */
__global__ void neighbour_kernel(int *out, int synced) {
    __shared__ int slot[N];
    int t = (int)threadIdx.x;
    if (t == 0)
        for (int i = 0; i < N; i++) slot[i] = -1;
    __syncthreads();
    slot[t] = t + 1;
    if (synced) __syncthreads();
    out[t] = slot[(t + 1) % N];
    __syncthreads();   /* (both variants end at the same barrier count) */
}

/* prev[b] = the block that ran just before block b (-1: the first) */
__global__ void block_order_kernel(int *prev, int *last) {
    if (threadIdx.x == 0) {
        prev[blockIdx.x] = last[0];
        last[0] = (int)blockIdx.x;
    }
}

template <class K, class... A> static void launch(K kernel, unsigned blocks, unsigned threads, A... args) {
    emu_make_launcher(kernel, dim3(blocks), dim3(threads), 0, "test kernel")(args...);
}

/* What a child writes back: the racy and the synced reads, and the block order. */
struct results {
    int racy[N], synced[N], prev[BLOCKS];
};

static bool run_child(const char *order, results *r) {
    int fds[2];
    if (pipe(fds) != 0) return false;
    fflush(stdout);
    pid_t pid = fork();
    if (pid == 0) {
        close(fds[0]);
        setenv("FSDP_EMU_ORDER", order, 1);
        cudaSetDevice(0);
        int *d_out, *d_prev, *d_last;
        cudaMalloc((void **)&d_out, sizeof(int) * N);
        cudaMalloc((void **)&d_prev, sizeof(int) * BLOCKS);
        cudaMalloc((void **)&d_last, sizeof(int));
        results mine;
        launch(neighbour_kernel, 1, N, d_out, 0);
        cudaMemcpyAsync(mine.racy, d_out, sizeof mine.racy, cudaMemcpyDeviceToHost, 0);
        launch(neighbour_kernel, 1, N, d_out, 1);
        cudaMemcpyAsync(mine.synced, d_out, sizeof mine.synced, cudaMemcpyDeviceToHost, 0);
        int minus1 = -1;
        cudaMemcpyAsync(d_last, &minus1, sizeof minus1, cudaMemcpyHostToDevice, 0);
        launch(block_order_kernel, BLOCKS, 32, d_prev, d_last);
        cudaMemcpyAsync(mine.prev, d_prev, sizeof mine.prev, cudaMemcpyDeviceToHost, 0);
        ssize_t w = write(fds[1], &mine, sizeof mine);
        _exit(w == (ssize_t)sizeof mine ? 0 : 1);
    }
    close(fds[1]);
    size_t n = 0;
    ssize_t k;
    while (n < sizeof *r && (k = read(fds[0], (char *)r + n, sizeof *r - n)) > 0) n += (size_t)k;
    close(fds[0]);
    int status = 0;
    waitpid(pid, &status, 0);
    return n == sizeof *r && WIFEXITED(status) && WEXITSTATUS(status) == 0;
}

static void launch_sideways(void) {
    setenv("FSDP_EMU_ORDER", "sideways", 1);
    cudaSetDevice(0);
    int *d_out;
    cudaMalloc((void **)&d_out, sizeof(int) * N);
    launch(neighbour_kernel, 1, N, d_out, 1);
}

static bool refused(void) {
    char buf[1024];
    int status = run_child(launch_sideways, buf, sizeof buf);
    return status >= 0 && WIFSIGNALED(status) && strstr(buf, "FSDP_EMU_ORDER must be forward (the default) or reverse");
}

int main(void) {
    results fwd, rev;
    bool ran = run_child("forward", &fwd) && run_child("reverse", &rev);
    check(ran, "both orders ran");
    if (ran) {
        check(memcmp(fwd.synced, rev.synced, sizeof fwd.synced) == 0 && fwd.synced[0] == 2 && fwd.synced[N - 1] == 1,
              "with the barrier: every thread reads its neighbour's write, in either order");
        check(memcmp(fwd.racy, rev.racy, sizeof fwd.racy) != 0,
              "without it: the values read depend on the order (the race is seen in one of the two runs)");
        check(fwd.prev[0] == -1 && fwd.prev[BLOCKS - 1] == BLOCKS - 2 && rev.prev[BLOCKS - 1] == -1 &&
                  rev.prev[0] == 1,
              "blocks run first to last, and last to first when reversed");
    }
    check(refused(), "FSDP_EMU_ORDER=sideways is refused, named");
    printf(failures ? "%d FAILED\n" : "all passed\n", failures);
    return failures ? 1 : 0;
}
