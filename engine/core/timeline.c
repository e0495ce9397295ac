/* timeline.c: the planner's timeline (timeline.h, fsdp.h). Events append
 * to one growable array under a lock; recording starts and stops from the
 * planner, which reads the array back once per counted step. */
#include "internal.h"
#include "timeline.h"
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

int fsdp_timeline_on;

static pthread_mutex_t tl_mu = PTHREAD_MUTEX_INITIALIZER;
static int64_t *tl_events;   /* FSDP_TIMELINE_FIELDS each */
static int64_t tl_len, tl_cap;
static bool tl_overflow;     /* an append found no memory: the record is incomplete */

static void append(const int64_t *ev) {
    pthread_mutex_lock(&tl_mu);
    if (fsdp_timeline_on) {
        if (tl_len == tl_cap) {
            int64_t cap = tl_cap ? 2 * tl_cap : 4096;
            int64_t *grown = realloc(tl_events, (size_t)cap * FSDP_TIMELINE_FIELDS * sizeof *grown);
            if (grown) {
                tl_events = grown;
                tl_cap = cap;
            }
        }
        if (tl_len < tl_cap) memcpy(tl_events + tl_len++ * FSDP_TIMELINE_FIELDS, ev, FSDP_TIMELINE_FIELDS * sizeof *ev);
        else tl_overflow = true;
    }
    pthread_mutex_unlock(&tl_mu);
}

void timeline_kernel(int entry, int64_t bytes_read, int64_t bytes_written, int64_t flops, int64_t launches,
                     int64_t syncs) {
    if (!fsdp_timeline_on) return;
    int64_t ev[FSDP_TIMELINE_FIELDS] = {FSDP_TIMELINE_KERNEL, entry, bytes_read, bytes_written, flops, launches, syncs, 0};
    append(ev);
}

void timeline_issue(uint64_t comm_id, int comm_size, int first, int stride, int kind, uint64_t seq, int64_t bytes,
                    int dtype, uint64_t label_hash) {
    if (!fsdp_timeline_on) return;
    /* the id's low 48 bits identify the communicator; size, first member
     * and stride share one field (16 bits each) */
    int64_t shape = ((int64_t)(comm_size & 0xffff) << 32) | ((int64_t)(first & 0xffff) << 16) |
                    (int64_t)(stride < 0 ? 0xffff : stride & 0xffff);
    int64_t ev[FSDP_TIMELINE_FIELDS] = {FSDP_TIMELINE_ISSUE, kind, (int64_t)(comm_id & 0xffffffffffffULL), (int64_t)seq,
                                        bytes, shape, dtype, (int64_t)(label_hash & 0xffffffffffffULL)};
    append(ev);
}

void timeline_wait(uint64_t comm_id, uint64_t seq) {
    if (!fsdp_timeline_on) return;
    int64_t ev[FSDP_TIMELINE_FIELDS] = {FSDP_TIMELINE_WAIT, 0, (int64_t)(comm_id & 0xffffffffffffULL), (int64_t)seq,
                                        0, 0, 0, 0};
    append(ev);
}

fsdp_status fsdp_timeline_record(int on) {
    pthread_mutex_lock(&tl_mu);
    if (on) {
        tl_len = 0;
        tl_overflow = false;
    }
    fsdp_timeline_on = on != 0;
    pthread_mutex_unlock(&tl_mu);
    return FSDP_OK;
}

fsdp_status fsdp_timeline_length(int64_t *n) {
    if (!n) return fsdp_set_error(FSDP_ERR_INVALID, "fsdp_timeline_length: n is NULL");
    pthread_mutex_lock(&tl_mu);
    *n = tl_len;
    bool lost = tl_overflow;
    pthread_mutex_unlock(&tl_mu);
    if (lost) return fsdp_set_error(FSDP_ERR_OOM, "fsdp_timeline_length: out of host memory while recording: the "
                                    "timeline is incomplete");
    return FSDP_OK;
}

fsdp_status fsdp_timeline_read(int64_t first, int64_t count, int64_t *out) {
    if (!out && count > 0) return fsdp_set_error(FSDP_ERR_INVALID, "fsdp_timeline_read: out is NULL");
    pthread_mutex_lock(&tl_mu);
    int64_t len = tl_len;
    if (first < 0 || count < 0 || first > len || count > len - first) {
        pthread_mutex_unlock(&tl_mu);
        return fsdp_set_error(FSDP_ERR_INVALID, "fsdp_timeline_read: events %lld..%lld of %lld",
                              (long long)first, (long long)(first + count), (long long)len);
    }
    if (count > 0) memcpy(out, tl_events + first * FSDP_TIMELINE_FIELDS, (size_t)count * FSDP_TIMELINE_FIELDS * sizeof *out);
    pthread_mutex_unlock(&tl_mu);
    return FSDP_OK;
}
