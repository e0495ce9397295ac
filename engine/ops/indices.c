/* indices.c: the index checks embedding and cross-entropy share: ids
 * (i64) inside the table or the classes, read from a host copy when they
 * live on a device and their host range does not already decide. */
#include "ops_util.h"
#include <stdlib.h>

/* ---- index checks shared by embedding and cross-entropy ---- */

/* "[1,2]": the multi-index of flat position pos in shape, for messages. */
const char *index_str(int ndim, const int64_t *shape, int64_t pos, char *buf, size_t size) {
    int64_t idx[FSDP_MAX_DIMS];
    for (int d = ndim - 1; d >= 0; d--) {
        idx[d] = shape[d] ? pos % shape[d] : 0;
        pos = shape[d] ? pos / shape[d] : 0;
    }
    return shape_str(ndim, idx, buf, size);
}

/* First position of ids (i64, contiguous) outside [0, limit), or -1, and
 * its value in *value; with has_skip, the value skip (an ignore_index) is
 * allowed too. Ids in device memory are checked from a host copy. */
int64_t first_bad_index(const fsdp_tensor *ids, int64_t limit, bool has_skip, int64_t skip, int64_t *value) {
    int64_t n = tensor_numel(ids), lo, hi;
    /* values host code gave (a batch, positions): their range decides
     * without reading them back; otherwise, or when it does not, they are read */
    if (tensor_device(ids) != FSDP_DEVICE_CPU && tensor_host_range(ids, &lo, &hi) && lo >= 0 && hi < limit) return -1;
    const int64_t *p = tensor_data(ids);
    int64_t *host = NULL;
    if (tensor_device(ids) != FSDP_DEVICE_CPU) {
        host = malloc((size_t)(n ? n : 1) * sizeof *host);
        if (!host) return -1;
        KERNELS(ids)->copy_to_host(host, p, (size_t)n * sizeof *host);
        p = host;
    }
    int64_t bad = -1;
    for (int64_t i = 0; i < n && bad < 0; i++)
        if ((p[i] < 0 || p[i] >= limit) && !(has_skip && p[i] == skip)) bad = i;
    if (bad >= 0) *value = p[bad];
    free(host);
    return bad;
}
