/* Note [Shared-memory protocol]
 * Ranks on one node share a control block (an MPI-3 shared window) with one slot per rank:
 *
 *   slot r: arrive1 (own cache line) | arrive2 (own cache line) | record[0] | record[1]
 *   record: header words | pid, input address, output address, status, seq | inline payload
 *
 * Call number `seq` (the same on every rank) writes record[seq & 1], then publishes
 * arrive1 = seq and waits for every rank's arrive1 >= seq. Every rank then reads every
 * header: they must agree (the last word is free), so a mismatch is seen by all ranks at
 * once and all of them report it. Records are double-buffered: a rank can only overwrite
 * record[seq & 1] again at call seq + 2, after every rank has arrived at seq + 1 and so has
 * finished reading call seq. Inline calls need no second barrier for that reason.
 * Every record is stamped with its call number, and a reader checks the stamp: a rank whose
 * protocol counter drifted from the others' is reported as out of step, never paired with a
 * stale record of an earlier call. (The counter advances only when a call enters, csrc/
 * context.c, so this is a backstop; a rank that skipped or repeated a whole collective is
 * caught by the header comparison where the headers differ, else by the watchdog.)
 *
 * Sliced calls (large buffers): rank r reduces slice r of every rank's input (in rank order,
 * Note [Summation order]), and writes the result into slice r of every
 * rank's output. Only rank r touches slice r of any buffer, so in-place calls are safe, and
 * each input byte is read once and each output byte written once on the whole node.
 * Peers are reached by cross-memory attach (process_vm_readv/writev) or, where the kernel
 * forbids it, through staging segments in a shared window.
 * A rank may also hand in its data as a list of segments (many tensors, reduced in place
 * without packing them into one buffer: Note [Zero-copy buckets] in mpidp/comm/buckets.py); its
 * record then carries the segment table in the payload, and whoever touches its bytes maps
 * offsets through that table. Ranks choose independently; only the byte count must agree. A second barrier (arrive2)
 * orders the writes into a rank's output before that rank returns; each rank's status is
 * published before it, so a peer failure is reported by every rank. */
#define _GNU_SOURCE
#include "shm.h"
#include "cma.h"
#include "heap.h"
#include "kernels.h"
#include <errno.h>
#include <sched.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

typedef struct {
    int64_t header[MP_HEADER_WORDS];
    int64_t pid, in_addr, out_addr, status, nsegs, seq;
    char pad[128 - (MP_HEADER_WORDS + 6) * 8];
    char payload[SHM_INLINE_BYTES];
} record_t;

typedef struct {
    uint64_t arrive1;
    uint64_t departed; /* Note [A rank that has shut down] */
    char pad1[112];
    uint64_t arrive2;
    char pad2[120];
    record_t record[2];
} slot_t;

_Static_assert(sizeof(slot_t) == SHM_SLOT_BYTES, "slot layout");

static slot_t *slot_of(const shm_call *c, int q) { return (slot_t *)(c->ctrl + (size_t)q * SHM_SLOT_BYTES); }

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static inline void cpu_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    __asm__ __volatile__("yield");
#endif
}

/* Note [Interrupting a wait]
 * A rank waiting for the others must still notice what should end it: a signal (Ctrl-C,
 * SIGTERM forwarded by the launcher) or its context being closed by shutdown while another
 * thread waits in it. The protocol knows nothing of Python, so the caller hands in a poll,
 * `interrupted` (csrc/context.c: takes the GIL, runs the signal handlers, reads the closed
 * flag), which the wait calls in its slow path only, at most every SHM_POLL_S: the spin of a
 * call that completes quickly never pays for it. A nonzero answer ends the call at once with
 * SHM_INTERRUPTED. Such a call has published its arrival, so the others may go on with it;
 * its rank is out of step for good, and the context refuses every later call (the process is
 * expected to end: mpidp.train aborts the job). */

/* Note [A rank that has shut down]
 * A rank that shuts down (mpidp.shutdown, at exit too) closes its context (csrc/context.c)
 * and so will enter no later call: it says so in its slot's `departed` word before anything
 * of its shutdown can block. A rank waiting for it reads that word where it polls (the slow
 * path of a wait, every SHM_POLL_S): a rank that has departed without arriving at this call
 * never will, and the call ends at once with SHM_DEPARTED naming it, on every rank that waits
 * for it, where it would otherwise wait until the watchdog ended the job (Horovod raises
 * "Horovod has been shut down" there). A rank that departed after arriving is no reason to
 * stop: its record of the call is in place until the windows are freed, which every rank
 * does together. Waits across nodes (MPI) are ended by the watchdog instead (Note [Watchdog]
 * in mpidp/runtime/watchdog.py, "A rank that has shut down"). */

