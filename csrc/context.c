/* The calls of mpidp._ext.ShmContext into the shared-memory protocol (the type itself, what a
 * context holds and its method table, is csrc/context_type.c): the handshake alone
 * (exchange), the general all-reduce (allreduce), and the entry every call takes, one-call
 * paths included (mp_ctx_enter). The call counter advances only when a call really enters
 * the protocol: a call refused for its arguments (a read-only buffer, a size that does not
 * fit) has taken no part in it, so its rank stays in step with the others (Note
 * [Shared-memory protocol] in shm.c). */
#include "context.h"
#include "kernels.h"

static int read_header(PyObject *obj, int64_t *header) {
    if (!PyTuple_Check(obj) || PyTuple_GET_SIZE(obj) != MP_HEADER_WORDS) {
        PyErr_Format(PyExc_TypeError, "header must be a tuple of %d ints", MP_HEADER_WORDS);
        return -1;
    }
    for (int i = 0; i < MP_HEADER_WORDS; i++) {
        header[i] = PyLong_AsLongLong(PyTuple_GET_ITEM(obj, i));
        if (header[i] == -1 && PyErr_Occurred()) return -1;
    }
    return 0;
}

/* Puts `item` (a new reference, or NULL after a failure) into tuple `t`; 0 on NULL. */
static int set_item(PyObject *t, Py_ssize_t i, PyObject *item) {
    if (!item) return 0;
    PyTuple_SET_ITEM(t, i, item);
    return 1;
}

/* (status, info) of a finished call: OK -> every rank's free header word (handshake) or None;
 * MISMATCH -> every rank's header; TIMEOUT -> the ranks that had not arrived; DEPARTED -> the
 * ranks that shut down without arriving (Note [A rank that has shut down]); LOST -> those
 * whose process ended without arriving (Note [A lost peer]); PEER_ERROR ->
 * (rank, peer, errno); OUT_OF_STEP -> the call number of every rank's record. */
static PyObject *result_tuple(const shm_result *r, int nranks, int data) {
    PyObject *info = NULL;
    switch (r->status) {
    case SHM_OK:
        if (data != SHM_DATA_NONE) return Py_BuildValue("(iO)", SHM_OK, Py_None);
        info = PyTuple_New(nranks);
        for (int q = 0; info && q < nranks; q++)
            if (!set_item(info, q, PyLong_FromLongLong(r->headers[q][MP_HEADER_WORDS - 1])))
                Py_CLEAR(info);
        break;
    case SHM_MISMATCH:
        info = PyTuple_New(nranks);
        for (int q = 0; info && q < nranks; q++) {
            PyObject *h = PyTuple_New(MP_HEADER_WORDS);
            for (int i = 0; h && i < MP_HEADER_WORDS; i++)
                if (!set_item(h, i, PyLong_FromLongLong(r->headers[q][i]))) Py_CLEAR(h);
            if (!set_item(info, q, h)) Py_CLEAR(info);
        }
        break;
    case SHM_TIMEOUT:
    case SHM_DEPARTED:
    case SHM_LOST:
        info = PyList_New(0);
        for (int q = 0; info && q < nranks; q++)
            if (r->missing[q]) {
                PyObject *v = PyLong_FromLong(q);
                PyList_Append(info, v);
                Py_XDECREF(v);
            }
        break;
    case SHM_OUT_OF_STEP:
        info = PyTuple_New(nranks);
        for (int q = 0; info && q < nranks; q++)
            if (!set_item(info, q, PyLong_FromLongLong(r->seqs[q]))) Py_CLEAR(info);
        break;
    default:
        info = Py_BuildValue("(iii)", r->peer_rank, r->missing[0], r->peer_errno);
    }
    if (!info) return NULL;
    return Py_BuildValue("(iN)", r->status, info);
}

/* The poll of Note [Interrupting a wait] in shm.c, called without the GIL: 1 when the
 * context was closed (no exception set), or when a signal handler raised (in the main thread
 * only, where Python runs them: KeyboardInterrupt, or what the handler raised, is then set). */
static int poll_interrupt(void *arg) {
    ShmContext *self = (ShmContext *)arg;
    if (__atomic_load_n(&self->closed, __ATOMIC_ACQUIRE)) return 1;
    PyGILState_STATE gil = PyGILState_Ensure();
    int raised = PyErr_CheckSignals() < 0;
    PyGILState_Release(gil);
    return raised;
}

