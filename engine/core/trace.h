/* trace.h: the timeline's hooks (trace.c). Each costs one test of
 * fsdp_trace_on when tracing is off. */
#ifndef FSDP_TRACE_H
#define FSDP_TRACE_H

#include "fsdp.h"
#include <stddef.h>
#include <stdint.h>

/* TRACE_COMM_REPLICA: the replica lane's collectives (hybrid_shard on the CPU) */
enum { TRACE_STEPS = 0, TRACE_COMPUTE = 1, TRACE_COMM = 2, TRACE_COMM_REPLICA = 3, TRACE_TRACKS = 4 };

extern int fsdp_trace_on;

/* Microseconds on the trace clock; 0 when tracing is off. */
double trace_now(void);
/* One complete event [t0, t1] on a track; bytes and seq -1 when none. */
void trace_event_add(int track, const char *name, const char *unit, int64_t bytes, int64_t seq, double t0,
                     double t1);

/* The FSDP unit whose forward or backward runs (the calling thread): ops
 * recorded meanwhile carry it, and the span itself becomes an event
 * ("forward h.0", "backward h.0"). Pop names the unit it closes, so a
 * forward left by an error cannot shift the others. */
void trace_unit_push(const char *phase, const char *unit);
void trace_unit_pop(const char *phase, const char *unit);
const char *trace_current_unit(void);

/* TRACE_OP("fsdp_matmul", out) as an op's first line: the op, from there
 * to whichever return, with the bytes of *out. */
typedef struct {
    const char *name;
    fsdp_tensor **out;
    double t0;
} trace_scope;
void trace_op_end(trace_scope *s);
/* For the trace's file (engine/runtime/trace_file.c): a new trace to path
 * (recording on, clock started), its path, this rank's events as JSON
 * objects each followed by ",\n" (malloc'd; NULL without memory), and the
 * end (recording off, events freed). */
void trace_begin(const char *path);
const char *trace_path(void);
char *trace_events_json(int rank, size_t *len);
void trace_end(void);

#define TRACE_OP(name_, out_)                                                                     \
    __attribute__((cleanup(trace_op_end))) trace_scope trace_scope_ = {                          \
        (name_), (out_), __builtin_expect(fsdp_trace_on, 0) ? trace_now() : 0}

#endif
