/* Note [Node heap]
 * mpidp.alloc's memory. Through cross-memory attach a rank's bytes reach a peer's buffer only
 * by the kernel's copy, whose ordinary stores read every destination line first: a two-rank
 * all-reduce in place then moves 2.5 bytes per byte where a copy moves 2 (bench/RESULTS.md,
 * "Why 90% is out of reach through the kernel"). Memory that both processes map has no such
 * step: the rank reducing a slice loads the peer's bytes and stores the result over them
 * itself, from user space, while the lines it just loaded are still in its cache.
 *
 * Each block is an anonymous shared file (memfd_create), sealed against shrinking and growing
 * (no process can truncate it under a mapping) and mapped in its owner. A buffer inside one is
 * published in the call's record as (fd, serial, size, offset, inode); a peer on the node maps
 * the same file by opening /proc/<pid>/fd/<fd> and checks its size and inode, and keeps the
 * mapping for later calls. The serial (a per-process random prefix and a counter) names the
 * block in the peer's cache, the inode makes sure a reused descriptor number is not taken for
 * it. Nothing appears in /dev/shm and nothing outlives the processes.
 *
 * Who may map it: opening /proc/<pid>/fd needs ptrace's read access, which any process of the
 * same user has and Yama never restricts. That is no more than such a process may already do
 * where Yama is absent or at ptrace_scope 0 (attach, and so cross-memory attach, to any process
 * of its user); at ptrace_scope >= 1 it would be more, so there mpidp.alloc hands out ordinary
 * arrays (mpidp/comm/node_memory.py), as it does where peers use the staging window.
 *
 * Limits: blocks hold a descriptor each, at most a quarter of RLIMIT_NOFILE (then mpidp.alloc
 * falls back to ordinary arrays). A peer keeps at most HEAP_PEER_SLOTS mappings, evicting the
 * least recently used (more blocks than that in a loop are mapped again on every call), and a
 * mapping keeps a freed block's pages until it is evicted. A mapping a call is using is never
 * evicted (pins are per thread, given back when the call ends). The lock is taken around
 * fork() so a child never inherits it held. */
#define _GNU_SOURCE
#include "heap.h"
#include "binding.h"
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdio.h>
#include <sys/mman.h>
#include <sys/random.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#define HEAP_MAX_BLOCKS 4096
#define HEAP_PEER_SLOTS 128

typedef struct { char *base; size_t size; int fd; uint64_t serial; int64_t ino; } own_block;
typedef struct {
    pid_t pid;
    uint64_t serial;
    char *base;
    size_t size;
    int refs;
    uint64_t used;
} peer_map;

static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
static own_block owned[HEAP_MAX_BLOCKS];
static int n_owned;
static uint64_t next_serial;
static peer_map peers[HEAP_PEER_SLOTS];
static uint64_t clock_;
static uint64_t opened, pins; /* heap_stats(): peers' blocks mapped, pointers handed out */
static __thread int pinned[HEAP_PEER_SLOTS];
static __thread int n_pinned;
static pthread_once_t fork_once = PTHREAD_ONCE_INIT;

static void lock_for_fork(void) { pthread_mutex_lock(&lock); }
static void unlock_after_fork(void) { pthread_mutex_unlock(&lock); }
static void register_fork(void) {
    pthread_atfork(lock_for_fork, unlock_after_fork, unlock_after_fork);
}

heap_desc heap_find(const void *p, size_t n) {
    heap_desc d = {-1, 0, 0, 0};
    if (!__atomic_load_n(&n_owned, __ATOMIC_RELAXED)) return d;
    const char *c = p;
    pthread_mutex_lock(&lock);
    for (int i = 0; i < n_owned; i++) {
        if (c >= owned[i].base && c + n <= owned[i].base + owned[i].size) {
            d = (heap_desc){owned[i].fd, (int64_t)owned[i].serial, (int64_t)owned[i].size,
                            (int64_t)(c - owned[i].base), owned[i].ino};
            break;
        }
    }
    pthread_mutex_unlock(&lock);
    return d;
}

static void pin(int i) {
    peers[i].refs++;
    peers[i].used = ++clock_;
    pins++;
    pinned[n_pinned++] = i;
}

