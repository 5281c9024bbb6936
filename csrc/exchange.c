/* mpidp._ext.CheckedContext: the in-place all-reduce of an array across nodes, one rank per
 * node, as one call: recursive doubling over MPI with the collective's check in the same
 * messages (Note [Checked in the message] in mpidp/engine/doubling.py; up to `inline_bytes` the same
 * records, tags and schedule as mpidp/engine/doubling.py, so a rank on the Python path, one refusing
 * its input, say, pairs with ranks on this one), and above that the record alone, then the
 * data in pipelined chunks (Note [Chunks after the record]). */
#include "small.h"
#include "kernels.h"
#include <limits.h>
#include <stdlib.h>
#include <string.h>

/* Note [MPI from C]
 * The extension is built without MPI's headers (it needs none to install), so it calls the
 * MPI functions it uses through pointers that Python found in the MPI library mpi4py
 * loaded (mpidp/engine/exchange.py: c_context), with that library's handles for the
 * communicator and MPI_BYTE. Two ABIs are met: MPICH's handles are C ints, Open MPI's are
 * pointers (mpi4py's MPI._sizeof says which); the context keeps each handle, and each
 * request, as an mpi_handle and calls the functions through the types of its ABI (the
 * mpi_* wrappers below: the one place that knows). Statuses are written into 64 bytes,
 * more than either library's MPI_Status, and never read. The GIL is released around the
 * exchange, as mpi4py releases it around a blocking call, so the watchdog thread can answer
 * while this rank waits. A receive longer than this rank's record (a peer with another
 * count) is MPI_ERR_TRUNCATE on a communicator that returns errors: a disagreement; the
 * first error code of a call is kept (`error`, read once by take_error()), so that Python
 * raises any other (a lost process under fault tolerance, Note [In-job recovery] in
 * mpidp/runtime/recovery.py) as MPI's error rather than as a disagreement. */
typedef union {
    int i;   /* MPICH */
    void *p; /* Open MPI */
} mpi_handle;
typedef void (*mpi_fn)(void);
typedef int (*sendrecv_i)(const void *, int, int, int, int, void *, int, int, int, int, int,
                          void *);
typedef int (*sendrecv_p)(const void *, int, void *, int, int, void *, int, void *, int, int,
                          void *, void *);
typedef int (*send_i)(const void *, int, int, int, int, int);
typedef int (*send_p)(const void *, int, void *, int, int, void *);
typedef int (*recv_i)(void *, int, int, int, int, int, void *);
typedef int (*recv_p)(void *, int, void *, int, int, void *, void *);
typedef int (*isend_i)(const void *, int, int, int, int, int, int *);
typedef int (*isend_p)(const void *, int, void *, int, int, void *, void **);
typedef int (*irecv_i)(void *, int, int, int, int, int, int *);
typedef int (*irecv_p)(void *, int, void *, int, int, void *, void **);
typedef int (*wait_i)(int *, void *);
typedef int (*wait_p)(void **, void *);

/* Note [Chunks after the record]
 * Above `inline_bytes` the record and the data travel apart. In each round the partners
 * swap their records without data first (one latency; the check, as for every collective);
 * only where the merged record agrees — both ranks compute the same verdict from the same
 * two records — do they swap the data, as `nchunks` messages posted at once (tag DATA_TAG),
 * each chunk reduced into the caller's array as soon as it has arrived and this rank's own
 * send of it has completed, while the next chunks are on the wire. No copy in or out of a
 * record, and the reduction overlaps the transfer, where one whole-message swap could do
 * neither (it lost to MPI_Allreduce at 64-128 KiB, bench/RESULTS.md). Made only for a power
 * of two of ranks (no fold; mpidp.runtime.resources enables it for two: with more rounds a later
 * round's disagreement would leave the caller's array partly reduced, where the Python path
 * reduces a copy). A rank whose array allreduce_array declines takes the general path, which
 * for an agreeing header runs this same exchange (mpidp.engine.exchange.exchange calls `exchange`),
 * and mpidp.comm.collectives copies a strided array rather than let it be declined: a record
 * whose data follows never meets a rank that would not take it. */
