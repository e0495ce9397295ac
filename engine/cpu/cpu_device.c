/* cpu_device.c: the CPU's kernel table (see device.h): every entry of
 * kernels.def the CPU has, as cpu_<name>. */
#include "cpu_kernels.h"
#include "device.h"
#include <stdio.h>
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

static fsdp_status cpu_info(int *available, char *desc, int64_t size) {
    *available = 1;
    if (desc && size > 0) snprintf(desc, (size_t)size, "cpu (%d threads)", cpu_threads_get());
    return FSDP_OK;
}
static bool cpu_host_like(void) { return true; }
static const device_backend cpu_backend = {cpu_info, cpu_host_like};

/* at load: the CPU is always there */
__attribute__((constructor)) static void cpu_device_register(void) {
    device_register(FSDP_DEVICE_CPU, &cpu_device_kernels);
    device_register_backend(FSDP_DEVICE_CPU, &cpu_backend);
}
