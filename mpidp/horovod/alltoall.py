"""Horovod's ``alltoall``: rank r's block j of the tensor (rows ``splits[j]`` of dimension 0,
equal blocks without splits) becomes block r of rank j's result, on the torch.distributed
backend's all-to-all (mpidp.dist.ops: split sizes agreed or a MismatchError on every rank).
With ``splits`` it also returns the rows received from each rank, as Horovod does; the
gradient goes back the way the rows came."""
from __future__ import annotations

import torch

from .. import runtime
from ..comm import collectives
from ..dist import ops as dist_ops
from .ops import check_tensor, done_handle
from .process_sets import on


def _received(g, splits: list) -> list:
    """Rows each rank of ``g`` sends this one: column ``g.rank`` of every rank's splits."""
    every = collectives.allgather(torch.tensor([splits], dtype=torch.int64))
    return every[:, g.rank].tolist()


def _exchange(tensor: torch.Tensor, splits, g) -> tuple:
    rows = tensor.shape[0] if tensor.dim() else 1
    if splits is None:
        if rows % g.size:
            raise ValueError(f"alltoall: the tensor's {rows} rows do not split evenly among "
                             f"{g.size} ranks; pass splits")
        splits = [rows // g.size] * g.size
    else:
        splits = [int(k) for k in (splits.tolist() if isinstance(splits, torch.Tensor)
                                   else splits)]
        if len(splits) != g.size or min(splits) < 0 or sum(splits) != rows:
            raise ValueError(f"alltoall: splits {splits} do not split the tensor's {rows} rows "
                             f"among {g.size} ranks")
    received = _received(g, splits)
    x = tensor.detach().contiguous()
    out = x.new_empty((sum(received), *x.shape[1:]))
    dist_ops.all_to_all_single(g, out, x, received, splits)
    return out, received


class _Alltoall(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, splits, g):
        with runtime.using(g):
            out, received = _exchange(tensor, splits, g)
        ctx.g, ctx.received = g, received
        counts = torch.tensor(received, dtype=torch.int32)
        ctx.mark_non_differentiable(counts)
        return out, counts

    @staticmethod
    def backward(ctx, grad, _):
        with runtime.using(ctx.g):
            back, _ = _exchange(grad, ctx.received, ctx.g)
        return back, None, None


def alltoall(tensor, splits=None, name=None, process_set=None):
    """The blocks every rank sent this one, in rank order (and, with ``splits``, a tensor of
    the rows received from each rank); differentiable."""
    check_tensor(tensor, "alltoall")
    with on(process_set) as g:
        out, received = _Alltoall.apply(tensor, splits, g)
    return out if splits is None else (out, received)


def alltoall_async(tensor, splits=None, name=None, process_set=None) -> int:
    """``alltoall``, its handle returned; ``synchronize`` gives (tensor, received splits), as
    Horovod's does."""
    check_tensor(tensor, "alltoall")
    with on(process_set) as g:
        return done_handle(_Alltoall.apply(tensor, splits, g))
