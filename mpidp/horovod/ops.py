"""Horovod's collectives on torch tensors (``horovod.torch``'s allreduce, allgather,
broadcast, reducescatter, their in-place, grouped and ``_async`` forms, ``poll`` and
``synchronize``), on mpidp's collectives: shapes, dtypes and ops that differ between ranks
raise on every rank (mpidp's header exchange), never hang; so do an argument refused on one
rank only (its own error there, a MismatchError naming it elsewhere) and names that differ
(Note [Agreement before refusal] in mpidp/comm/agreement.py; Note [Names] in
mpidp/horovod/arguments.py). Note [Pending operations] in mpidp/horovod/handles.py."""
from __future__ import annotations

import inspect

import torch

from .. import config, runtime
from ..runtime import timeline
from ..comm import agreement, collectives, fusion, joined
from ..ddp import sync_bn
from ..engine.header import ALLGATHER, ALLREDUCE, BROADCAST, REDUCE_SCATTER, UNKNOWN
from . import backward, handles, sparse
from .arguments import (check_tensor, checked, name_text, named, op_word, refuse,
                        resolve_op)
from .process_sets import group_of, local_root, on
from .basics import Average, Max, Min, Product, Sum
from .compression import Compression
from .integers import NARROW, as_reduced, narrowed, scaled as _scaled, widened

_MPIDP_OP = {Average: "avg", Sum: "sum", Min: "min", Max: "max"}
_PLAIN = {None: "avg", **_MPIDP_OP}  # allreduce_'s shortcut: ops with no rule to apply
_TENSOR = torch.Tensor
_PENDING = handles.pending_list()  # allreduce_'s shortcut only where none is pending
# allreduce_'s shortcut: the dtypes mpidp's collectives carry (Note [Horovod's integer
# scaling] in mpidp/horovod/integers.py: the others, and an integer Average, go round)
_FLOATS = frozenset((torch.float16, torch.bfloat16, torch.float32, torch.float64))
_CARRIED = _FLOATS | {torch.int32, torch.int64}
_NAME_STAMPS: dict = {}  # allreduce_'s shortcut: name -> the stamp of its text (Note [Names])


def _reduce_into(x: torch.Tensor, op: int) -> torch.Tensor:
    """Reduces ``x`` (a tensor this module owns, of a dtype mpidp carries; an integer
    Average already made a Sum) in place over every rank."""
    if op == Product:  # no product kernel: every rank multiplies all inputs in rank order
        every = collectives.allgather(x.reshape(1, -1))
        return x.copy_(torch.prod(every, dim=0).reshape(x.shape))
    collectives.allreduce_(x, _MPIDP_OP[op])
    return x


def reduced(tensor: torch.Tensor, op: int, prescale: float = 1.0,
            postscale: float = 1.0) -> torch.Tensor:
    """A new tensor: ``tensor`` times ``prescale``, reduced with ``op``, times ``postscale``,
    on the current group (Note [Horovod's integer scaling] in mpidp/horovod/integers.py)."""
    with torch.no_grad():
        op, postscale = as_reduced(tensor, op, postscale)
        x = _scaled(widened(tensor.detach()).clone(memory_format=torch.contiguous_format),
                    prescale)
        if x.dtype != tensor.dtype:  # a narrow dtype: prescaled, summed and postscaled in it
            x = widened(narrowed(x, tensor.dtype))
        return _scaled(narrowed(_reduce_into(x, op), tensor.dtype), postscale)


class _Allreduce(torch.autograd.Function):
    """Horovod's: the gradient is the all-reduce of the gradient, with the same op and
    factors."""

    @staticmethod
    def forward(ctx, tensor, op, prescale, postscale, process_set):
        ctx.args = (op, prescale, postscale, process_set)  # the set, not its group: Note
        with on(process_set):                              # [Process sets in autograd]
            return reduced(tensor, op, prescale, postscale)

    @staticmethod
    def backward(ctx, grad):
        return _Allreduce.apply(grad, *ctx.args), None, None, None, None


