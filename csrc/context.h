/* The ShmContext type shared by csrc/context_type.c (the type and its method table),
 * csrc/context.c (the protocol's calls) and csrc/small.c (the small all-reduce in one call);
 * the functions below are context.c's (Note [One direction in C] in module.c). */
#ifndef MPIDP_CONTEXT_H
#define MPIDP_CONTEXT_H
#include "binding.h"
#include "shm.h"

typedef struct {
    PyObject_HEAD
    char *ctrl;
    int nranks, rank, peers;
    unsigned long long seq;
    Py_ssize_t inline_bytes, chunk_bytes, capacity;
    double timeout_s;
    char *segments[SHM_MAX_RANKS];
    PyObject *board; /* the watchdog's board (mpidp.runtime.watchdog.Board) the fast path posts on */
    int closed;      /* set by close(): every wait ends, no call enters (any thread reads it) */
    int interrupted; /* a call of this context was interrupted: its rank is out of step */
    int64_t pids[SHM_MAX_RANKS];   /* each local rank's process, 0: not watched (watch()), */
    int64_t starts[SHM_MAX_RANKS]; /* and when it started */
} ShmContext;

/* Runs call `c` (its arguments checked) as the context's next call: NULL without an error
 * for a data call that went through, else (status, info) or NULL with an exception. */
PyObject *mp_ctx_enter(ShmContext *self, shm_call *c, int64_t *header);
/* 1 for a context __init__ has set up, else 0 with a TypeError. */
int mp_ctx_ready(ShmContext *self);
/* ShmContext.exchange(header) and ShmContext.allreduce(header, src, dst, dtype, op, divisor). */
PyObject *mp_ctx_exchange(ShmContext *self, PyObject *header_obj);
extern const char mp_ctx_exchange_doc[];
PyObject *mp_ctx_allreduce(ShmContext *self, PyObject *const *args, Py_ssize_t nargs);
extern const char mp_ctx_allreduce_doc[];

#endif
