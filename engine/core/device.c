/* device.c: which kernel table serves which device. Core names no device:
 * each backend registers its table and what it says of itself (engine/cpu,
 * engine/meta at load; engine/cuda at start-up, when a GPU is there). */
#include "device.h"
#include "internal.h"
#include <stdio.h>

static const fsdp_device_kernels *tables[FSDP_DEVICE_COUNT];
static const device_backend *backends[FSDP_DEVICE_COUNT];

const fsdp_device_kernels *device_kernels(int device) {
    return device >= 0 && device < FSDP_DEVICE_COUNT ? tables[device] : NULL;
}

void device_register(int device, const fsdp_device_kernels *k) {
    if (device >= 0 && device < FSDP_DEVICE_COUNT) tables[device] = k;
}

void device_register_backend(int device, const device_backend *b) {
    if (device >= 0 && device < FSDP_DEVICE_COUNT) backends[device] = b;
}

bool device_is_host_like(int device) {
    const device_backend *b = device >= 0 && device < FSDP_DEVICE_COUNT ? backends[device] : NULL;
    return b && b->host_like && b->host_like();
}

static int default_device = FSDP_DEVICE_CPU;

fsdp_status fsdp_default_device(int *out) {
    if (!out) return fsdp_set_error(FSDP_ERR_INVALID, "fsdp_default_device: out is NULL");
    *out = default_device;
    return FSDP_OK;
}

fsdp_status fsdp_set_default_device(fsdp_device device) {
    if (!device_kernels(device))
        return fsdp_set_error(FSDP_ERR_DEVICE, "fsdp_set_default_device: %s is not built into this engine, or has "
                              "no hardware", fsdp_device_name(device));
    default_device = device;
    return FSDP_OK;
}

fsdp_status fsdp_device_info(fsdp_device device, int *available, char *desc, int64_t size) {
    if (!available) return fsdp_set_error(FSDP_ERR_INVALID, "fsdp_device_info: available is NULL");
    if (size < 0) return fsdp_set_error(FSDP_ERR_INVALID, "fsdp_device_info: size %lld is negative", (long long)size);
    if (device < 0 || device >= FSDP_DEVICE_COUNT)
        return fsdp_set_error(FSDP_ERR_DEVICE, "fsdp_device_info: no device %d (expected 0 = cpu, 1 = cuda or "
                              "2 = meta)", device);
    const device_backend *b = backends[device];
    if (b && b->info) return b->info(available, desc, size);
    *available = 0;
    if (desc && size > 0) snprintf(desc, (size_t)size, "not built");
    return FSDP_OK;
}
