/* mpidp._ext: Python bindings of the host kernels, bucket fusion and the shared-memory protocol.
 * Buffer protocol only (no numpy or torch headers); the GIL is released around every loop;
 * errors set a Python exception and return NULL. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include "fusion.h"
#include "kernels.h"
#include "shm.h"

static int get_buffer(PyObject *obj, Py_buffer *view, int writable, const char *what) {
    if (PyObject_GetBuffer(obj, view, writable ? (PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS)
                                               : PyBUF_C_CONTIGUOUS) < 0) {
        PyErr_Format(PyExc_TypeError, "%s must be a C-contiguous%s buffer", what,
                     writable ? " writable" : "");
        return -1;
    }
    return 0;
}

static int check_codes(int dtype, int op) {
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

PyDoc_STRVAR(reduce_into_doc,
"reduce_into(dst, src, dtype, op)\n\n"
"dst = dst <op> src element-wise; dst and src hold the same number of bytes.");

static PyObject *py_reduce_into(PyObject *self, PyObject *args) {
    PyObject *dst_obj, *src_obj;
    int dtype, op;
    if (!PyArg_ParseTuple(args, "OOii", &dst_obj, &src_obj, &dtype, &op)) return NULL;
    if (check_codes(dtype, op) < 0) return NULL;
    Py_buffer dst, src;
    if (get_buffer(dst_obj, &dst, 1, "dst") < 0) return NULL;
    if (get_buffer(src_obj, &src, 0, "src") < 0) { PyBuffer_Release(&dst); return NULL; }
    size_t isz = mp_itemsize(dtype);
    if (dst.len != src.len || dst.len % (Py_ssize_t)isz) {
        PyErr_Format(PyExc_ValueError, "dst has %zd bytes, src %zd; both must be equal multiples of %zu",
                     dst.len, src.len, isz);
    } else {
        Py_BEGIN_ALLOW_THREADS
        mp_reduce2(dst.buf, dst.buf, src.buf, (size_t)dst.len / isz, dtype, op);
        Py_END_ALLOW_THREADS
    }
    PyBuffer_Release(&src);
    PyBuffer_Release(&dst);
    if (PyErr_Occurred()) return NULL;
    Py_RETURN_NONE;
}

PyDoc_STRVAR(divide_doc, "divide(buf, dtype, divisor)\n\nbuf = buf / divisor for floating dtypes.");

static PyObject *py_divide(PyObject *self, PyObject *args) {
    PyObject *obj;
    int dtype;
    long divisor;
    if (!PyArg_ParseTuple(args, "Oil", &obj, &dtype, &divisor)) return NULL;
    if (check_codes(dtype, OP_SUM) < 0) return NULL;
    if (dtype != DT_F16 && dtype != DT_BF16 && dtype != DT_F32 && dtype != DT_F64) {
        PyErr_Format(PyExc_ValueError, "divide needs a floating dtype, got code %d", dtype);
        return NULL;
    }
    if (divisor <= 0) {
        PyErr_Format(PyExc_ValueError, "divisor must be positive, got %ld", divisor);
        return NULL;
    }
    Py_buffer buf;
    if (get_buffer(obj, &buf, 1, "buf") < 0) return NULL;
    size_t isz = mp_itemsize(dtype);
    Py_BEGIN_ALLOW_THREADS
    mp_divide(buf.buf, (size_t)buf.len / isz, dtype, divisor);
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&buf);
    Py_RETURN_NONE;
}

/* Buffers of every item of `seq`, as segments; on failure releases what it took. */
static Py_ssize_t get_segments(PyObject *seq, int writable, size_t isz, Py_buffer **views,
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
        if (get_buffer(PySequence_Fast_GET_ITEM(fast, got), v, writable, "each tensor") < 0)
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

static void release_segments(Py_buffer *views, mp_segment *segs, Py_ssize_t n) {
    for (Py_ssize_t i = 0; i < n; i++) PyBuffer_Release(&views[i]);
    PyMem_Free(views);
    PyMem_Free(segs);
}

PyDoc_STRVAR(pack_doc,
"pack(bucket, sources) -> nbytes\n\n"
"Copies every buffer of `sources` into the writable buffer `bucket`, back to back from its\n"
"start; returns the bytes written. The GIL is released while copying.");

static PyObject *py_pack(PyObject *self, PyObject *args) {
    PyObject *bucket_obj, *seq;
    if (!PyArg_ParseTuple(args, "OO", &bucket_obj, &seq)) return NULL;
    Py_buffer bucket;
    if (get_buffer(bucket_obj, &bucket, 1, "bucket") < 0) return NULL;
    Py_buffer *views;
    mp_segment *segs;
    size_t total;
    Py_ssize_t n = get_segments(seq, 0, 1, &views, &segs, &total);
    if (n < 0) {
        PyBuffer_Release(&bucket);
        return NULL;
    }
    if (total > (size_t)bucket.len) {
        PyErr_Format(PyExc_ValueError, "sources hold %zu bytes, more than the bucket's %zd",
                     total, bucket.len);
    } else {
        Py_BEGIN_ALLOW_THREADS
        mp_pack(bucket.buf, segs, (size_t)n);
        Py_END_ALLOW_THREADS
    }
    release_segments(views, segs, n);
    PyBuffer_Release(&bucket);
    if (PyErr_Occurred()) return NULL;
    return PyLong_FromSize_t(total);
}

PyDoc_STRVAR(unpack_doc,
"unpack(bucket, destinations, dtype, divisor) -> nbytes\n\n"
"Copies `bucket` back into every writable buffer of `destinations` (the inverse of pack),\n"
"dividing each element by `divisor` in the same pass when divisor > 1 (floating dtypes\n"
"only). Returns the bytes read. The GIL is released while copying.");

static PyObject *py_unpack(PyObject *self, PyObject *args) {
    PyObject *bucket_obj, *seq;
    int dtype;
    long divisor;
    if (!PyArg_ParseTuple(args, "OOil", &bucket_obj, &seq, &dtype, &divisor)) return NULL;
    if (check_codes(dtype, OP_SUM) < 0) return NULL;
    if (divisor <= 0) {
        PyErr_Format(PyExc_ValueError, "divisor must be positive, got %ld", divisor);
        return NULL;
    }
    if (divisor > 1 && dtype != DT_F16 && dtype != DT_BF16 && dtype != DT_F32 && dtype != DT_F64) {
        PyErr_Format(PyExc_ValueError, "dividing needs a floating dtype, got code %d", dtype);
        return NULL;
    }
    Py_buffer bucket;
    if (get_buffer(bucket_obj, &bucket, 0, "bucket") < 0) return NULL;
    Py_buffer *views;
    mp_segment *segs;
    size_t total;
    Py_ssize_t n = get_segments(seq, 1, mp_itemsize(dtype), &views, &segs, &total);
    if (n < 0) {
        PyBuffer_Release(&bucket);
        return NULL;
    }
    if (total > (size_t)bucket.len) {
        PyErr_Format(PyExc_ValueError, "destinations hold %zu bytes, more than the bucket's %zd",
                     total, bucket.len);
    } else {
        Py_BEGIN_ALLOW_THREADS
        mp_unpack(bucket.buf, segs, (size_t)n, dtype, divisor);
        Py_END_ALLOW_THREADS
    }
    release_segments(views, segs, n);
    PyBuffer_Release(&bucket);
    if (PyErr_Occurred()) return NULL;
    return PyLong_FromSize_t(total);
}

PyDoc_STRVAR(shm_run_doc,
"shm_run(ctrl_addr, nranks, rank, seq, header, data, src, dst, dtype, op, divisor,\n"
"        slice_lo, slice_hi, chunk_bytes, peers, segments, timeout_s) -> (status, info)\n\n"
"One call of the shared-memory protocol (Note [Shared-memory protocol] in csrc/shm.c).\n"
"Sliced calls may pass src as a list of writable buffers (reduced in place, dst None).\n"
"info: OK -> every rank's free header word; MISMATCH -> every rank's header;\n"
"TIMEOUT -> the ranks that had not arrived; PEER_ERROR -> (rank, peer, errno).");

static PyObject *py_shm_run(PyObject *self, PyObject *args) {
    unsigned long long ctrl, seq;
    int nranks, rank, data, dtype, op, peers;
    PyObject *header_obj, *src_obj, *dst_obj, *segments_obj;
    long divisor;
    Py_ssize_t slice_lo, slice_hi, chunk_bytes;
    double timeout_s;
    if (!PyArg_ParseTuple(args, "KiiKOiOOiilnnniOd", &ctrl, &nranks, &rank, &seq, &header_obj,
                          &data, &src_obj, &dst_obj, &dtype, &op, &divisor, &slice_lo,
                          &slice_hi, &chunk_bytes, &peers, &segments_obj, &timeout_s))
        return NULL;
    if (nranks < 1 || nranks > SHM_MAX_RANKS || rank < 0 || rank >= nranks) {
        PyErr_Format(PyExc_ValueError, "rank %d of %d outside 1..%d ranks", rank, nranks, SHM_MAX_RANKS);
        return NULL;
    }
    if (check_codes(dtype, op) < 0) return NULL;
    shm_call c;
    memset(&c, 0, sizeof(c));
    int64_t header[SHM_HEADER_WORDS];
    if (!PyTuple_Check(header_obj) || PyTuple_GET_SIZE(header_obj) != SHM_HEADER_WORDS) {
        PyErr_Format(PyExc_TypeError, "header must be a tuple of %d ints", SHM_HEADER_WORDS);
        return NULL;
    }
    for (int i = 0; i < SHM_HEADER_WORDS; i++) {
        header[i] = PyLong_AsLongLong(PyTuple_GET_ITEM(header_obj, i));
        if (header[i] == -1 && PyErr_Occurred()) return NULL;
    }
    char *segs[SHM_MAX_RANKS];
    if (peers == SHM_PEERS_WINDOW && data == SHM_DATA_SLICED) {
        if (!PyTuple_Check(segments_obj) || PyTuple_GET_SIZE(segments_obj) != nranks) {
            PyErr_SetString(PyExc_TypeError, "window mode needs one segment address per rank");
            return NULL;
        }
        for (int q = 0; q < nranks; q++) {
            segs[q] = (char *)(uintptr_t)PyLong_AsUnsignedLongLong(PyTuple_GET_ITEM(segments_obj, q));
            if (PyErr_Occurred()) return NULL;
        }
    }
    Py_buffer src = {0}, dst = {0};
    Py_buffer *seg_views = NULL;
    mp_segment *data_segs = NULL;
    size_t seg_total = 0;
    Py_ssize_t nsegs = 0;
    if (data == SHM_DATA_SLICED && (PyList_Check(src_obj) || PyTuple_Check(src_obj))) {
        /* segmented: src lists the buffers reduced in place (dst must be None) */
        if (dst_obj != Py_None) {
            PyErr_SetString(PyExc_ValueError, "segmented calls reduce in place: dst must be None");
            return NULL;
        }
        nsegs = get_segments(src_obj, 1, mp_itemsize(dtype), &seg_views, &data_segs, &seg_total);
        if (nsegs < 0) return NULL;
        if (nsegs == 0 || nsegs > SHM_MAX_SEGMENTS) {
            release_segments(seg_views, data_segs, nsegs);
            PyErr_Format(PyExc_ValueError, "segmented calls take 1 to %d buffers, got %zd",
                         SHM_MAX_SEGMENTS, nsegs);
            return NULL;
        }
        src_obj = dst_obj = Py_None;
    }
    int have_src = src_obj != Py_None, have_dst = dst_obj != Py_None;
    if (have_src && get_buffer(src_obj, &src, 0, "src") < 0) {
        if (data_segs) release_segments(seg_views, data_segs, nsegs);
        return NULL;
    }
    if (have_dst && get_buffer(dst_obj, &dst, 1, "dst") < 0) {
        if (have_src) PyBuffer_Release(&src);
        return NULL;
    }
    size_t isz = mp_itemsize(dtype);
    c.ctrl = (char *)(uintptr_t)ctrl;
    c.nranks = nranks;
    c.rank = rank;
    c.seq = seq;
    c.header = header;
    c.data = data;
    c.in = have_src ? src.buf : NULL;
    c.out = have_dst ? dst.buf : NULL;
    c.count = have_src ? (size_t)src.len / isz : seg_total / isz;
    c.segs = data_segs;
    c.nsegs = (size_t)nsegs;
    c.dtype = dtype;
    c.op = op;
    c.divisor = divisor;
    c.slice_lo = (size_t)slice_lo;
    c.slice_hi = (size_t)slice_hi;
    c.chunk_bytes = (size_t)chunk_bytes;
    c.peers = peers;
    c.segments = segs;
    c.timeout_s = timeout_s;
    const char *bad = NULL;
    if (data != SHM_DATA_NONE && !nsegs && (!have_src || !have_dst || src.len != dst.len))
        bad = "data calls need src and dst of equal size";
    else if (data == SHM_DATA_INLINE && (size_t)src.len > SHM_INLINE_BYTES)
        bad = "inline payload larger than SHM_INLINE_BYTES";
    else if (data == SHM_DATA_SLICED && (slice_lo > slice_hi || (size_t)slice_hi > c.count))
        bad = "slice outside the buffer";
    shm_result result, *r = NULL; /* large but cheap: only the fields a status uses are read */
    if (!bad) {
        r = &result;
        r->status = SHM_OK;
        r->peer_rank = r->peer_errno = 0;
        r->missing[0] = 0;
        Py_BEGIN_ALLOW_THREADS
        shm_run(&c, r);
        Py_END_ALLOW_THREADS
    }
    if (have_src) PyBuffer_Release(&src);
    if (have_dst) PyBuffer_Release(&dst);
    if (data_segs) release_segments(seg_views, data_segs, nsegs);
    if (bad) {
        PyErr_SetString(PyExc_ValueError, bad);
        return NULL;
    }
    if (!r) return NULL;
    PyObject *info = NULL;
    int status = r->status;
    if (status == SHM_OK) {
        if (data == SHM_DATA_NONE) {
            info = PyTuple_New(nranks);
            for (int q = 0; info && q < nranks; q++)
                PyTuple_SET_ITEM(info, q, PyLong_FromLongLong(r->headers[q][SHM_HEADER_WORDS - 1]));
        } else {
            info = Py_NewRef(Py_None);
        }
    } else if (status == SHM_MISMATCH) {
        info = PyTuple_New(nranks);
        for (int q = 0; info && q < nranks; q++) {
            PyObject *h = PyTuple_New(SHM_HEADER_WORDS);
            for (int i = 0; h && i < SHM_HEADER_WORDS; i++)
                PyTuple_SET_ITEM(h, i, PyLong_FromLongLong(r->headers[q][i]));
            PyTuple_SET_ITEM(info, q, h);
        }
    } else if (status == SHM_TIMEOUT) {
        info = PyList_New(0);
        for (int q = 0; info && q < nranks; q++)
            if (r->missing[q]) {
                PyObject *v = PyLong_FromLong(q);
                PyList_Append(info, v);
                Py_XDECREF(v);
            }
    } else {
        info = Py_BuildValue("(iii)", r->peer_rank, r->missing[0], r->peer_errno);
    }
    if (!info) return NULL;
    return Py_BuildValue("(iN)", status, info);
}

static PyObject *py_cma_probe(PyObject *self, PyObject *args) {
    long pid;
    unsigned long long addr;
    Py_ssize_t nbytes;
    if (!PyArg_ParseTuple(args, "lKn", &pid, &addr, &nbytes)) return NULL;
    int err;
    Py_BEGIN_ALLOW_THREADS
    err = shm_cma_probe((pid_t)pid, addr, (size_t)nbytes);
    Py_END_ALLOW_THREADS
    return PyLong_FromLong(err);
}

static PyMethodDef methods[] = {
    {"reduce_into", py_reduce_into, METH_VARARGS, reduce_into_doc},
    {"divide", py_divide, METH_VARARGS, divide_doc},
    {"pack", py_pack, METH_VARARGS, pack_doc},
    {"unpack", py_unpack, METH_VARARGS, unpack_doc},
    {"shm_run", py_shm_run, METH_VARARGS, shm_run_doc},
    {"cma_probe", py_cma_probe, METH_VARARGS, "cma_probe(pid, addr, nbytes) -> 0 or errno"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef moduledef = {
    PyModuleDef_HEAD_INIT, "mpidp._ext", "Host kernels, bucket fusion and the shared-memory protocol of mpidp.",
    -1, methods,
};

PyMODINIT_FUNC PyInit__ext(void) {
    PyObject *m = PyModule_Create(&moduledef);
    if (!m) return NULL;
    shm_allow_peers();
    if (PyModule_AddIntConstant(m, "SHM_HEADER_WORDS", SHM_HEADER_WORDS) < 0 ||
        PyModule_AddIntConstant(m, "SHM_INLINE_BYTES", SHM_INLINE_BYTES) < 0 ||
        PyModule_AddIntConstant(m, "SHM_SLOT_BYTES", SHM_SLOT_BYTES) < 0 ||
        PyModule_AddIntConstant(m, "SHM_MAX_RANKS", SHM_MAX_RANKS) < 0 ||
        PyModule_AddIntConstant(m, "SHM_MAX_SEGMENTS", SHM_MAX_SEGMENTS) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
