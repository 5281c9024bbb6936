"""Horovod's ``alltoall``: rank r's block j of the tensor (rows ``splits[j]`` of dimension 0,
equal blocks without splits) becomes block r of rank j's result, on mpidp.comm's all-to-all
(mpidp.comm.operations.alltoallv: split sizes agreed or a MismatchError on every rank).
With ``splits`` it also returns the rows received from each rank, as Horovod does; the
gradient goes back the way the rows came."""
from __future__ import annotations

import math

import torch

from ..comm import collectives, operations
from ..comm.tensor_views import tensor_bytes
from ..engine import header
from ..engine.header import ALLGATHER
from .arguments import check_tensor, named, refuse
from . import handles
from .process_sets import on


header.other_header("alltoall")  # any rank can name it where another called something else


def _received(g, splits: list) -> list:
    """Rows each rank of ``g`` sends this one: column ``g.rank`` of every rank's splits."""
    every = collectives.allgather(torch.tensor([splits], dtype=torch.int64))
    return every[:, g.rank].tolist()


def _splits(tensor: torch.Tensor, splits, size: int) -> list:
    """The rows this rank sends each rank: ``splits``, checked, or equal blocks."""
    rows = tensor.shape[0] if tensor.dim() else 1
    if splits is None:
        if rows % size:
            raise ValueError(f"alltoall: the tensor's {rows} rows do not split evenly among "
                             f"{size} ranks; pass splits")
        return [rows // size] * size
    splits = [int(k) for k in (splits.tolist() if isinstance(splits, torch.Tensor) else splits)]
    if len(splits) != size or min(splits) < 0 or sum(splits) != rows:
        raise ValueError(f"alltoall: splits {splits} do not split the tensor's {rows} rows "
                         f"among {size} ranks")
    return splits


def _exchange(tensor: torch.Tensor, splits, g) -> tuple:
    try:
        splits = _splits(tensor, splits, g.size)
    except Exception as exc:  # refused on every rank: the others wait in _received's gather
        collectives.refuse(g, ALLGATHER, exc)
        raise
    received = _received(g, splits)
    x = tensor.detach().to("cpu").contiguous()
    out = x.new_empty((sum(received), *x.shape[1:]))
    row = math.prod(x.shape[1:]) * x.element_size()  # bytes of a row
    operations.alltoallv(g, "alltoall", tensor_bytes(x), [k * row for k in splits],
                         tensor_bytes(out), [k * row for k in received],
                         dtype_word=header.other_dtype(str(x.dtype).removeprefix("torch.")))
    return out.to(tensor.device), received


class _Alltoall(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, splits, process_set):
        with on(process_set) as g:
            out, received = _exchange(tensor, splits, g)
        ctx.process_set, ctx.received = process_set, received
        counts = torch.tensor(received, dtype=torch.int32)
        ctx.mark_non_differentiable(counts)
        return out, counts

    @staticmethod
    def backward(ctx, grad, _):
        with on(ctx.process_set) as g:
            back, _ = _exchange(grad, ctx.received, g)
        return back, None, None


def alltoall(tensor, splits=None, name=None, process_set=None):
    """The blocks every rank sent this one, in rank order (and, with ``splits``, a tensor of
    the rows received from each rank); differentiable. ``name``: checked against every
    rank's (Note [Names] in mpidp/horovod/arguments.py)."""
    _check(tensor, process_set)
    with named(name, process_set, "alltoall"):
        out, received = _Alltoall.apply(tensor, splits, process_set)
    return out if splits is None else (out, received)


def _check(tensor, process_set) -> None:
    try:
        check_tensor(tensor, "alltoall")
    except TypeError as exc:  # refused on every rank (Note [Agreement before refusal])
        refuse(exc, process_set, ALLGATHER)
        raise


def alltoall_async(tensor, splits=None, name=None, process_set=None) -> int:
    """``alltoall``, held pending, its handle returned (Note [Pending operations] in
    mpidp/horovod/handles.py); ``synchronize`` gives (tensor, received splits), as Horovod's
    does."""
    def run():
        _check(tensor, process_set)
        with named(name, process_set, "alltoall"):
            return _Alltoall.apply(tensor, splits, process_set)
    return handles.submit(run, name)
