/* cuda_case.c: the buffers of one kernel test case (cuda_case.h). */
#include "cuda_case.h"

const fsdp_device_kernels *G;
static void *host_ptrs[CASE_MAX_BUFFERS], *dev_ptrs[CASE_MAX_BUFFERS];
static int n_host, n_dev;

void *halloc(size_t bytes) {
    void *p = malloc(bytes ? bytes : 1);
    if (!p || n_host == CASE_MAX_BUFFERS) abort();
    return host_ptrs[n_host++] = p;
}
void *dalloc(size_t bytes) {
    void *p = G->raw_alloc(bytes ? bytes : 1);
    if (!p || n_dev == CASE_MAX_BUFFERS) {
        fprintf(stderr, "raw_alloc(%zu) failed\n", bytes);
        exit(1);
    }
    return dev_ptrs[n_dev++] = p;
}
void free_case(void) {
    while (n_host) free(host_ptrs[--n_host]);
    while (n_dev) G->raw_free(dev_ptrs[--n_dev]);
}
