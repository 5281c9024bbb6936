/* The helpers every binding file shares (binding.c: buffers, codes, segments), and what
 * module.c registers from the other files (their types and functions). */
#ifndef MPIDP_BINDING_H
#define MPIDP_BINDING_H
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include "fusion.h"

#include "wire.h"

int mp_get_buffer(PyObject *obj, Py_buffer *view, int writable, const char *what);
int mp_check_codes(int dtype, int op);
/* Buffers of every item of `seq`, as segments; on failure releases what it took. */
Py_ssize_t mp_get_segments(PyObject *seq, int writable, size_t isz, Py_buffer **views,
                           mp_segment **segs, size_t *total);
void mp_release_segments(Py_buffer *views, mp_segment *segs, Py_ssize_t n);
/* Adds the ShmContext type (context_type.c) to module `m`; -1 on error. */
int mp_add_shm_context_type(PyObject *m);
/* Adds the CheckedContext type (exchange.c) to module `m`; -1 on error. */
int mp_add_checked_type(PyObject *m);
/* Adds the HostView type (view.c) to module `m`; -1 on error. */
int mp_add_host_view_type(PyObject *m);
/* Adds the HeapBlock type (heap.c) to module `m`; -1 on error. */
int mp_add_heap_type(PyObject *m);
/* heap_alloc(nbytes): Note [Node heap] in heap.c. */
PyObject *mp_heap_alloc(PyObject *module, PyObject *arg);
extern const char mp_heap_alloc_doc[];
PyObject *mp_heap_stats(PyObject *module, PyObject *unused);
extern const char mp_heap_stats_doc[];
/* host_view(addr, nbytes, format, shape, owner): Note [Host views] in view.c. */
PyObject *mp_host_view(PyObject *module, PyObject *const *args, Py_ssize_t nargs);
extern const char mp_host_view_doc[];
/* tensor_view(x, Tensor, strided, formats): Note [Tensor views in C] in view.c. */
PyObject *mp_tensor_view(PyObject *module, PyObject *const *args, Py_ssize_t nargs);
extern const char mp_tensor_view_doc[];
/* atomic_add, atomic_load, atomic_store: int64 words of a shared buffer (atomics.c). */
PyObject *mp_atomic_add(PyObject *module, PyObject *args);
PyObject *mp_atomic_load(PyObject *module, PyObject *args);
PyObject *mp_atomic_store(PyObject *module, PyObject *args);
extern const char mp_atomic_add_doc[], mp_atomic_load_doc[], mp_atomic_store_doc[];

#endif
