/* Cross-memory attach: the kernel's copy between this process and a peer's memory
 * (process_vm_readv/writev), for the shared-memory protocol (shm.c) and mpidp.doctor's probe.
 * Note [Cross-memory attach] in mpidp/engine/shm.py says when it is allowed. */
#define _GNU_SOURCE
#include "cma.h"
#include <errno.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/uio.h>

/* Moves n bytes between `local` and process `pid`'s address `remote` with cross-memory
 * attach, looping over partial transfers. Returns 0 or an errno. */
int mp_cma_transfer(pid_t pid, void *local, uint64_t remote, size_t n, int write) {
    size_t done = 0;
    while (done < n) {
        struct iovec l = {(char *)local + done, n - done};
        struct iovec rv = {(void *)(uintptr_t)(remote + done), n - done};
        ssize_t got = write ? process_vm_writev(pid, &l, 1, &rv, 1, 0)
                            : process_vm_readv(pid, &l, 1, &rv, 1, 0);
        if (got <= 0) return got < 0 ? errno : EIO;
        done += (size_t)got;
    }
    return 0;
}

#define SEG_BATCH 64 /* remote pieces per cross-memory-attach call */

/* Moves a batch of pieces between consecutive bytes at `buf` and process `pid`: one system
 * call for all of them, piece by piece only if the kernel stops short. */
static int cma_batch(pid_t pid, char *buf, const struct iovec *remote, int count, size_t total,
                     int write) {
    struct iovec l = {buf, total};
    ssize_t got = write ? process_vm_writev(pid, &l, 1, remote, (unsigned long)count, 0)
                        : process_vm_readv(pid, &l, 1, remote, (unsigned long)count, 0);
    if (got == (ssize_t)total) return 0;
    for (int i = 0; i < count; i++) { /* idempotent: redo the batch piece by piece */
        int err = mp_cma_transfer(pid, buf, (uint64_t)(uintptr_t)remote[i].iov_base,
                               remote[i].iov_len, write);
        if (err) return err;
        buf += remote[i].iov_len;
    }
    return 0;
}

int mp_seg_move(pid_t pid, const seg_entry *table, int64_t nsegs, size_t off, char *buf,
                size_t n, int write) {
    struct iovec batch[SEG_BATCH];
    int count = 0;
    size_t base = 0, pending = 0;
    char *start = buf;
    for (int64_t i = 0; i < nsegs && n; i++) {
        size_t len = (size_t)table[i].nbytes;
        if (off < base + len) {
            size_t skip = off - base, take = len - skip < n ? len - skip : n;
            char *addr = (char *)(uintptr_t)table[i].addr + skip;
            if (pid == 0) {
                if (write) memcpy(addr, buf, take);
                else memcpy(buf, addr, take);
            } else {
                batch[count].iov_base = addr;
                batch[count].iov_len = take;
                pending += take;
                if (++count == SEG_BATCH) {
                    int err = cma_batch(pid, start, batch, count, pending, write);
                    if (err) return err;
                    start += pending;
                    count = 0;
                    pending = 0;
                }
            }
            buf += take;
            off += take;
            n -= take;
        }
        base += len;
    }
    return count ? cma_batch(pid, start, batch, count, pending, write) : 0;
}

int shm_cma_probe(pid_t pid, uint64_t addr, size_t nbytes) {
    char buf[64];
    if (nbytes > sizeof(buf)) nbytes = sizeof(buf);
    struct iovec l = {buf, nbytes}, rv = {(void *)(uintptr_t)addr, nbytes};
    ssize_t got = process_vm_readv(pid, &l, 1, &rv, 1, 0);
    if (got < 0) return errno;
    return got == (ssize_t)nbytes ? 0 : EIO;
}

int shm_set_ptracer(long pid) {
#ifdef PR_SET_PTRACER
    return prctl(PR_SET_PTRACER, (unsigned long)pid, 0, 0, 0) ? errno : 0;
#else
    return pid ? ENOSYS : 0;
#endif
}
