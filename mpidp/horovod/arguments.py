"""The arguments of Horovod's operations: the op (Horovod's rule), the tensor, an average's
dtype, checked on each rank and refused on every rank (``checked``, ``refuse``: Note
[Agreement before refusal] in mpidp/comm/agreement.py), and an operation's name, checked
against every rank's (``named``: Note [Names])."""
from __future__ import annotations

import contextlib
from typing import Any, Optional

import torch

from ..comm import collectives
from ..comm.agreement import agreed
from ..engine import header
from ..engine.dtypes import BF16, F16, F32, F64, I32, I64
from ..engine.header import UNKNOWN
from ..runtime import timeline
from . import basics
from .basics import Adasum, Average, Max, Min, Sum
from .process_sets import group_of, on

# Note [Names]
# Horovod matches the operations of the ranks by name: a named operation submitted on one
# rank waits for the one of that name on the others, in whatever order they submit them.
# mpidp's operations run when they are called (Note [Pending operations] in
# mpidp/horovod/handles.py: an ``*_async`` one at the latest before the next), in the order
# called, so a named operation instead carries its name in its header (a described stamp:
# Note [Agreement before refusal] in mpidp/comm/agreement.py), and ranks that submit named
# operations in another order — ``a`` then ``b`` on one rank, ``b`` then ``a`` on another
# — raise a MismatchError on every rank naming each rank's name, where they would have
# added ``a`` to ``b``. Unnamed operations are matched by their order, as always. Both keep
# the one-call path where it takes the tensor (csrc/small.c, csrc/exchange.c): the stamp goes
# into that call's header (``allreduce_array``'s third argument), so a named ``allreduce_``
# of a small tensor costs a dictionary lookup more than an unnamed one, no exchange (the
# stamp of a name is made once: mpidp.comm.agreement.stamp_of); DistributedOptimizer's buckets carry
# their parameters' names their own way (Note [Gradients during backward] in backward.py).
# The backward pass of a named operation is not named (Horovod names it after the forward).

def resolve_op(op: Optional[int], average: Optional[bool]) -> int:
    """Horovod's rule: ``op`` defaults to Average; the deprecated ``average`` maps to Average
    or Sum and may not be given with ``op``. Adasum is refused (docs/horovod.md)."""
    if op is not None and average is not None:
        raise ValueError("op and average cannot both be given; average is deprecated, use op")
    if op is None:
        op = Sum if average is False else Average
    if op == Adasum:
        raise NotImplementedError("mpidp.horovod: op=hvd.Adasum is not supported; use "
                                  "hvd.Average (docs/horovod.md)")
    if op not in basics.OP_NAMES:
        raise ValueError(f"unknown op {op!r}; accepted: hvd.Average, hvd.Sum, hvd.Min, "
                         "hvd.Max, hvd.Product")
    return op


def check_tensor(tensor: Any, what: str) -> None:
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{what} needs a torch.Tensor, got {type(tensor).__name__}")


_DTYPE_CODES = {torch.float16: F16, torch.bfloat16: BF16, torch.float32: F32,
                torch.float64: F64, torch.int32: I32, torch.int64: I64}
_OP_WORDS = {Average: header.op_word(0, True), Sum: 0, Min: 1, Max: 2, Adasum: 8}


def op_word(op: Any, average: Any = None) -> int:
    """The header's op word of Horovod op ``op`` as given (UNKNOWN for one it has none of)."""
    if op is None:
        op = Sum if average is False else Average
    return _OP_WORDS.get(op, UNKNOWN) if type(op) is int else UNKNOWN


def refuse(exc: BaseException, process_set, kind: int, tensor: Any = None,
           op: int = UNKNOWN) -> None:
    """This rank refuses its call (``exc``) of collective ``kind`` on ``process_set``: it
    joins the header exchange with a refusal showing ``tensor``'s dtype and size and ``op``
    (its op word, or a broadcast's root), so every rank raises — ``exc`` here, which the
    caller raises, a MismatchError naming this rank and those values elsewhere (Note
    [Agreement before refusal] in mpidp/comm/agreement.py). A process set this rank cannot
    run on (not added, not a member) is this rank's error alone."""
    try:
        group_of(process_set)
    except (TypeError, ValueError):
        return
    dtype, count = UNKNOWN, UNKNOWN
    if isinstance(tensor, torch.Tensor):
        dtype, count = _DTYPE_CODES.get(tensor.dtype, UNKNOWN), tensor.numel()
    with on(process_set) as g:
        collectives.refuse(g, kind, exc, header.refusal(kind, exc, op, dtype, count))


def named(name: Any, process_set, what: str):
    """The block of operation ``what`` (Horovod's word: allreduce, grouped_allreduce, ...)
    named ``name`` (None: not named): its collectives carry the name, checked against every
    rank's (Note [Names]); while the timeline records, it is a span named as Horovod's
    timeline names it, ``<what>.<name>``."""
    if name is None:
        return _NOTHING
    return _named(str(name), process_set, what)


def name_text(name: Any) -> str:
    """What a name's stamp says (Note [Names])."""
    return f"name {str(name)!r}"


@contextlib.contextmanager
def _named(name: str, process_set, what: str):
    with on(process_set) as g, agreed(g, name_text(name)):
        if timeline.ON:
            with timeline.span(f"{what}.{name}"):
                yield
        else:
            yield


_NOTHING = contextlib.nullcontext()


def checked(tensor: Any, op: Any, average: Any, process_set, kind: int, what: str,
            ops: Optional[tuple] = None) -> int:
    """Horovod's op for reduction ``what`` of ``tensor`` (collective ``kind``), once the tensor
    and the op (one of ``ops`` where given) are checked; refused on every rank otherwise
    (``refuse``)."""
    asked = op_word(op, average)
    try:
        check_tensor(tensor, what)
        op = resolve_op(op, average)
        if ops is not None and op not in ops:
            raise ValueError(f"{what} takes " + ", ".join(f"hvd.{basics.op_name(o)}"
                                                          for o in ops) +
                             f", not hvd.{basics.op_name(op)}")
        return op
    except Exception as exc:
        refuse(exc, process_set, kind, tensor, asked)
        raise
