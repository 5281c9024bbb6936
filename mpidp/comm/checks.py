"""The checks of a collective's input at the public boundary, the header that refuses a bad
one on every rank (Note [The collective frame] in mpidp/runtime/frame.py), and the
bookkeeping after an in-place result: what mpidp.comm.collectives and the bindings above it
share."""
from __future__ import annotations

from typing import Any, Optional

import numpy as np

from ..engine import header
from ..runtime.frame import Frame
from ..engine.gpu import executor as gpu_executor  # imports no CuPy until a device array arrives
from ..algorithms import DEVICE, HOST, check_name
from ..engine.dtypes import FLOATING, OP_CODES, OPS, write_back
from ..engine.header import op_word
from .tensor_views import bump_version as bump_tensor_version


def op_codes(op: Any, dtype: int) -> tuple:
    """(op code, average) of op name ``op`` for dtype code ``dtype``; ValueError naming the
    accepted ops, or for an average of integers."""
    codes = OP_CODES.get(op) if isinstance(op, str) else None
    if codes is None:
        raise ValueError(f"unknown op {op!r}; accepted: {', '.join(OPS)}")
    if codes[1] and dtype not in FLOATING:
        raise ValueError("op 'avg' needs a floating dtype (float16, bfloat16, float32, "
                         "float64); use 'sum' for integers and divide as you need")
    return codes


def check_root(root: Any, size: int) -> None:
    """ValueError unless ``root`` is a rank of a group of ``size``."""
    if not isinstance(root, (int, np.integer)) or isinstance(root, bool) or not 0 <= root < size:
        raise ValueError(f"root {root!r} is not a rank of this group (0..{size - 1})")


def check_algorithm(algorithm: Any, on_device: bool) -> str:
    """``algorithm`` if it names an all-reduce algorithm for host (or device) arrays, else
    ValueError listing the accepted names."""
    return check_name(algorithm, DEVICE if on_device else HOST)


def facts(g, on_device: bool):
    """What the algorithm choices read for group ``g`` (mpidp.algorithms.Facts), with the
    device's facts for device arrays."""
    return gpu_executor.facts(g.resources.links, g.resources.facts) if on_device else \
        g.resources.facts


def check_writable(a) -> None:
    """ValueError for an in-place call on an array the result cannot be written into."""
    original = a.original
    if isinstance(original, np.ndarray) and not original.flags.writeable:
        raise ValueError("x is read-only (numpy flag writeable=False); an in-place collective "
                         "writes its result into x: pass a writable array or use the "
                         "out-of-place call")


def wrote(a) -> None:
    """The result is in host array ``a``'s flat view: copied back into a non-contiguous
    original, and counted (``bump_version``)."""
    write_back(a)
    bump_version(a)


def bump_version(a) -> None:
    """An in-place call on a torch tensor (host or device) counts as torch's in-place ops
    count: autograd then refuses a tensor it saved for backward instead of computing wrong
    gradients."""
    if a.is_torch:
        bump_tensor_version(a.original)


def refusal(kind: int, exc: BaseException, a=None, op: Any = None, root: Any = None) -> tuple:
    """The header refusing ``exc`` for collective ``kind`` that shows what this rank was called
    with, as far as it knows: host array ``a``'s dtype and count, op name ``op`` or ``root``
    (Note [Agreement before refusal] in mpidp/comm/agreement.py)."""
    word = header.UNKNOWN
    if isinstance(op, str) and op in OP_CODES:
        word = op_word(*OP_CODES[op])
    elif isinstance(root, (int, np.integer)) and not isinstance(root, bool):
        word = int(root)
    return header.refusal(kind, exc, word, header.UNKNOWN if a is None else a.dtype,
                          header.UNKNOWN if a is None else len(a.flat))


def refuse(g, kind: int, exc: BaseException, hdr: Optional[tuple] = None) -> None:
    """This rank's input to collective ``kind`` is bad (``exc``): the collective's frame
    refuses it (Note [The collective frame] in mpidp/runtime/frame.py) with header ``hdr``
    (header.refusal, naming the values this rank was called with: Note [Agreement before
    refusal] in mpidp/comm/agreement.py; None: the plain error header), which raises on every
    rank (``exc`` here, a MismatchError elsewhere). Alone, returns (the caller raises)."""
    with Frame(g, kind) as f:
        f.refuse(exc, hdr)


def agree_on_nothing(g, kind: int) -> None:
    """Exchanges the header of a ``kind`` collective of no elements on ``g`` (a group of no
    tensors whose layout must still meet the others': Note [A group's layout] in
    mpidp/comm/fusion.py); raises on every rank where the others called something else.
    Collective."""
    with Frame(g, kind) as f:
        f.check(header.header(kind, 0, 0, 0, 0, ()))
