"""The front door of every collective: ``allreduce``, ``allreduce_``, ``broadcast``,
``broadcast_``, ``reduce_``, ``allgather``, ``reduce_scatter`` on numpy arrays, torch
tensors (CPU or CUDA) and CuPy arrays.

Every call passes through the collective frame (Note [The collective frame] in
mpidp/runtime/frame.py): the input is viewed and checked here, at the public boundary, before
the call counts as a collective; a rank whose input is bad — any exception, of any type —
joins the header exchange with an error code instead (``Frame.refuse``), so every rank raises
and none waits or pairs with the wrong call. A good input's header (one builder:
mpidp.engine.header) is published on the watchdog's board, an executor —
mpidp.engine.host_executor, or mpidp.engine.gpu.executor for device arrays, handed the group's
links (Note [Handed down] in mpidp/engine/links.py) — exchanges it and moves the data, and the
board marks it done whatever happens. Device arrays take the host path through ``staged``
where the GPU executor has no algorithm of its own.

Every function here is a synchronisation point: every rank of the group must call it, in the
same order, all with host arrays or all with device arrays."""
from __future__ import annotations

from typing import Any

import numpy as np

from ..engine import header, host_executor
from .. import runtime
from ..runtime import timeline
from ..runtime.frame import Frame
from ..engine.gpu import executor as gpu_executor  # imports no CuPy until a device array arrives
from ..algorithms import DEVICE, HOST, TABLE, check_name, choose
from ..engine.dtypes import OP_CODES, as_host_array, empty_like
from ..engine.gpu import is_device_array
from ..engine.header import ALLGATHER, ALLREDUCE, BROADCAST, REDUCE, REDUCE_SCATTER, op_word
from ..errors import MismatchError
from ..engine.blocks import partition
from .checks import (agree_on_nothing, bump_version, check_algorithm, check_root,  # noqa: F401
                     check_writable, facts, op_codes, refusal, refuse, wrote)
from .tensor_views import bump_version as bump_tensor_version, tensor_view

_HOST_CODES = {a.name: a.code for a in TABLE if a.where == HOST}


def allreduce(x: Any, op: str = "sum", algorithm: str = "auto"):
    """Reduces ``x`` over every rank and returns the result as a new array or tensor of the
    same type, shape and dtype; ``x`` is unchanged. ``op``: sum, avg, min, max (min and max
    propagate NaN). ``algorithm``: auto, shm, doubling, hier, mpi, ring for host arrays;
    auto, ring, nccl, staged for device arrays (docs/api.md). Every rank must call it."""
    return allreduce_in(runtime.group(), x, op, algorithm, False)


def allreduce_(x: Any, op: str = "sum", algorithm: str = "auto"):
    """In-place ``allreduce``: ``x`` holds the result afterwards, and is returned."""
    return allreduce_in(runtime.group(), x, op, algorithm, True)


# Note [Group-explicit collectives]
# The public collectives above and below act on the calling context's group
# (mpidp.runtime.group()); each is a line over its ``*_in`` form, which takes the group
# explicitly. Every caller inside mpidp that has a group — buckets, fusion, the
# torch.distributed backend — calls the ``*_in`` form with it: below the public API the group
# is handed down, never looked up again.

def allreduce_in(g, x: Any, op: str = "sum", algorithm: str = "auto", inplace: bool = False):
    """``allreduce`` (``allreduce_`` with ``inplace``) over group ``g``. Note [One call or the
    general path]: with ``algorithm`` auto, an in-place call on a numpy array or a CPU
    tensor's view, or an out-of-place one on a small numpy array, tries the one C call
    first."""
    try:
        if algorithm == "auto":
            fast = g.resources.fast_allreduce  # one C call: csrc/small.c, csrc/exchange.c
            if fast is not None and inplace:
                # Note [Views of torch tensors]; the one call declines what it cannot take
                view = x if type(x) is np.ndarray else tensor_view(x)
                if view is not None and _one_call(g, view, op):
                    if view is not x:
                        bump_tensor_version(x)
                    return x
            elif fast is not None and type(x) is np.ndarray and \
                    x.nbytes <= g.resources.fast_max_bytes:
                y = np.array(x, order="C")  # a copy: the one call reduces it in place
                if _one_call(g, y, op):
                    return y
        return _allreduce(g, x, op, algorithm, inplace)
    except MismatchError as exc:
        _unless_joined(exc)
    return with_joined(g, x, op, algorithm, inplace)  # outside the handler: no chained error


