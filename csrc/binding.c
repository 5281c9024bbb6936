/* The helpers every binding file shares (declared in binding.h): a buffer taken with a clear
 * TypeError, the dtype and op codes checked, a sequence of buffers taken as segments. */
#include "binding.h"
#include "kernels.h"

int mp_get_buffer(PyObject *obj, Py_buffer *view, int writable, const char *what) {
    if (PyObject_GetBuffer(obj, view, writable ? (PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS)
                                               : PyBUF_C_CONTIGUOUS) < 0) {
        PyErr_Format(PyExc_TypeError, "%s must be a C-contiguous%s buffer", what,
                     writable ? " writable" : "");
        return -1;
    }
    return 0;
}

int mp_check_codes(int dtype, int op) {
    if (dtype < 0 || dtype >= DT_COUNT) {
        PyErr_Format(PyExc_ValueError, "unknown dtype code %d", dtype);
        return -1;
    }
    if (op < 0 || op >= OP_COUNT) {
        PyErr_Format(PyExc_ValueError, "unknown op code %d", op);
        return -1;
    }
    return 0;
}

/* Buffers of every item of `seq`, as segments; on failure releases what it took. */
Py_ssize_t mp_get_segments(PyObject *seq, int writable, size_t isz, Py_buffer **views,
                           mp_segment **segs, size_t *total) {
    PyObject *fast = PySequence_Fast(seq, "expected a sequence of buffers");
    if (!fast) return -1;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(fast), got = 0;
    *views = PyMem_Calloc((size_t)n + 1, sizeof(Py_buffer));
    *segs = PyMem_Calloc((size_t)n + 1, sizeof(mp_segment));
    *total = 0;
    if (!*views || !*segs) {
        PyErr_NoMemory();
        goto fail;
    }
    for (; got < n; got++) {
        Py_buffer *v = &(*views)[got];
        if (mp_get_buffer(PySequence_Fast_GET_ITEM(fast, got), v, writable, "each tensor") < 0)
            goto fail;
        if ((size_t)v->len % isz) {
            PyErr_Format(PyExc_ValueError, "tensor %zd has %zd bytes, not a multiple of the "
                         "item size %zu", got, v->len, isz);
            PyBuffer_Release(v);
            goto fail;
        }
        (*segs)[got].ptr = v->buf;
        (*segs)[got].nbytes = (size_t)v->len;
        *total += (size_t)v->len;
    }
    Py_DECREF(fast);
    return n;
fail:
    for (Py_ssize_t i = 0; i < got; i++) PyBuffer_Release(&(*views)[i]);
    PyMem_Free(*views);
    PyMem_Free(*segs);
    *views = NULL;
    *segs = NULL;
    Py_DECREF(fast);
    return -1;
}

void mp_release_segments(Py_buffer *views, mp_segment *segs, Py_ssize_t n) {
    for (Py_ssize_t i = 0; i < n; i++) PyBuffer_Release(&views[i]);
    PyMem_Free(views);
    PyMem_Free(segs);
}