def allreduce(tensor, average=None, name=None, compression=Compression.none, op=None,
              prescale_factor=1.0, postscale_factor=1.0, process_set=None):
    """The reduction of ``tensor`` over every rank, a new tensor (``tensor`` unchanged);
    differentiable. ``name``: checked against every rank's (Note [Names] in
    mpidp/horovod/arguments.py)."""
    op = checked(tensor, op, average, process_set, ALLREDUCE, "allreduce")
    with named(name, process_set, "allreduce"):
        compressed, ctx = compression.compress(tensor)
        return compression.decompress(_Allreduce.apply(compressed, op, float(prescale_factor),
                                                       float(postscale_factor), process_set),
                                      ctx)


def allreduce_(tensor, average=None, name=None, op=None, prescale_factor=1.0,
               postscale_factor=1.0, process_set=None):
    """In place: ``tensor`` holds the reduction afterwards, and is returned."""
    if average is None and process_set is None and prescale_factor == 1.0 and \
            postscale_factor == 1.0 and type(tensor) is _TENSOR and not backward.active \
            and not _PENDING:
        plain = _PLAIN.get(op) if op is None or type(op) is int else None
        if plain is not None:  # the common call, straight to mpidp's
            if name is None:
                if collectives.allreduce_tensor_(runtime.group(), tensor, plain):
                    return tensor  # in one C call (it declines the dtypes it does not carry)
                if tensor.dtype in (_FLOATS if plain == "avg" else _CARRIED):
                    return collectives.allreduce_(tensor, plain)
            elif type(name) is str and not timeline.ON:  # the name in the header (Note [Names])
                stamp = _NAME_STAMPS.get(name)
                if stamp is None:
                    stamp = _NAME_STAMPS[name] = agreement.stamp_of(name_text(name))
                if agreement.allreduce_tensor_(runtime.group(), tensor, plain, stamp):
                    return tensor
    op = checked(tensor, op, average, process_set, ALLREDUCE, "allreduce_")
    with torch.no_grad(), on(process_set), named(name, process_set, "allreduce"):
        if tensor.is_contiguous() and op != Product and prescale_factor == 1.0 and \
                tensor.is_floating_point():
            return _scaled(_reduce_into(tensor, op), float(postscale_factor))
        return tensor.copy_(reduced(tensor, op, float(prescale_factor),
                                    float(postscale_factor)))


def grouped_allreduce(tensors, average=None, name=None, compression=Compression.none, op=None,
                      prescale_factor=1.0, postscale_factor=1.0, process_set=None):
    """``allreduce`` of each tensor, fused into a few buckets; new tensors."""
    return _grouped(tensors, False, average, op, prescale_factor, postscale_factor,
                    process_set, compression, name)


def grouped_allreduce_(tensors, average=None, name=None, op=None, prescale_factor=1.0,
                       postscale_factor=1.0, process_set=None):
    """In place, fused into a few buckets; returns the tensors."""
    return _grouped(tensors, True, average, op, prescale_factor, postscale_factor,
                    process_set, Compression.none, name)


def _grouped(tensors, in_place, average, op, prescale, postscale, process_set, compression,
             name=None):
    asked = op_word(op, average)
    try:
        op = resolve_op(op, average)
        tensors = list(tensors)
        for t in tensors:
            check_tensor(t, "grouped_allreduce")
    except Exception as exc:
        refuse(exc, process_set, ALLREDUCE, None, asked)
        raise
    with named(name, process_set, "grouped_allreduce"):
        if op == Product or any(t.dtype not in (_FLOATS if op == Average else _CARRIED)
                                or (t.requires_grad and not in_place) for t in tensors):
            outs = [allreduce(t, op=op, prescale_factor=prescale, postscale_factor=postscale,
                              compression=compression, process_set=process_set)
                    for t in tensors]
            return [t.copy_(o) for t, o in zip(tensors, outs)] if in_place else outs
        with on(process_set):
            return fused(tensors, in_place, op, float(prescale), float(postscale),
                         compression)


