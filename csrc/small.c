/* The in-place all-reduce of a small array as one call of mpidp._ext.ShmContext:
 * allreduce_array (Note [Small all-reduce in one call]). */
#include "context.h"
#include "kernels.h"
#include "small.h"

/* Note [Small all-reduce in one call]
 * An in-place all-reduce of a small numpy array on one node, the call whose cost is all
 * overhead, is one C call: the array's buffer (writable, C-contiguous: its format gives the
 * dtype), the header built here as mpidp.engine.header.header builds it (the shape's hash is
 * Python's hash of the shape tuple, so it equals what any other path of another rank
 * publishes), posted on the watchdog's board as every collective is, and the protocol's
 * inline call that carries header and data together. Whatever it cannot take (another
 * dtype, a read-only or strided array, more than inline_bytes, avg on integers) it declines
 * before touching anything, returning NotImplemented: the front then takes the general path,
 * which checks, refuses or runs it. */
static PyObject *s_seq, *s_done, *s_what, *s_sum, *s_avg, *s_min, *s_max;

int mp_format_dtype(const Py_buffer *v) {
    const char *f = v->format ? v->format : "B";
    if (*f == '<' || *f == '=' || *f == '@') f++;
    if (f[1]) return -1;
    switch (*f) {
    case 'e': return v->itemsize == 2 ? DT_F16 : -1;
    case 'f': return v->itemsize == 4 ? DT_F32 : -1;
    case 'd': return v->itemsize == 8 ? DT_F64 : -1;
    case 'i': case 'l': case 'q':
        return v->itemsize == 4 ? DT_I32 : v->itemsize == 8 ? DT_I64 : -1;
    default: return -1;
    }
}

int mp_op_of(PyObject *op, int *code, int *average) {
    *average = 0;
    if (!PyUnicode_Check(op)) return -1;
    if (op == s_sum || PyUnicode_Compare(op, s_sum) == 0) *code = OP_SUM;
    else if (op == s_avg || PyUnicode_Compare(op, s_avg) == 0) { *code = OP_SUM; *average = 1; }
    else if (op == s_min || PyUnicode_Compare(op, s_min) == 0) *code = OP_MIN;
    else if (op == s_max || PyUnicode_Compare(op, s_max) == 0) *code = OP_MAX;
    else { PyErr_Clear(); return -1; }
    return 0;
}

long long mp_post(PyObject *board, const int64_t *header) {
    PyObject *seq = PyObject_GetAttr(board, s_seq);
    if (!seq) return -1;
    long long next = PyLong_AsLongLong(seq);
    Py_DECREF(seq);
    if (next == -1 && PyErr_Occurred()) return -1;
    next++;
    PyObject *what = PyTuple_New(MP_HEADER_WORDS), *n = PyLong_FromLongLong(next);
    int bad = !what || !n;
    for (int i = 0; !bad && i < MP_HEADER_WORDS; i++) {
        PyObject *word = PyLong_FromLongLong(header[i]);
        if (!word) bad = 1;
        else PyTuple_SET_ITEM(what, i, word);
    }
    /* what first: a board whose seq moved always names what it waits in */
    bad = bad || PyObject_SetAttr(board, s_what, what) < 0 || PyObject_SetAttr(board, s_seq, n) < 0;
    Py_XDECREF(what);
    Py_XDECREF(n);
    return bad ? -1 : next;
}