void shm_depart(char *ctrl, int rank) {
    slot_t *mine = (slot_t *)(ctrl + (size_t)rank * SHM_SLOT_BYTES);
    __atomic_store_n(&mine->departed, 1, __ATOMIC_RELEASE);
}

/* 1 when rank q has not reached counter `second` (arrive2, else arrive1) of this call. */
static int behind(const shm_call *c, int q, int second) {
    const slot_t *s = slot_of(c, q);
    return __atomic_load_n(second ? &s->arrive2 : &s->arrive1, __ATOMIC_ACQUIRE) < c->seq;
}

/* 1 when a rank that has shut down has not arrived at counter `second` of this call (and will
 * not: Note [A rank that has shut down]), those ranks marked in r->missing; else 0. */
static int departed(const shm_call *c, int second, shm_result *r) {
    int any = 0;
    for (int q = 0; q < c->nranks; q++) {
        r->missing[q] = __atomic_load_n(&slot_of(c, q)->departed, __ATOMIC_ACQUIRE) &&
                        behind(c, q, second);
        any |= r->missing[q];
    }
    return any;
}

/* Note [A lost peer]
 * A rank whose process ends without shutting down (killed, crashed, os._exit) leaves no word
 * in its slot. Where the launcher does not end the job for it (srun without
 * --kill-on-bad-exit, an MPI with fault tolerance), the ranks waiting for it would wait until
 * the watchdog's timeout. So each context knows the process of every rank of the node
 * (ShmContext.watch, from mpidp/engine/shm.py: its pid and its start time, which the ranks
 * exchanged at set-up; a rank in another pid namespace, whose pid means another process
 * here, is not watched), and a wait's poll (its slow path, every SHM_POLL_S) asks the kernel
 * about each rank that has not arrived: no such process (kill(pid, 0): ESRCH), a process of
 * that pid started at another time (the pid reused), or one that has ended and not yet been
 * reaped (a zombie in /proc/<pid>/stat with one thread: a live process whose main thread
 * has exited also reads as a zombie, with its other threads) ends the call at once with
 * SHM_LOST naming it, on every rank that waits for it. The fast spin of a call whose ranks
 * arrive together asks nothing. */

/* From /proc/<pid>/stat: the state letter, the number of threads and the start time (fields
 * 3, 20 and 22); 0, or -1 where it cannot be read. */
int mp_process_stat(pid_t pid, char *state, long *threads, unsigned long long *start) {
    char path[64], buf[1024];
    snprintf(path, sizeof path, "/proc/%d/stat", (int)pid);
    FILE *f = fopen(path, "r");
    if (!f) return -1;
    size_t n = fread(buf, 1, sizeof buf - 1, f);
    fclose(f);
    buf[n] = 0;
    const char *paren = strrchr(buf, ')'); /* "pid (comm) S ...": the name may hold spaces */
    if (!paren || sscanf(paren + 1, " %c %*d %*d %*d %*d %*d %*u %*u %*u %*u %*u %*u %*u "
                         "%*d %*d %*d %*d %ld %*d %llu", state, threads, start) != 3)
        return -1;
    return 0;
}

/* 1 when the process of `pid` that started at `start` has ended: there is no such process,
 * another one started at another time has its pid, or it is a zombie; 0 while it runs or
 * where it cannot be told. */
static int process_ended(pid_t pid, unsigned long long start) {
    if (kill(pid, 0) != 0) return errno == ESRCH;
    char state;
    long threads;
    unsigned long long started;
    if (mp_process_stat(pid, &state, &threads, &started) < 0) return 0;
    return started != start || ((state == 'Z' || state == 'X') && threads <= 1);
}

/* 1 when a rank that has not arrived at counter `second` of this call has lost its process
 * (Note [A lost peer]), those ranks marked in r->missing; else 0. */
static int lost(const shm_call *c, int second, shm_result *r) {
    int any = 0;
    for (int q = 0; q < c->nranks; q++) {
        r->missing[q] = q != c->rank && c->pids && c->pids[q] > 0 && behind(c, q, second) &&
                        process_ended((pid_t)c->pids[q], (unsigned long long)c->starts[q]);
        any |= r->missing[q];
    }
    return any;
}

