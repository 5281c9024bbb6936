/* mpidp._ext.ShmContext: one node's shared-memory context as a Python type. It holds what
 * every call of the protocol shares (control block, ranks, peer mode, sizes, staging
 * segments, the call counter), so a call passes only its own header and data. This file is
 * the type: what a context holds, how it is made, given its segments and board, and closed,
 * and its method table, which names the calls of csrc/context.c (exchange, allreduce) and of
 * csrc/small.c (allreduce_array) (Note [One direction in C] in module.c). */
#include "context.h"
#include "small.h"
#include <structmember.h>

static void ctx_dealloc(ShmContext *self) {
    Py_XDECREF(self->board);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static int ctx_init(ShmContext *self, PyObject *args, PyObject *kwds) {
    static char *kw[] = {"ctrl_addr", "nranks", "rank", "peers", "inline_bytes", "chunk_bytes",
                         "timeout_s", NULL};
    unsigned long long ctrl;
    int nranks, rank, peers;
    Py_ssize_t inline_bytes, chunk_bytes;
    double timeout_s;
    if (self->ctrl) {
        PyErr_SetString(PyExc_TypeError, "a ShmContext is initialised once");
        return -1;
    }
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "Kiiinnd", kw, &ctrl, &nranks, &rank, &peers,
                                     &inline_bytes, &chunk_bytes, &timeout_s))
        return -1;
    if (!ctrl || nranks < 1 || nranks > SHM_MAX_RANKS || rank < 0 || rank >= nranks) {
        PyErr_Format(PyExc_ValueError, "rank %d of %d outside 1..%d ranks (or no control block)",
                     rank, nranks, SHM_MAX_RANKS);
        return -1;
    }
    if (peers != SHM_PEERS_CMA && peers != SHM_PEERS_WINDOW) {
        PyErr_Format(PyExc_ValueError, "unknown peer mode %d", peers);
        return -1;
    }
    if (inline_bytes < 0 || inline_bytes > SHM_INLINE_BYTES || chunk_bytes < 1) {
        PyErr_Format(PyExc_ValueError, "inline_bytes must be 0..%d and chunk_bytes positive",
                     SHM_INLINE_BYTES);
        return -1;
    }
    self->nranks = nranks;
    self->rank = rank;
    self->peers = peers;
    self->inline_bytes = inline_bytes;
    self->chunk_bytes = chunk_bytes;
    self->timeout_s = timeout_s;
    self->ctrl = (char *)(uintptr_t)ctrl;
    self->seq = 0;
    self->capacity = 0;
    return 0;
}

static PyObject *ctx_set_segments(ShmContext *self, PyObject *args) {
    PyObject *addrs;
    Py_ssize_t capacity;
    if (!PyArg_ParseTuple(args, "O!n", &PyTuple_Type, &addrs, &capacity)) return NULL;
    if (PyTuple_GET_SIZE(addrs) != self->nranks) {
        PyErr_SetString(PyExc_ValueError, "one staging segment address per rank");
        return NULL;
    }
    for (int q = 0; q < self->nranks; q++) {
        self->segments[q] = (char *)(uintptr_t)PyLong_AsUnsignedLongLong(PyTuple_GET_ITEM(addrs, q));
        if (PyErr_Occurred()) return NULL;
    }
    self->capacity = capacity;
    Py_RETURN_NONE;
}

static PyObject *ctx_watch(ShmContext *self, PyObject *const *args, Py_ssize_t nargs) {
    if (!mp_ctx_ready(self)) return NULL;
    if (nargs != 2 || !PyTuple_Check(args[0]) || !PyTuple_Check(args[1]) ||
        PyTuple_GET_SIZE(args[0]) != self->nranks || PyTuple_GET_SIZE(args[1]) != self->nranks) {
        PyErr_Format(PyExc_TypeError, "watch(pids, starts): two tuples of %d ints", self->nranks);
        return NULL;
    }
    int64_t pids[SHM_MAX_RANKS], starts[SHM_MAX_RANKS];
    for (int q = 0; q < self->nranks; q++) {
        pids[q] = PyLong_AsLongLong(PyTuple_GET_ITEM(args[0], q));
        starts[q] = PyLong_AsLongLong(PyTuple_GET_ITEM(args[1], q));
        if (PyErr_Occurred()) return NULL;
    }
    memcpy(self->pids, pids, (size_t)self->nranks * sizeof(int64_t));
    memcpy(self->starts, starts, (size_t)self->nranks * sizeof(int64_t));
    Py_RETURN_NONE;
}

/* process_stat(pid) -> (state, threads, start) from /proc/<pid>/stat, or None (Note [A lost
 * peer] in shm.c: what a rank tells the others of its own process). */
static PyObject *ctx_process_stat(PyObject *unused, PyObject *arg) {
    long pid = PyLong_AsLong(arg);
    if (pid == -1 && PyErr_Occurred()) return NULL;
    char state;
    long threads;
    unsigned long long start;
    if (mp_process_stat((pid_t)pid, &state, &threads, &start) < 0) Py_RETURN_NONE;
    return Py_BuildValue("(CLK)", (int)state, (long long)threads, start);
}

