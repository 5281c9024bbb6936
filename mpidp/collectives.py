"""Collectives on host arrays (numpy arrays and CPU torch tensors): ``allreduce``,
``allreduce_``, ``broadcast``, ``broadcast_``, ``reduce_``, ``allgather``, ``reduce_scatter``.
Device arrays (CuPy arrays, torch CUDA tensors) take the same calls and are handed to
mpidp.gpu.collectives.

Every function here is a synchronisation point: every rank of the group must call it, in the
same order. Inputs are checked across ranks first (mpidp.handshake); bad input on any rank
raises on every rank, and the runtime stays usable afterwards. Each collective is posted on
the group's watchdog board while it runs (Note [Watchdog] in mpidp/watchdog.py)."""
from __future__ import annotations

from typing import Any

import numpy as np

from . import algorithms, handshake, runtime, timeline
from .errors import MismatchError
from .dtypes import FLOATING, ITEMSIZE, OP_CODES, OPS, as_host_array, empty_like, write_back
from .handshake import (ALLGATHER, ALLREDUCE, ALGORITHM_CODES, BROADCAST, REDUCE,
                        REDUCE_SCATTER)
from .gpu import is_device_array
from .ring import partition


def _device():
    from .gpu import collectives as device_collectives  # imports CuPy: only for device arrays
    return device_collectives


def _op_codes(op: Any, dtype: int) -> tuple:
    codes = OP_CODES.get(op) if isinstance(op, str) else None
    if codes is None:
        raise ValueError(f"unknown op {op!r}; accepted: {', '.join(OPS)}")
    if codes[1] and dtype not in FLOATING:
        raise ValueError("op 'avg' needs a floating dtype (float16, bfloat16, float32, "
                         "float64); use 'sum' for integers and divide as you need")
    return codes


def refuse(g, kind: int, exc: BaseException) -> None:
    """This rank's input to collective ``kind`` is bad (``exc``): joins the collective's
    header exchange with an error code, which raises on every rank (``exc`` here, a
    MismatchError elsewhere), so no rank waits for it. Alone, returns (the caller raises)."""
    if g.size > 1:
        b = g.board  # Note [Watchdog] in mpidp/watchdog.py
        try:
            handshake.exchange(g, b.publish(handshake.error_header(kind, exc)),
                               handshake.KIND_NAMES[kind], exc)
        finally:
            b.done = b.seq


def _posted(body):
    """Runs ``body(g, board, ...)`` as one collective on the group's watchdog board, marked
    done when it returns or raises (Note [Watchdog] in mpidp/watchdog.py)."""
    def run(*args, **kwargs):
        g = runtime.group()
        b = g.board
        try:
            return body(g, b, *args, **kwargs)
        finally:
            b.done = b.seq
    return run


def allreduce(x: Any, op: str = "sum", algorithm: str = "auto"):
    """Reduces ``x`` over every rank and returns the result as a new array or tensor of the
    same type, shape and dtype; ``x`` is unchanged. ``op``: sum, avg, min, max.
    ``algorithm``: auto, shm, ring, hier, mpi (see README). Every rank must call it."""
    if is_device_array(x):
        return _device().allreduce(x, op, algorithm, inplace=False)
    return _allreduce(x, op, algorithm, inplace=False)


def allreduce_(x: Any, op: str = "sum", algorithm: str = "auto"):
    """In-place ``allreduce``: ``x`` holds the result afterwards, and is returned."""
    if is_device_array(x):
        return _device().allreduce(x, op, algorithm, inplace=True)
    return _allreduce(x, op, algorithm, inplace=True)


@timeline.traced("allreduce")
def _allreduce(x, op, algorithm, inplace):
    g = runtime.group()
    b = g.board  # as _posted, inline: this is the hot path (one call less per all-reduce)
    try:
        try:
            a = as_host_array(x)
            opc, avg = _op_codes(op, a.dtype)
            algo = algorithms.choose(g, algorithm, a.flat.nbytes)
        except (TypeError, ValueError) as exc:
            refuse(g, ALLREDUCE, exc)
            raise
        src = a.flat
        out, dst = (a.original, src) if inplace else empty_like(a)
        divisor = g.size if avg else 1
        if g.size == 1:
            if dst is not src:
                dst[...] = src
        else:
            hdr = b.publish((ALLREDUCE, ALGORITHM_CODES[algo], opc + 4 * avg, a.dtype, len(src),
                             hash(a.shape), 0, 0))
            if algo == "shm":
                status, info = algorithms.shm(g, src, dst, a.dtype, opc, divisor, hdr)
                if status:
                    raise handshake.mismatch_error("allreduce", info, g.rank)
            else:
                handshake.exchange(g, hdr, "allreduce")
                if algo == "mpi":
                    algorithms.mpi_allreduce(g, src, dst, a.dtype, opc, divisor)
                elif algo == "ring":
                    algorithms.ring(g, src, dst, a.dtype, opc, divisor)
                else:
                    algorithms.hier(g, src, dst, a.dtype, opc, divisor, hdr)
        if inplace:
            write_back(a)
        return out
    finally:
        b.done = b.seq