enum { REC_OK = 0, REC_DISAGREE = 1, CHECK_TAG = 0x6D63, DATA_TAG = 0x6D64, MAX_ROUNDS = 31 };

typedef struct {
    PyObject_HEAD
    mpi_fn sendrecv, send, recv, isend, irecv, wait;
    int pointers;             /* Open MPI's ABI: handles are pointers */
    mpi_handle comm, byte_type;
    int error;                /* the first MPI error code of the last call, or 0 */
    int rank, size, fold_out, fold_in, nrounds, rounds[MAX_ROUNDS];
    Py_ssize_t inline_bytes, max_bytes, chunk_bytes, words;
    int window;
    int64_t *mine, *theirs; /* two records: (1 + 8 + size) words, then inline_bytes of data */
    char *peer_data;        /* window x chunk_bytes: the partner's chunks in flight */
    mpi_handle *requests;   /* 2 per chunk in flight: its receive, its send */
    char *sent;             /* per slot: its send was posted (its receive always is) */
    PyObject *board;
} CheckedContext;

static int checked_init(CheckedContext *self, PyObject *args, PyObject *kw) {
    unsigned long long f[6], comm, byte_type;
    int pointers, rank, size, window;
    Py_ssize_t inline_bytes, max_bytes, chunk_bytes;
    PyObject *board;
    if (!PyArg_ParseTuple(args, "(KKKKKK)pKKiinnniO", &f[0], &f[1], &f[2], &f[3], &f[4], &f[5],
                          &pointers, &comm, &byte_type, &rank, &size, &inline_bytes,
                          &max_bytes, &chunk_bytes, &window, &board))
        return -1;
    int fns_ok = 1;
    for (int i = 0; i < 6; i++) fns_ok &= f[i] != 0;
    if (size < 2 || rank < 0 || rank >= size || inline_bytes < 0 || max_bytes < inline_bytes ||
        chunk_bytes < 16 || chunk_bytes % 16 || chunk_bytes > INT_MAX || window < 1 ||
        window > 1024 || !fns_ok) {
        PyErr_SetString(PyExc_ValueError,
                        "CheckedContext: bad rank, size, bytes, chunk, window or function");
        return -1;
    }
    self->sendrecv = (mpi_fn)(uintptr_t)f[0];
    self->send = (mpi_fn)(uintptr_t)f[1];
    self->recv = (mpi_fn)(uintptr_t)f[2];
    self->isend = (mpi_fn)(uintptr_t)f[3];
    self->irecv = (mpi_fn)(uintptr_t)f[4];
    self->wait = (mpi_fn)(uintptr_t)f[5];
    self->pointers = pointers;
    if (pointers) { /* mpi4py gives a handle as an unsigned number: its address or its int */
        self->comm.p = (void *)(uintptr_t)comm, self->byte_type.p = (void *)(uintptr_t)byte_type;
    } else {
        self->comm.i = (int)(uint32_t)comm, self->byte_type.i = (int)(uint32_t)byte_type;
    }
    self->error = 0, self->rank = rank, self->size = size;
    int m = 1;
    while (m * 2 <= size) m *= 2;
    self->fold_out = rank >= m ? rank - m : -1;
    self->fold_in = rank < m && rank + m < size ? rank + m : -1;
    self->nrounds = 0;
    for (int k = 1; rank < m && k < m; k *= 2) self->rounds[self->nrounds++] = rank ^ k;
    if (m != size) max_bytes = inline_bytes; /* Note [Chunks after the record]: no fold */
    self->inline_bytes = inline_bytes, self->max_bytes = max_bytes;
    self->chunk_bytes = chunk_bytes, self->window = window;
    self->words = 1 + MP_HEADER_WORDS + size;
    size_t bytes = (size_t)self->words * 8 + (size_t)inline_bytes;
    free(self->mine);
    free(self->theirs);
    free(self->peer_data);
    free(self->requests);
    free(self->sent);
    self->mine = malloc(bytes), self->theirs = malloc(bytes);
    self->peer_data = malloc((size_t)window * (size_t)chunk_bytes);
    self->requests = calloc(2 * (size_t)window, sizeof(mpi_handle));
    self->sent = calloc((size_t)window, 1);
    if (!self->mine || !self->theirs || !self->peer_data || !self->requests || !self->sent) {
        PyErr_NoMemory();
        return -1;
    }
    Py_XSETREF(self->board, Py_NewRef(board));
    return 0;
}

