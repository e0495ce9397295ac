/* timeline.h: the planner's record of one process's work in order
 * (timeline.c): the counting device's kernel calls and the collectives'
 * issues and waits, which fsdp.plan replays against a time model. Each hook
 * costs one test of fsdp_timeline_on while nothing records. */
#ifndef FSDP_TIMELINE_H
#define FSDP_TIMELINE_H

#include "fsdp.h"
#include <stdint.h>

extern int fsdp_timeline_on;

/* A kernel table entry's call on the counting device and what it counts. */
void timeline_kernel(int entry, int64_t bytes_read, int64_t bytes_written, int64_t flops, int64_t launches,
                     int64_t syncs);
/* A collective queued: its communicator (id, size, first member's world
 * rank and the stride between members, -1 when they are not evenly
 * spaced), kind (fsdp_collective), sequence number, bytes as counted,
 * dtype and its label's hash. */
void timeline_issue(uint64_t comm_id, int comm_size, int first, int stride, int kind, uint64_t seq, int64_t bytes,
                    int dtype, uint64_t label_hash);
/* The calling thread waits for that collective. */
void timeline_wait(uint64_t comm_id, uint64_t seq);

#endif
