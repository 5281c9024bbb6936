/* mpidp._ext.CheckedContext: the in-place all-reduce of a small array across nodes, one rank
 * per node, as one call: recursive doubling over MPI with the collective's check in the same
 * messages (Note [Checked in the message] in mpidp/doubling.py; the same records, tags and
 * schedule as mpidp/doubling.py, so a rank on the Python path, one refusing its input, say,
 * pairs with ranks on this one). */
#include "small.h"
#include "kernels.h"
#include <stdlib.h>
#include <string.h>

/* Note [MPI from C]
 * The extension is built without MPI's headers (it needs none to install), so it calls the
 * three MPI functions it uses through pointers that Python found in the MPI library mpi4py
 * loaded (mpidp/checked.py: c_functions), with that library's handles for the communicator
 * and MPI_BYTE. It is only made where those handles are C ints (MPICH's ABI: mpi4py's
 * MPI._sizeof says so); elsewhere the Python path runs. The GIL is released around the
 * exchange, as mpi4py releases it around a blocking call, so the watchdog thread can answer
 * while this rank waits. A receive longer than this rank's record (a peer with another
 * count) is MPI_ERR_TRUNCATE on a communicator that returns errors: a disagreement. */
typedef int (*sendrecv_fn)(const void *, int, int, int, int, void *, int, int, int, int, int,
                           void *);
typedef int (*send_fn)(const void *, int, int, int, int, int);
typedef int (*recv_fn)(void *, int, int, int, int, int, void *);

enum { REC_OK = 0, REC_DISAGREE = 1, CHECK_TAG = 0x6D63, HEADER_WORDS = 8, COMPARED = 7,
       MAX_ROUNDS = 31, DOUBLING = 8 /* the algorithm's code, mpidp.algorithms */ };

typedef struct {
    PyObject_HEAD
    sendrecv_fn sendrecv;
    send_fn send;
    recv_fn recv;
    int comm, byte_type, rank, size, fold_out, fold_in, nrounds, rounds[MAX_ROUNDS];
    Py_ssize_t max_bytes, words;
    int64_t *mine, *theirs; /* two records: (1 + 8 + size) words, then max_bytes of data */
    PyObject *board;
} CheckedContext;

static int checked_init(CheckedContext *self, PyObject *args, PyObject *kw) {
    unsigned long long sr, sd, rv;
    int comm, byte_type, rank, size;
    Py_ssize_t max_bytes;
    PyObject *board;
    if (!PyArg_ParseTuple(args, "(KKK)iiiinO", &sr, &sd, &rv, &comm, &byte_type, &rank, &size,
                          &max_bytes, &board))
        return -1;
    if (size < 2 || rank < 0 || rank >= size || max_bytes < 0 || !sr || !sd || !rv) {
        PyErr_SetString(PyExc_ValueError, "CheckedContext: bad rank, size, bytes or function");
        return -1;
    }
    self->sendrecv = (sendrecv_fn)(uintptr_t)sr;
    self->send = (send_fn)(uintptr_t)sd;
    self->recv = (recv_fn)(uintptr_t)rv;
    self->comm = comm, self->byte_type = byte_type, self->rank = rank, self->size = size;
    int m = 1;
    while (m * 2 <= size) m *= 2;
    self->fold_out = rank >= m ? rank - m : -1;
    self->fold_in = rank < m && rank + m < size ? rank + m : -1;
    self->nrounds = 0;
    for (int k = 1; rank < m && k < m; k *= 2) self->rounds[self->nrounds++] = rank ^ k;
    self->max_bytes = max_bytes;
    self->words = 1 + HEADER_WORDS + size;
    size_t bytes = (size_t)self->words * 8 + (size_t)max_bytes;
    free(self->mine);
    free(self->theirs);
    self->mine = malloc(bytes), self->theirs = malloc(bytes);
    if (!self->mine || !self->theirs) {
        PyErr_NoMemory();
        return -1;
    }
    Py_XSETREF(self->board, Py_NewRef(board));
    return 0;
}

