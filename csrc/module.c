/* mpidp._ext: Python bindings of the host kernels, bucket fusion and the shared-memory protocol.
 * Buffer protocol only (no numpy or torch headers); the GIL is released around every loop;
 * errors set a Python exception and return NULL. This file is the module's entry: its method
 * table, its init, and the thin wrappers that parse a kernel's arguments.
 *
 * Note [One direction in C]
 * The extension's files call one way: a file names only files on lower rows.
 *   module.c                 the entry: method table, init, argument-parsing wrappers
 *   context_type.c view.c    Python types: ShmContext (what it holds, its methods), HostView;
 *   atomics.c                atomic int64 words of a shared buffer
 *   exchange.c               CheckedContext: the one-call all-reduce across nodes
 *   small.c                  allreduce_array on one node, and what both one-call paths share
 *   context.c                ShmContext's calls into the protocol (mp_ctx_enter enters it)
 *   binding.c                buffers, codes and segments taken from Python objects
 *   shm.c                    the shared-memory protocol
 *   cma.c heap.c fusion.c    a peer's memory (kernel copy; node heap, HeapBlock); fusion
 *   kernels.c                the loops
 * A type whose methods come from several files has its method table in a file above them
 * (ShmContext's in context_type.c, over context.c and small.c), so no call returns upward,
 * and no file calls module.c. tests/unit/test_csrc_layers.py reads the sources (which file
 * defines which symbol with external linkage, which files name it) and fails on a cycle, on
 * a call into module.c, or on a call up these rows. The hot paths keep their callees where
 * they were: allreduce_array calls the one-call helpers in its own file and enters the
 * protocol in context.c (one call across files, as before this split). */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include "fusion.h"
#include "kernels.h"
#include "shm.h"
#include "cma.h"
#include "binding.h"
#include "small.h"

PyDoc_STRVAR(reduce_into_doc,
"reduce_into(dst, src, dtype, op)\n\n"
"dst = dst <op> src element-wise; dst and src hold the same number of bytes.");

static PyObject *py_reduce_into(PyObject *self, PyObject *args) {
    PyObject *dst_obj, *src_obj;
    int dtype, op;
    if (!PyArg_ParseTuple(args, "OOii", &dst_obj, &src_obj, &dtype, &op)) return NULL;
    if (mp_check_codes(dtype, op) < 0) return NULL;
    Py_buffer dst, src;
    if (mp_get_buffer(dst_obj, &dst, 1, "dst") < 0) return NULL;
    if (mp_get_buffer(src_obj, &src, 0, "src") < 0) { PyBuffer_Release(&dst); return NULL; }
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
    if (mp_check_codes(dtype, OP_SUM) < 0) return NULL;
    if (dtype != DT_F16 && dtype != DT_BF16 && dtype != DT_F32 && dtype != DT_F64) {
        PyErr_Format(PyExc_ValueError, "divide needs a floating dtype, got code %d", dtype);
        return NULL;
    }
    if (divisor <= 0) {
        PyErr_Format(PyExc_ValueError, "divisor must be positive, got %ld", divisor);
        return NULL;
    }
    Py_buffer buf;
    if (mp_get_buffer(obj, &buf, 1, "buf") < 0) return NULL;
    size_t isz = mp_itemsize(dtype);
    Py_BEGIN_ALLOW_THREADS
    mp_divide(buf.buf, (size_t)buf.len / isz, dtype, divisor);
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&buf);
    Py_RETURN_NONE;
}

PyDoc_STRVAR(stream_copy_doc, "stream_copy(dst, src)\n\ndst[:] = src with non-temporal "
             "stores (Note [Streaming copy] in csrc/kernels.c); the same byte count.");

static PyObject *py_stream_copy(PyObject *self, PyObject *args) {
    PyObject *dst_obj, *src_obj;
    if (!PyArg_ParseTuple(args, "OO", &dst_obj, &src_obj)) return NULL;
    Py_buffer dst, src;
    if (mp_get_buffer(dst_obj, &dst, 1, "dst") < 0) return NULL;
    if (mp_get_buffer(src_obj, &src, 0, "src") < 0) {
        PyBuffer_Release(&dst);
        return NULL;
    }
    if (dst.len != src.len) {
        PyErr_Format(PyExc_ValueError, "stream_copy: dst has %zd bytes, src %zd", dst.len,
                     src.len);
    } else {
        Py_BEGIN_ALLOW_THREADS
        mp_stream_copy(dst.buf, src.buf, (size_t)dst.len);
        Py_END_ALLOW_THREADS
    }
    PyBuffer_Release(&src);
    PyBuffer_Release(&dst);
    if (PyErr_Occurred()) return NULL;
    Py_RETURN_NONE;
}

