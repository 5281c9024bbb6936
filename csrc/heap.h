/* The node heap: memory a rank allocates so that the other ranks of its node can load and
 * store into it directly. See Note [Node heap] in heap.c. */
#ifndef MPIDP_HEAP_H
#define MPIDP_HEAP_H
#include <stddef.h>
#include <stdint.h>
#include <sys/types.h>

/* Where a buffer lies in its owner's heap (the block's descriptor number, serial, size and
 * inode, the buffer's offset in it); fd < 0: not in it. */
typedef struct {
    int64_t fd, serial, size, offset, ino;
} heap_desc;

/* The block of this process's heap holding all of [p, p + n): its descriptor, else fd = -1. */
heap_desc heap_find(const void *p, size_t n);
/* Process `pid`'s block `d`, mapped here (cached), plus d.offset, for `n` bytes from there;
 * NULL where it cannot be mapped or does not hold them (the caller then goes through
 * cross-memory attach). Every pointer a call got is given back with heap_release_all before
 * the call returns: a mapping in use is never unmapped. */
char *heap_peer(pid_t pid, const heap_desc *d, size_t n);
void heap_release_all(void);

#endif
