/* error.c: the thread's last error, names of enums, the rank for messages. */
#include "internal.h"
#include <stdarg.h>
#include <stdio.h>
#include <string.h>

static _Thread_local char last_error[4096];

fsdp_status fsdp_set_error(fsdp_status st, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(last_error, sizeof last_error, fmt, ap);
    va_end(ap);
    if (n < 0) n = 0;
    if ((size_t)n >= sizeof last_error) n = (int)sizeof last_error - 1;
    /* A message that wraps an earlier one carries its rank already: drop
     * those copies so the rank is named once, at the end. */
    char suffix[32];
    int k = snprintf(suffix, sizeof suffix, " [rank %d]", fsdp_current_rank());
    for (char *p; (p = strstr(last_error, suffix)) != NULL; n -= k)
        memmove(p, p + k, strlen(p + k) + 1);
    if ((size_t)n + (size_t)k < sizeof last_error) memcpy(last_error + n, suffix, (size_t)k + 1);
    return st;
}

const char *fsdp_last_error(void) { return last_error[0] ? last_error : "no error"; }

static const char *const dtype_names[] = {"f32", "bf16", "i32", "i64", "u16"};
static const size_t dtype_sizes[] = {4, 2, 4, 8, 2};
static const char *const device_names[] = {"cpu", "cuda", "meta"};
static const char *const tag_names[] = {"param", "grad", "optimizer", "activation", "comm", "other"};

const char *fsdp_dtype_name(int dtype) {
    return dtype >= 0 && dtype < FSDP_DTYPE_COUNT ? dtype_names[dtype] : "?dtype";
}
size_t fsdp_dtype_size(int dtype) { return dtype >= 0 && dtype < FSDP_DTYPE_COUNT ? dtype_sizes[dtype] : 0; }
bool fsdp_dtype_is_float(int dtype) { return dtype == FSDP_F32 || dtype == FSDP_BF16; }
const char *fsdp_device_name(int device) {
    return device >= 0 && device < FSDP_DEVICE_COUNT ? device_names[device] : "?device";
}
const char *fsdp_tag_name(int tag) { return tag >= 0 && tag < FSDP_TAG_COUNT ? tag_names[tag] : "?tag"; }

/* This process's rank, as the runtime set it at init (engine/runtime). */
static int g_current_rank = 0;
int fsdp_current_rank(void) { return g_current_rank; }
void fsdp_set_current_rank(int rank) { g_current_rank = rank; }
