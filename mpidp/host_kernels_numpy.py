"""The numpy twin of the C extension's host kernels: same signatures, same results.

float16 is widened to float32 and rounded back once, as numpy itself does; bfloat16 (carried
as 16-bit integers, numpy has no such type) is widened to float32 and rounded to nearest even,
as torch does."""
from __future__ import annotations

import numpy as np

from .dtypes import BF16, F16, FLOATING, NUMPY_STORAGE, OP_MAX, OP_MIN, OP_SUM


def _bf16_to_f32(bits: np.ndarray) -> np.ndarray:
    return (bits.view(np.uint16).astype(np.uint32) << 16).view(np.float32)


def _f32_to_bf16(values: np.ndarray) -> np.ndarray:
    u = values.astype(np.float32).view(np.uint32)
    nan = (u & 0x7FFFFFFF) > 0x7F800000
    rounded = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)
    quiet = ((u >> 16) | 0x40).astype(np.uint16)
    return np.where(nan, quiet, rounded)


_UFUNCS = {OP_SUM: np.add, OP_MIN: np.minimum, OP_MAX: np.maximum}


def _typed(buf, dtype: int) -> np.ndarray:
    return np.frombuffer(buf, dtype=NUMPY_STORAGE[dtype]) if not isinstance(buf, np.ndarray) \
        else buf.reshape(-1).view(NUMPY_STORAGE[dtype])


def reduce_into(dst, src, dtype: int, op: int) -> None:
    """dst = dst <op> src element-wise (codes from mpidp.dtypes)."""
    d, s = _typed(dst, dtype), _typed(src, dtype)
    if d.nbytes != s.nbytes:
        raise ValueError(f"dst has {d.nbytes} bytes, src {s.nbytes}; both must be equal")
    if dtype == BF16:
        d[...] = _f32_to_bf16(_UFUNCS[op](_bf16_to_f32(d), _bf16_to_f32(s)))
    elif op == OP_SUM and dtype != F16 and d.dtype.kind == "i":
        np.add(d, s, out=d, casting="unsafe")
    else:
        _UFUNCS[op](d, s, out=d)


def divide(buf, dtype: int, divisor: int) -> None:
    """buf = buf / divisor for floating dtypes."""
    if dtype not in FLOATING:
        raise ValueError(f"divide needs a floating dtype, got code {dtype}")
    if divisor <= 0:
        raise ValueError(f"divisor must be positive, got {divisor}")
    b = _typed(buf, dtype)
    if dtype == BF16:
        b[...] = _f32_to_bf16(_bf16_to_f32(b) / np.float32(divisor))
    else:
        np.divide(b, b.dtype.type(divisor), out=b)