# Note [One call or the general path]
# Which all-reduces take the one C call (Note [Small all-reduce in one call] in csrc/small.c)
# is decided here only: ``allreduce_in`` for arrays and tensors, ``allreduce_view_`` for a
# buffer view the torch.distributed backend made, ``allreduce_tensor_`` for the drop-in
# bindings; what the one call declines goes to the general path (``_allreduce``) directly,
# never to a second try. A MismatchError that says ranks have joined is retried once, with
# their zeros (``with_joined``), after ``_unless_joined`` let it by, outside the handler (an
# error of the retry is its own, not chained to the first): Note [Joined ranks] in
# mpidp/engine/header.py.

def allreduce_view_(g, view, op: str) -> None:
    """The in-place all-reduce over group ``g`` of ``view``, a writable C-contiguous buffer
    (mpidp.engine.host_ops.host_view's, over a CPU tensor) of a dtype ``op`` can reduce: the
    one C call where the group has it, else the general path (Note [One call or the general
    path]); raises on every rank when the ranks' inputs disagree. Every rank of ``g`` calls
    it."""
    try:
        if g.resources.fast_allreduce is None or not _one_call(g, view, op):
            _allreduce(g, np.asarray(view), op, "auto", True)
        return
    except MismatchError as exc:
        _unless_joined(exc)
    with_joined(g, np.asarray(view), op, "auto", True)


def _unless_joined(exc: MismatchError) -> None:
    """The joined ranks' rule, the one place: raises ``exc`` again unless its headers say
    ranks have joined (Note [Joined ranks] in mpidp/engine/header.py), when the caller's
    all-reduce is to run once more with their zeros. Called in the handler of ``exc``."""
    if header.for_joined(getattr(exc, "headers", ())) is None:
        raise exc


def with_joined(g, x, op: str, algorithm: str, inplace: bool):
    """The all-reduce of ``x`` once more, the ranks that joined adding zeros (Note [Joined
    ranks] in mpidp/engine/header.py): ``x`` viewed flat, a shape a joined rank can make."""
    shape = tuple(x.shape)
    if len(shape) == 1:
        return allreduce_in(g, x, op, algorithm, inplace)
    flat = x.reshape(-1)  # a view where x is contiguous, else a copy
    out = allreduce_in(g, flat, op, algorithm, inplace)
    if not inplace:
        return out.reshape(shape)
    if not (x.is_contiguous() if hasattr(x, "is_contiguous") else x.flags.c_contiguous):
        x[...] = flat.reshape(shape)
    return x


def allreduce_tensor_(g, x, op: str, stamp: int = 0) -> bool:
    """The in-place all-reduce of CPU torch tensor ``x`` over group ``g`` as one C call, its
    header carrying ``stamp`` (0: none; the caller's ``agreed`` block in
    mpidp/comm/agreement.py otherwise): the drop-in bindings' shortcut. True when done (where
    ranks have joined, once more with their zeros: Note [Joined ranks] in
    mpidp/engine/header.py); False when it declined, nothing done (another dtype or device,
    strided, too large, an average of integers: the caller takes its general path); raises
    on every rank when the ranks' inputs disagree. Every rank of ``g`` calls it."""
    if g.resources.fast_allreduce is None:
        return False
    view = tensor_view(x)
    if view is None:
        return False
    try:
        if not _one_call(g, view, op, stamp):
            return False
        bump_tensor_version(x)
        return True
    except MismatchError as exc:
        _unless_joined(exc)
    with g.resources.stamped(stamp or None):
        with_joined(g, x, op, "auto", True)
    return True


