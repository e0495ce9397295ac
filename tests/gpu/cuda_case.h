/* cuda_case.h: the buffers of one kernel test case, on the host and on the
 * device (through the CUDA table's raw_alloc), all freed by free_case().
 * The including test sets G, the CUDA table, before its first case. */
#ifndef FSDP_TEST_CUDA_CASE_H
#define FSDP_TEST_CUDA_CASE_H

#include "device.h"
#include <stdio.h>
#include <stdlib.h>

#define CASE_MAX_BUFFERS 1024   /* per case, host and device each */

static const fsdp_device_kernels *G;   /* the CUDA table */
static void *host_ptrs[CASE_MAX_BUFFERS], *dev_ptrs[CASE_MAX_BUFFERS];
static int n_host, n_dev;

static void *halloc(size_t bytes) {
    void *p = malloc(bytes ? bytes : 1);
    if (!p || n_host == CASE_MAX_BUFFERS) abort();
    return host_ptrs[n_host++] = p;
}
static void *dalloc(size_t bytes) {
    void *p = G->raw_alloc(bytes ? bytes : 1);
    if (!p || n_dev == CASE_MAX_BUFFERS) {
        fprintf(stderr, "raw_alloc(%zu) failed\n", bytes);
        exit(1);
    }
    return dev_ptrs[n_dev++] = p;
}
static void free_case(void) {
    while (n_host) free(host_ptrs[--n_host]);
    while (n_dev) G->raw_free(dev_ptrs[--n_dev]);
}

#endif
