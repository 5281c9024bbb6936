"""Element types and reduction ops mpidp accepts, and the view of a user's host array
(numpy array or CPU torch tensor) as a flat numpy buffer with a dtype code."""
from __future__ import annotations

import functools
import sys
from typing import Any, NamedTuple

import numpy as np

# Codes shared with csrc/kernels.h.
F16, BF16, F32, F64, I32, I64 = range(6)
DTYPE_NAMES = ("float16", "bfloat16", "float32", "float64", "int32", "int64")
FLOATING = frozenset((F16, BF16, F32, F64))
ITEMSIZE = (2, 2, 4, 8, 4, 8)
# numpy type that holds each dtype's bits (bfloat16 travels as 16-bit integers)
NUMPY_STORAGE = (np.float16, np.uint16, np.float32, np.float64, np.int32, np.int64)

OP_SUM, OP_MIN, OP_MAX = range(3)
OPS = ("sum", "avg", "min", "max")
# op name -> (kernel op code, divide by the number of ranks afterwards)
OP_CODES = {"sum": (OP_SUM, False), "avg": (OP_SUM, True), "min": (OP_MIN, False),
            "max": (OP_MAX, False)}

NUMPY_CODES = {np.dtype(np.float16): F16, np.dtype(np.float32): F32,
                np.dtype(np.float64): F64, np.dtype(np.int32): I32, np.dtype(np.int64): I64}


class HostArray(NamedTuple):
    """A user's array seen as a flat, C-contiguous numpy buffer.

    ``flat`` shares memory with ``original`` when ``contiguous`` is true; otherwise it is a
    contiguous copy and in-place results must be copied back (``write_back``)."""

    original: Any
    flat: np.ndarray
    dtype: int
    shape: tuple
    is_torch: bool
    contiguous: bool


_new_host_array = functools.partial(tuple.__new__, HostArray)  # skips NamedTuple's slow __new__


def flat_host_array(flat: np.ndarray, dtype: int) -> HostArray:
    """mpidp's own flat buffer (a bucket) as a HostArray of dtype code ``dtype``."""
    return _new_host_array((flat, flat, dtype, flat.shape, False, True))


def _torch_codes() -> dict:
    torch = sys.modules["torch"]
    return {torch.float16: F16, torch.bfloat16: BF16, torch.float32: F32,
            torch.float64: F64, torch.int32: I32, torch.int64: I64}


_torch_code_cache: dict | None = None


def _torch_module():
    """torch if the user has imported it (mpidp never imports torch just to look)."""
    return sys.modules.get("torch")


def unsupported_dtype(what: str, dtype: Any) -> TypeError:
    """The error for a numpy or CuPy array whose dtype mpidp does not reduce."""
    return TypeError(f"{what} has dtype {dtype}; supported: {', '.join(DTYPE_NAMES)}"
                     " (bfloat16 as a torch tensor)")


def as_host_array(x: Any, what: str = "x") -> HostArray:
    """Views ``x`` as a HostArray (a HostArray is returned as it is: mpidp's own flat
    buffers, such as buckets); TypeError names an unsupported type or dtype."""
    global _torch_code_cache
    if isinstance(x, np.ndarray):  # inline, not shared with CuPy's: every collective passes here
        code = NUMPY_CODES.get(x.dtype)
        if code is None:
            raise unsupported_dtype(what, x.dtype)
        contiguous = x.flags.c_contiguous
        flat = (x if contiguous else np.ascontiguousarray(x)).reshape(-1)
        return _new_host_array((x, flat, code, x.shape, False, contiguous))
    if type(x) is HostArray:
        return x
    torch = _torch_module()
    if torch is not None and isinstance(x, torch.Tensor):
        if _torch_code_cache is None:
            _torch_code_cache = _torch_codes()
        code = _torch_code_cache.get(x.dtype)
        if code is None:
            raise TypeError(f"{what} has dtype {x.dtype}; supported: {', '.join(DTYPE_NAMES)}")
        if not x.is_cpu:
            raise TypeError(f"{what} is on device {x.device}; host collectives take CPU tensors")
        t = x.detach() if x.requires_grad else x  # numpy's reshape is cheaper than torch's
        contiguous = t.is_contiguous()
        if not contiguous:
            t = t.contiguous()
        if code == BF16:
            flat = t.view(torch.int16).numpy().view(np.uint16).reshape(-1)
        else:
            flat = t.numpy().reshape(-1)
        return _new_host_array((x, flat, code, tuple(x.shape), True, contiguous))
    raise TypeError(f"{what} must be a numpy.ndarray or a CPU torch.Tensor, "
                    f"got {type(x).__module__}.{type(x).__qualname__}")


def empty_like(a: HostArray, shape: tuple | None = None) -> tuple:
    """(new array, its flat numpy view): C-contiguous, a's type and dtype, ``shape`` (default
    a's)."""
    shape = a.shape if shape is None else shape
    if a.is_torch:
        out = _torch_module().empty(shape, dtype=a.original.dtype)
        return out, as_host_array(out).flat
    flat = np.empty(int(np.prod(shape, dtype=np.int64)) if shape != a.shape else a.flat.size,
                    dtype=a.flat.dtype)
    return flat.reshape(shape), flat


def write_back(a: HostArray) -> None:
    """Copies a non-contiguous array's reduced flat copy back into the user's array."""
    if a.contiguous:
        return
    if a.is_torch:
        torch = _torch_module()
        src = torch.from_numpy(a.flat)
        if a.dtype == BF16:
            src = src.view(torch.int16).view(torch.bfloat16)
        a.original.copy_(src.reshape(a.shape))
    else:
        np.copyto(a.original, a.flat.reshape(a.shape))