PyDoc_STRVAR(pack_doc,
"pack(bucket, sources) -> nbytes\n\n"
"Copies every buffer of `sources` into the writable buffer `bucket`, back to back from its\n"
"start; returns the bytes written. The GIL is released while copying.");

static PyObject *py_pack(PyObject *self, PyObject *args) {
    PyObject *bucket_obj, *seq;
    if (!PyArg_ParseTuple(args, "OO", &bucket_obj, &seq)) return NULL;
    Py_buffer bucket;
    if (mp_get_buffer(bucket_obj, &bucket, 1, "bucket") < 0) return NULL;
    Py_buffer *views;
    mp_segment *segs;
    size_t total;
    Py_ssize_t n = mp_get_segments(seq, 0, 1, &views, &segs, &total);
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
    mp_release_segments(views, segs, n);
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
    if (mp_check_codes(dtype, OP_SUM) < 0) return NULL;
    if (divisor <= 0) {
        PyErr_Format(PyExc_ValueError, "divisor must be positive, got %ld", divisor);
        return NULL;
    }
    if (divisor > 1 && dtype != DT_F16 && dtype != DT_BF16 && dtype != DT_F32 && dtype != DT_F64) {
        PyErr_Format(PyExc_ValueError, "dividing needs a floating dtype, got code %d", dtype);
        return NULL;
    }
    Py_buffer bucket;
    if (mp_get_buffer(bucket_obj, &bucket, 0, "bucket") < 0) return NULL;
    Py_buffer *views;
    mp_segment *segs;
    size_t total;
    Py_ssize_t n = mp_get_segments(seq, 1, mp_itemsize(dtype), &views, &segs, &total);
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
    mp_release_segments(views, segs, n);
    PyBuffer_Release(&bucket);
    if (PyErr_Occurred()) return NULL;
    return PyLong_FromSize_t(total);
}

PyDoc_STRVAR(cast_segments_doc,
"cast_segments(bucket, segments, wire, outer, divisor, unpack) -> nbytes\n\n"
"Packs the float32 buffers `segments` (dtype code `outer`) into `bucket` as float16 or\n"
"bfloat16 (code `wire`), or with `unpack` true reads the bucket back into them as float32,\n"
"dividing by `divisor` in float32 on the way (Note [Casting buckets] in kernels.c). Returns\n"
"the bucket bytes used. The GIL is released while converting.");

