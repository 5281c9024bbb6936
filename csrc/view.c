/* mpidp._ext.host_view: a writable, C-contiguous buffer over memory that Python knows by its
 * address (a CPU torch tensor's data_ptr()), for the calls that take the buffer protocol;
 * mpidp._ext.tensor_view: the same over a CPU tensor, asked of the tensor itself.
 *
 * Note [Host views]
 * torch offers two ways to see a tensor as a buffer: ``tensor.numpy()``, which makes the
 * tensor's storage unresizable for good (torch's backends never do that, and hooks such as
 * batched PowerSGD resize their tensors), and DLPack (``np.from_dlpack``), which costs more
 * than a small all-reduce itself (~10 µs: capsule, deleter, array). A view made here from the
 * address, byte count, struct format and shape costs one small object and touches nothing of
 * the tensor's; the caller keeps the tensor alive while the view is used (it passes it as
 * ``owner``, which the view holds). Its numpy twin is mpidp.engine.host_ops_numpy.host_view. */
#include "binding.h"
#include <string.h>

#define VIEW_MAX_DIMS 64

typedef struct {
    PyObject_HEAD
    char *buf;
    Py_ssize_t len, itemsize;
    int ndim;
    char format[4];
    Py_ssize_t shape[VIEW_MAX_DIMS], strides[VIEW_MAX_DIMS];
    PyObject *owner;
} HostView;

static void view_dealloc(HostView *self) {
    Py_XDECREF(self->owner);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static int view_getbuffer(HostView *self, Py_buffer *v, int flags) {
    v->buf = self->buf;
    v->obj = Py_NewRef((PyObject *)self);
    v->len = self->len;
    v->itemsize = self->itemsize;
    v->readonly = 0;
    v->ndim = self->ndim;
    v->format = (flags & PyBUF_FORMAT) ? self->format : NULL;
    v->shape = (flags & PyBUF_ND) == PyBUF_ND ? self->shape : NULL;
    v->strides = (flags & PyBUF_STRIDES) == PyBUF_STRIDES ? self->strides : NULL;
    v->suboffsets = NULL;
    v->internal = NULL;
    if (!v->shape) v->ndim = 1; /* a consumer that asks for no shape sees the bytes */
    return 0;
}

static PyBufferProcs view_as_buffer = {(getbufferproc)view_getbuffer, NULL};

static PyTypeObject HostViewType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "mpidp._ext.HostView",
    .tp_doc = "A writable C-contiguous buffer over an address (mpidp._ext.host_view).",
    .tp_basicsize = sizeof(HostView),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_dealloc = (destructor)view_dealloc,
    .tp_as_buffer = &view_as_buffer,
};

static Py_ssize_t format_itemsize(const char *f) {
    if (!f[0] || f[1]) return -1;
    switch (f[0]) {
    case 'B': case 'b': case '?': return 1;
    case 'e': case 'h': case 'H': return 2;
    case 'f': case 'i': case 'I': return 4;
    case 'd': case 'q': case 'Q': return 8;
    default: return -1;
    }
}

const char mp_host_view_doc[] =
"host_view(addr, nbytes, format, shape, owner) -> HostView\n\n"
"A writable, C-contiguous buffer of `nbytes` bytes at address `addr` with struct format\n"
"`format` (one of B b ? e h H f i I d q Q) and `shape` (a tuple whose product times the item\n"
"size is nbytes), holding `owner` (Note [Host views] in csrc/view.c).";

/* A new view of `nbytes` bytes at `addr` with struct `format` and the extents of `shape` (a
 * tuple), holding `owner`; NULL with the error set. */
static PyObject *new_view(unsigned long long addr, Py_ssize_t nbytes, PyObject *format_obj,
                          PyObject *shape, PyObject *owner) {
    const char *format = PyUnicode_Check(format_obj) ? PyUnicode_AsUTF8(format_obj) : NULL;
    if (!format) {
        if (!PyErr_Occurred()) PyErr_SetString(PyExc_TypeError, "format must be a str");
        return NULL;
    }
    Py_ssize_t itemsize = format_itemsize(format);
    if (itemsize < 0) {
        PyErr_Format(PyExc_ValueError, "host_view: unknown format %R", format_obj);
        return NULL;
    }
    if (!PyTuple_Check(shape) || PyTuple_GET_SIZE(shape) > VIEW_MAX_DIMS) {
        PyErr_Format(PyExc_TypeError, "host_view: shape must be a tuple of at most %d ints",
                     VIEW_MAX_DIMS);
        return NULL;
    }
    HostView *self = PyObject_New(HostView, &HostViewType);
    if (!self) return NULL;
    self->owner = NULL;
    self->ndim = (int)PyTuple_GET_SIZE(shape);
    Py_ssize_t count = 1;
    for (int i = 0; i < self->ndim; i++) {
        self->shape[i] = PyLong_AsSsize_t(PyTuple_GET_ITEM(shape, i));
        if (self->shape[i] < 0) {
            if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "host_view: negative extent");
            Py_DECREF(self);
            return NULL;
        }
        count *= self->shape[i];
    }
    if (nbytes < 0 || count * itemsize != nbytes || (!addr && nbytes)) {
        PyErr_Format(PyExc_ValueError, "host_view: shape %R of format %s is not %zd bytes",
                     shape, format, nbytes);
        Py_DECREF(self);
        return NULL;
    }
    for (int i = self->ndim - 1; i >= 0; i--)
        self->strides[i] = i == self->ndim - 1 ? itemsize
                                               : self->strides[i + 1] * self->shape[i + 1];
    self->buf = (char *)(uintptr_t)addr;
    self->len = nbytes;
    self->itemsize = itemsize;
    memcpy(self->format, format, 2);
    self->owner = Py_NewRef(owner);
    return (PyObject *)self;
}

