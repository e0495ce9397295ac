/* nccl.h (emulation): the NCCL calls of the engine, on the host
 * (tests/gpu/emu/nccl_emu.cpp). A communicator of one rank copies; one of
 * several ranks carries the data over MPI between processes (one process
 * per emulated GPU, as with NCCL). Collectives are enqueued on the given
 * stream like NCCL's: their output appears only when that stream runs (see
 * cuda_runtime.h), so an engine that forgets to wait reads stale memory.
 * Names are emu_ symbols behind macros. */
#ifndef FSDP_EMU_NCCL_H
#define FSDP_EMU_NCCL_H

#include "cuda_runtime.h"

#define NCCL_VERSION(X, Y, Z) (((X) <= 2 && (Y) <= 8) ? (X) * 1000 + (Y) * 100 + (Z) : (X) * 10000 + (Y) * 100 + (Z))
#define NCCL_VERSION_CODE NCCL_VERSION(2, 21, 5)   /* the API it follows */

#ifdef __cplusplus
extern "C" {
#endif

typedef struct emu_nccl_comm_s *ncclComm_t;
#define NCCL_UNIQUE_ID_BYTES 128
typedef struct {
    char internal[NCCL_UNIQUE_ID_BYTES];
} ncclUniqueId;

typedef enum {
    ncclSuccess = 0,
    ncclUnhandledCudaError = 1,
    ncclSystemError = 2,
    ncclInternalError = 3,
    ncclInvalidArgument = 4,
    ncclInvalidUsage = 5,
    ncclRemoteError = 6,
    ncclInProgress = 7,
} ncclResult_t;

typedef enum {
    ncclInt8 = 0,
    ncclUint8 = 1,
    ncclInt32 = 2,
    ncclUint32 = 3,
    ncclInt64 = 4,
    ncclUint64 = 5,
    ncclFloat16 = 6,
    ncclFloat32 = 7,
    ncclFloat64 = 8,
    ncclBfloat16 = 9,
} ncclDataType_t;

typedef enum { ncclSum = 0, ncclProd = 1, ncclMax = 2, ncclMin = 3, ncclAvg = 4 } ncclRedOp_t;

/* ncclCommSplit's settings; the emulation has none, so it ignores them. */
typedef struct ncclConfig_v21700 {
    size_t size;
    unsigned int magic, version;
    int blocking, cgaClusterSize, minCTAs, maxCTAs;
    const char *netName;
    int splitShare;
} ncclConfig_t;
#define NCCL_SPLIT_NOCOLOR -1

#define ncclGetUniqueId emu_ncclGetUniqueId
#define ncclCommInitRank emu_ncclCommInitRank
#define ncclCommDestroy emu_ncclCommDestroy
#define ncclCommGetAsyncError emu_ncclCommGetAsyncError
#define ncclGetErrorString emu_ncclGetErrorString
#define ncclGetLastError emu_ncclGetLastError
#define ncclAllGather emu_ncclAllGather
#define ncclReduceScatter emu_ncclReduceScatter
#define ncclAllReduce emu_ncclAllReduce
#define ncclBroadcast emu_ncclBroadcast
#define ncclCommAbort emu_ncclCommAbort
#define ncclCommSplit emu_ncclCommSplit
#define ncclCommCount emu_ncclCommCount
#define ncclCommUserRank emu_ncclCommUserRank
#define ncclGroupStart emu_ncclGroupStart
#define ncclGroupEnd emu_ncclGroupEnd

ncclResult_t ncclGetUniqueId(ncclUniqueId *id);
ncclResult_t ncclCommInitRank(ncclComm_t *comm, int nranks, ncclUniqueId id, int rank);
ncclResult_t ncclCommDestroy(ncclComm_t comm);
ncclResult_t ncclCommAbort(ncclComm_t comm);
/* Collective over comm's ranks: the ranks of each color ranked by key (ties:
 * comm's rank); NCCL_SPLIT_NOCOLOR takes part and gets NULL. */
ncclResult_t ncclCommSplit(ncclComm_t comm, int color, int key, ncclComm_t *newcomm, ncclConfig_t *config);
ncclResult_t ncclCommCount(const ncclComm_t comm, int *count);
ncclResult_t ncclCommUserRank(const ncclComm_t comm, int *rank);
/* Collectives between them are kept and enqueued at the outermost
 * ncclGroupEnd, in call order (one failed call: none of them). */
ncclResult_t ncclGroupStart(void);
ncclResult_t ncclGroupEnd(void);
ncclResult_t ncclCommGetAsyncError(ncclComm_t comm, ncclResult_t *async);
const char *ncclGetErrorString(ncclResult_t r);
const char *ncclGetLastError(ncclComm_t comm);
ncclResult_t ncclAllGather(const void *send, void *recv, size_t count, ncclDataType_t t, ncclComm_t comm,
                           cudaStream_t s);
ncclResult_t ncclReduceScatter(const void *send, void *recv, size_t count, ncclDataType_t t, ncclRedOp_t op,
                               ncclComm_t comm, cudaStream_t s);
ncclResult_t ncclAllReduce(const void *send, void *recv, size_t count, ncclDataType_t t, ncclRedOp_t op,
                           ncclComm_t comm, cudaStream_t s);
ncclResult_t ncclBroadcast(const void *send, void *recv, size_t count, ncclDataType_t t, int root, ncclComm_t comm,
                           cudaStream_t s);

/* ---- test controls ---- */
int emu_nccl_comms_made(void);    /* ncclCommInitRank calls that succeeded */
int emu_nccl_comms_split(void);   /* communicators ncclCommSplit made */
int emu_nccl_comms_live(void);    /* communicators made or split and not yet destroyed or aborted */
long long emu_nccl_groups(void);  /* groups of at least one collective launched */
/* FSDP_EMU_NCCL_FAIL_GROUP=R:N (environment): the N-th such group fails at
 * its ncclGroupEnd on world rank R, launching nothing of it. */

#ifdef __cplusplus
}
#endif

#endif