def fused(tensors: list, in_place: bool, op: int, prescale: float, postscale: float,
          compression) -> list:
    """``tensors`` (not requiring grad; ``op`` resolved, not Product) compressed, scaled,
    all-reduced in mpidp's fused buckets on the current group, scaled and decompressed: into
    new tensors, or back into ``tensors`` with ``in_place``."""
    with torch.no_grad():
        pairs = [compression.compress(t) for t in tensors]
        work = [c if in_place and c is t else c.detach().clone() for (c, _), t in
                zip(pairs, tensors)]
        for w in work:
            _scaled(w, prescale)
        fusion.grouped_allreduce_(work, _MPIDP_OP[op],
                                  bucket_cap_mb=config.get().horovod_fusion_bytes / 2**20)
        outs = [compression.decompress(_scaled(w, postscale), ctx)
                for w, (_, ctx) in zip(work, pairs)]
        if in_place:
            return [t if o is t else t.copy_(o) for t, o in zip(tensors, outs)]
        return outs


def _rows_of_every_rank(rows: int) -> list:
    return collectives.allgather(torch.tensor([rows], dtype=torch.int64)).tolist()


class _Allgather(torch.autograd.Function):
    """Horovod's: the gradient is this rank's rows of the averaged gradient."""

    @staticmethod
    def forward(ctx, tensor, process_set):
        ctx.rows, ctx.process_set = tensor.shape[0], process_set
        with on(process_set):
            return narrowed(collectives.allgather(widened(tensor.detach().contiguous())),
                            tensor.dtype)

    @staticmethod
    def backward(ctx, grad):
        with on(ctx.process_set) as g:
            total = reduced(grad, Average)
            start = sum(_rows_of_every_rank(ctx.rows)[:g.rank])
        return total.narrow(0, start, ctx.rows), None


def allgather(tensor, name=None, process_set=None):
    """Every rank's ``tensor`` concatenated along dimension 0 in rank order (first dimensions
    may differ); differentiable."""
    try:
        check_tensor(tensor, "allgather")
    except TypeError as exc:
        refuse(exc, process_set, ALLGATHER)
        raise
    with named(name, process_set, "allgather"):
        return _Allgather.apply(tensor, process_set)


def grouped_allgather(tensors, name=None, process_set=None):
    with named(name, process_set, "grouped_allgather"):
        return [allgather(t, process_set=process_set) for t in tensors]


class _Broadcast(torch.autograd.Function):
    """Horovod's: root's gradient is the average of every rank's, the others' zero."""

    @staticmethod
    def forward(ctx, tensor, root, process_set):
        ctx.root, ctx.process_set = root, process_set  # root: a rank of the set's group
        with on(process_set):
            return narrowed(collectives.broadcast(widened(tensor.detach().contiguous()), root),
                            tensor.dtype)

    @staticmethod
    def backward(ctx, grad):
        with on(ctx.process_set) as g:
            total = reduced(grad, Average)
        return (total if g.rank == ctx.root else total.zero_()), None, None


def broadcast(tensor, root_rank, name=None, process_set=None):
    """Root's ``tensor`` on every rank, a new tensor; differentiable. ``root_rank`` is a
    global rank, also with a process set (as in Horovod)."""
    root = _checked_root(tensor, root_rank, process_set, "broadcast")
    with named(name, process_set, "broadcast"):
        return _Broadcast.apply(tensor, root, process_set)


def _checked_root(tensor, root_rank, process_set, what: str) -> int:
    """``root_rank`` as a rank of ``process_set``'s group, once ``tensor`` and it are checked;
    refused on every rank otherwise (Note [Agreement before refusal])."""
    try:
        check_tensor(tensor, what)
        group_of(process_set)  # a set this rank cannot run on: its error alone
        return local_root(process_set, root_rank)
    except Exception as exc:
        refuse(exc, process_set, BROADCAST, tensor,
               root_rank if type(root_rank) is int else UNKNOWN)
        raise