static void checked_dealloc(CheckedContext *self) {
    free(self->mine);
    free(self->theirs);
    free(self->peer_data);
    free(self->requests);
    free(self->sent);
    Py_XDECREF(self->board);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

/* The MPI calls, through the types of the library's ABI (Note [MPI from C]); each returns
 * MPI's code and keeps the first nonzero one of a call in `error`. */
static int kept(CheckedContext *self, int rc) {
    if (rc && !self->error) self->error = rc;
    return rc;
}

/* MPI_Sendrecv of n bytes with `peer`, both ways under one tag. */
static int mpi_sendrecv(CheckedContext *self, const void *out, void *in, int n, int peer,
                        int tag, void *status) {
    mpi_handle c = self->comm, t = self->byte_type;
    return kept(self, self->pointers
        ? ((sendrecv_p)self->sendrecv)(out, n, t.p, peer, tag, in, n, t.p, peer, tag, c.p, status)
        : ((sendrecv_i)self->sendrecv)(out, n, t.i, peer, tag, in, n, t.i, peer, tag, c.i, status));
}

static int mpi_send(CheckedContext *self, const void *out, int n, int peer, int tag) {
    mpi_handle c = self->comm, t = self->byte_type;
    return kept(self, self->pointers ? ((send_p)self->send)(out, n, t.p, peer, tag, c.p)
                                     : ((send_i)self->send)(out, n, t.i, peer, tag, c.i));
}

static int mpi_recv(CheckedContext *self, void *in, int n, int peer, int tag, void *status) {
    mpi_handle c = self->comm, t = self->byte_type;
    return kept(self, self->pointers ? ((recv_p)self->recv)(in, n, t.p, peer, tag, c.p, status)
                                     : ((recv_i)self->recv)(in, n, t.i, peer, tag, c.i, status));
}

static int mpi_isend(CheckedContext *self, const void *out, int n, int peer, int tag,
                     mpi_handle *rq) {
    mpi_handle c = self->comm, t = self->byte_type;
    return kept(self, self->pointers
        ? ((isend_p)self->isend)(out, n, t.p, peer, tag, c.p, &rq->p)
        : ((isend_i)self->isend)(out, n, t.i, peer, tag, c.i, &rq->i));
}

static int mpi_irecv(CheckedContext *self, void *in, int n, int peer, int tag, mpi_handle *rq) {
    mpi_handle c = self->comm, t = self->byte_type;
    return kept(self, self->pointers
        ? ((irecv_p)self->irecv)(in, n, t.p, peer, tag, c.p, &rq->p)
        : ((irecv_i)self->irecv)(in, n, t.i, peer, tag, c.i, &rq->i));
}

static int mpi_wait(CheckedContext *self, mpi_handle *rq, void *status) {
    return kept(self, self->pointers ? ((wait_p)self->wait)(&rq->p, status)
                                     : ((wait_i)self->wait)(&rq->i, status));
}

/* Merges the peer's record in `theirs` (rc: how its receive ended) into `mine`. */
static void merge(CheckedContext *self, int rc, int mine_first, size_t len, int dtype, int op) {
    int64_t *a = self->mine, *b = self->theirs;
    if (rc != 0) {
        a[0] = REC_DISAGREE;
        return;
    }
    for (Py_ssize_t i = 1 + MP_HEADER_WORDS; i < self->words; i++) a[i] |= b[i];
    if (a[0] != REC_OK || b[0] != REC_OK || memcmp(a + 1, b + 1, MP_FREE_WORD * 8) != 0) {
        a[0] = REC_DISAGREE;
        return;
    }
    char *x = (char *)(a + self->words), *y = (char *)(b + self->words);
    size_t count = len / mp_itemsize(dtype);
    if (count) mp_reduce2(x, mine_first ? x : y, mine_first ? y : x, count, dtype, op);
}

/* The exchange of `len` data bytes, the GIL released; the outcome in mine[0]. */
static void exchange(CheckedContext *self, size_t len, int dtype, int op) {
    int n = (int)(self->words * 8 + (Py_ssize_t)len);
    char status[64]; /* MPI_Status, whatever its layout: never read */
    if (self->fold_out >= 0) {
        int rc = mpi_send(self, self->mine, n, self->fold_out, CHECK_TAG);
        rc = rc ? rc : mpi_recv(self, self->theirs, n, self->fold_out, CHECK_TAG, status);
        if (rc) self->mine[0] = REC_DISAGREE;
        else memcpy(self->mine, self->theirs, (size_t)n);
        return;
    }
    if (self->fold_in >= 0)
        merge(self, mpi_recv(self, self->theirs, n, self->fold_in, CHECK_TAG, status), 1, len,
              dtype, op);
    for (int k = 0; k < self->nrounds; k++) {
        int peer = self->rounds[k];
        int rc = mpi_sendrecv(self, self->mine, self->theirs, n, peer, CHECK_TAG, status);
        merge(self, rc, self->rank < peer, len, dtype, op);
    }
    if (self->fold_in >= 0 && mpi_send(self, self->mine, n, self->fold_in, CHECK_TAG))
        self->mine[0] = REC_DISAGREE;
}

/* The length of chunk i of `len` bytes. */
static size_t chunk_length(const CheckedContext *self, size_t len, size_t i) {
    size_t chunk = (size_t)self->chunk_bytes, at = i * chunk;
    return len - at < chunk ? len - at : chunk;
}

/* Posts chunk i of `len` bytes (its receive into a window slot, its send from `buf`): 0 or
 * an MPI error code. A chunk whose receive was posted counts in `posted` (it is waited for),
 * its send too where that was posted (`sent`). */
static int post_chunk(CheckedContext *self, int peer, char *buf, size_t len, size_t i,
                      size_t *posted) {
    size_t chunk = (size_t)self->chunk_bytes, at = i * chunk, n = chunk_length(self, len, i);
    int slot = (int)(i % (size_t)self->window);
    mpi_handle *rq = self->requests + 2 * slot;
    int rc = mpi_irecv(self, self->peer_data + (size_t)slot * chunk, (int)n, peer, DATA_TAG,
                       &rq[0]);
    if (rc) return rc;
    (*posted)++;
    rc = mpi_isend(self, buf + at, (int)n, peer, DATA_TAG, &rq[1]);
    self->sent[slot] = rc == 0;
    return rc;
}

/* The data of one round in chunks, `window` of them in flight (Note [Chunks after the
 * record]): 0, or an MPI error code (every posted request waited for all the same). */
static int swap_chunks(CheckedContext *self, int peer, char *buf, size_t len, int dtype, int op,
                       int mine_first) {
    size_t chunk = (size_t)self->chunk_bytes, item = mp_itemsize(dtype);
    size_t nchunks = (len + chunk - 1) / chunk, posted = 0;
    int err = 0;
    char status[64]; /* MPI_Status, whatever its layout: never read */
    /* a request whose posting failed is not waited for (an MPI error here is a broken
     * communicator, ended by the watchdog's abort, or a lost process): every one posted is */
    while (!err && posted < nchunks && posted < (size_t)self->window)
        err = post_chunk(self, peer, buf, len, posted, &posted);
    for (size_t i = 0; i < posted; i++) {
        size_t at = i * chunk, n = chunk_length(self, len, i);
        int slot = (int)(i % (size_t)self->window);
        mpi_handle *rq = self->requests + 2 * slot;
        int rc = mpi_wait(self, &rq[0], status);
        if (self->sent[slot]) rc = mpi_wait(self, &rq[1], status) || rc;
        err = err ? err : rc;
        if (err) continue;
        char *x = buf + at, *y = self->peer_data + (size_t)slot * chunk;
        mp_reduce2(x, mine_first ? x : y, mine_first ? y : x, n / item, dtype, op);
        if (posted < nchunks) err = post_chunk(self, peer, buf, len, posted, &posted);
    }
    return err;
}

/* Above inline_bytes: in each round the records alone, then (agreed) the data in chunks; the
 * outcome in mine[0]. */
static void exchange_chunked(CheckedContext *self, char *buf, size_t len, int dtype, int op) {
    int n = (int)(self->words * 8);
    char status[64];
    for (int k = 0; k < self->nrounds; k++) {
        int peer = self->rounds[k];
        int rc = mpi_sendrecv(self, self->mine, self->theirs, n, peer, CHECK_TAG, status);
        merge(self, rc, self->rank < peer, 0, dtype, op);
        if (self->mine[0] == REC_OK && swap_chunks(self, peer, buf, len, dtype, op,
                                                   self->rank < peer))
            self->mine[0] = REC_DISAGREE;
    }
}

/* The exchange of `header` with `len` bytes of `buf` reduced in place (dtype, op), the GIL
 * released: the data in the records up to inline_bytes, in chunks after them above; the
 * outcome (REC_OK or REC_DISAGREE) in mine[0], the merged free words after the header. */
static int64_t run(CheckedContext *self, const int64_t *header, char *buf, size_t len,
                   int dtype, int op) {
    int64_t *rec = self->mine;
    rec[0] = REC_OK;
    self->error = 0;
    memcpy(rec + 1, header, MP_HEADER_WORDS * 8);
    memset(rec + 1 + MP_HEADER_WORDS, 0, (size_t)self->size * 8); /* a slot: its owner's only */
    rec[1 + MP_HEADER_WORDS + self->rank] = header[MP_FREE_WORD];
    int inlined = len <= (size_t)self->inline_bytes;
    if (inlined) memcpy(rec + self->words, buf, len);
    Py_BEGIN_ALLOW_THREADS
    if (inlined) exchange(self, len, dtype, op);
    else exchange_chunked(self, buf, len, dtype, op);
    if (rec[0] == REC_OK && inlined) memcpy(buf, rec + self->words, len);
    Py_END_ALLOW_THREADS
    return rec[0];
}

/* A tuple of the `n` ints at `words`, or NULL with an exception set. */
static PyObject *int_tuple(const int64_t *words, int n) {
    PyObject *t = PyTuple_New(n);
    for (int i = 0; t && i < n; i++) {
        PyObject *w = PyLong_FromLongLong(words[i]);
        if (!w) Py_CLEAR(t);
        else PyTuple_SET_ITEM(t, i, w);
    }
    return t;
}

static PyObject *checked_allreduce_array(CheckedContext *self, PyObject *const *args,
                                         Py_ssize_t nargs) {
    if (nargs < 2 || nargs > 3) {
        PyErr_SetString(PyExc_TypeError, "allreduce_array(x, op[, stamp])");
        return NULL;
    }
    int64_t stamp;
    if (mp_small_stamp(args, nargs, &stamp) < 0) return NULL;
    int opc, average, dtype;
    Py_buffer v;
    Py_hash_t shape_hash;
    if (!mp_small_take(args[0], args[1], self->max_bytes, &v, &dtype, &opc, &average,
                       &shape_hash))
        Py_RETURN_NOTIMPLEMENTED;
    int64_t header[MP_HEADER_WORDS] = {MP_KIND_ALLREDUCE, MP_ALGO_DOUBLING | stamp, opc + 4 * average, dtype,
                                    (int64_t)(v.len / v.itemsize), shape_hash, 0, 0};
    long long seq = mp_post(self->board, header);
    if (seq < 0) { /* nothing entered: the general path takes the call (out of memory) */
        PyErr_Clear();
        PyBuffer_Release(&v);
        Py_RETURN_NOTIMPLEMENTED;
    }
    int64_t status = run(self, header, v.buf, (size_t)v.len, dtype, opc);
    if (status == REC_OK && average) {
        Py_BEGIN_ALLOW_THREADS
        mp_divide(v.buf, (size_t)(v.len / v.itemsize), dtype, self->size);
        Py_END_ALLOW_THREADS
    }
    PyBuffer_Release(&v);
    if (mp_mark_done(self->board, seq) < 0) return NULL;
    if (status == REC_OK) return Py_NewRef(args[0]);
    PyObject *words = int_tuple(header, MP_HEADER_WORDS); /* disagreed: (False, header) */
    return words ? Py_BuildValue("(ON)", Py_False, words) : NULL;
}

/* exchange(header, x, dtype, op): mpidp.engine.exchange.exchange's data exchange (the header already
 * published by the caller): `x` (a writable C-contiguous buffer of at most max_bytes) reduced
 * in place; every rank's free word as a tuple, or None where the ranks disagree. */
static PyObject *checked_exchange(CheckedContext *self, PyObject *const *args, Py_ssize_t nargs) {
    int dtype, op;
    int64_t header[MP_HEADER_WORDS];
    if (nargs != 4 || !PyTuple_Check(args[0]) || PyTuple_GET_SIZE(args[0]) != MP_HEADER_WORDS) {
        PyErr_SetString(PyExc_TypeError, "exchange(header (8 ints), x, dtype, op)");
        return NULL;
    }
    for (int i = 0; i < MP_HEADER_WORDS; i++) {
        header[i] = PyLong_AsLongLong(PyTuple_GET_ITEM(args[0], i));
        if (header[i] == -1 && PyErr_Occurred()) return NULL;
    }
    long d = PyLong_AsLong(args[2]), o = PyLong_AsLong(args[3]);
    if (PyErr_Occurred()) return NULL;
    dtype = (int)d, op = (int)o;
    Py_buffer v;
    if (PyObject_GetBuffer(args[1], &v, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0) return NULL;
    size_t item = mp_itemsize(dtype);
    if (v.len > self->max_bytes || !item || (size_t)v.len % item) {
        PyBuffer_Release(&v);
        PyErr_Format(PyExc_ValueError, "exchange: %zd bytes of dtype %d (at most %zd)", v.len,
                     dtype, self->max_bytes);
        return NULL;
    }
    int64_t status = run(self, header, v.buf, (size_t)v.len, dtype, op);
    PyBuffer_Release(&v);
    if (status != REC_OK) Py_RETURN_NONE;
    return int_tuple(self->mine + 1 + MP_HEADER_WORDS, self->size);
}

static PyObject *checked_get_max_bytes(CheckedContext *self, void *closure) {
    return PyLong_FromSsize_t(self->max_bytes);
}

static PyObject *checked_take_error(CheckedContext *self, PyObject *unused) {
    int error = self->error;
    self->error = 0;
    return PyLong_FromLong(error);
}

static PyGetSetDef checked_getset[] = {
    {"max_bytes", (getter)checked_get_max_bytes, NULL, "the largest array a call takes", NULL},

    {NULL, NULL, NULL, NULL, NULL},
};

static PyMethodDef checked_methods[] = {
    {"allreduce_array", (PyCFunction)(void (*)(void))checked_allreduce_array, METH_FASTCALL,
     "allreduce_array(x, op[, stamp]) -> x, (False, header) when the ranks disagree, or NotImplemented "
     "when it declines (nothing done, nothing posted)"},
    {"take_error", (PyCFunction)checked_take_error, METH_NOARGS,
     "take_error() -> the first MPI error code of the last call, 0 if none, and 0 from then "
     "on (Note [MPI from C])"},
    {"exchange", (PyCFunction)(void (*)(void))checked_exchange, METH_FASTCALL,
     "exchange(header, x, dtype, op) -> every rank's free word, or None when the ranks "
     "disagree: x reduced in place, the header published by the caller"},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject CheckedContextType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "mpidp._ext.CheckedContext",
    .tp_basicsize = sizeof(CheckedContext),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "CheckedContext((sendrecv, send, recv, isend, irecv, wait), pointers, comm, "
              "byte, rank, "
              "size, inline_bytes, max_bytes, chunk_bytes, window, board): the all-reduce "
              "across nodes in one call (csrc/exchange.c)",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)checked_init,
    .tp_dealloc = (destructor)checked_dealloc,
    .tp_methods = checked_methods,
    .tp_getset = checked_getset,
};

int mp_add_checked_type(PyObject *m) {
    if (PyType_Ready(&CheckedContextType) < 0) return -1;
    return PyModule_AddObjectRef(m, "CheckedContext", (PyObject *)&CheckedContextType);
}
