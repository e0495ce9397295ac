/* cuda_case.h: the buffers of one kernel test case, on the host and on the
 * device (through the CUDA table's raw_alloc), all freed by free_case()
 * (cuda_case.c, linked into each kernel test). The test sets G, the CUDA
 * table, before its first case. */
#ifndef FSDP_TEST_CUDA_CASE_H
#define FSDP_TEST_CUDA_CASE_H

#include "device.h"
#include <stdio.h>
#include <stdlib.h>

#define CASE_MAX_BUFFERS 1024   /* per case, host and device each */

extern const fsdp_device_kernels *G;   /* the CUDA table */

void *halloc(size_t bytes);   /* host bytes (aborts when out of memory or slots) */
void *dalloc(size_t bytes);   /* device bytes (exits when it fails) */
void free_case(void);         /* frees every buffer of the case */

#endif
