/* trace.c: the timeline's events (DESIGN.md, decision 9). Ops, backward nodes,
 * collectives and the waits for them are recorded as Chrome trace events
 * ("ph": "X", microseconds) and written as one JSON file that Perfetto and
 * chrome://tracing open: one process per rank, one track (thread) per
 * stream of work, "compute" (the calling thread: ops, backward, waits) and
 * "comm" (the comm thread: collectives), plus "steps" (step boundaries,
 * each with its comm busy and exposed milliseconds: the time a collective
 * ran, and the compute track's waits for one).
 *
 * Off by default: every hook is one test of a global flag. On:
 * fsdp_trace_start, or FSDP_TRACE=FILE for any program (the runtime starts
 * it at init and writes it at finalize); fsdp-lua --trace=FILE sets that.
 * Each rank keeps its events in memory here; engine/runtime/trace_file.c
 * starts a trace after a barrier and at the end gathers every rank's events
 * on rank 0, which writes the file. Times are CLOCK_MONOTONIC from the start.
 *
 * On the CUDA path an op's event spans the host's enqueue, not the GPU's
 * run: the kernels are asynchronous. */
#define _POSIX_C_SOURCE 200809L
#include "internal.h"
#include "trace.h"
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

int fsdp_trace_on;

typedef struct {
    double ts, dur;          /* microseconds since the start */
    int64_t bytes;           /* -1: none */
    int64_t seq;             /* collective sequence number, -1: none */
    int track;
    double comm_busy_ms, comm_exposed_ms;   /* a step's figures; -1: none */
    char name[48];
    char unit[80];
} trace_event;

static pthread_mutex_t g_mu = PTHREAD_MUTEX_INITIALIZER;
static trace_event *g_ev;
static size_t g_n, g_cap, g_dropped, g_max = 4000000;
static double g_t0;
static double g_last_mark;   /* the end of the last step, or the start */
static size_t g_mark_n;      /* the events recorded by then */
static char g_path[1024];

static double mono_us(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec * 1e6 + (double)ts.tv_nsec * 1e-3;
}

double trace_now(void) { return fsdp_trace_on ? mono_us() : 0; }

void trace_event_add(int track, const char *name, const char *unit, int64_t bytes, int64_t seq, double t0,
                     double t1) {
    if (!fsdp_trace_on) return;
    pthread_mutex_lock(&g_mu);
    if (g_n == g_cap) {
        size_t cap = g_cap ? 2 * g_cap : 65536;
        trace_event *p = g_n < g_max ? realloc(g_ev, cap * sizeof *p) : NULL;
        if (!p) {
            g_dropped++;
            pthread_mutex_unlock(&g_mu);
            return;
        }
        g_ev = p;
        g_cap = cap;
    }
    trace_event *e = &g_ev[g_n++];
    e->ts = t0 - g_t0;
    e->dur = t1 > t0 ? t1 - t0 : 0;
    e->bytes = bytes;
    e->seq = seq;
    e->track = track;
    e->comm_busy_ms = e->comm_exposed_ms = -1;
    snprintf(e->name, sizeof e->name, "%s", name ? name : "?");
    snprintf(e->unit, sizeof e->unit, "%s", unit ? unit : "");
    pthread_mutex_unlock(&g_mu);
}

/* the open unit spans of the calling (compute) thread */
enum { UNIT_DEPTH = 32 };
static struct {
    const char *phase, *unit;
    double t0;
} g_units[UNIT_DEPTH];
static int g_nunits;

static const char *current_unit(void) { return g_nunits > 0 ? g_units[g_nunits - 1].unit : NULL; }
const char *trace_current_unit(void) { return current_unit(); }

void trace_unit_push(const char *phase, const char *unit) {
    if (!fsdp_trace_on) return;
    if (g_nunits == UNIT_DEPTH) return;
    g_units[g_nunits].phase = phase;
    g_units[g_nunits].unit = unit;
    g_units[g_nunits].t0 = mono_us();
    g_nunits++;
}