/* Note [Waiting for a late rank]
 * A wait spins briefly (a call whose ranks arrive together costs no system call), then
 * yields the core. Linux's scheduler hands a yielding process the core again as soon as its
 * share comes round, so a rank that yields for long still takes its share of the cores: on
 * a node with more ranks than cores (a laptop, a CI runner) the ranks that wait slow down
 * the rank they wait for, and beside it a rank writing a checkpoint or a straggler. A wait
 * that has lasted SHM_NAP_AFTER_S sleeps instead, SHM_NAP_NS at a time: the core is given
 * away, and the latency added is at most one nap in a wait that already took far longer.
 * Measured on 2 ranks, one 0.5 s late: the other's wait took 0.50 s of CPU yielding, 0.08 s
 * napping (tests/mpi/bodies/body_signals.py checks it); all-reduces of 1 to 64 MiB took the
 * same time either way (python -m mpidp.bench allreduce, two launches of each). */
#define SHM_NAP_AFTER_S 1e-3
#define SHM_NAP_NS 50000L

/* Waits until every rank's counter (arrive1 or arrive2) reaches seq (Note [Waiting for a
 * late rank]). Returns 0, -1 on timeout with the ranks that had not arrived marked in
 * r->missing, -2 when interrupted (Note [Interrupting a wait]), -3 when a rank that has
 * shut down will never arrive, marked in r->missing (Note [A rank that has shut down]), or
 * -4 when a rank's process has ended, marked in r->missing (Note [A lost peer]). */
static int wait_all(const shm_call *c, int second, shm_result *r) {
    double deadline = 0.0, next_poll = 0.0, nap_at = 0.0;
    int napping = 0;
    const struct timespec nap = {0, SHM_NAP_NS};
    for (int q = 0; q < c->nranks; q++) {
        uint64_t *ctr = second ? &slot_of(c, q)->arrive2 : &slot_of(c, q)->arrive1;
        unsigned spins = 0;
        while (__atomic_load_n(ctr, __ATOMIC_ACQUIRE) < c->seq) {
            if (++spins < 256) { cpu_relax(); continue; }
            if (napping) nanosleep(&nap, NULL);
            else sched_yield();
            if (napping || (spins & 255) == 0) {
                double t = now_s();
                if (deadline == 0.0) {
                    deadline = t + c->timeout_s;
                    next_poll = t + SHM_POLL_S;
                    nap_at = t + SHM_NAP_AFTER_S;
                } else if (t > deadline) {
                    for (int p = 0; p < c->nranks; p++) r->missing[p] = behind(c, p, second);
                    return -1;
                } else if (!napping && t >= nap_at) {
                    napping = 1;
                } else if (t >= next_poll) {
                    if (departed(c, second, r)) return -3;
                    if (lost(c, second, r)) return -4;
                    if (c->interrupted && c->interrupted(c->interrupt_arg)) return -2;
                    next_poll = now_s() + SHM_POLL_S;
                }
            }
        }
    }
    return 0;
}

/* The status of a call whose wait ended with `waited` (wait_all's nonzero answer). */
static int wait_status(int waited) {
    return waited == -1 ? SHM_TIMEOUT : waited == -2 ? SHM_INTERRUPTED :
           waited == -3 ? SHM_DEPARTED : SHM_LOST;
}

static int peer_read(const shm_call *c, int q, void *local, size_t offset, size_t n) {
    const record_t *rec = &slot_of(c, q)->record[c->seq & 1];
    if (c->peers == SHM_PEERS_WINDOW) {
        memcpy(local, c->segments[q] + offset, n);
        return 0;
    }
    if (rec->nsegs)
        return mp_seg_move((pid_t)rec->pid, (const seg_entry *)rec->payload, rec->nsegs,
                           offset, local, n, 0);
    return mp_cma_transfer((pid_t)rec->pid, local, (uint64_t)rec->in_addr + offset, n, 0);
}

static int peer_write(const shm_call *c, int q, size_t offset, const void *local, size_t n) {
    const record_t *rec = &slot_of(c, q)->record[c->seq & 1];
    if (c->peers == SHM_PEERS_WINDOW) {
        memcpy(c->segments[q] + offset, local, n);
        return 0;
    }
    if (rec->nsegs)
        return mp_seg_move((pid_t)rec->pid, (const seg_entry *)rec->payload, rec->nsegs,
                           offset, (char *)local, n, 1);
    return mp_cma_transfer((pid_t)rec->pid, (void *)local, (uint64_t)rec->out_addr + offset, n,
                           1);
}

