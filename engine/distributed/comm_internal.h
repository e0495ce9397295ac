/* comm_internal.h: what the rest of the engine may ask of a communicator
 * beyond the public calls in fsdp.h (comm*.c). */
#ifndef FSDP_COMM_INTERNAL_H
#define FSDP_COMM_INTERNAL_H

#include "fsdp.h"

/* This process's rank in c, and c's number of ranks (cached at creation: no
 * MPI call, callable from any thread). -1 when c is NULL. */
int comm_rank_of(fsdp_comm *c);
int comm_size_of(fsdp_comm *c);
/* A short name for messages, e.g. "world" or "world.split3.color1"
 * ("?" for NULL). */
const char *comm_name_of(fsdp_comm *c);
/* fsdp_reduce_scatter that adds its result into dst instead of writing it
 * (dst += this rank's block of the sum or average), in the pass that sums
 * the terms: no output buffer and no separate add. f32 dst and src on the
 * host, not overlapping; the same bits as a reduce-scatter followed by an
 * add. */
fsdp_status comm_reduce_scatter_add(fsdp_work **work, fsdp_comm *c, fsdp_tensor *dst, fsdp_tensor *src,
                                    fsdp_reduce_op op, const char *label);
/* CUDA collectives issued on this thread between comm_group_begin and
 * comm_group_end (nested: the outermost pair counts) are launched as one
 * NCCL group (ncclGroupStart/End) once the last one has been agreed on:
 * each keeps its own sequence number, fingerprint, agreement, events and
 * handle, in the one issue order. For collectives whose buffers are
 * independent of each other only (an all-gather of one unit with the
 * reduce-scatter of another, the two gathers of a unit pair): a group's
 * operations may run concurrently. The caller waits for none of them
 * before comm_group_end; a blocking collective (no work handle) inside is
 * not grouped. Host collectives are not affected. */
void comm_group_begin(void);
void comm_group_end(void);
/* A new communicator of the same ranks in the same order (collective over
 * parent; works on every backend, counting ones included). */
fsdp_status comm_dup(fsdp_comm **out, fsdp_comm *parent);
/* Comm lanes: a lane is a comm thread with its own queue (comm_queue.c).
 * Lane 0 runs every communicator's collectives unless one is put on the
 * replica lane (hybrid_shard's replica reductions of host tensors), which
 * then progress beside lane 0's. comm_set_lane applies only to a
 * communicator between ranks that has queued nothing yet, when MPI runs
 * with MPI_THREAD_MULTIPLE and FSDP_COMM_LANES is not 1; otherwise it
 * leaves c on lane 0. comm_lane_of says where c is. */
enum { COMM_LANE_MAIN = 0, COMM_LANE_REPLICA = 1, COMM_LANES = FSDP_COMM_LANES };
void comm_set_lane(fsdp_comm *c, int lane);
int comm_lane_of(fsdp_comm *c);
/* Drains the collective queue and stops the comm thread (a later collective
 * starts it again). fsdp_runtime_finalize calls it before MPI_Finalize. A
 * queue that does not drain within the watchdog time ends the job. */
void comm_shutdown(void);
/* At finalize, after comm_shutdown: tells every rank of the job that this
 * one leaves, and waits until all have, so that a rank which returns early
 * (or calls os.exit) while others go on ends the job with a message naming
 * it instead of leaving them waiting (comm_mpi.c). */
fsdp_status comm_leave(void);

#endif