def broadcast_(tensor, root_rank, name=None, process_set=None):
    """In place: every rank's ``tensor`` holds root's values, and is returned."""
    root = _checked_root(tensor, root_rank, process_set, "broadcast_")
    with torch.no_grad(), on(process_set), named(name, process_set, "broadcast"):
        if tensor.is_contiguous() and tensor.dtype not in NARROW:
            return collectives.broadcast_(tensor, root)
        return tensor.copy_(collectives.broadcast(widened(tensor.contiguous()), root))


def barrier(process_set=None) -> None:
    """Returns once every rank (of ``process_set``) has called it; operations pending stay
    pending, as Horovod's barrier does not wait for those in flight (Note [Pending
    operations] in mpidp/horovod/handles.py)."""
    with on(process_set, pending=False):
        collectives.allreduce_(torch.zeros(1, dtype=torch.int32), "sum")


class SyncBatchNorm(sync_bn.SyncBatchNorm):
    """Horovod's SyncBatchNorm: mpidp's (the global batch's statistics, Note [Synchronised
    batch statistics] in mpidp/ddp/sync_bn.py), its all-reduces made as hvd's own are, in
    their place after the gradient buckets in flight."""

    @staticmethod
    def reduce(t: torch.Tensor) -> None:
        with on(None):
            collectives.allreduce_(t, "sum")


def join(device: int = -1) -> int:
    """Horovod's: this rank is out of data; until every rank has called ``join`` it adds
    zeros to the all-reduces the others make (gradients of DistributedOptimizer too; an
    average stays over every rank), on CUDA device ``device`` where theirs run on a GPU (-1:
    the current one). Other collectives raise on the ranks that call them meanwhile. Returns
    the rank that joined last (Note [Joined ranks] in mpidp/engine/header.py)."""
    if not isinstance(device, int) or isinstance(device, bool) or device < -1:
        raise ValueError(f"join takes a CUDA device index, or -1, got {device!r}")
    with on(None) as g:
        return joined.join(g, None if device < 0 else device)


def _async(fn, name: str):
    """``fn``'s ``*_async`` form: the operation held pending, its handle returned (Note
    [Pending operations] in mpidp/horovod/handles.py)."""
    signature = inspect.signature(fn)

    def run(*args, **kwargs):
        called = signature.bind(*args, **kwargs).arguments.get("name")
        return handles.submit(lambda: fn(*args, **kwargs), called)
    run.__name__ = run.__qualname__ = name
    run.__doc__ = f"``{fn.__name__}``, held pending; its handle returned (Note [Pending operations])."
    return run


allreduce_async = _async(allreduce, "allreduce_async")
allreduce_async_ = _async(allreduce_, "allreduce_async_")
grouped_allreduce_async = _async(grouped_allreduce, "grouped_allreduce_async")
grouped_allreduce_async_ = _async(grouped_allreduce_, "grouped_allreduce_async_")
allgather_async = _async(allgather, "allgather_async")
grouped_allgather_async = _async(grouped_allgather, "grouped_allgather_async")
broadcast_async = _async(broadcast, "broadcast_async")
broadcast_async_ = _async(broadcast_, "broadcast_async_")


def sparse_allreduce_async(tensor, name, op, process_set=None):
    """Horovod's reduction of a sparse ``tensor``: its indices and values gathered from
    every rank (named ``<name>.indices``, ``<name>.values``), the values divided by the
    set's size for Average (Note [Sparse gradients] in mpidp/horovod/sparse.py); returns a
    function that returns the sparse result."""
    indices, values = sparse.parts(tensor)
    indices = allgather(indices, name=f"{name}.indices", process_set=process_set)
    values = allgather(values, name=f"{name}.values", process_set=process_set)
    size = group_of(process_set).size
    return lambda: sparse.result(tensor, indices, values, op, size)


poll, synchronize = handles.poll, handles.synchronize