def _one_call(g, view, op: str, stamp: int = 0) -> bool:
    """The in-place all-reduce of ``view`` as one C call (csrc/small.c on one node,
    csrc/exchange.c across nodes), its header carrying ``stamp`` (0: none; Note [Described
    stamps] in mpidp/engine/header.py): True when done, False when it declined (nothing done);
    raises on every rank when the ranks' inputs disagree. A strided array goes through a
    contiguous copy, not the general path: only what every rank's header shows (dtype, op,
    size) may send a rank there (Note [Chunks after the record] in csrc/exchange.c)."""
    try:
        done = g.resources.fast_allreduce(view, op, stamp) if stamp else \
            g.resources.fast_allreduce(view, op)
    except BaseException:  # refused here, in C: it raised at once (the others: fast_disagreed)
        g.board.failed += 1
        raise
    if done is view:
        return True
    if done is not NotImplemented:  # the ranks disagreed: raise on every rank
        g.resources.fast_disagreed(done)
    if type(view) is not np.ndarray or view.flags.c_contiguous or not view.flags.writeable \
            or view.nbytes > g.resources.fast_max_bytes:
        return False
    tmp = np.ascontiguousarray(view)
    if not _one_call(g, tmp, op, stamp):
        return False
    view[...] = tmp
    return True


@timeline.traced("allreduce")
def _allreduce(g, x, op, algorithm, inplace):
    if is_device_array(x):
        return _device_allreduce(g, x, op, algorithm, inplace)
    with Frame(g, ALLREDUCE) as f:
        a = None
        try:
            a = as_host_array(x)
            opc, avg = op_codes(op, a.dtype)
            name = choose(HOST, algorithm, g.resources.facts, a.flat.nbytes).name
            if inplace:
                check_writable(a)
            src = a.flat
            out, dst = (a.original, src) if inplace else empty_like(a)
        except Exception as exc:
            f.refuse(exc, refusal(ALLREDUCE, exc, a, op))
            raise
        if g.size == 1:
            if dst is not src:
                dst[...] = src
        else:
            hdr = f.publish(header.header(ALLREDUCE, _HOST_CODES[name], op_word(opc, avg),
                                          a.dtype, len(src), a.shape))
            host_executor.allreduce(f.links(), name, hdr, src, dst, a.dtype, opc,
                                    g.size if avg else 1)
        if inplace:
            wrote(a)
        return out


def allreduce_segments_(g, flats: list, dtype: int, op: str) -> None:
    """mpidp-internal: all-reduces the contiguous, writable flat buffers ``flats`` (dtype code
    ``dtype``) in place as one concatenated buffer without packing them, with the shared-memory
    algorithm — where mpidp.engine.planner.plan_bucket said so (Note [Zero-copy buckets] in
    mpidp/comm/buckets.py). Its header is the one a packed buffer of the same count sends.
    ``g``: the group."""
    opc, avg = OP_CODES[op]
    count = sum(len(f) for f in flats)
    def run():
        with Frame(g, ALLREDUCE) as f, timeline.span("allreduce"):
            hdr = f.publish(header.header(ALLREDUCE, _HOST_CODES["shm"], op_word(opc, avg),
                                          dtype, count, (count,)))
            host_executor.allreduce_segments(f.links(), hdr, flats, dtype, opc,
                                             g.size if avg else 1)
    try:
        run()
        return
    except MismatchError as exc:
        _unless_joined(exc)
    run()