/* Runs call `c` (its arguments already checked) as the context's next call. A context that
 * was closed, or one of whose calls was interrupted, lets no call enter: (SHM_INTERRUPTED,
 * None). An interrupted call returns NULL with the signal handler's exception, or
 * (SHM_INTERRUPTED, None) when close() ended it. */
PyObject *mp_ctx_enter(ShmContext *self, shm_call *c, int64_t *header) {
    if (self->interrupted || __atomic_load_n(&self->closed, __ATOMIC_ACQUIRE))
        return Py_BuildValue("(iO)", SHM_INTERRUPTED, Py_None);
    header[1] |= (int64_t)(c->data | self->peers << 2) << MP_MODE_SHIFT;
    c->ctrl = self->ctrl;
    c->nranks = self->nranks;
    c->rank = self->rank;
    c->seq = ++self->seq;
    c->header = header;
    c->chunk_bytes = (size_t)self->chunk_bytes;
    c->peers = self->peers;
    c->segments = self->segments;
    c->timeout_s = self->timeout_s;
    c->interrupted = poll_interrupt;
    c->interrupt_arg = self;
    c->pids = self->pids;
    c->starts = self->starts;
    shm_result result; /* large but cheap: only the fields a status uses are read */
    result.status = SHM_OK;
    result.peer_rank = result.peer_errno = 0;
    result.missing[0] = 0;
    Py_BEGIN_ALLOW_THREADS
    shm_run(c, &result);
    Py_END_ALLOW_THREADS
    if (result.status == SHM_OK && c->data != SHM_DATA_NONE) return NULL; /* the fast answer */
    if (result.status == SHM_INTERRUPTED) {
        self->interrupted = 1;
        if (PyErr_Occurred()) return NULL;
        return Py_BuildValue("(iO)", SHM_INTERRUPTED, Py_None);
    }
    return result_tuple(&result, self->nranks, c->data);
}

/* A call refused for its arguments after its header was read still takes its turn: it joins
 * the handshake with an error header (mpidp.engine.header.error_header), so every other rank
 * raises a MismatchError instead of waiting for it; then the error set here is raised. */
static PyObject *refuse(ShmContext *self, int64_t kind) {
    PyObject *type, *value, *tb;
    PyErr_Fetch(&type, &value, &tb);
    int64_t header[MP_HEADER_WORDS] = {0};
    header[0] = kind;
    header[MP_HEADER_WORDS - 2] = PyErr_GivenExceptionMatches(type, PyExc_TypeError) ? 1 : 2;
    shm_call c;
    memset(&c, 0, sizeof(c));
    c.data = SHM_DATA_NONE;
    c.dtype = DT_F32;
    c.divisor = 1;
    PyObject *answer = mp_ctx_enter(self, &c, header);
    Py_XDECREF(answer);
    PyErr_Restore(type, value, tb); /* this rank's own error, whatever the others said */
    return NULL;
}

const char mp_ctx_exchange_doc[] =
"exchange(header) -> (status, info)\n\n"
"The protocol's handshake alone: OK with every rank's free header word, or MISMATCH with\n"
"every rank's header (also TIMEOUT, OUT_OF_STEP). Every local rank calls it.";

int mp_ctx_ready(ShmContext *self) {
    if (self->ctrl) return 1;
    PyErr_SetString(PyExc_TypeError, "ShmContext used before __init__");
    return 0;
}

PyObject *mp_ctx_exchange(ShmContext *self, PyObject *header_obj) {
    if (!mp_ctx_ready(self)) return NULL;
    int64_t header[MP_HEADER_WORDS];
    if (read_header(header_obj, header) < 0) return NULL;
    shm_call c;
    memset(&c, 0, sizeof(c));
    c.data = SHM_DATA_NONE;
    c.dtype = DT_F32;
    c.divisor = 1;
    return mp_ctx_enter(self, &c, header);
}

const char mp_ctx_allreduce_doc[] =
"allreduce(header, src, dst, dtype, op, divisor) -> None or (status, info)\n\n"
"Reduces every local rank's `src` into its `dst` (may be `src`) in one call that also\n"
"checks the headers: inline in the control block up to inline_bytes, else sliced (each rank\n"
"reduces its share for all). `src` may be a list of writable buffers (dst None): reduced in\n"
"place where they lie. Returns None when done, else (status, info) as exchange. Bad\n"
"arguments join the handshake with an error header, then raise. Every local rank calls it.";

