/* comm_debug.c: fingerprints of collectives and the check that ranks agree
 * on them before any data moves (DESIGN.md, decisions 8 and 12).
 *
 * Every collective on a communicator takes the next sequence number of that
 * communicator and a fingerprint (kind, communicator id, sequence number,
 * bytes, dtype, reduce op or root, device, label hash). Always, before the
 * data moves, the comm thread hashes the fingerprint to 64 bits h and
 * all-reduces (h, ~h) with MAX over the communicator: one small exchange
 * that yields the largest and the smallest h of all ranks. When they differ
 * somebody disagrees, every rank knows it from the same result, and all of
 * them all-gather the whole fingerprints to name the first rank that
 * differs from rank 0 and both sides' collectives; the work then fails on
 * every rank, and no data moved. A count, dtype or root that differs thus
 * never reaches MPI (which would read or write past a buffer), nor does a
 * sum meeting a max.
 *
 * The label (the unit's name) is not part of the default check: only
 * FSDP_DEBUG_COLLECTIVES=1 compares it too, and adds this rank's last
 * collectives (history) to the message. The exchange is also where a rank
 * waits for the others to arrive, so the backend's agree_max waits without
 * spinning and runs the watchdog (comm_mpi.c, comm_watchdog.c). */
#include "comm_impl.h"
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

const char *const comm_kind_names[] = {"all_gather", "reduce_scatter", "all_reduce", "broadcast",
                                       "barrier", "all_reduce_doubles", "split", "free", "cancel",
                                       "group_end"};

uint64_t comm_hash_str(const char *s) {   /* FNV-1a */
    uint64_t h = 0xcbf29ce484222325ull;
    for (; *s; s++) h = (h ^ (unsigned char)*s) * 0x100000001b3ull;
    return h;
}

uint64_t comm_hash_mix(uint64_t a, uint64_t b) {
    uint64_t z = a ^ (b + 0x9e3779b97f4a7c15ull + (a << 6) + (a >> 2));
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

const char *comm_op_name(int op) {
    return op == FSDP_REDUCE_SUM ? "sum" : op == FSDP_REDUCE_AVG ? "avg" : op == FSDP_REDUCE_MAX ? "max" : "?op";
}

static const char *fp_dtype_name(int dt) {
    if (dt == DT_COMPRESSED + FSDP_COMPRESS_INT8) return "f32 as int8 blocks";
    if (dt == DT_COMPRESSED + FSDP_COMPRESS_TOPK) return "f32 as top-k";
    return dt == DT_F64 ? "f64" : dt == DT_NONE ? "" : fsdp_dtype_name(dt);
}

void comm_fp_describe(const fingerprint *f, bool with_seq, char *buf, size_t size) {
    char extra[32] = "";
    if (f->kind == K_REDUCE_SCATTER || f->kind == K_ALL_REDUCE || f->kind == K_DOUBLES)
        snprintf(extra, sizeof extra, " %s", comm_op_name(f->arg));
    else if (f->kind == K_BROADCAST)
        snprintf(extra, sizeof extra, " root %d", f->arg);
    char seq[32] = "";
    if (with_seq) snprintf(seq, sizeof seq, "#%llu ", (unsigned long long)f->seq);
    const char *kind = f->kind >= K_ALL_GATHER && f->kind <= K_GROUP_END ? comm_kind_names[f->kind] : "?kind";
    snprintf(buf, size, "%s%s '%s' %llu B%s%s%s%s", seq, kind, f->label, (unsigned long long)f->bytes,
             f->dtype == DT_NONE ? "" : " ", fp_dtype_name(f->dtype), extra,
             f->device == FSDP_DEVICE_CUDA ? " cuda" : "");
}

static bool fp_equal(const fingerprint *a, const fingerprint *b, bool with_label) {
    return a->comm_id == b->comm_id && a->seq == b->seq && a->bytes == b->bytes &&
           (!with_label || a->label_hash == b->label_hash) && a->kind == b->kind && a->dtype == b->dtype &&
           a->arg == b->arg && a->device == b->device;
}

/* 64 bits of what must agree (the label too in debug mode). */
static uint64_t fp_hash(const fingerprint *f, bool with_label) {
    uint64_t h = comm_hash_mix(f->comm_id, f->seq);
    h = comm_hash_mix(h, f->bytes);
    h = comm_hash_mix(h, ((uint64_t)(uint32_t)f->kind << 32) | (uint32_t)f->dtype);
    h = comm_hash_mix(h, ((uint64_t)(uint32_t)f->arg << 32) | (uint32_t)f->device);
    if (with_label) h = comm_hash_mix(h, f->label_hash);
    return h;
}

/* Every rank compares every rank's fingerprint with rank 0's and all agree
 * on the first mismatch. */
static fsdp_status check_fingerprints(fsdp_work *w, bool with_label) {
    fsdp_comm *c = w->comm;
    fingerprint *all = calloc((size_t)c->size, sizeof *all);
    if (!all) return fsdp_set_error(FSDP_ERR_OOM, "out of host memory for %d fingerprints", c->size);
    fsdp_status st = c->be->all_gather(c, all, &w->fp, (int64_t)sizeof w->fp, 1);
    for (int r = 1; st == FSDP_OK && r < c->size; r++) {
        if (fp_equal(&all[0], &all[r], with_label)) continue;
        bool seq = all[0].seq != all[r].seq;
        char a[160], b[160];
        comm_fp_describe(&all[0], seq, a, sizeof a);
        comm_fp_describe(&all[r], seq, b, sizeof b);
        char hist[1200] = "";
        if (comm_cfg()->debug) {
            comm_history(hist, sizeof hist);
            if (!hist[0]) snprintf(hist, sizeof hist, " none");
        }
        st = fsdp_set_error(FSDP_ERR_COMM, "collective #%llu on comm %s(%d): rank 0 issued %s but rank %d issued %s; "
                            "no data moved%s%s", (unsigned long long)w->fp.seq, c->name, c->size, a, r, b,
                            hist[0] ? "; the last collectives this rank finished:" : "", hist);
        break;
        /* Already complete: the queue must not wrap it in a second
         * description of the same collective. */
        const char *e;
        int n = comm_last_error_len(&e);
        snprintf(w->msg, sizeof w->msg, "%.*s", n, e);
        w->status = st;
    }
    free(all);
    return st;
}

fsdp_status comm_agree(fsdp_work *w) {
    fsdp_comm *c = w->comm;
    if (!w->counted || c->size == 1 || c->be->local || !c->be->agree_max) return FSDP_OK;
    bool debug = comm_cfg()->debug;
    uint64_t h = fp_hash(&w->fp, debug);
    /* max of h and of ~h (order-reversing on int64) gives max and min */
    int64_t words[2] = {(int64_t)h, (int64_t)~h};
    FSDP_TRY(c->be->agree_max(c, words, 2, &w->fp));
    if ((uint64_t)words[0] == h && ~(uint64_t)words[1] == h) return FSDP_OK;
    return check_fingerprints(w, debug);
}