void trace_unit_pop(const char *phase, const char *unit) {
    if (!fsdp_trace_on) return;
    for (int i = g_nunits - 1; i >= 0; i--) {
        if (g_units[i].unit == unit && g_units[i].phase == phase) {
            double now = mono_us();
            /* spans above it were left by an error: they end here too */
            for (int k = g_nunits - 1; k >= i; k--) {
                char name[48];
                snprintf(name, sizeof name, "%s %s", g_units[k].phase, g_units[k].unit);
                trace_event_add(TRACE_COMPUTE, name, g_units[k].unit, -1, -1, g_units[k].t0, now);
            }
            g_nunits = i;
            return;
        }
    }
}

void trace_op_end(trace_scope *s) {
    if (s->t0 <= 0 || !fsdp_trace_on) return;
    int64_t bytes = -1;
    if (s->out && *s->out) bytes = tensor_numel(*s->out) * (int64_t)fsdp_dtype_size((*s->out)->dtype);
    trace_event_add(TRACE_COMPUTE, s->name, current_unit(), bytes, -1, s->t0, mono_us());
}

/* A new trace: the events so far dropped, the clock's start now. */
void trace_begin(const char *path) {
    const char *m = getenv("FSDP_TRACE_MAX_EVENTS");
    if (m && atol(m) > 0) g_max = (size_t)atol(m);
    snprintf(g_path, sizeof g_path, "%s", path);
    g_n = 0;
    g_dropped = 0;
    g_t0 = mono_us();
    g_last_mark = g_t0;
    g_mark_n = 0;
    fsdp_trace_on = 1;
}

const char *trace_path(void) { return g_path; }

/* The comm queue's own entries, which move no data. */
static bool queue_bookkeeping(const char *name) {
    return !strcmp(name, "split") || !strcmp(name, "free") || !strcmp(name, "cancel") || !strcmp(name, "group_end");
}

typedef struct { double t0, t1; } span;
static int span_cmp(const void *a, const void *b) {
    double x = ((const span *)a)->t0, y = ((const span *)b)->t0;
    return x < y ? -1 : x > y;
}

/* Over the events since the last step mark, clipped to [a, b] (relative
 * microseconds): the time at least one collective ran (the comm tracks:
 * one after another on each, the lanes beside each other) and the compute
 * track's waits for them. */
static void step_comm_figures(double a, double b, double *busy, double *exposed) {
    *busy = *exposed = 0;
    span *sp = malloc((g_n - g_mark_n + 1) * sizeof *sp);
    size_t n = 0;
    for (size_t i = g_mark_n; i < g_n; i++) {
        const trace_event *e = &g_ev[i];
        double t0 = e->ts > a ? e->ts : a, t1 = e->ts + e->dur < b ? e->ts + e->dur : b;
        if ((e->track == TRACE_COMM || e->track == TRACE_COMM_REPLICA) && !queue_bookkeeping(e->name)) {
            if (sp && t1 > t0) sp[n++] = (span){t0, t1};
        } else if (e->track == TRACE_COMPUTE && strcmp(e->name, "wait") == 0 && t1 > t0) {
            *exposed += t1 - t0;
        }
    }
    if (!sp) return;   /* out of memory: no busy figure rather than a wrong one */
    qsort(sp, n, sizeof *sp, span_cmp);
    double end = a;
    for (size_t i = 0; i < n; i++) {
        double t0 = sp[i].t0 < end ? end : sp[i].t0;
        if (sp[i].t1 > t0) *busy += sp[i].t1 - t0, end = sp[i].t1;
    }
    free(sp);
}

