/* comm_run_host.c: host collectives as the comm thread runs them, between
 * the queue (comm_queue.c) and the host backend (comm_backend.h): bf16
 * reductions widened to f32 (MPI has no bf16 type: the terms are summed in
 * f32 and the result rounded back once, so sums are as exact as f32 sums,
 * not rounded once per rank), an average's division, scratch for buffers
 * that overlap, and the scratch a counting run must show the planner. */
#include "comm_impl.h"
#include "cpu_kernels.h"
#include <string.h>


static void widen_bf16(float *out, const uint16_t *in, int64_t n) {
    for (int64_t i = 0; i < n; i++) out[i] = bf16_to_f32(in[i]);
}
static void narrow_bf16(uint16_t *out, const float *in, int64_t n) {
    for (int64_t i = 0; i < n; i++) out[i] = f32_to_bf16(in[i]);
}
static void divide_f32(float *x, int64_t n, int d) {
    if (d == 1) return;
    for (int64_t i = 0; i < n; i++) x[i] /= (float)d;
}

bool comm_overlaps(const void *a, int64_t an, const void *b, int64_t bn) {
    const char *pa = a, *pb = b;
    return an > 0 && bn > 0 && pa < pb + bn && pb < pa + an;
}

/* Scratch on the comm thread, counted under the comm tag. */
typedef struct { void *p; size_t n; } scratch;
static fsdp_status scratch_get(scratch *s, size_t nbytes) {
    s->n = nbytes;
    return fsdp_alloc(FSDP_DEVICE_CPU, FSDP_TAG_COMM, nbytes, &s->p);
}
static void scratch_put(scratch *s) {
    if (s->p) fsdp_free(FSDP_DEVICE_CPU, FSDP_TAG_COMM, s->p, s->n);
    s->p = NULL;
}

fsdp_status comm_run_all_gather(fsdp_work *w) {
    fsdp_comm *c = w->comm;
    size_t esz = fsdp_dtype_size(w->dtype);
    int64_t block = w->n * (int64_t)esz;
    char *dst = w->dst;
    const void *src = w->src;
    if (src == dst + (int64_t)c->rank * block) return c->be->all_gather(c, dst, NULL, block, esz);
    if (!comm_overlaps(src, block, dst, block * c->size)) return c->be->all_gather(c, dst, src, block, esz);
    /* src lies inside dst but not at this rank's block: send a copy. */
    scratch s = {0};
    FSDP_TRY(scratch_get(&s, (size_t)block));
    memcpy(s.p, src, (size_t)block);
    fsdp_status st = c->be->all_gather(c, dst, s.p, block, esz);
    scratch_put(&s);
    return st;
}

fsdp_status comm_run_reduce_scatter(fsdp_work *w) {
    fsdp_comm *c = w->comm;
    int64_t n = w->n, total = n * c->size;
    scratch in = {0}, out = {0};
    fsdp_status st = FSDP_OK;
    int divide = w->op == FSDP_REDUCE_AVG ? c->size : 1;   /* the average's division, in the backend's pass */
    if (w->dtype == FSDP_F32) {
        float *dst = w->dst;
        /* MPI wants distinct buffers (an accumulating one never aliases: comm.c refuses it) */
        bool alias = comm_overlaps(w->dst, n * 4, w->src, total * 4);
        if (alias) st = scratch_get(&out, (size_t)n * 4);
        float *res = alias ? out.p : dst;
        if (st == FSDP_OK) st = c->be->reduce_scatter_f32(c, res, w->src, n, divide, w->accumulate);
        if (st == FSDP_OK && alias) memcpy(dst, res, (size_t)n * 4);
    } else {   /* bf16: reduce in f32, round once */
        st = scratch_get(&in, (size_t)total * 4);
        if (st == FSDP_OK) st = scratch_get(&out, (size_t)n * 4);
        if (st == FSDP_OK) {
            widen_bf16(in.p, w->src, total);
            st = c->be->reduce_scatter_f32(c, out.p, in.p, n, divide, false);
        }
        if (st == FSDP_OK) narrow_bf16(w->dst, out.p, n);
    }
    scratch_put(&in);
    scratch_put(&out);
    return st;
}