def _device_allreduce(g, x, op, algorithm, inplace):
    dev = gpu_executor
    try:
        a = dev.view(x)
        opc, avg = op_codes(op, a.dtype)
        row = choose(DEVICE, check_name(algorithm, DEVICE), facts(g, True), a.flat.nbytes)
        prepared = None if row.name == "staged" else dev.prepare(a, inplace)
    except Exception as exc:  # ImportError too: CuPy or NCCL missing on this rank
        refuse(g, ALLREDUCE, exc)
        raise
    if prepared is None:  # staged: the host all-reduce posts itself on the board
        return _staged(g, x, inplace, ALLREDUCE, lambda h: allreduce_in(g, h, op, "auto", True))
    with Frame(g, ALLREDUCE) as f:
        hdr = f.publish(header.header(ALLREDUCE, row.code, op_word(opc, avg), a.dtype,
                                      len(a.flat), a.shape))
        dev.allreduce(f.links(), row.name, hdr, a, prepared, opc, avg)
        if inplace:
            bump_version(a)
        return prepared[0]


def _staged(g, x, inplace: bool, kind: int, host_call):
    """Runs ``host_call`` on a host copy of device array ``x`` and returns its result on x's
    device (in place into ``x`` with ``inplace``): the path without NCCL, and the one of the
    collectives the GPU executor does not have. ``kind``: the collective, for a refusal."""
    try:
        a = gpu_executor.view(x)
        host = gpu_executor.to_host(a)
    except Exception as exc:
        refuse(g, kind, exc)
        raise
    out = gpu_executor.from_host(host_call(host), a, inplace)
    if inplace:
        bump_version(a)
    return out


# ---- the other collectives -------------------------------------------------------------------

def broadcast(x: Any, root: int = 0):
    """Returns a new array or tensor holding root's ``x`` on every rank; ``x`` is unchanged.
    Every rank passes an ``x`` of the same shape and dtype."""
    return broadcast_in(runtime.group(), x, root, False)


def broadcast_(x: Any, root: int = 0):
    """In-place ``broadcast``: every rank's ``x`` holds root's values afterwards."""
    return broadcast_in(runtime.group(), x, root, True)


@timeline.traced("broadcast")
def broadcast_in(g, x: Any, root: int = 0, inplace: bool = False):
    """``broadcast`` (``broadcast_`` with ``inplace``) over group ``g``."""
    if is_device_array(x):
        return _staged(g, x, inplace, BROADCAST, lambda h: broadcast_in(g, h, root, True))
    with Frame(g, BROADCAST) as f:
        a = None
        try:
            a = as_host_array(x)
            check_root(root, g.size)
            if inplace:
                check_writable(a)
            out, flat = (a.original, a.flat) if inplace else empty_like(a)
        except Exception as exc:
            f.refuse(exc, refusal(BROADCAST, exc, a, root=root))
            raise
        if not inplace:
            flat[...] = a.flat
        if g.size > 1:
            hdr = f.publish(header.header(BROADCAST, 0, int(root), a.dtype, len(a.flat),
                                          a.shape))
            host_executor.broadcast(f.links(), hdr, flat, int(root))
        if inplace:
            wrote(a)
        return out


def reduce_(x: Any, root: int = 0, op: str = "sum"):
    """Reduces ``x`` over every rank into root's ``x`` (MPI_Reduce, in place at root); the
    other ranks' ``x`` is unchanged. ``op``: sum, avg, min, max. Every rank must call it."""
    return reduce_in(runtime.group(), x, root, op)


@timeline.traced("reduce")
def reduce_in(g, x: Any, root: int = 0, op: str = "sum"):
    """``reduce_`` over group ``g``."""
    if is_device_array(x):
        return _staged(g, x, True, REDUCE, lambda h: reduce_in(g, h, root, op))
    with Frame(g, REDUCE) as f:
        a = None
        try:
            a = as_host_array(x)
            check_root(root, g.size)
            opc, avg = op_codes(op, a.dtype)
            if g.rank == root:
                check_writable(a)
        except Exception as exc:
            f.refuse(exc, refusal(REDUCE, exc, a, op))
            raise
        root = int(root)
        if g.size > 1:
            hdr = f.publish(header.header(REDUCE, _HOST_CODES["mpi"], op_word(opc, avg),
                                          a.dtype, len(a.flat), a.shape, free=root))
            host_executor.reduce(f.links(), hdr, a.flat, a.dtype, opc, g.size if avg else 1,
                                 root)
        if g.rank == root:
            wrote(a)
        return a.original


