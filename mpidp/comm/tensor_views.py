"""A CPU torch tensor as the buffer the one-call all-reduce takes (Note [Views of torch
tensors]), the struct format such a view carries, and the version bump after writing
through it. Imports no torch: a tensor here means torch is imported already."""
from __future__ import annotations

import sys
from typing import Any, Optional

from ..engine import host_ops

# Note [Views of torch tensors]
# The one-call all-reduce (csrc/small.c) takes any writable C-contiguous buffer. A tensor's
# `.numpy()` costs 0.67 us on this machine and makes its storage unresizable for good; the
# host view (Note [Host views] in csrc/view.c, which the torch.distributed backend uses too)
# is made from the tensor's address, size, format and shape in ~0.35 us and touches nothing
# of the tensor's, so an 8 B all-reduce of a tensor, made afresh or reduced again and again,
# pays ~0.5 us for its view with the checks. The version counter is bumped through
# torch._C's call directly (0.11 us against the public wrapper's 0.28).

_FORMATS: dict = {}  # torch dtype -> struct format of its host view, filled at first use


def host_format(dtype) -> Optional[str]:
    """The struct format a host view of a tensor of ``dtype`` carries (None: it has none,
    e.g. bfloat16 or bool: such tensors take torch's own paths)."""
    if not _FORMATS:
        torch = sys.modules["torch"]
        _FORMATS.update({torch.float32: "f", torch.float64: "d", torch.float16: "e",
                         torch.int32: "i", torch.int64: "q"})
    return _FORMATS.get(dtype)


def tensor_view(x: Any):
    """A writable buffer over a contiguous dense CPU torch tensor's memory, holding the
    tensor, for the one-call path; None for anything else (the general path takes it)."""
    torch = sys.modules.get("torch")
    if torch is None or type(x) is not torch.Tensor or x.layout is not torch.strided or \
            not x.is_cpu or not x.is_contiguous():
        return None
    fmt = host_format(x.dtype)
    if fmt is None or x.numel() == 0:
        return None
    return host_ops.host_view(x.data_ptr(), x.nbytes, fmt, x.shape, x)


def bump_version(t) -> None:
    """Tells autograd that ``t`` was written in place (as torch's own in-place ops do)."""
    _increment[0]((t,))


def _first_increment(tensors) -> None:
    _increment[0] = sys.modules["torch"]._C._increment_version  # torch is imported by now
    _increment[0](tensors)


_increment = [_first_increment]
