"""The frame of operations beyond mpidp's own collectives (Note [Operations beyond mpidp's
collectives] in mpidp/backend/ops.py): a header naming the operation exchanged first, then
MPI's own call on the bytes (mpidp.runtime.mpi); and the all-to-all(v) of bytes with its
split sizes agreed, which the torch.distributed backend and Horovod's ``alltoall`` share."""
from __future__ import annotations

import contextlib
from typing import Callable, Optional

import numpy as np

from ..engine import header
from ..errors import MismatchError
from ..runtime import mpi
from ..runtime.frame import Frame


@contextlib.contextmanager
def operation(g, name: str, count: int = 0, root=None, dtype_word: int = 0,
              validate: Optional[Callable[[], None]] = None):
    """The body of operation ``name`` as the group's next collective under the watchdog,
    after the header check (Note [The collective frame] in mpidp/runtime/frame.py): its
    header carries ``root`` (None: none), ``dtype_word`` (header.OTHER_DTYPES' index + 1, 0:
    unknown) and ``count`` elements. ``validate()`` runs first, and an exception it raises is
    raised on this rank, a MismatchError on the others. Every rank of ``g`` enters it."""
    with Frame(g, header.OTHER, name) as f:
        try:
            if validate is not None:
                validate()
            op = 0 if root is None else int(root) + 1
        except Exception as exc:  # shown with what it was called with, as far as known
            f.refuse(exc, header.other_header(name, _root_word(root), dtype_word, count,
                                              header.error_code(exc)))
            raise
        f.check(header.other_header(name, op, dtype_word, count))
        yield


def _root_word(root) -> int:
    """An OTHER header's op word for ``root`` (1 + root; 0 for none or not an integer)."""
    return int(root) + 1 if isinstance(root, int) and not isinstance(root, bool) and \
        root >= 0 else 0


def alltoallv(g, name: str, send: np.ndarray, send_counts: list, recv: np.ndarray,
              recv_counts: list, count: int = 0, dtype_word: int = 0) -> None:
    """All-to-all of bytes over group ``g`` as operation ``name`` (``operation``):
    ``send_counts[j]`` bytes of ``send`` (back to back) go to rank j, ``recv_counts[j]`` come
    from rank j into ``recv`` (back to back). What each rank sends each other is first
    checked against what that one expects: a disagreement raises a MismatchError on every
    rank, naming the pairs. ``send`` and ``recv``: uint8 arrays; ``count`` and
    ``dtype_word``: the header's. Every rank of ``g`` calls it."""
    with operation(g, name, count, None, dtype_word):
        alltoallv_agreed(g, name, send, send_counts, recv, recv_counts)


def alltoallv_agreed(g, name: str, send: np.ndarray, send_counts: list, recv: np.ndarray,
                     recv_counts: list) -> None:
    """``alltoallv``'s exchange inside a frame of the caller's."""
    sent = np.array(send_counts, np.int64)
    announced = np.empty_like(sent)
    if g.size > 1:
        mpi.alltoall_bytes(g.comm, sent, announced)
    else:
        announced[...] = sent
    wrong = [f"rank {j} sends {int(a)} bytes, rank {g.rank} expects {r}"
             for j, (a, r) in enumerate(zip(announced, recv_counts)) if a != r]
    if sum(recv_counts) > recv.nbytes or sum(send_counts) > send.nbytes:
        wrong.append(f"rank {g.rank}'s buffers are smaller than its split sizes")
    count = np.array([len(wrong)], np.int64)
    if g.size > 1:
        mpi.allreduce_sum_(g.comm, count)
    if count[0]:
        raise MismatchError(f"rank {g.rank}: {name}: the ranks' split sizes do not "
                            "agree" + (": " + "; ".join(wrong) if wrong else
                                       " (between other ranks); every rank raises this error"))
    mpi.alltoallv_bytes(g.comm, send, list(send_counts), recv, list(recv_counts))
