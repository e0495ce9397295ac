/* cpu_device.c: the CPU's kernel table (see device.h): every entry of
 * kernels.def the CPU has, as cpu_<name>. */
#include "cpu_kernels.h"
#include "device.h"
#include <stdlib.h>
#include <string.h>

/* host memory is the device's memory: plain allocation and memcpy */
void *cpu_raw_alloc(size_t nbytes) { return aligned_alloc(64, nbytes); }
void cpu_raw_free(void *ptr) { free(ptr); }
void cpu_copy_from_host(void *dst, const void *src, size_t nbytes) { memcpy(dst, src, nbytes); }
void cpu_copy_to_host(void *dst, const void *src, size_t nbytes) { memcpy(dst, src, nbytes); }
void cpu_synchronize(void) {}

const fsdp_device_kernels cpu_device_kernels = {
    .name = "cpu",
#define FSDP_KERNEL(ret, name, params, has) FSDP_ON_CPU_##has(.name = cpu_##name, )
#include "kernels.def"
};