fsdp_status fsdp_trace_step(int64_t step) {
    if (!fsdp_trace_on) return FSDP_OK;
    double now = mono_us();
    char name[48];
    snprintf(name, sizeof name, "step %lld", (long long)step);
    trace_event_add(TRACE_STEPS, name, NULL, -1, -1, g_last_mark, now);
    /* the step's event carries how much communication ran and how much of it the compute waited for */
    pthread_mutex_lock(&g_mu);
    if (g_n > 0 && g_ev[g_n - 1].track == TRACE_STEPS) {
        double busy, exposed;
        step_comm_figures(g_last_mark - g_t0, now - g_t0, &busy, &exposed);
        g_ev[g_n - 1].comm_busy_ms = busy * 1e-3;
        g_ev[g_n - 1].comm_exposed_ms = exposed * 1e-3;
    }
    g_mark_n = g_n;
    pthread_mutex_unlock(&g_mu);
    g_last_mark = now;
    g_nunits = 0;   /* a step leaves no unit open */
    return FSDP_OK;
}

static const char *track_names[TRACE_TRACKS] = {"steps", "compute", "comm", "replica comm"};

/* JSON string body: quotes, backslashes and control bytes escaped. */
static void put_json(FILE *f, const char *s) {
    for (; *s; s++) {
        unsigned char c = (unsigned char)*s;
        if (c == '"' || c == '\\') fprintf(f, "\\%c", c);
        else if (c < 0x20) fprintf(f, "\\u%04x", c);
        else fputc(c, f);
    }
}

/* This rank's events as JSON objects, each followed by ",\n". */
char *trace_events_json(int rank, size_t *len) {
    char *buf = NULL;
    size_t n = 0;
    FILE *f = open_memstream(&buf, &n);
    if (!f) return NULL;
    fprintf(f, "{\"ph\":\"M\",\"pid\":%d,\"name\":\"process_name\",\"args\":{\"name\":\"rank %d\"}},\n", rank, rank);
    fprintf(f, "{\"ph\":\"M\",\"pid\":%d,\"name\":\"process_sort_index\",\"args\":{\"sort_index\":%d}},\n", rank, rank);
    for (int t = 0; t < TRACE_TRACKS; t++)
        fprintf(f, "{\"ph\":\"M\",\"pid\":%d,\"tid\":%d,\"name\":\"thread_name\",\"args\":{\"name\":\"%s\"}},\n", rank,
                t, track_names[t]);
    for (size_t i = 0; i < g_n; i++) {
        trace_event *e = &g_ev[i];
        fprintf(f, "{\"ph\":\"X\",\"pid\":%d,\"tid\":%d,\"ts\":%.3f,\"dur\":%.3f,\"name\":\"", rank, e->track, e->ts,
                e->dur);
        put_json(f, e->name);
        fprintf(f, "\",\"cat\":\"%s\",\"args\":{", track_names[e->track]);
        const char *sep = "";
        if (e->unit[0]) {
            fputs("\"unit\":\"", f);
            put_json(f, e->unit);
            fputs("\"", f);
            sep = ",";
        }
        if (e->bytes >= 0) fprintf(f, "%s\"bytes\":%lld", sep, (long long)e->bytes), sep = ",";
        if (e->seq >= 0) fprintf(f, "%s\"seq\":%lld", sep, (long long)e->seq), sep = ",";
        if (e->comm_busy_ms >= 0)
            fprintf(f, "%s\"comm_busy_ms\":%.3f,\"comm_exposed_ms\":%.3f", sep, e->comm_busy_ms, e->comm_exposed_ms);
        fputs("}},\n", f);
    }
    if (g_dropped)
        fprintf(f, "{\"ph\":\"i\",\"pid\":%d,\"tid\":1,\"ts\":0,\"s\":\"p\",\"name\":\"%zu events dropped "
                   "(FSDP_TRACE_MAX_EVENTS)\"},\n", rank, g_dropped);
    fclose(f);
    *len = n;
    return buf;
}

/* The events' memory given back (after trace_events_json). */
void trace_end(void) {
    fsdp_trace_on = 0;
    free(g_ev);
    g_ev = NULL;
    g_n = g_cap = 0;
}