char *heap_peer(pid_t pid, const heap_desc *d, size_t n) {
    if (d->fd < 0 || n_pinned == HEAP_PEER_SLOTS || d->offset < 0 || d->size <= 0 ||
        (uint64_t)d->offset > (uint64_t)d->size || n > (uint64_t)(d->size - d->offset))
        return NULL;
    pthread_once(&fork_once, register_fork);
    char *found = NULL;
    pthread_mutex_lock(&lock);
    int victim = -1;
    for (int i = 0; i < HEAP_PEER_SLOTS; i++) {
        if (peers[i].base && peers[i].pid == pid && peers[i].serial == (uint64_t)d->serial) {
            pin(i);
            found = peers[i].base + d->offset;
            goto out;
        }
        if (peers[i].refs == 0 && (victim < 0 || !peers[i].base ||
                                   (peers[victim].base && peers[i].used < peers[victim].used)))
            victim = i;
    }
    if (victim < 0) goto out;
    char path[64];
    snprintf(path, sizeof(path), "/proc/%d/fd/%d", (int)pid, (int)d->fd);
    int fd = open(path, O_RDWR | O_CLOEXEC);
    if (fd < 0) goto out;
    struct stat st;
    void *base = MAP_FAILED;
    if (fstat(fd, &st) == 0 && st.st_size == d->size && (int64_t)st.st_ino == d->ino)
        base = mmap(NULL, (size_t)d->size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    close(fd);
    if (base == MAP_FAILED) goto out;
    if (peers[victim].base) munmap(peers[victim].base, peers[victim].size);
    opened++;
    peers[victim] = (peer_map){pid, (uint64_t)d->serial, base, (size_t)d->size, 0, 0};
    pin(victim);
    found = (char *)base + d->offset;
out:
    pthread_mutex_unlock(&lock);
    return found;
}

void heap_release_all(void) {
    if (!n_pinned) return;
    pthread_mutex_lock(&lock);
    for (int k = 0; k < n_pinned; k++) peers[pinned[k]].refs--;
    n_pinned = 0;
    pthread_mutex_unlock(&lock);
}

/* ---- the Python type: a block of the heap, exposing its bytes (writable, 1-D) ---------- */

typedef struct {
    PyObject_HEAD
    char *base;
    Py_ssize_t size;
} HeapBlock;

static void block_dealloc(HeapBlock *self) {
    if (self->base) {
        pthread_mutex_lock(&lock);
        for (int i = 0; i < n_owned; i++) {
            if (owned[i].base == self->base) {
                close(owned[i].fd);
                owned[i] = owned[--n_owned];
                break;
            }
        }
        pthread_mutex_unlock(&lock);
        munmap(self->base, (size_t)self->size);
    }
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static int block_getbuffer(HeapBlock *self, Py_buffer *view, int flags) {
    return PyBuffer_FillInfo(view, (PyObject *)self, self->base, self->size, 0, flags);
}

static PyBufferProcs block_as_buffer = {(getbufferproc)block_getbuffer, NULL};

static PyTypeObject HeapBlockType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "mpidp._ext.HeapBlock",
    .tp_basicsize = sizeof(HeapBlock),
    .tp_dealloc = (destructor)block_dealloc,
    .tp_as_buffer = &block_as_buffer,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "A block of the node heap (Note [Node heap] in csrc/heap.c): its bytes, which the "
              "other ranks of the node reach without the kernel's copy.",
};

const char mp_heap_alloc_doc[] = "heap_alloc(nbytes) -> HeapBlock: nbytes (> 0) of the node "
                                 "heap, zeroed (Note [Node heap] in csrc/heap.c)";

PyObject *mp_heap_alloc(PyObject *module, PyObject *arg) {
    Py_ssize_t n = PyLong_AsSsize_t(arg);
    if (n == -1 && PyErr_Occurred()) return NULL;
    if (n <= 0) return PyErr_Format(PyExc_ValueError, "heap_alloc: nbytes must be positive, "
                                    "got %zd", n);
    pthread_once(&fork_once, register_fork);
    struct rlimit lim;
    size_t most = HEAP_MAX_BLOCKS;
    if (getrlimit(RLIMIT_NOFILE, &lim) == 0 && lim.rlim_cur != RLIM_INFINITY &&
        lim.rlim_cur / 4 < most)
        most = lim.rlim_cur / 4;
    if ((size_t)__atomic_load_n(&n_owned, __ATOMIC_RELAXED) >= most)
        return PyErr_Format(PyExc_MemoryError, "heap_alloc: %zu blocks of the node heap are "
                            "in use already (a quarter of RLIMIT_NOFILE at most)", most);
    int fd = memfd_create("mpidp-heap", MFD_CLOEXEC | MFD_ALLOW_SEALING);
    if (fd < 0) return PyErr_SetFromErrno(PyExc_OSError);
    void *base = MAP_FAILED;
    struct stat st;
    if (ftruncate(fd, (off_t)n) == 0 &&
        fcntl(fd, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL) == 0 &&
        fstat(fd, &st) == 0)
        base = mmap(NULL, (size_t)n, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (base == MAP_FAILED) {
        int err = errno;
        close(fd);
        errno = err;
        return PyErr_SetFromErrno(PyExc_OSError);
    }
    HeapBlock *b = PyObject_New(HeapBlock, &HeapBlockType);
    if (!b) {
        munmap(base, (size_t)n);
        close(fd);
        return NULL;
    }
    b->base = base;
    b->size = n;
    /* the count was checked above: only a caller holding the GIL adds or frees blocks */
    pthread_mutex_lock(&lock);
    if (!next_serial) {
        uint32_t prefix = 0;
        if (getrandom(&prefix, sizeof(prefix), 0) != sizeof(prefix))
            prefix = (uint32_t)time(NULL) ^ (uint32_t)getpid();
        next_serial = (uint64_t)prefix << 32;
    }
    owned[n_owned++] = (own_block){base, (size_t)n, fd, ++next_serial, (int64_t)st.st_ino};
    pthread_mutex_unlock(&lock);
    return (PyObject *)b;
}

const char mp_heap_stats_doc[] = "heap_stats() -> (mapped, used): how many peers' blocks this "
                                 "process has mapped, and how many times a call used one";

PyObject *mp_heap_stats(PyObject *module, PyObject *unused) {
    pthread_mutex_lock(&lock);
    uint64_t o = opened, p = pins;
    pthread_mutex_unlock(&lock);
    return Py_BuildValue("(KK)", (unsigned long long)o, (unsigned long long)p);
}

int mp_add_heap_type(PyObject *m) {
    if (PyType_Ready(&HeapBlockType) < 0) return -1;
    Py_INCREF(&HeapBlockType);
    if (PyModule_AddObject(m, "HeapBlock", (PyObject *)&HeapBlockType) < 0) {
        Py_DECREF(&HeapBlockType);
        return -1;
    }
    return 0;
}