PyObject *mp_host_view(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 5) {
        PyErr_SetString(PyExc_TypeError, "host_view(addr, nbytes, format, shape, owner)");
        return NULL;
    }
    unsigned long long addr = PyLong_AsUnsignedLongLong(args[0]);
    Py_ssize_t nbytes = PyLong_AsSsize_t(args[1]);
    if (PyErr_Occurred()) return NULL;
    return new_view(addr, nbytes, args[2], args[3], args[4]);
}

/* Note [Tensor views in C]
 * The one-call all-reduce of a small CPU tensor is ~1 us of MPI; building its view in Python
 * (type, layout, device, dtype, contiguity, address, size and shape, one attribute each) cost
 * ~0.85 us more. Here the same questions are asked through the C API, without the
 * interpreter between them. The tensor is read through its public attributes only (no torch
 * headers: Note [Host views]); what torch's objects are (torch.Tensor, torch.strided, and the
 * struct format of each dtype that has one) comes from the caller,
 * mpidp.comm.tensor_views. */
static int attr_is(PyObject *x, PyObject *name, PyObject *expected) {
    PyObject *v = PyObject_GetAttr(x, name);
    if (!v) return -1;
    int same = v == expected;
    Py_DECREF(v);
    return same;
}

const char mp_tensor_view_doc[] =
"tensor_view(x, Tensor, strided, formats) -> HostView or None\n\n"
"A view of `x`, an exact `Tensor` of layout `strided` on the CPU, C-contiguous, not empty, of a\n"
"dtype that `formats` (dtype -> struct format) names, holding `x`; None for anything else\n"
"(Note [Tensor views in C] in csrc/view.c).";

PyObject *mp_tensor_view(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    static PyObject *s_layout, *s_is_cpu, *s_dtype, *s_is_contiguous, *s_data_ptr, *s_shape;
    if (nargs != 4 || !PyDict_Check(args[3])) {
        PyErr_SetString(PyExc_TypeError, "tensor_view(x, Tensor, strided, formats: dict)");
        return NULL;
    }
    if (!s_shape) {
        if (!(s_layout = PyUnicode_InternFromString("layout")) ||
            !(s_is_cpu = PyUnicode_InternFromString("is_cpu")) ||
            !(s_dtype = PyUnicode_InternFromString("dtype")) ||
            !(s_is_contiguous = PyUnicode_InternFromString("is_contiguous")) ||
            !(s_data_ptr = PyUnicode_InternFromString("data_ptr")) ||
            !(s_shape = PyUnicode_InternFromString("shape")))
            return NULL;
    }
    PyObject *x = args[0];
    if ((PyObject *)Py_TYPE(x) != args[1]) Py_RETURN_NONE;
    int ok = attr_is(x, s_layout, args[2]);
    if (ok > 0) ok = attr_is(x, s_is_cpu, Py_True);
    if (ok <= 0) return ok < 0 ? NULL : Py_NewRef(Py_None);
    PyObject *dtype = PyObject_GetAttr(x, s_dtype);
    if (!dtype) return NULL;
    PyObject *format = PyDict_GetItemWithError(args[3], dtype);
    Py_DECREF(dtype);
    if (!format) return PyErr_Occurred() ? NULL : Py_NewRef(Py_None);
    Py_INCREF(format); /* held across calls into torch, which may run Python code */
    PyObject *view = NULL, *shape = NULL;
    PyObject *contiguous = PyObject_CallMethodNoArgs(x, s_is_contiguous);
    if (!contiguous) goto done;
    int dense = contiguous == Py_True;
    Py_DECREF(contiguous);
    const char *fmt = PyUnicode_Check(format) ? PyUnicode_AsUTF8(format) : NULL;
    if (!dense || !fmt) {
        view = PyErr_Occurred() ? NULL : Py_NewRef(Py_None);
        goto done;
    }
    if (!(shape = PyObject_GetAttr(x, s_shape))) goto done;
    /* the size from the shape: one attribute fewer than nbytes (a 0-d tensor: one item); the
     * format's width is its dtype's (checked where the formats are made: tensor_views.py) */
    Py_ssize_t nbytes = PyTuple_Check(shape) ? format_itemsize(fmt) : -1;
    for (Py_ssize_t i = 0; nbytes > 0 && i < PyTuple_GET_SIZE(shape); i++) {
        Py_ssize_t extent = PyLong_AsSsize_t(PyTuple_GET_ITEM(shape, i));
        if (extent < 0 || __builtin_mul_overflow(nbytes, extent, &nbytes)) nbytes = -1;
    }
    PyObject *ptr = nbytes > 0 ? PyObject_CallMethodNoArgs(x, s_data_ptr) : NULL;
    unsigned long long addr = ptr ? PyLong_AsUnsignedLongLong(ptr) : 0;
    Py_XDECREF(ptr);
    view = PyErr_Occurred() ? NULL
           : nbytes > 0 ? new_view(addr, nbytes, format, shape, x) : Py_NewRef(Py_None);
done:
    Py_XDECREF(shape);
    Py_DECREF(format);
    return view;
}

int mp_add_host_view_type(PyObject *m) {
    if (PyType_Ready(&HostViewType) < 0) return -1;
    return PyModule_AddObjectRef(m, "HostView", (PyObject *)&HostViewType);
}