/* Peers' buffers mapped here (Note [Node heap] in heap.c): rank q's input at in[q], and at
 * out[q] its output where that is the input (in place), else NULL: reached through the kernel.
 * `all`: every peer's input is mapped. */
typedef struct {
    char *in[SHM_MAX_RANKS], *out[SHM_MAX_RANKS];
    int all;
} direct_t;

/* A sliced call's record publishes where its input lies in the node heap (heap_desc) in its
 * payload, unused otherwise in that mode (shm_run). An output that is not the input is
 * always ordinary memory (mpidp.allreduce returns a new array), reached through the kernel. */
static void map_peers(const shm_call *c, size_t nbytes, direct_t *dx) {
    dx->all = c->nranks > 1 && c->peers == SHM_PEERS_CMA;
    for (int q = 0; q < c->nranks; q++) {
        const record_t *rec = &slot_of(c, q)->record[c->seq & 1];
        dx->in[q] = dx->out[q] = NULL;
        if (q == c->rank) continue;
        if (c->peers == SHM_PEERS_CMA && !rec->nsegs)
            dx->in[q] = heap_peer((pid_t)rec->pid, (const heap_desc *)rec->payload, nbytes);
        if (rec->out_addr == rec->in_addr) dx->out[q] = dx->in[q];
        dx->all &= dx->in[q] != NULL;
    }
}

/* Stores `n` bytes of this rank's result at offset `off` of rank q's output: where it is
 * mapped here (in place: the lines were just loaded, so plain stores hit the cache) straight
 * into it, else through the kernel. */
static int store_to_peer(const shm_call *c, const direct_t *dx, int q, size_t off,
                         const char *src, size_t n) {
    if (!dx->out[q]) return peer_write(c, q, off, src, n);
    memcpy(dx->out[q] + off, src, n);
    return 0;
}

/* Reduces slice [slice_lo, slice_hi) of every rank's input into every rank's output,
 * chunk by chunk through a cache-sized scratch buffer (peers mapped here are loaded from
 * directly). Returns 0 or an errno. */
/* Note [Chunk size]
 * A slice is reduced a chunk at a time (MPIDP_SHM_CHUNK_BYTES, 256 KiB by default): each peer's
 * chunk is read into a scratch that stays in cache, reduced, and written back out. Each chunk
 * costs a process_vm_readv and a process_vm_writev per peer, and the kernel pins the pages of
 * every call: on the 2-core test machine (AMD EPYC, 1 MiB L2 a core, 32 MiB L3) reading a
 * peer's 32 MiB through 64 KiB chunks ran at 7.2 GB/s, 256 KiB at 9.6 and 1 MiB at 13.9 (a
 * user-space copy of the same pattern: 12-16; bench/collectives/copy_kinds.py --chunk). The 64 MiB
 * in-place all-reduce on 2 ranks took 0.82x the time with 1 MiB chunks as with 256 KiB, and
 * 0.85-0.93x from 1 to 32 MiB (bench/RESULTS.md, issue 32), so the default was 1 MiB. On
 * today's 2-core machine (Intel Xeon, 2 MiB L2 a core, 300 MiB L3) the same comparison went the
 * other way in every pair: 256 KiB took 0.67-0.77x the time of 1 MiB from 4 to 64 MiB with
 * rotated buffers and 0.58-0.83x from 1 to 64 MiB with buffers in cache, level at 256 KiB and
 * at 1 MiB rotated (4 alternating pairs each, bench/RESULTS.md, issue 45): the 1 MiB default
 * was the 64 MiB all-reduce's 21-35% loss since 7b7fab6. Which is faster is the machine's (the
 * kernel's page pinning per process_vm_readv against the chunk's stay in L2), not the size's:
 * no size regime chose 1 MiB here, so the default is 256 KiB again, and a machine like the
 * first one may set 1 MiB (docs/configuration.md). The scratch is never larger than
 * the slice. Where every peer's buffer is mapped here (Note [Node heap] in heap.c) there is no
 * system call to amortise, and the chunk is what must stay in cache between loading the
 * peer's bytes and storing the result over them: at most SHM_DIRECT_CHUNK_BYTES (64 KiB). The
 * 64 MiB in-place all-reduce of node memory on 2 ranks ran at 99-101% of the non-temporal
 * copy with 64 KiB chunks, 72-94% with 128 KiB, 89-97% with 256 KiB (bench/collectives/copy_kinds.py,
 * the kinds taking turns), and ~80% with 1 MiB in the first experiment (bench/RESULTS.md). */