def allreduce_segments_(flats: list, dtype: int, op: str = "sum",
                        algorithm: str = "auto") -> bool:
    """mpidp-internal: all-reduces the contiguous flat buffers ``flats`` (dtype code ``dtype``)
    in place as one concatenated buffer without packing them, where the algorithm is shm and
    the buffers qualify (Note [Zero-copy buckets] in mpidp/fusion.py). Returns False, having
    exchanged nothing, where they do not: the caller then packs them. Ranks may decide
    differently: the header is the one a packed buffer of the same count would send."""
    g = runtime.group()
    if g.size == 1 or not flats:
        return False
    opc, avg = OP_CODES[op]
    count = sum(len(f) for f in flats)
    nbytes = count * ITEMSIZE[dtype]
    if algorithms.choose(g, algorithm, nbytes) != "shm":
        return False
    ctx = g.shm()
    if nbytes <= ctx.inline_bytes or len(flats) > ctx.max_segments:
        return False
    b = g.board  # Note [Watchdog] in mpidp/watchdog.py
    hdr = b.publish(handshake.header(ALLREDUCE, ALGORITHM_CODES["shm"], opc + 4 * avg, dtype,
                                     count, (count,)))  # what a packed bucket of this count sends
    try:
        with timeline.span("allreduce"):
            status, info = ctx.allreduce(hdr, None, None, dtype, opc, g.size if avg else 1,
                                         segments=flats)
        if status:
            raise handshake.mismatch_error("allreduce", info, g.rank)
        return True
    finally:
        b.done = b.seq


def broadcast(x: Any, root: int = 0):
    """Returns a new array or tensor holding root's ``x`` on every rank; ``x`` is unchanged.
    Every rank passes an ``x`` of the same shape and dtype."""
    if is_device_array(x):
        return _device().staged(x, False, BROADCAST, lambda host: broadcast_(host, root))
    return _broadcast(x, root, inplace=False)


def broadcast_(x: Any, root: int = 0):
    """In-place ``broadcast``: every rank's ``x`` holds root's values afterwards."""
    if is_device_array(x):
        return _device().staged(x, True, BROADCAST, lambda host: broadcast_(host, root))
    return _broadcast(x, root, inplace=True)


def check_root(root: Any, size: int) -> None:
    """ValueError unless ``root`` is a rank of a group of ``size``."""
    if not isinstance(root, (int, np.integer)) or isinstance(root, bool) or not 0 <= root < size:
        raise ValueError(f"root {root!r} is not a rank of this group (0..{size - 1})")


@timeline.traced("broadcast")
@_posted
def _broadcast(g, b, x, root, inplace):
    try:
        a = as_host_array(x)
        check_root(root, g.size)
    except (TypeError, ValueError) as exc:
        refuse(g, BROADCAST, exc)
        raise
    out, flat = (a.original, a.flat) if inplace else empty_like(a)
    if not inplace:
        flat[...] = a.flat
    if g.size > 1:
        handshake.exchange(g, b.publish(handshake.header(BROADCAST, 0, int(root), a.dtype,
                                                         len(a.flat), a.shape)), "broadcast")
        g.comm.Bcast(flat.view(np.uint8), root=int(root))
    if inplace:
        write_back(a)
    return out


@timeline.traced("reduce")
def reduce_(x: Any, root: int = 0, op: str = "sum"):
    """Reduces ``x`` over every rank into root's ``x`` (MPI_Reduce, in place at root); the
    other ranks' ``x`` is unchanged. ``op``: sum, avg, min, max. Every rank must call it."""
    if is_device_array(x):
        return _device().staged(x, True, REDUCE, lambda host: reduce_(host, root, op))
    return _reduce(x, root, op)


