/* device.c: which kernel table serves which device. */
#include "device.h"
#include "internal.h"
#include "cpu_kernels.h"
#include <stdio.h>
#ifdef FSDP_HAVE_CUDA
#include "cuda_internal.h"
#endif

extern const fsdp_device_kernels cpu_device_kernels;
extern fsdp_device_kernels meta_device_kernels;   /* engine/meta/meta_device.c */

static const fsdp_device_kernels *tables[FSDP_DEVICE_COUNT] = {[FSDP_DEVICE_CPU] = &cpu_device_kernels,
                                                               [FSDP_DEVICE_META] = &meta_device_kernels};

const fsdp_device_kernels *device_kernels(int device) {
    return device >= 0 && device < FSDP_DEVICE_COUNT ? tables[device] : NULL;
}

void device_register(int device, const fsdp_device_kernels *k) {
    if (device > FSDP_DEVICE_CPU && device < FSDP_DEVICE_COUNT) tables[device] = k;
}

bool device_is_host_like(int device) {
    if (device == FSDP_DEVICE_CPU) return true;
    int mimic = -1;
    return device == FSDP_DEVICE_META && fsdp_meta_mimicked(&mimic) == FSDP_OK && mimic == FSDP_DEVICE_CPU;
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
    switch (device) {
    case FSDP_DEVICE_CPU:
        *available = 1;
        if (desc && size > 0) snprintf(desc, (size_t)size, "cpu (%d threads)", cpu_threads_get());
        return FSDP_OK;
    case FSDP_DEVICE_CUDA:
#ifdef FSDP_HAVE_CUDA
        return cuda_device_info(available, desc, size);
#else
        *available = 0;
        if (desc && size > 0) snprintf(desc, (size_t)size, "not built");
        return FSDP_OK;
#endif
    case FSDP_DEVICE_META: {
        *available = 1;
        int mimic = FSDP_DEVICE_CPU;
        fsdp_meta_mimicked(&mimic);
        if (desc && size > 0)
            snprintf(desc, (size_t)size, "meta (counts, computes nothing; the %s kernel set)", fsdp_device_name(mimic));
        return FSDP_OK;
    }
    default:
        return fsdp_set_error(FSDP_ERR_DEVICE, "fsdp_device_info: no device %d (expected 0 = cpu, 1 = cuda or "
                              "2 = meta)", device);
    }
}