static void checked_dealloc(CheckedContext *self) {
    free(self->mine);
    free(self->theirs);
    Py_XDECREF(self->board);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

/* Merges the peer's record in `theirs` (rc: how its receive ended) into `mine`. */
static void merge(CheckedContext *self, int rc, int mine_first, size_t len, int dtype, int op) {
    int64_t *a = self->mine, *b = self->theirs;
    if (rc != 0) {
        a[0] = REC_DISAGREE;
        return;
    }
    for (Py_ssize_t i = 1 + HEADER_WORDS; i < self->words; i++) a[i] |= b[i];
    if (a[0] != REC_OK || b[0] != REC_OK || memcmp(a + 1, b + 1, COMPARED * 8) != 0) {
        a[0] = REC_DISAGREE;
        return;
    }
    char *x = (char *)(a + self->words), *y = (char *)(b + self->words);
    size_t count = len / mp_itemsize(dtype);
    if (count) mp_reduce2(x, mine_first ? x : y, mine_first ? y : x, count, dtype, op);
}

/* The exchange of `len` data bytes, the GIL released; the outcome in mine[0]. */
static void exchange(CheckedContext *self, size_t len, int dtype, int op) {
    int n = (int)(self->words * 8 + (Py_ssize_t)len), c = self->comm, t = self->byte_type;
    char status[64]; /* MPI_Status, whatever its layout: never read */
    if (self->fold_out >= 0) {
        int rc = self->send(self->mine, n, t, self->fold_out, CHECK_TAG, c);
        rc = rc ? rc : self->recv(self->theirs, n, t, self->fold_out, CHECK_TAG, c, status);
        if (rc) self->mine[0] = REC_DISAGREE;
        else memcpy(self->mine, self->theirs, (size_t)n);
        return;
    }
    if (self->fold_in >= 0)
        merge(self, self->recv(self->theirs, n, t, self->fold_in, CHECK_TAG, c, status), 1, len,
              dtype, op);
    for (int k = 0; k < self->nrounds; k++) {
        int peer = self->rounds[k];
        int rc = self->sendrecv(self->mine, n, t, peer, CHECK_TAG, self->theirs, n, t, peer,
                                CHECK_TAG, c, status);
        merge(self, rc, self->rank < peer, len, dtype, op);
    }
    if (self->fold_in >= 0 && self->send(self->mine, n, t, self->fold_in, CHECK_TAG, c))
        self->mine[0] = REC_DISAGREE;
}

static PyObject *checked_allreduce_array(CheckedContext *self, PyObject *const *args,
                                         Py_ssize_t nargs) {
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "allreduce_array(x, op)");
        return NULL;
    }
    int opc, average, dtype;
    Py_buffer v;
    Py_hash_t shape_hash;
    if (!mp_small_take(args[0], args[1], self->max_bytes, &v, &dtype, &opc, &average,
                       &shape_hash))
        Py_RETURN_NOTIMPLEMENTED;
    int64_t header[HEADER_WORDS] = {1 /* ALLREDUCE */, DOUBLING, opc + 4 * average, dtype,
                                    (int64_t)(v.len / v.itemsize), shape_hash, 0, 0};
    long long seq = mp_post(self->board, header);
    if (seq < 0) { /* nothing entered: the general path takes the call (out of memory) */
        PyErr_Clear();
        PyBuffer_Release(&v);
        Py_RETURN_NOTIMPLEMENTED;
    }
    int64_t *rec = self->mine;
    rec[0] = REC_OK;
    memcpy(rec + 1, header, sizeof(header));
    memset(rec + 1 + HEADER_WORDS, 0, (size_t)self->size * 8); /* every free word: 0 */
    memcpy(rec + self->words, v.buf, (size_t)v.len);
    Py_BEGIN_ALLOW_THREADS
    exchange(self, (size_t)v.len, dtype, opc);
    if (rec[0] == REC_OK) {
        memcpy(v.buf, rec + self->words, (size_t)v.len);
        if (average) mp_divide(v.buf, (size_t)(v.len / v.itemsize), dtype, self->size);
    }
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&v);
    if (mp_mark_done(self->board, seq) < 0) return NULL;
    if (rec[0] == REC_OK) return Py_NewRef(args[0]);
    PyObject *words = PyTuple_New(HEADER_WORDS); /* the ranks disagreed: (False, header) */
    for (int i = 0; words && i < HEADER_WORDS; i++) {
        PyObject *w = PyLong_FromLongLong(header[i]);
        if (!w) Py_CLEAR(words);
        else PyTuple_SET_ITEM(words, i, w);
    }
    return words ? Py_BuildValue("(ON)", Py_False, words) : NULL;
}

static PyMethodDef checked_methods[] = {
    {"allreduce_array", (PyCFunction)(void (*)(void))checked_allreduce_array, METH_FASTCALL,
     "allreduce_array(x, op) -> x, (False, header) when the ranks disagree, or NotImplemented "
     "when it declines (nothing done, nothing posted)"},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject CheckedContextType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "mpidp._ext.CheckedContext",
    .tp_basicsize = sizeof(CheckedContext),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "CheckedContext((sendrecv, send, recv), comm, byte, rank, size, max_bytes, board): "
              "the small all-reduce across nodes in one call (csrc/checked.c)",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)checked_init,
    .tp_dealloc = (destructor)checked_dealloc,
    .tp_methods = checked_methods,
};

int mp_add_checked_type(PyObject *m) {
    if (PyType_Ready(&CheckedContextType) < 0) return -1;
    return PyModule_AddObjectRef(m, "CheckedContext", (PyObject *)&CheckedContextType);
}
