/* The ShmContext type shared by csrc/context.c (the type, the protocol's calls) and
 * csrc/small.c (the small all-reduce in one call). */
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
} ShmContext;

/* Runs call `c` (its arguments checked) as the context's next call: NULL without an error
 * for a data call that went through, else (status, info) or NULL with an exception. */
PyObject *mp_ctx_enter(ShmContext *self, shm_call *c, int64_t *header);
/* 1 for a context __init__ has set up, else 0 with a TypeError. */
int mp_ctx_ready(ShmContext *self);
/* Note [Small all-reduce in one call] in small.c */
PyObject *mp_ctx_allreduce_array(ShmContext *self, PyObject *const *args, Py_ssize_t nargs);
extern const char mp_allreduce_array_doc[];
int mp_small_init(void);

#endif