static PyObject *ctx_set_board(ShmContext *self, PyObject *board) {
    Py_XSETREF(self->board, Py_NewRef(board));
    Py_RETURN_NONE;
}

static PyObject *ctx_close(ShmContext *self, PyObject *unused) {
    __atomic_store_n(&self->closed, 1, __ATOMIC_RELEASE);
    if (self->ctrl) shm_depart(self->ctrl, self->rank); /* Note [A rank that has shut down] */
    Py_RETURN_NONE;
}

static PyObject *ctx_get_closed(ShmContext *self, void *closure) {
    return PyBool_FromLong(__atomic_load_n(&self->closed, __ATOMIC_ACQUIRE) || self->interrupted);
}

static PyObject *ctx_get_seq(ShmContext *self, void *closure) {
    return PyLong_FromUnsignedLongLong(self->seq);
}

static PyMethodDef ctx_methods[] = {
    {"exchange", (PyCFunction)mp_ctx_exchange, METH_O, mp_ctx_exchange_doc},
    {"allreduce", (PyCFunction)(void (*)(void))mp_ctx_allreduce, METH_FASTCALL,
     mp_ctx_allreduce_doc},
    {"allreduce_array", (PyCFunction)(void (*)(void))mp_ctx_allreduce_array, METH_FASTCALL,
     mp_allreduce_array_doc},
    {"watch", (PyCFunction)(void (*)(void))ctx_watch, METH_FASTCALL,
     "watch(pids, starts): each local rank's process (0: not watched) and its start time,\n"
     "whose end a wait notices (SHM_LOST: Note [A lost peer] in shm.c)"},
    {"process_stat", (PyCFunction)ctx_process_stat, METH_O | METH_STATIC,
     "process_stat(pid) -> (state, threads, start) from /proc/<pid>/stat, or None"},
    {"set_board", (PyCFunction)ctx_set_board, METH_O,
     "set_board(board): the watchdog's board allreduce_array posts on"},
    {"close", (PyCFunction)ctx_close, METH_NOARGS,
     "close(): ends every wait of this context, in any thread, and lets no later call enter\n"
     "(they answer (SHM_INTERRUPTED, None)); the other ranks' waits for a call this rank\n"
     "will not enter end with SHM_DEPARTED (Note [A rank that has shut down] in shm.c).\n"
     "No communication; the control block must still be mapped"},
    {"set_segments", (PyCFunction)ctx_set_segments, METH_VARARGS,
     "set_segments(addresses, capacity): every rank's staging segment (window mode)"},
    {NULL, NULL, 0, NULL},
};

static PyMemberDef ctx_members[] = {
    {"nranks", T_INT, offsetof(ShmContext, nranks), READONLY, "local ranks"},
    {"rank", T_INT, offsetof(ShmContext, rank), READONLY, "this process's local rank"},
    {"peers", T_INT, offsetof(ShmContext, peers), READONLY, "SHM_PEERS_CMA or SHM_PEERS_WINDOW"},
    {"inline_bytes", T_PYSSIZET, offsetof(ShmContext, inline_bytes), READONLY,
     "largest buffer carried in the control block"},
    {"capacity", T_PYSSIZET, offsetof(ShmContext, capacity), READONLY,
     "bytes of each staging segment (window mode)"},
    {"timeout_s", T_DOUBLE, offsetof(ShmContext, timeout_s), 0,
     "seconds a wait for the other local ranks lasts before its call ends with SHM_TIMEOUT\n"
     "(read when a call enters; settable: a group's timeout, mpidp.engine.shm)"},
    {NULL, 0, 0, 0, NULL},
};

static PyGetSetDef ctx_getset[] = {
    {"seq", (getter)ctx_get_seq, NULL, "calls that entered the protocol", NULL},
    {"closed", (getter)ctx_get_closed, NULL,
     "True after close() or an interrupted call: no call enters any more", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyTypeObject ShmContextType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "mpidp._ext.ShmContext",
    .tp_doc = "ShmContext(ctrl_addr, nranks, rank, peers, inline_bytes, chunk_bytes, timeout_s)\n\n"
              "The shared-memory protocol of one node's ranks (Note [Shared-memory protocol]).",
    .tp_basicsize = sizeof(ShmContext),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_new = PyType_GenericNew,
    .tp_dealloc = (destructor)ctx_dealloc,
    .tp_init = (initproc)ctx_init,
    .tp_methods = ctx_methods,
    .tp_members = ctx_members,
    .tp_getset = ctx_getset,
};

int mp_add_shm_context_type(PyObject *m) {
    if (PyType_Ready(&ShmContextType) < 0) return -1;
    return PyModule_AddObjectRef(m, "ShmContext", (PyObject *)&ShmContextType);
}
