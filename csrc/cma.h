/* Cross-memory attach (process_vm_readv/writev) between this process and a peer: see cma.c. */
#ifndef MPIDP_CMA_H
#define MPIDP_CMA_H
#include <stddef.h>
#include <stdint.h>
#include <sys/types.h>

/* One piece of a buffer handed in as segments (a record's segment table). */
typedef struct {
    int64_t addr, nbytes;
} seg_entry;

/* Moves n bytes between `local` and process `pid`'s address `remote` (write = 1: into it).
 * Returns 0 or an errno. */
int mp_cma_transfer(pid_t pid, void *local, uint64_t remote, size_t n, int write);
/* Moves bytes [off, off + n) of the segmented buffer `table` (nsegs pieces, in process pid;
 * pid 0: this one) to (write = 0) or from (write = 1) `buf`. Returns 0 or an errno. */
int mp_seg_move(pid_t pid, const seg_entry *table, int64_t nsegs, size_t off, char *buf,
                size_t n, int write);
/* 0 if this process can read `nbytes` at `addr` in process `pid`, else errno. */
int shm_cma_probe(pid_t pid, uint64_t addr, size_t nbytes);
/* Declares `pid` (and its descendants) as allowed to attach to this process under Yama
 * ptrace_scope 1 (0: nobody). Returns 0 or an errno. Note [Cross-memory attach] in shm.py. */
int shm_set_ptracer(long pid);

#endif
