"""A user's device array (CuPy array or torch CUDA tensor) seen as a flat CuPy buffer with a
dtype code, zero-copy (torch through DLPack), and the stream that produced it."""
from __future__ import annotations

import sys
from typing import Any, NamedTuple


from ..dtypes import (
    BF16,
    DTYPE_NAMES,
    F16,
    F32,
    F64,
    I32,
    I64,
    NUMPY_CODES,
    NUMPY_STORAGE,
    unsupported_dtype)
from .device import cupy


class DeviceArray(NamedTuple):
    """``flat`` is a 1-D CuPy array of the dtype's storage type (bfloat16 as uint16) sharing
    memory with ``original`` when ``contiguous``; else a contiguous copy (``write_back``)."""

    original: Any
    flat: Any
    dtype: int
    shape: tuple
    is_torch: bool
    contiguous: bool
    device: int


def _torch_code(t) -> int:
    torch = sys.modules["torch"]
    codes = {torch.float16: F16, torch.bfloat16: BF16, torch.float32: F32,
             torch.float64: F64, torch.int32: I32, torch.int64: I64}
    code = codes.get(t.dtype)
    if code is None:
        raise TypeError(f"tensor has dtype {t.dtype}; supported: {', '.join(DTYPE_NAMES)}")
    return code


def as_device_array(x: Any, what: str = "x") -> DeviceArray:
    """Views ``x`` (CuPy array or torch CUDA tensor) as a DeviceArray; TypeError names an
    unsupported type or dtype."""
    if type(x) is DeviceArray:
        return x
    cp = cupy()
    if isinstance(x, cp.ndarray):
        code = NUMPY_CODES.get(x.dtype)
        if code is None:
            raise unsupported_dtype(what, x.dtype)
        contiguous = x.flags.c_contiguous
        flat = (x if contiguous else cp.ascontiguousarray(x)).reshape(-1)
        return DeviceArray(x, flat, code, tuple(x.shape), False, contiguous, x.device.id)
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(x, torch.Tensor) and x.is_cuda:
        code = _torch_code(x)
        t = x.detach()
        contiguous = t.is_contiguous()
        if not contiguous:
            t = t.contiguous()
        if code == BF16:
            t = t.view(torch.int16)  # CuPy has no bfloat16: the bits travel as 16-bit ints
        flat = cp.from_dlpack(t.reshape(-1))
        if code == BF16:
            flat = flat.view(cp.uint16)
        return DeviceArray(x, flat, code, tuple(x.shape), True, contiguous, x.device.index)
    raise TypeError(f"{what} must be a cupy.ndarray or a CUDA torch.Tensor, "
                    f"got {type(x).__module__}.{type(x).__qualname__}")


def empty_like(a: DeviceArray, shape: tuple | None = None) -> tuple:
    """(new array of a's kind, dtype and device, its flat CuPy view)."""
    shape = a.shape if shape is None else tuple(shape)
    if a.is_torch:
        out = sys.modules["torch"].empty(shape, dtype=a.original.dtype, device=a.original.device)
        return out, as_device_array(out).flat
    cp = cupy()
    with cp.cuda.Device(a.device):
        out = cp.empty(shape, dtype=NUMPY_STORAGE[a.dtype])
    return out, out.reshape(-1)


def write_back(a: DeviceArray) -> None:
    """Copies a non-contiguous array's flat copy back into the user's array."""
    if a.contiguous:
        return
    if a.is_torch:
        torch = sys.modules["torch"]
        src = torch.from_dlpack(a.flat)
        if a.dtype == BF16:
            src = src.view(torch.int16).view(torch.bfloat16)
        a.original.copy_(src.reshape(a.shape))
    else:
        a.original[...] = a.flat.reshape(a.shape)


def producer_stream(a: DeviceArray):
    """The CuPy view of the stream ``a``'s producer works on: torch's current stream for a
    torch tensor, CuPy's current stream for a CuPy array."""
    cp = cupy()
    if a.is_torch:
        return external_stream(sys.modules["torch"].cuda.current_stream(a.original.device))
    return cp.cuda.get_current_stream()


def external_stream(torch_stream):
    """CuPy's view of a torch CUDA stream (CuPy 14's Stream.from_external where it exists:
    ExternalStream is deprecated there)."""
    cp = cupy()
    from_external = getattr(cp.cuda.Stream, "from_external", None)
    if from_external is not None and hasattr(torch_stream, "__cuda_stream__"):
        return from_external(torch_stream)
    return cp.cuda.ExternalStream(torch_stream.cuda_stream, torch_stream.device.index)
