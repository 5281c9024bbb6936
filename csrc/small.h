/* What every one-call small all-reduce shares (csrc/small.c on one node, csrc/exchange.c
 * across nodes): the array's dtype and the op as header codes, the shape's hash as Python
 * computes it, and the watchdog's board (Note [Small all-reduce in one call] in small.c);
 * and ShmContext.allreduce_array, the one on one node. */
#ifndef MPIDP_SMALL_H
#define MPIDP_SMALL_H
#include "binding.h"
#include "context.h"
#include <stdint.h>

/* The names the helpers below look up, interned once at the module's init; -1 on error. */
int mp_small_init(void);
/* ShmContext.allreduce_array(x, op[, stamp]): Note [Small all-reduce in one call]. */
PyObject *mp_ctx_allreduce_array(ShmContext *self, PyObject *const *args, Py_ssize_t nargs);
extern const char mp_allreduce_array_doc[];

/* The dtype code of a buffer's format, or -1 for one mpidp does not take. */
int mp_format_dtype(const Py_buffer *v);
/* The op code of "sum", "avg", "min" or "max" (average set for "avg"); -1 otherwise. */
int mp_op_of(PyObject *op, int *code, int *average);
/* Takes `x` and `op` for a one-call all-reduce of at most `max_bytes`: 1 with the writable
 * C-contiguous buffer held and its dtype, op and shape hash set; 0 when it declines (nothing
 * held, no exception set): another dtype or op, read-only, strided, too large, avg of ints. */
int mp_small_take(PyObject *x, PyObject *op, Py_ssize_t max_bytes, Py_buffer *v, int *dtype,
                  int *opc, int *average, Py_hash_t *shape_hash);
/* The optional third argument of allreduce_array, a name's stamp (below 2**24), shifted to
 * where a header's word 1 carries it (Note [Described stamps] in mpidp/engine/header.py):
 * 0 with *stamp set (0 without the argument), or -1 with an exception set. */
int mp_small_stamp(PyObject *const *args, Py_ssize_t nargs, int64_t *stamp);
/* hash() of the buffer's shape tuple, as mpidp.engine.header.header takes it; -1 on error. */
Py_hash_t mp_shape_hash(const Py_buffer *v);
/* board.seq += 1; board.what = header; returns the new seq, or -1 with an exception set. */
long long mp_post(PyObject *board, const int64_t *header);
/* board.done = seq; 0, or -1 with an exception set. */
int mp_mark_done(PyObject *board, long long seq);

#endif