static int sliced_reduce(const shm_call *c, const direct_t *dx, shm_result *r) {
    size_t isz = mp_itemsize(c->dtype);
    size_t chunk_bytes = c->chunk_bytes;
    if (dx->all && chunk_bytes > SHM_DIRECT_CHUNK_BYTES) chunk_bytes = SHM_DIRECT_CHUNK_BYTES;
    size_t chunk = chunk_bytes / isz;
    if (chunk == 0) chunk = 1;
    if (c->slice_hi > c->slice_lo && chunk > c->slice_hi - c->slice_lo)
        chunk = c->slice_hi - c->slice_lo; /* the scratch no larger than the slice */
    const record_t *mine = &slot_of(c, c->rank)->record[c->seq & 1];
    const seg_entry *own_table = (const seg_entry *)mine->payload;
    /* Note [Summation order]: with three ranks or more the terms are added in rank order, so
     * that the result does not depend on who owns the slice (and so on bucket layout); an
     * in-place call on rank > 0 then needs a spare chunk, since its own data is added after
     * rank 0's. With two ranks own-first is the same sum (addition is commutative). */
    int rank_order = c->nranks > 2;
    int spare_needed = rank_order && c->rank > 0 && (c->nsegs || c->in == c->out);
    char *scratch = NULL, *acc = NULL, *spare = NULL; /* acc: this chunk of own segments */
    if ((c->nranks > 1 || c->nsegs) && c->slice_hi > c->slice_lo) {
        scratch = malloc(chunk * isz * (1 + (c->nsegs ? 1 : 0) + spare_needed));
        if (!scratch) return ENOMEM;
        acc = c->nsegs ? scratch + chunk * isz : NULL;
        spare = spare_needed ? scratch + chunk * isz * (c->nsegs ? 2 : 1) : NULL;
    }
    int err = 0;
    for (size_t lo = c->slice_lo; lo < c->slice_hi && !err; lo += chunk) {
        size_t n = (c->slice_hi - lo < chunk) ? c->slice_hi - lo : chunk;
        size_t off = lo * isz, nbytes = n * isz;
        char *dst = acc ? acc : c->out + off;
        const char *own = acc ? acc : c->in + off;
        if (acc) mp_seg_move(0, own_table, mine->nsegs, off, acc, nbytes, 0);
        if (c->nranks == 1 && dst != own) memcpy(dst, own, nbytes);
        if (rank_order && c->nranks > 1) {
            char *sum = spare ? spare : dst;
            for (int q = 0; q < c->nranks && !err; q++) {
                const char *term = own;
                if (q != c->rank && dx->in[q]) {
                    term = dx->in[q] + off;
                } else if (q != c->rank) {
                    char *into = q == 0 ? sum : scratch;
                    if ((err = peer_read(c, q, into, off, nbytes))) { r->peer_rank = q; break; }
                    term = into;
                }
                if (q == 0) { if (sum != term) memcpy(sum, term, nbytes); }
                else mp_reduce2(sum, sum, term, n, c->dtype, c->op);
            }
            if (!err && sum != dst) memcpy(dst, sum, nbytes);
        } else {
            for (int k = 1; k < c->nranks && !err; k++) {
                int q = (c->rank + k) % c->nranks;
                const char *term = dx->in[q] ? dx->in[q] + off : scratch;
                if (!dx->in[q] && (err = peer_read(c, q, scratch, off, nbytes))) r->peer_rank = q;
                else mp_reduce2(dst, k == 1 ? own : dst, term, n, c->dtype, c->op);
            }
        }
        if (!err && c->divisor > 1) mp_divide(dst, n, c->dtype, c->divisor);
        for (int k = 1; k < c->nranks && !err; k++) {
            int q = (c->rank + k) % c->nranks;
            if ((err = store_to_peer(c, dx, q, off, dst, nbytes))) r->peer_rank = q;
        }
        if (c->peers == SHM_PEERS_WINDOW && !err) memcpy(c->segments[c->rank] + off, dst, nbytes);
        else if (acc && !err) mp_seg_move(0, own_table, mine->nsegs, off, acc, nbytes, 1);
    }
    free(scratch);
    return err;
}

static void inline_reduce(const shm_call *c) {
    size_t nbytes = c->count * mp_itemsize(c->dtype);
    for (int q = 0; q < c->nranks; q++) {
        const char *p = slot_of(c, q)->record[c->seq & 1].payload;
        if (q == 0) memcpy(c->out, p, nbytes);
        else mp_reduce2(c->out, c->out, p, c->count, c->dtype, c->op);
    }
    if (c->divisor > 1) mp_divide(c->out, c->count, c->dtype, c->divisor);
}

