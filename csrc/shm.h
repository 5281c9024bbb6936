/* The shared-memory protocol of ranks on one node: a control block with one slot per rank
 * (arrival counters and a double-buffered record), and the sliced single-copy all-reduce.
 * See Note [Shared-memory protocol] in shm.c. */
#ifndef MPIDP_SHM_H
#define MPIDP_SHM_H
#include <stddef.h>
#include <stdint.h>
#include <sys/types.h>
#include "fusion.h"
#include "wire.h"

#define SHM_INLINE_BYTES 4096  /* payload carried inside the record itself */
#define SHM_SLOT_BYTES (256 + 2 * (128 + SHM_INLINE_BYTES))
#define SHM_MAX_SEGMENTS (SHM_INLINE_BYTES / 16) /* segment table in the inline payload */
/* The chunk where peers' buffers are mapped (Note [Chunk size] in shm.c): a peer's chunk
 * loaded for the reduction must still be in cache when the result is stored over it. */
#define SHM_DIRECT_CHUNK_BYTES (64 << 10)

enum { SHM_OK = 0, SHM_MISMATCH = 1, SHM_TIMEOUT = 2, SHM_PEER_ERROR = 3, SHM_OUT_OF_STEP = 4,
       SHM_INTERRUPTED = 5, SHM_DEPARTED = 6, SHM_LOST = 7 };
enum { SHM_PEERS_CMA = 0, SHM_PEERS_WINDOW = 1 };
enum { SHM_DATA_NONE = 0, SHM_DATA_INLINE = 1, SHM_DATA_SLICED = 2 };

typedef struct {
    char *ctrl;            /* base of the control block: nranks * SHM_SLOT_BYTES */
    int nranks, rank;
    uint64_t seq;          /* the same on every rank for the same call */
    const int64_t *header; /* MP_HEADER_WORDS words */
    int data;              /* SHM_DATA_* */
    const char *in;        /* this rank's input (NULL for a handshake only) */
    char *out;             /* this rank's output; may equal in */
    const mp_segment *segs; /* sliced mode, nsegs > 0: the data is these segments, back to */
    size_t nsegs;           /* back, reduced in place (in and out unused) */
    size_t count;          /* elements */
    int dtype, op;
    long divisor;          /* > 1: divide the reduced result (average) */
    size_t slice_lo, slice_hi; /* elements this rank reduces (sliced mode) */
    size_t chunk_bytes;
    int peers;             /* SHM_PEERS_* */
    char *const *segments; /* window mode: every rank's staging segment, mapped here */
    double timeout_s;
    /* Note [Interrupting a wait] in shm.c: polled in the slow path of every wait, at most
     * every SHM_POLL_S; nonzero ends the call with SHM_INTERRUPTED. NULL: never polled. */
    int (*interrupted)(void *arg);
    void *interrupt_arg;
    const int64_t *pids;   /* each rank's process, 0 where not watched (Note [A lost peer]), */
    const int64_t *starts; /* and its start time (/proc/<pid>/stat's field 22) */
} shm_call;

#define SHM_POLL_S 0.05 /* seconds between two polls of `interrupted` in a wait */

#define SHM_MAX_RANKS 256

/* /proc/<pid>/stat's state letter, thread count and start time: 0, or -1 (Note [A lost peer]
 * in shm.c). */
int mp_process_stat(pid_t pid, char *state, long *threads, unsigned long long *start);

typedef struct {
    int status;                 /* SHM_* */
    int64_t headers[SHM_MAX_RANKS][MP_HEADER_WORDS]; /* on mismatch, or for a handshake: every rank's */
    int missing[SHM_MAX_RANKS];            /* on timeout: 1 for each rank that had not arrived;
                                              departed: for each that shut down before it;
                                              lost: for each whose process ended before it */
    int64_t seqs[SHM_MAX_RANKS];           /* out of step: the call number of every rank's record */
    int peer_rank, peer_errno;  /* on a peer error */
} shm_result;

/* Note [A rank that has shut down] in shm.c: rank `rank` of the control block at `ctrl` will
 * enter no more calls. Any thread, no GIL needed. */
void shm_depart(char *ctrl, int rank);
/* Runs one call of the protocol; releases nothing (the caller drops the GIL). */
void shm_run(const shm_call *c, shm_result *r);
/* Elements of rank `rank`'s slice of `count` split over `nranks` (as mpidp.engine.ring.partition). */
void shm_partition(size_t count, int nranks, int rank, size_t *lo, size_t *hi);

#endif