static PyObject *py_cast_segments(PyObject *self, PyObject *args) {
    PyObject *bucket_obj, *seq;
    int wire, outer, unpack;
    long divisor;
    if (!PyArg_ParseTuple(args, "OOiilp", &bucket_obj, &seq, &wire, &outer, &divisor, &unpack))
        return NULL;
    if (mp_check_codes(wire, OP_SUM) < 0 || mp_check_codes(outer, OP_SUM) < 0) return NULL;
    if (outer != DT_F32 || (wire != DT_F16 && wire != DT_BF16)) {
        PyErr_Format(PyExc_ValueError, "cast_segments converts float32 buffers to and from a "
                     "float16 or bfloat16 bucket; got codes %d (buffers), %d (bucket)", outer,
                     wire);
        return NULL;
    }
    if (divisor <= 0) {
        PyErr_Format(PyExc_ValueError, "divisor must be positive, got %ld", divisor);
        return NULL;
    }
    Py_buffer bucket;
    if (mp_get_buffer(bucket_obj, &bucket, !unpack, "bucket") < 0) return NULL;
    Py_buffer *views;
    mp_segment *segs;
    size_t total, osz = mp_itemsize(outer), wsz = mp_itemsize(wire);
    Py_ssize_t n = mp_get_segments(seq, unpack, osz, &views, &segs, &total);
    if (n < 0) {
        PyBuffer_Release(&bucket);
        return NULL;
    }
    size_t used = total / osz * wsz;
    if (used > (size_t)bucket.len) {
        PyErr_Format(PyExc_ValueError, "the buffers need %zu bucket bytes, more than the "
                     "bucket's %zd", used, bucket.len);
    } else {
        Py_BEGIN_ALLOW_THREADS
        mp_cast_segments(bucket.buf, wire, segs, (size_t)n, outer, divisor, unpack);
        Py_END_ALLOW_THREADS
    }
    mp_release_segments(views, segs, n);
    PyBuffer_Release(&bucket);
    if (PyErr_Occurred()) return NULL;
    return PyLong_FromSize_t(used);
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

static PyObject *py_set_ptracer(PyObject *self, PyObject *args) {
    long pid;
    if (!PyArg_ParseTuple(args, "l", &pid)) return NULL;
    return PyLong_FromLong(shm_set_ptracer(pid));
}

static PyMethodDef methods[] = {
    {"reduce_into", py_reduce_into, METH_VARARGS, reduce_into_doc},
    {"divide", py_divide, METH_VARARGS, divide_doc},
    {"stream_copy", py_stream_copy, METH_VARARGS, stream_copy_doc},
    {"pack", py_pack, METH_VARARGS, pack_doc},
    {"unpack", py_unpack, METH_VARARGS, unpack_doc},
    {"cast_segments", py_cast_segments, METH_VARARGS, cast_segments_doc},
    {"set_ptracer", py_set_ptracer, METH_VARARGS,
     "set_ptracer(pid) -> 0 or errno: Yama's PR_SET_PTRACER (0 clears it)"},
    {"cma_probe", py_cma_probe, METH_VARARGS, "cma_probe(pid, addr, nbytes) -> 0 or errno"},
    {"heap_alloc", mp_heap_alloc, METH_O, mp_heap_alloc_doc},
    {"heap_stats", mp_heap_stats, METH_NOARGS, mp_heap_stats_doc},
    {"host_view", (PyCFunction)(void (*)(void))mp_host_view, METH_FASTCALL, mp_host_view_doc},
    {"tensor_view", (PyCFunction)(void (*)(void))mp_tensor_view, METH_FASTCALL,
     mp_tensor_view_doc},
    {"atomic_add", mp_atomic_add, METH_VARARGS, mp_atomic_add_doc},
    {"atomic_load", mp_atomic_load, METH_VARARGS, mp_atomic_load_doc},
    {"atomic_store", mp_atomic_store, METH_VARARGS, mp_atomic_store_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef moduledef = {
    PyModuleDef_HEAD_INIT, "mpidp._ext", "Host kernels, bucket fusion and the shared-memory protocol of mpidp.",
    -1, methods,
};

PyMODINIT_FUNC PyInit__ext(void) {
    PyObject *m = PyModule_Create(&moduledef);
    if (!m) return NULL;
    if (mp_small_init() < 0 || mp_add_shm_context_type(m) < 0 || mp_add_checked_type(m) < 0 ||
        mp_add_host_view_type(m) < 0 || mp_add_heap_type(m) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    /* csrc/wire.h, which mpidp.engine.header.check_wire compares with its own */
    PyObject *wire = Py_BuildValue("{s:i,s:i,s:i,s:i,s:i,s:i,s:i}",
                                   "HEADER_WORDS", MP_HEADER_WORDS, "FREE_WORD", MP_FREE_WORD,
                                   "ALLREDUCE", MP_KIND_ALLREDUCE, "SHM", MP_ALGO_SHM,
                                   "DOUBLING", MP_ALGO_DOUBLING, "MODE_SHIFT", MP_MODE_SHIFT,
                                   "STAMP_SHIFT", MP_STAMP_SHIFT);
    int added = wire ? PyModule_AddObjectRef(m, "WIRE", wire) : -1;
    Py_XDECREF(wire);
    if (added < 0 ||
        PyModule_AddIntConstant(m, "SHM_INLINE_BYTES", SHM_INLINE_BYTES) < 0 ||
        PyModule_AddIntConstant(m, "SHM_SLOT_BYTES", SHM_SLOT_BYTES) < 0 ||
        PyModule_AddIntConstant(m, "SHM_MAX_RANKS", SHM_MAX_RANKS) < 0 ||
        PyModule_AddIntConstant(m, "SHM_MAX_SEGMENTS", SHM_MAX_SEGMENTS) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