def allgather(x: Any):
    """Concatenates every rank's ``x`` along dimension 0, in rank order, into a new array or
    tensor. The first dimension may differ between ranks; the others and the dtype may not."""
    return allgather_in(runtime.group(), x)


@timeline.traced("allgather")
def allgather_in(g, x: Any):
    """``allgather`` over group ``g``."""
    if is_device_array(x):
        return _staged(g, x, False, ALLGATHER, lambda h: allgather_in(g, h))
    with Frame(g, ALLGATHER) as f:
        try:
            a = as_host_array(x)
            if len(a.shape) == 0:
                raise ValueError("allgather needs at least one dimension (it concatenates "
                                 "along 0)")
        except Exception as exc:
            f.refuse(exc)
            raise
        row = int(np.prod(a.shape[1:], dtype=np.int64))
        rows = [a.shape[0]]
        if g.size > 1:
            hdr = f.publish(header.header(ALLGATHER, 0, 0, a.dtype, row, a.shape[1:],
                                          free=a.shape[0]))
            links = f.links()
            rows = host_executor.allgather_rows(links, hdr)
        out, flat = empty_like(a, (sum(rows),) + tuple(a.shape[1:]))
        if g.size == 1:
            flat[...] = a.flat
        else:
            host_executor.allgather(links, a.flat, flat, rows, row)
        return out


def reduce_scatter(x: Any, op: str = "sum", algorithm: str = "auto"):
    """Reduces ``x`` over every rank and returns this rank's block along dimension 0, the
    blocks split as ``numpy.array_split`` splits. ``algorithm``: auto or ring (our ring's
    reduce-scatter phase) or mpi (MPI_Reduce_scatter). ``x`` is unchanged."""
    return reduce_scatter_in(runtime.group(), x, op, algorithm)


@timeline.traced("reduce_scatter")
def reduce_scatter_in(g, x: Any, op: str = "sum", algorithm: str = "auto"):
    """``reduce_scatter`` over group ``g``."""
    if is_device_array(x):
        return _staged(g, x, False, REDUCE_SCATTER,
                       lambda h: reduce_scatter_in(g, h, op, algorithm))
    with Frame(g, REDUCE_SCATTER) as f:
        try:
            a = as_host_array(x)
            if len(a.shape) == 0:
                raise ValueError("reduce_scatter needs at least one dimension (it splits "
                                 "along 0)")
            opc, avg = op_codes(op, a.dtype)
            if algorithm not in ("auto", "ring", "mpi"):
                raise ValueError(f"unknown reduce_scatter algorithm {algorithm!r}; accepted: "
                                 "auto, ring, mpi")
            row = int(np.prod(a.shape[1:], dtype=np.int64))
            out, flat = empty_like(a, (partition(a.shape[0], g.size)[g.rank][1],) + a.shape[1:])
        except Exception as exc:
            f.refuse(exc)
            raise
        name = "ring" if algorithm == "auto" else algorithm
        chunks = partition(len(a.flat), g.size, unit=max(row, 1)) if row else \
            tuple((0, 0) for _ in range(g.size))
        if g.size == 1:
            flat[...] = a.flat
            return out
        hdr = f.publish(header.header(REDUCE_SCATTER, _HOST_CODES[name], op_word(opc, avg),
                                      a.dtype, len(a.flat), a.shape))
        host_executor.reduce_scatter(f.links(), name, hdr, a.flat, flat, a.dtype, opc,
                                     g.size if avg else 1, chunks)
        return out

