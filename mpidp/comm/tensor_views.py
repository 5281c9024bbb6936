"""A CPU torch tensor as the buffer the one-call all-reduce takes (Note [Views of torch
tensors]), the struct format such a view carries, and the version bump after writing
through it. Imports no torch: a tensor here means torch is imported already."""
from __future__ import annotations

import struct
import sys
from typing import Any, Optional

import numpy as np

from ..engine import host_ops

# Note [Views of torch tensors]
# The one-call all-reduce (csrc/small.c) takes any writable C-contiguous buffer. A tensor's
# `.numpy()` costs 0.67 us on this machine and makes its storage unresizable for good; a host
# view (Note [Host views] in csrc/view.c, which the torch.distributed backend uses too) is made
# from the tensor's address, format and shape and touches nothing of the tensor's. The
# questions that decide whether a tensor can have one (type, layout, device, dtype, contiguity)
# and the view itself are one C call (Note [Tensor views in C] there, ~0.45 us, where the same
# in Python took 0.85 us), so an 8 B all-reduce of a tensor, made afresh or reduced again and
# again, pays no more for its view than that. The version counter is bumped through torch._C's
# call directly (0.13 us against the public wrapper's 0.28).

_FORMATS: dict = {}  # torch dtype -> struct format of its host view, filled at first use
# (host_ops.tensor_view, torch.Tensor, torch.strided, _FORMATS) once torch is imported
_VIEWER: list = []


def host_format(dtype) -> Optional[str]:
    """The struct format a host view of a tensor of ``dtype`` carries (None: it has none,
    e.g. bfloat16 or bool: such tensors take torch's own paths)."""
    if not _FORMATS:
        torch = sys.modules["torch"]
        formats = {torch.float32: "f", torch.float64: "d", torch.float16: "e",
                   torch.int32: "i", torch.int64: "q"}
        # the C view takes its size from the format: each must be its dtype's width
        assert all(struct.calcsize(f) == d.itemsize for d, f in formats.items()), formats
        _FORMATS.update(formats)
    return _FORMATS.get(dtype)


def tensor_view(x: Any):
    """A writable buffer over a contiguous dense CPU torch tensor's memory, holding the
    tensor, for the one-call path; None for anything else (the general path takes it)."""
    v = _VIEWER
    if not v:
        torch = sys.modules.get("torch")
        if torch is None:  # no tensor can exist yet
            return None
        host_format(torch.float32)
        # the same four from any thread that gets here first
        v[:] = (host_ops.tensor_view, torch.Tensor, torch.strided, _FORMATS)
    return v[0](x, v[1], v[2], v[3])


def bump_version(t) -> None:
    """Tells autograd that ``t`` was written in place (as torch's own in-place ops do)."""
    _increment[0]((t,))


def _first_increment(tensors) -> None:
    _increment[0] = sys.modules["torch"]._C._increment_version  # torch is imported by now
    _increment[0](tensors)


_increment = [_first_increment]


def tensor_bytes(t):
    """The bytes of contiguous CPU tensor ``t`` as a numpy uint8 array sharing its memory (a
    host view: Note [Views of torch tensors]), holding ``t``."""
    return np.asarray(host_ops.host_view(t.data_ptr(), t.nbytes, "B", (t.nbytes,), t))
