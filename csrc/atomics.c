/* Atomic int64 words in a buffer that other processes map too (an MPI shared window): what
 * the parameter server's node-local shards synchronise with (Note [Node-local shards] in
 * mpidp/modes/ps_shared.py). numpy has no atomics and no fences, so each call here is one
 * atomic operation with the barrier its protocol needs:
 *   atomic_add   fetch-and-add, sequentially consistent (a word several processes update);
 *   atomic_load  a full fence, then a load-acquire: no load or store issued before the call
 *                (a numpy copy out of the shared buffer, say) moves after it, and none after
 *                it moves before;
 *   atomic_store a full fence, a store-release, then a full fence: what was written before
 *                (a copy into the shared buffer) is visible to whoever loads the new value,
 *                and nothing after the call moves before it. On x86 the fence GCC emits
 *                (a locked instruction) does not order non-temporal stores, which a large
 *                memcpy may use, so an sfence comes first there.
 * Each takes the buffer and the index of an 8-byte-aligned int64 word in it. */
#include "binding.h"

static int64_t *word_of(Py_buffer *view, Py_ssize_t index) {
    if (index < 0 || (size_t)(index + 1) * 8 > (size_t)view->len) {
        PyErr_Format(PyExc_IndexError, "word %zd is outside a buffer of %zd bytes", index,
                     view->len);
        return NULL;
    }
    int64_t *w = (int64_t *)view->buf + index;
    if ((uintptr_t)w % 8) {
        PyErr_SetString(PyExc_ValueError, "the buffer's int64 words are not 8-byte aligned");
        return NULL;
    }
    return w;
}

enum { ADD, LOAD, STORE };

/* The one body of the three calls: (buf, index[, value]) parsed, the word found, `op` done. */
static PyObject *word_call(PyObject *args, int op) {
    PyObject *obj;
    Py_ssize_t index;
    long long value = 0;
    if (!PyArg_ParseTuple(args, op == LOAD ? "On" : "OnL", &obj, &index, &value)) return NULL;
    Py_buffer view;
    if (mp_get_buffer(obj, &view, op != LOAD, "buf") < 0) return NULL;
    int64_t *w = word_of(&view, index);
    int64_t out = 0;
    if (w && op == ADD) {
        out = __atomic_fetch_add(w, (int64_t)value, __ATOMIC_SEQ_CST);
    } else if (w && op == LOAD) {
        __atomic_thread_fence(__ATOMIC_SEQ_CST);
        out = __atomic_load_n(w, __ATOMIC_ACQUIRE);
    } else if (w) {
#if defined(__x86_64__) || defined(__i386__)
        __builtin_ia32_sfence();
#endif
        __atomic_thread_fence(__ATOMIC_SEQ_CST);
        __atomic_store_n(w, (int64_t)value, __ATOMIC_RELEASE);
        __atomic_thread_fence(__ATOMIC_SEQ_CST);
    }
    PyBuffer_Release(&view);
    if (!w) return NULL;
    if (op == STORE) Py_RETURN_NONE;
    return PyLong_FromLongLong(out);
}

const char mp_atomic_add_doc[] = "atomic_add(buf, index, value) -> the word's old value\n\n"
    "Adds value to int64 word index of buf atomically (sequentially consistent).";

PyObject *mp_atomic_add(PyObject *module, PyObject *args) { return word_call(args, ADD); }

const char mp_atomic_load_doc[] = "atomic_load(buf, index) -> int\n\n"
    "A full fence, then int64 word index of buf loaded with acquire order.";

PyObject *mp_atomic_load(PyObject *module, PyObject *args) { return word_call(args, LOAD); }

const char mp_atomic_store_doc[] = "atomic_store(buf, index, value)\n\n"
    "A full fence, int64 word index of buf stored with release order, then a full fence.";

PyObject *mp_atomic_store(PyObject *module, PyObject *args) { return word_call(args, STORE); }
