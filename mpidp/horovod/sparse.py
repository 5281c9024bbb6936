"""Horovod's reduction of a sparse gradient: every rank's indices and values gathered, and the
result put back into the gradient in the form Horovod leaves it (Note [Sparse gradients])."""
from __future__ import annotations

from typing import Callable

import torch

from .basics import Average

# Note [Sparse gradients]
# Horovod reduces a sparse tensor (an nn.Embedding(sparse=True)'s gradient) without making it
# dense: the indices (transposed, so that the rows of every rank concatenate) and the values
# are gathered from every rank, and the sparse tensor of all of them, uncoalesced, is the sum
# (indices repeated across ranks add up when it is coalesced); Average divides the values by
# the set's size. Every op but Average is that sum, Min and Max too, and
# gradient_predivide_factor and compression are not applied: Horovod's sparse path takes the
# op only. Ranks may hold different numbers of nonzero rows: the gathers take any count.
# DistributedOptimizer (mpidp/horovod/optimizer.py) does this for a sparse gradient without
# sparse_as_dense, in its bucket's place in the order (Note [Gradients during backward]), not
# in the bucket's fused buffer; with sparse_as_dense the gradient is made dense, all-reduced
# in its bucket, and made sparse again (dense.to_sparse(): every nonzero element, sparse in
# every dimension), as Horovod does before the update. Either way the result goes into the
# gradient itself (zeroed, then the result added: Horovod's way, since a sparse tensor has no
# set_), so ``p.grad`` stays the tensor it was and stays sparse, as torch.optim.SparseAdam
# needs. Which parameters of a bucket are gathered is in the bucket's stamp
# (mpidp.horovod.backward.tag): where it differs between ranks — a gradient sparse on one
# rank and dense or absent (zeros) on another — every rank raises at the bucket's first
# collective, naming both, where Horovod's ranks wait for an all-reduce and two all-gathers
# (of other names) that never meet; sparse_as_dense=True makes them agree. Alone (size 1)
# Horovod reduces nothing, and the optimizer leaves a sparse gradient as it is.


def parts(tensor: torch.Tensor) -> tuple:
    """The rows to gather of sparse ``tensor``: (indices, one row per nonzero, int64;
    values)."""
    return tensor._indices().transpose(0, 1).contiguous(), tensor._values()


def result(tensor: torch.Tensor, indices: torch.Tensor, values: torch.Tensor, op: int,
           size: int) -> torch.Tensor:
    """The sparse reduction of ``tensor`` from every rank's gathered ``indices`` and
    ``values`` (``parts``), over a set of ``size`` ranks (Note [Sparse gradients])."""
    if op == Average:
        values = values / size
    return tensor.new(indices.transpose(0, 1), values, tensor.size())


def gathered(grad: torch.Tensor, op: int, size: int,
             allgather: Callable[[torch.Tensor], torch.Tensor]) -> None:
    """Sparse ``grad`` replaced, in place, by its reduction over the ``size`` ranks that call
    ``allgather`` (a collective: every rank of the set, the indices first)."""
    indices, values = parts(grad)
    indices = allgather(indices)
    install(grad, result(grad, indices, allgather(values), op, size))


def install(grad: torch.Tensor, reduced: torch.Tensor) -> None:
    """Sparse ``grad`` made ``reduced`` (sparse, or dense: then made sparse) in place."""
    grad.zero_().add_(reduced if reduced.is_sparse else reduced.to_sparse())