PyObject *mp_ctx_allreduce(ShmContext *self, PyObject *const *args, Py_ssize_t nargs) {
    if (!mp_ctx_ready(self)) return NULL;
    if (nargs != 6) {
        PyErr_SetString(PyExc_TypeError, "allreduce takes 6 arguments");
        return NULL;
    }
    int64_t header[MP_HEADER_WORDS];
    if (read_header(args[0], header) < 0) return NULL;
    PyObject *src_obj = args[1], *dst_obj = args[2];
    int dtype = PyLong_AsLong(args[3]), op = PyLong_AsLong(args[4]);
    long divisor = PyLong_AsLong(args[5]);
    if (PyErr_Occurred() || mp_check_codes(dtype, op) < 0) return refuse(self, header[0]);
    if (divisor < 1) {
        PyErr_Format(PyExc_ValueError, "divisor must be positive, got %ld", divisor);
        return refuse(self, header[0]);
    }
    size_t isz = mp_itemsize(dtype);
    shm_call c;
    memset(&c, 0, sizeof(c));
    c.dtype = dtype;
    c.op = op;
    c.divisor = divisor;
    Py_buffer src = {0}, dst = {0};
    Py_buffer *seg_views = NULL;
    mp_segment *segs = NULL;
    Py_ssize_t nsegs = 0;
    int have_src = 0, have_dst = 0;
    size_t nbytes;
    const char *bad = NULL;
    if (PyList_Check(src_obj) || PyTuple_Check(src_obj)) { /* segmented, in place */
        if (dst_obj != Py_None) {
            PyErr_SetString(PyExc_ValueError, "segmented calls reduce in place: dst must be None");
            return refuse(self, header[0]);
        }
        nsegs = mp_get_segments(src_obj, 1, isz, &seg_views, &segs, &nbytes);
        if (nsegs < 0) return refuse(self, header[0]);
        if (nsegs == 0 || nsegs > SHM_MAX_SEGMENTS) bad = "segmented calls take 1 to SHM_MAX_SEGMENTS buffers";
    } else if (src_obj == dst_obj) { /* in place: one writable buffer */
        if (mp_get_buffer(src_obj, &dst, 1, "x") < 0) return refuse(self, header[0]);
        have_dst = 1;
        src = dst;
        nbytes = (size_t)dst.len;
    } else {
        if (mp_get_buffer(src_obj, &src, 0, "src") < 0) return refuse(self, header[0]);
        have_src = 1;
        if (mp_get_buffer(dst_obj, &dst, 1, "dst") < 0) {
            PyBuffer_Release(&src);
            return refuse(self, header[0]);
        }
        have_dst = 1;
        nbytes = (size_t)src.len;
        if (src.len != dst.len) bad = "src and dst must hold the same number of bytes";
    }
    if (!bad && nbytes % isz) bad = "the buffer's size is not a multiple of its item size";
    c.count = nbytes / isz;
    c.data = (!nsegs && nbytes <= (size_t)self->inline_bytes) ? SHM_DATA_INLINE : SHM_DATA_SLICED;
    if (!bad && c.data == SHM_DATA_SLICED && self->peers == SHM_PEERS_WINDOW &&
        (Py_ssize_t)nbytes > self->capacity)
        bad = "the staging segments are smaller than the buffer (ensure_segments first)";
    PyObject *out = NULL;
    if (bad) {
        PyErr_SetString(PyExc_ValueError, bad);
        refuse(self, header[0]);
    } else {
        c.in = src.buf;
        c.out = dst.buf;
        c.segs = segs;
        c.nsegs = (size_t)nsegs;
        if (c.data == SHM_DATA_SLICED) shm_partition(c.count, self->nranks, self->rank, &c.slice_lo, &c.slice_hi);
        out = mp_ctx_enter(self, &c, header);
        if (!out && !PyErr_Occurred()) out = Py_NewRef(Py_None);
    }
    if (have_src) PyBuffer_Release(&src);
    if (have_dst) PyBuffer_Release(&dst);
    if (segs) mp_release_segments(seg_views, segs, nsegs);
    return out;
}
