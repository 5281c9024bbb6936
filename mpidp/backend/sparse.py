"""The sparse all-reduce of the torch.distributed backend: ``dist.all_reduce`` of a sparse COO
tensor, summed as gloo sums it — every rank's indices and values gathered in rank order, the
sum coalesced, the same bits on every rank; ``t`` holds it afterwards (its number of stored
elements changes). SUM only, as gloo; any device (staged through the host). A rank whose
tensor is another shape, sparse/dense split or dtype raises with the others, naming them."""
from __future__ import annotations

import numpy as np
import torch

from ..engine import header
from ..errors import MismatchError
from ..runtime import mpi
from .ops import _NAMES, RED, _bytes, _reduction, operation, reduce_name

NAME = "all_reduce sparse"
_DIMS = 16  # a description holds up to this many sizes
_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.complex64,
           torch.complex128, torch.int8, torch.uint8, torch.int16, torch.int32, torch.int64,
           torch.bool)
for _op in (*_NAMES.values(), "unsupported"):  # every rank can name what another called
    header.other_header(f"{NAME} {_op}")


def all_reduce(g, t: torch.Tensor, op) -> None:
    """torch.distributed.all_reduce of sparse COO tensor ``t`` with ReduceOp ``op`` (SUM)."""
    kind, name = _reduction(op)

    def validate():
        reduce_name(op)
        if kind != RED.SUM:
            raise ValueError(f"all_reduce of a sparse tensor: the mpidp backend sums sparse "
                             f"tensors (SUM, as gloo), it has no sparse {name}")
        if t.layout is not torch.sparse_coo:
            raise TypeError(f"all_reduce: {t.layout} tensors are not supported by the mpidp "
                            "backend; sparse COO tensors are (SUM), and dense ones")
        if t.dim() > _DIMS or t.dtype not in _DTYPES:
            raise TypeError(f"all_reduce of a sparse tensor: {t.dim()} dimensions of "
                            f"{t.dtype}; the mpidp backend takes up to {_DIMS} of "
                            + ", ".join(str(d) for d in _DTYPES))

    with operation(g, f"{NAME} {name}", None, t.numel(), validate=validate):
        c = t.detach().to("cpu").coalesce()
        mine = np.zeros(4 + _DIMS, np.int64)
        mine[:4] = (c._nnz(), c.sparse_dim(), _DTYPES.index(c.dtype), c.dim())
        mine[4:4 + c.dim()] = c.shape
        every = np.empty((g.size, mine.size), np.int64)
        mpi.allgather_bytes(g.comm, mine, every)
        differ = [r for r in range(g.size) if not np.array_equal(every[r, 1:], mine[1:])]
        if any(not np.array_equal(every[r, 1:], every[0, 1:]) for r in range(g.size)):
            raise MismatchError(f"{NAME}: rank {g.rank}'s tensor is sparse {tuple(c.shape)} "
                                f"of {c.dtype} with {c.sparse_dim()} sparse dimensions; "
                                f"ranks {differ} hold another shape, dtype or split")
        counts = every[:, 0]
        total = int(counts.sum())
        indices = torch.empty((total, c.sparse_dim()), dtype=torch.int64)
        values = torch.empty((total,) + tuple(c.shape[c.sparse_dim():]), dtype=c.dtype)
        for part, whole in ((c.indices().t().contiguous(), indices),
                            (c.values().contiguous(), values)):
            row = whole[0].numel() * whole.element_size() if total else 0
            mpi.allgatherv_bytes(g.comm, _bytes(part), _bytes(whole), counts * row,
                                 np.concatenate(([0], np.cumsum(counts)[:-1])) * row)
        summed = torch.sparse_coo_tensor(indices.t(), values, c.shape,
                                         check_invariants=False).coalesce()  # valid parts
        with torch.no_grad():
            t.copy_(summed.to(t.device))