fsdp_status comm_run_all_reduce(fsdp_work *w) {
    fsdp_comm *c = w->comm;
    int op = w->op == FSDP_REDUCE_MAX ? FSDP_REDUCE_MAX : FSDP_REDUCE_SUM;
    switch (w->dtype) {
    case FSDP_F32:
        FSDP_TRY(c->be->all_reduce(c, w->dst, w->n, COMM_RT_F32, op));
        if (w->op == FSDP_REDUCE_AVG) divide_f32(w->dst, w->n, c->size);
        return FSDP_OK;
    case FSDP_BF16: {
        scratch s = {0};
        FSDP_TRY(scratch_get(&s, (size_t)w->n * 4));
        widen_bf16(s.p, w->dst, w->n);
        fsdp_status st = c->be->all_reduce(c, s.p, w->n, COMM_RT_F32, op);
        if (st == FSDP_OK) {
            if (w->op == FSDP_REDUCE_AVG) divide_f32(s.p, w->n, c->size);
            narrow_bf16(w->dst, s.p, w->n);
        }
        scratch_put(&s);
        return st;
    }
    case FSDP_I32: return c->be->all_reduce(c, w->dst, w->n, COMM_RT_I32, op);
    case FSDP_I64: return c->be->all_reduce(c, w->dst, w->n, COMM_RT_I64, op);
    default: return fsdp_set_error(FSDP_ERR_DTYPE, "all_reduce: dtype %s", fsdp_dtype_name(w->dtype));
    }
}

/* A counting communicator moves nothing, but on a device that stands for
 * the host (the counting device mimicking the CPU) the plan must see the
 * scratch the host path holds: allocated on that device under the comm
 * tag, all of it at once as run_* holds it, and given back. */
fsdp_status comm_count_scratch(fsdp_work *w) {
    fsdp_comm *c = w->comm;
    int64_t n = w->n, esz = (int64_t)fsdp_dtype_size(w->dtype), sizes[2] = {0, 0};
    if (w->kind == K_ALL_GATHER) {
        const char *dst = w->dst;
        if (w->src != dst + (int64_t)c->rank * n * esz && comm_overlaps(w->src, n * esz, dst, n * esz * c->size))
            sizes[0] = n * esz;
    } else if (w->kind == K_REDUCE_SCATTER) {
        if (w->dtype == FSDP_F32) {
            if (comm_overlaps(w->dst, n * 4, w->src, n * c->size * 4)) sizes[0] = n * 4;
        } else {
            sizes[0] = n * c->size * 4;
            sizes[1] = n * 4;
        }
    } else if (w->kind == K_ALL_REDUCE && w->dtype == FSDP_BF16) {
        sizes[0] = n * 4;
    }
    void *p[2] = {NULL, NULL};
    fsdp_status st = FSDP_OK;
    for (int i = 0; i < 2 && st == FSDP_OK; i++)
        if (sizes[i]) st = fsdp_alloc(w->device, FSDP_TAG_COMM, (size_t)sizes[i], &p[i]);
    for (int i = 0; i < 2; i++)
        if (p[i]) fsdp_free(w->device, FSDP_TAG_COMM, p[i], (size_t)sizes[i]);
    return st;
}

fsdp_status comm_run_doubles(fsdp_work *w) {
    fsdp_comm *c = w->comm;
    int op = w->op == FSDP_REDUCE_MAX ? FSDP_REDUCE_MAX : FSDP_REDUCE_SUM;
    FSDP_TRY(c->be->all_reduce(c, w->doubles, w->n, COMM_RT_F64, op));
    if (w->op == FSDP_REDUCE_AVG)
        for (int64_t i = 0; i < w->n; i++) w->doubles[i] /= (double)c->size;
    return FSDP_OK;
}