@_posted
def _reduce(g, b, x, root, op):
    try:
        a = as_host_array(x)
        check_root(root, g.size)
        opc, avg = _op_codes(op, a.dtype)
    except (TypeError, ValueError) as exc:
        refuse(g, REDUCE, exc)
        raise
    if g.size > 1:
        roots = handshake.exchange(g, b.publish(handshake.header(
            REDUCE, ALGORITHM_CODES["mpi"], opc + 4 * avg, a.dtype, len(a.flat), a.shape,
            free=int(root))), "reduce")
        if len(set(int(r) for r in roots)) > 1:
            raise MismatchError(f"rank {g.rank}: reduce called with different roots: "
                                + ", ".join(f"rank {i} root={int(r)}"
                                            for i, r in enumerate(roots)))
        from mpi4py import MPI
        buf = algorithms.mpi_buffer(a.flat, a.dtype)
        mpi_op = algorithms.mpi_op(a.dtype, opc)
        if g.rank == root:
            g.comm.Reduce(MPI.IN_PLACE, buf, op=mpi_op, root=int(root))
        else:
            g.comm.Reduce(buf, None, op=mpi_op, root=int(root))
    if g.rank == root:
        if avg and len(a.flat):
            from . import host_kernels
            host_kernels.divide(a.flat, a.dtype, g.size)
        write_back(a)
    return a.original


@timeline.traced("allgather")
def allgather(x: Any):
    """Concatenates every rank's ``x`` along dimension 0, in rank order, into a new array or
    tensor. The first dimension may differ between ranks; the others and the dtype may not."""
    if is_device_array(x):
        return _device().staged(x, False, ALLGATHER, allgather)
    return _allgather(x)


@_posted
def _allgather(g, b, x):
    try:
        a = as_host_array(x)
        if len(a.shape) == 0:
            raise ValueError("allgather needs at least one dimension (it concatenates along 0)")
    except (TypeError, ValueError) as exc:
        refuse(g, ALLGATHER, exc)
        raise
    row = int(np.prod(a.shape[1:], dtype=np.int64))
    if g.size == 1:
        rows = [a.shape[0]]
    else:
        hdr = handshake.header(ALLGATHER, 0, 0, a.dtype, row, a.shape[1:], free=a.shape[0])
        rows = [int(r) for r in handshake.exchange(g, b.publish(hdr), "allgather")]
    out, flat = empty_like(a, (sum(rows),) + tuple(a.shape[1:]))
    itemsize = a.flat.itemsize
    counts = [r * row * itemsize for r in rows]
    displs = [sum(counts[:i]) for i in range(len(counts))]
    if g.size == 1:
        flat[...] = a.flat
    else:
        g.comm.Allgatherv(a.flat.view(np.uint8), [flat.view(np.uint8), (counts, displs)])
    return out


@timeline.traced("reduce_scatter")
def reduce_scatter(x: Any, op: str = "sum", algorithm: str = "auto"):
    """Reduces ``x`` over every rank and returns this rank's block along dimension 0, the
    blocks split as ``numpy.array_split`` splits. ``algorithm``: auto or ring (our ring's
    reduce-scatter phase) or mpi (MPI_Reduce_scatter). ``x`` is unchanged."""
    if is_device_array(x):
        return _device().staged(x, False, REDUCE_SCATTER,
                                 lambda host: reduce_scatter(host, op, algorithm))
    return _reduce_scatter(x, op, algorithm)


@_posted
def _reduce_scatter(g, b, x, op, algorithm):
    try:
        a = as_host_array(x)
        if len(a.shape) == 0:
            raise ValueError("reduce_scatter needs at least one dimension (it splits along 0)")
        opc, avg = _op_codes(op, a.dtype)
        if algorithm not in ("auto", "ring", "mpi"):
            raise ValueError(f"unknown reduce_scatter algorithm {algorithm!r}; accepted: "
                             "auto, ring, mpi")
    except (TypeError, ValueError) as exc:
        refuse(g, REDUCE_SCATTER, exc)
        raise
    algo = "ring" if algorithm == "auto" else algorithm
    row = int(np.prod(a.shape[1:], dtype=np.int64))
    chunks = partition(len(a.flat), g.size, unit=max(row, 1)) if row else \
        tuple((0, 0) for _ in range(g.size))
    offset, count = chunks[g.rank]
    rows = partition(a.shape[0], g.size)[g.rank][1]
    out, flat = empty_like(a, (rows,) + tuple(a.shape[1:]))
    if g.size == 1:
        flat[...] = a.flat
        return out
    hdr = handshake.header(REDUCE_SCATTER, ALGORITHM_CODES[algo], opc + 4 * avg, a.dtype,
                           len(a.flat), a.shape)
    handshake.exchange(g, b.publish(hdr), "reduce_scatter")
    if algo == "ring":
        work = a.flat.copy()
        algorithms.ring_reduce_scatter(g, work, a.dtype, opc, chunks)
        flat[...] = work[offset:offset + count]
    else:
        g.comm.Reduce_scatter(algorithms.mpi_buffer(a.flat, a.dtype),
                              algorithms.mpi_buffer(flat, a.dtype),
                              [c for _, c in chunks], op=algorithms.mpi_op(a.dtype, opc))
    if avg and count:
        from . import host_kernels
        host_kernels.divide(flat, a.dtype, g.size)
    return out
