"""The numpy view of a CPU torch tensor that the one-call all-reduce takes, kept per tensor
(Note [Views of torch tensors]), and the version bump after writing through it."""
from __future__ import annotations

import ctypes
import sys
import weakref
from typing import Any, Optional

import numpy as np

# Note [Views of torch tensors]
# The one-call all-reduce (csrc/small.c) takes a numpy array; a torch tensor's `.numpy()` costs
# 0.67 us on this machine and the checks before it another 0.3, against a whole 8 B
# all-reduce of ~1 us: a tensor reduced again and again (a metric, a loss, a flag) paid them
# at every call. So the view is made once per tensor and kept, keyed by the tensor's id, with
# what it was made from: a weak reference to the tensor (the entry goes when the tensor does,
# and an id reused by another tensor never matches), its data pointer, dtype and shape. A call
# whose tensor still has them all and is still contiguous takes the kept view (~0.37 us of
# checks); anything else (`.data` swapped, `resize_`, a transposed layout, another dtype)
# makes a new one or declines. The view is made over the tensor's memory from its address and
# holds no reference to the tensor (one that did would keep every tensor ever reduced alive
# through the cache); it is only ever used while the tensor is alive with that same pointer.
# The version counter is bumped through torch._C's call directly (0.11 us against the public
# wrapper's 0.28).

_DTYPES = {}  # torch dtype -> numpy dtype, filled on first use (torch may not be imported)
_views: dict = {}  # id(tensor) -> (weak reference, data pointer, dtype, shape, numpy view)


def numpy_view(x: Any) -> Optional[np.ndarray]:
    """A writable numpy array over a contiguous CPU torch tensor's memory, for the one-call
    path; None for anything else (the general path takes it)."""
    kept = _views.get(id(x))
    if kept is not None and kept[0]() is x and x.data_ptr() == kept[1] and \
            x.dtype is kept[2] and x.shape == kept[3] and x.is_contiguous():
        return kept[4]  # the tensor it was made for, unchanged
    torch = sys.modules.get("torch")
    if torch is None or type(x) is not torch.Tensor:
        return None
    return _new_view(torch, x)


def _new_view(torch, x) -> Optional[np.ndarray]:
    if not _DTYPES:
        _DTYPES.update({torch.float16: np.float16, torch.float32: np.float32,
                        torch.float64: np.float64, torch.int32: np.int32,
                        torch.int64: np.int64})
    dtype = _DTYPES.get(x.dtype)
    if dtype is None or not x.is_cpu or x.is_sparse or not x.is_contiguous() or \
            x.numel() == 0:
        return None
    key, ptr = id(x), x.data_ptr()
    memory = (ctypes.c_char * (x.numel() * x.element_size())).from_address(ptr)
    view = np.frombuffer(memory, dtype=dtype).reshape(tuple(x.shape))
    _views[key] = (weakref.ref(x, lambda _, key=key: _views.pop(key, None)), ptr, x.dtype,
                   x.shape, view)
    return view


def bump_version(t) -> None:
    """Tells autograd that ``t`` was written in place (as torch's own in-place ops do)."""
    _increment[0]((t,))


def _first_increment(tensors) -> None:
    _increment[0] = sys.modules["torch"]._C._increment_version  # torch is imported by now
    _increment[0](tensors)


_increment = [_first_increment]
