"""The check every collective starts with: each rank publishes a fixed-size header (which
collective, algorithm, op, dtype, count, shape, local error), every rank sees every header,
and a disagreement is reported on every rank instead of corrupting data or hanging.

On one node the headers travel through the shared-memory control block (and the shm
all-reduce carries its data in the same call); across nodes in one MPI_Allgather of 64 bytes."""
from __future__ import annotations

from typing import Optional, Sequence

import numpy as np

from .dtypes import DTYPE_NAMES, OPS
from .errors import MismatchError

ALLREDUCE, BROADCAST, ALLGATHER, REDUCE_SCATTER, REDUCE = 1, 2, 3, 4, 5
KIND_NAMES = {ALLREDUCE: "allreduce", BROADCAST: "broadcast", ALLGATHER: "allgather",
              REDUCE_SCATTER: "reduce_scatter", REDUCE: "reduce"}
ALGORITHM_CODES = {"mpi": 1, "ring": 2, "shm": 3, "hier": 4, "ring on GPU": 5, "nccl": 6}
_ALGORITHM_NAMES = {v: k for k, v in ALGORITHM_CODES.items()}

# local error codes carried in header word 6
ERR_NONE, ERR_TYPE, ERR_VALUE = 0, 1, 2
FREE_WORD = 7  # not compared: a value that may differ per rank (allgather's first dimension)


def header(kind: int, algorithm: int, op: int, dtype: int, count: int, shape: tuple,
           error: int = ERR_NONE, free: int = 0) -> tuple:
    """The 8 words a rank publishes; words 0-6 must agree on every rank."""
    return (kind, algorithm, op, dtype, count, hash(shape), error, free)


def error_header(kind: int, exc: BaseException) -> tuple:
    return (kind, 0, 0, 0, 0, 0, ERR_TYPE if isinstance(exc, TypeError) else ERR_VALUE, 0)


def _describe(h: Sequence[int], op_names: Sequence[str]) -> str:
    kind, algorithm, op, dtype, count, _, error, _ = h
    name = KIND_NAMES.get(kind, f"collective #{kind}")
    if error:
        return f"{name} with an input it rejected"
    what = f"{name} {DTYPE_NAMES[dtype]}[{count}]" if 0 <= dtype < len(DTYPE_NAMES) else name
    if kind == BROADCAST:
        what += f" root={op}"
    elif 0 <= op < len(op_names):
        what += f" op={op_names[op]}"
    if algorithm in _ALGORITHM_NAMES:
        what += f" algorithm={_ALGORITHM_NAMES[algorithm]}"
    return what


def mismatch_error(operation: str, headers: Sequence[Sequence[int]], mine: int) -> MismatchError:
    """A MismatchError listing what every rank called, marking those that differ from rank 0."""
    ref = tuple(headers[0][:FREE_WORD])
    lines = []
    for r, h in enumerate(headers):
        text = _describe(h, OPS)
        if tuple(h[:FREE_WORD]) != ref:
            text += "  <- differs from rank 0"
            if h[4] == ref[4] and h[5] != ref[5] and h[3] == ref[3]:
                text += " (same count, different shape)"
        lines.append(f"  rank {r}: {text}")
    return MismatchError(f"rank {mine}: {operation}: ranks called it with inputs that do not "
                         "agree; every rank raises this error:\n" + "\n".join(lines))


def check(operation: str, status_ok: bool, headers: Optional[Sequence], rank: int,
          local_error: Optional[BaseException]) -> None:
    """Raises on every rank after an exchange: the rank's own input error if it has one, else
    a MismatchError when the headers disagree."""
    if local_error is not None:
        raise local_error
    if not status_ok:
        raise mismatch_error(operation, headers, rank)


def exchange_mpi(comm, hdr: tuple, operation: str, local_error) -> np.ndarray:
    """Exchanges headers with MPI_Allgather; returns every rank's free word or raises."""
    mine = np.array(hdr, dtype=np.int64)
    table = np.empty((comm.Get_size(), len(hdr)), dtype=np.int64)
    comm.Allgather(mine, table)
    agree = bool((table[:, :FREE_WORD] == mine[:FREE_WORD]).all())
    check(operation, agree, table.tolist(), comm.Get_rank(), local_error)
    return table[:, FREE_WORD]


def exchange(g, hdr: tuple, operation: str, local_error=None):
    """Exchanges headers on group ``g`` (shared memory on one node, else MPI); returns every
    rank's free word or raises on every rank."""
    if g.single_node:
        from .shm import SHM_OK
        status, info = g.shm().exchange(hdr, operation)
        check(operation, status == SHM_OK, info, g.rank, local_error)
        return info
    return exchange_mpi(g.comm, hdr, operation, local_error)