int mp_small_take(PyObject *x, PyObject *op, Py_ssize_t max_bytes, Py_buffer *v, int *dtype,
                  int *opc, int *average, Py_hash_t *shape_hash) {
    if (mp_op_of(op, opc, average) < 0) return 0;
    if (PyObject_GetBuffer(x, v, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0) {
        PyErr_Clear();
        return 0;
    }
    *dtype = mp_format_dtype(v);
    *shape_hash = *dtype < 0 ? -1 : mp_shape_hash(v);
    if (*dtype < 0 || v->len > max_bytes || (*average && *dtype >= DT_I32) || *shape_hash == -1) {
        PyErr_Clear();
        PyBuffer_Release(v);
        return 0;
    }
    return 1;
}

Py_hash_t mp_shape_hash(const Py_buffer *v) {
    PyObject *shape = PyTuple_New(v->ndim);
    int whole = shape != NULL;
    for (int i = 0; whole && i < v->ndim; i++) {
        PyObject *extent = PyLong_FromSsize_t(v->shape[i]);
        if (!extent) whole = 0;
        else PyTuple_SET_ITEM(shape, i, extent);
    }
    Py_hash_t h = whole ? PyObject_Hash(shape) : -1;
    Py_XDECREF(shape);
    return h;
}

int mp_mark_done(PyObject *board, long long seq) {
    PyObject *done = PyLong_FromLongLong(seq);
    int ok = done && PyObject_SetAttr(board, s_done, done) == 0;
    Py_XDECREF(done);
    return ok ? 0 : -1;
}

const char mp_allreduce_array_doc[] =
"allreduce_array(x, op[, stamp]) -> x, (status, info) or NotImplemented\n\n"
"The whole in-place all-reduce of a small numpy array, posted on the board given to\n"
"set_board (Note [Small all-reduce in one call]): x when done, (status, info) as exchange\n"
"when the ranks disagree, NotImplemented when it declines (nothing done, nothing posted).\n"
"stamp: a name's stamp for the header's call-site bits (Note [Described stamps]), 0 none.";

int mp_small_stamp(PyObject *const *args, Py_ssize_t nargs, int64_t *stamp) {
    *stamp = 0;
    if (nargs == 3) {
        long long s = PyLong_AsLongLong(args[2]);
        if (s == -1 && PyErr_Occurred()) return -1;
        if (s < 0 || s >= (1LL << 24)) {
            PyErr_SetString(PyExc_ValueError, "allreduce_array: a stamp is below 2**24");
            return -1;
        }
        *stamp = (int64_t)s << MP_STAMP_SHIFT;
    }
    return 0;
}

PyObject *mp_ctx_allreduce_array(ShmContext *self, PyObject *const *args, Py_ssize_t nargs) {
    if (!mp_ctx_ready(self)) return NULL;
    if (nargs < 2 || nargs > 3 || !self->board) {
        PyErr_SetString(PyExc_TypeError, "allreduce_array(x, op[, stamp]) needs set_board first");
        return NULL;
    }
    int64_t stamp;
    if (mp_small_stamp(args, nargs, &stamp) < 0) return NULL;
    int opc, average, dtype;
    Py_buffer v;
    Py_hash_t shape_hash;
    if (!mp_small_take(args[0], args[1], self->inline_bytes, &v, &dtype, &opc, &average,
                       &shape_hash))
        Py_RETURN_NOTIMPLEMENTED;
    int64_t header[MP_HEADER_WORDS] = {MP_KIND_ALLREDUCE, MP_ALGO_SHM | stamp, opc + 4 * average,
                                        dtype, (int64_t)(v.len / v.itemsize), shape_hash, 0, 0};
    long long seq = mp_post(self->board, header);
    if (seq < 0) { /* nothing entered: the general path takes the call (out of memory) */
        PyErr_Clear();
        PyBuffer_Release(&v);
        Py_RETURN_NOTIMPLEMENTED;
    }
    shm_call c;
    memset(&c, 0, sizeof(c));
    c.dtype = dtype;
    c.op = opc;
    c.divisor = average ? self->nranks : 1;
    c.data = SHM_DATA_INLINE;
    c.in = v.buf;
    c.out = v.buf;
    c.count = (size_t)(v.len / v.itemsize);
    PyObject *out = mp_ctx_enter(self, &c, header);
    PyBuffer_Release(&v);
    PyObject *type, *value, *tb;
    PyErr_Fetch(&type, &value, &tb); /* the board is marked done whatever enter said */
    int marked = mp_mark_done(self->board, seq) == 0;
    if (type) {
        PyErr_Restore(type, value, tb);
        Py_XDECREF(out);
        return NULL;
    }
    if (!marked) {
        Py_XDECREF(out);
        return NULL;
    }
    if (!out) return Py_NewRef(args[0]);
    return out;
}

int mp_small_init(void) {
    return (s_seq = PyUnicode_InternFromString("seq")) && (s_done = PyUnicode_InternFromString("done")) &&
           (s_what = PyUnicode_InternFromString("what")) && (s_sum = PyUnicode_InternFromString("sum")) &&
           (s_avg = PyUnicode_InternFromString("avg")) && (s_min = PyUnicode_InternFromString("min")) &&
           (s_max = PyUnicode_InternFromString("max")) ? 0 : -1;
}