void shm_run(const shm_call *c, shm_result *r) {
    size_t nbytes = c->count * mp_itemsize(c->dtype);
    slot_t *mine = slot_of(c, c->rank);
    record_t *rec = &mine->record[c->seq & 1];
    memcpy(rec->header, c->header, sizeof(rec->header));
    rec->pid = (int64_t)getpid();
    rec->in_addr = (int64_t)(uintptr_t)c->in;
    rec->out_addr = (int64_t)(uintptr_t)c->out;
    rec->status = 0;
    rec->nsegs = (int64_t)c->nsegs;
    rec->seq = (int64_t)c->seq;
    if (c->data == SHM_DATA_SLICED && !c->nsegs && c->peers == SHM_PEERS_CMA && c->nranks > 1)
        *(heap_desc *)rec->payload = heap_find(c->in, nbytes);
    seg_entry *table = (seg_entry *)rec->payload;
    for (size_t i = 0; i < c->nsegs; i++) {
        table[i].addr = (int64_t)(uintptr_t)c->segs[i].ptr;
        table[i].nbytes = (int64_t)c->segs[i].nbytes;
    }
    if (c->data == SHM_DATA_INLINE && nbytes) memcpy(rec->payload, c->in, nbytes);
    if (c->data == SHM_DATA_SLICED && c->peers == SHM_PEERS_WINDOW && nbytes) {
        if (c->nsegs) mp_seg_move(0, table, rec->nsegs, 0, c->segments[c->rank], nbytes, 0);
        else memcpy(c->segments[c->rank], c->in, nbytes);
    }
    __atomic_store_n(&mine->arrive1, c->seq, __ATOMIC_RELEASE);

    r->status = SHM_OK;
    int waited = wait_all(c, 0, r);
    if (waited) { r->status = wait_status(waited); return; }
    int agree = 1, in_step = 1;
    for (int q = 0; q < c->nranks; q++) {
        r->seqs[q] = __atomic_load_n(&slot_of(c, q)->record[c->seq & 1].seq, __ATOMIC_ACQUIRE);
        if (r->seqs[q] != (int64_t)c->seq) in_step = 0;
    }
    if (!in_step) { r->status = SHM_OUT_OF_STEP; return; }
    for (int q = 0; q < c->nranks; q++) {
        const int64_t *h = slot_of(c, q)->record[c->seq & 1].header;
        memcpy(r->headers[q], h, sizeof(r->headers[q]));
        if (memcmp(h, c->header, (MP_HEADER_WORDS - 1) * sizeof(int64_t))) agree = 0;
    }
    if (!agree) { r->status = SHM_MISMATCH; return; }
    if (c->data == SHM_DATA_INLINE) { inline_reduce(c); return; }
    if (c->data != SHM_DATA_SLICED) return;

    direct_t dx;
    map_peers(c, nbytes, &dx);
    int err = sliced_reduce(c, &dx, r);
    heap_release_all();
    rec->status = err ? ((int64_t)r->peer_rank << 32) | (int64_t)err : 0;
    __atomic_store_n(&mine->arrive2, c->seq, __ATOMIC_RELEASE);
    waited = wait_all(c, 1, r);
    if (waited) { r->status = wait_status(waited); return; }
    for (int q = 0; q < c->nranks; q++) {
        int64_t s = slot_of(c, q)->record[c->seq & 1].status;
        if (s) {
            r->status = SHM_PEER_ERROR;
            r->peer_rank = q;                 /* the rank that failed ... */
            r->peer_errno = (int)(s & 0xffffffff);
            r->missing[0] = (int)(s >> 32);   /* ... and the peer it could not reach */
            return;
        }
    }
    if (c->peers == SHM_PEERS_WINDOW && nbytes) {
        if (c->nsegs) mp_seg_move(0, table, rec->nsegs, 0, c->segments[c->rank], nbytes, 1);
        else memcpy(c->out, c->segments[c->rank], nbytes);
    }
}

void shm_partition(size_t count, int nranks, int rank, size_t *lo, size_t *hi) {
    size_t base = count / (size_t)nranks, extra = count % (size_t)nranks, r = (size_t)rank;
    *lo = r * base + (r < extra ? r : extra);
    *hi = *lo + base + (r < extra ? 1 : 0);
}
