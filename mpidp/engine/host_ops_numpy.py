"""The numpy twin of the C extension's host kernels and bucket fusion: same signatures, same
results.

float16 is widened to float32 and rounded back once, as numpy itself does; bfloat16 (carried
as 16-bit integers, numpy has no such type) is widened to float32 and rounded to nearest even,
as torch does. Floating min and max propagate NaN and keep the chosen operand's bits (Note [NaN
in min and max] in csrc/kernels.c)."""
from __future__ import annotations

import numpy as np

from .dtypes import BF16, F16, F32, FLOATING, NUMPY_STORAGE, OP_MAX, OP_MIN, OP_SUM


def _bf16_to_f32(bits: np.ndarray) -> np.ndarray:
    return (bits.view(np.uint16).astype(np.uint32) << 16).view(np.float32)


def _f32_to_bf16(values: np.ndarray) -> np.ndarray:
    u = values.astype(np.float32).view(np.uint32)
    nan = (u & 0x7FFFFFFF) > 0x7F800000
    rounded = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)
    quiet = ((u >> 16) | 0x40).astype(np.uint16)
    return np.where(nan, quiet, rounded)


_UFUNCS = {OP_SUM: np.add, OP_MIN: np.minimum, OP_MAX: np.maximum}
_KEEPS_DST = {OP_MIN: np.greater_equal, OP_MAX: np.less_equal}  # src >= dst: min keeps dst


def _min_max_float(d: np.ndarray, s: np.ndarray, dtype: int, op: int) -> None:
    """dst = min/max(dst, src) in place for a floating dtype, as csrc/kernels.c chooses (Note
    [NaN in min and max]): src is taken where dst is not NaN and src is not >= dst (<= dst),
    i.e. src is smaller (larger) or NaN; the chosen operand is copied bit for bit. Explicit
    rather than np.minimum, whose choice on NaN payloads and signed-zero ties varies with the
    dtype and the platform's SIMD."""
    x, y = (_bf16_to_f32(d), _bf16_to_f32(s)) if dtype == BF16 else (d, s)
    keep = _KEEPS_DST[op](y, x)
    keep |= np.isnan(x)
    take = np.invert(keep, out=keep)  # src wherever dst is not kept
    np.copyto(d, s, where=take)


def _typed(buf, dtype: int) -> np.ndarray:
    return np.frombuffer(buf, dtype=NUMPY_STORAGE[dtype]) if not isinstance(buf, np.ndarray) \
        else buf.reshape(-1).view(NUMPY_STORAGE[dtype])


def reduce_into(dst, src, dtype: int, op: int, divisor: int = 1) -> None:
    """dst = dst <op> src element-wise (codes from mpidp.engine.dtypes), then divided by
    ``divisor`` when it is > 1."""
    d, s = _typed(dst, dtype), _typed(src, dtype)
    if d.nbytes != s.nbytes:
        raise ValueError(f"dst has {d.nbytes} bytes, src {s.nbytes}; both must be equal")
    if op in _KEEPS_DST and dtype in FLOATING:
        _min_max_float(d, s, dtype, op)
    elif dtype == BF16:
        d[...] = _f32_to_bf16(_UFUNCS[op](_bf16_to_f32(d), _bf16_to_f32(s)))
    elif op == OP_SUM and dtype != F16 and d.dtype.kind == "i":
        np.add(d, s, out=d, casting="unsafe")
    else:
        _UFUNCS[op](d, s, out=d)
    if divisor > 1 and d.size:
        divide(d, dtype, divisor)


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


def _bytes(buf, writable: bool) -> np.ndarray:
    view = memoryview(buf)
    if not view.c_contiguous:
        raise TypeError("each tensor must be a C-contiguous buffer")
    if writable and view.readonly:
        raise TypeError("each tensor must be a C-contiguous writable buffer")
    return np.frombuffer(view.cast("B"), dtype=np.uint8) if not writable else \
        np.asarray(view.cast("B"))


def pack(bucket, sources) -> int:
    """Copies every buffer of ``sources`` into ``bucket`` back to back; returns the bytes."""
    out = _bytes(bucket, True)
    parts = [_bytes(s, False) for s in sources]
    total = sum(p.nbytes for p in parts)
    if total > out.nbytes:
        raise ValueError(f"sources hold {total} bytes, more than the bucket's {out.nbytes}")
    offset = 0
    for p in parts:
        out[offset:offset + p.nbytes] = p
        offset += p.nbytes
    return total


def unpack(bucket, destinations, dtype: int, divisor: int) -> int:
    """Copies ``bucket`` back into ``destinations``, divided by ``divisor`` when > 1."""
    if divisor <= 0:
        raise ValueError(f"divisor must be positive, got {divisor}")
    if divisor > 1 and dtype not in FLOATING:
        raise ValueError(f"dividing needs a floating dtype, got code {dtype}")
    src = _bytes(bucket, False)
    parts = [_bytes(d, True) for d in destinations]
    itemsize = np.dtype(NUMPY_STORAGE[dtype]).itemsize
    for i, p in enumerate(parts):
        if p.nbytes % itemsize:
            raise ValueError(f"tensor {i} has {p.nbytes} bytes, not a multiple of the item "
                             f"size {itemsize}")
    total = sum(p.nbytes for p in parts)
    if total > src.nbytes:
        raise ValueError(f"destinations hold {total} bytes, more than the bucket's {src.nbytes}")
    offset = 0
    for p in parts:
        p[...] = src[offset:offset + p.nbytes]
        if divisor > 1:
            divide(p, dtype, divisor)
        offset += p.nbytes
    return total


def cast_segments(bucket, segments, wire: int, outer: int, divisor: int, unpack: bool) -> int:
    """float32 ``segments`` packed into a float16/bfloat16 ``bucket`` (or, ``unpack``, read
    back), divided by ``divisor`` in float32 on the way (Note [Casting buckets] in
    csrc/kernels.c). Returns the bucket bytes used."""
    if outer != F32 or wire not in (F16, BF16):
        raise ValueError(f"cast_segments converts float32 buffers to and from a float16 or "
                         f"bfloat16 bucket; got codes {outer} (buffers), {wire} (bucket)")
    if divisor <= 0:
        raise ValueError(f"divisor must be positive, got {divisor}")
    parts = [_bytes(s, unpack) for s in segments]
    for i, p in enumerate(parts):
        if p.nbytes % 4:
            raise ValueError(f"tensor {i} has {p.nbytes} bytes, not a multiple of the item "
                             "size 4")
    used = sum(p.nbytes for p in parts) // 2
    flat = _bytes(bucket, not unpack)
    if used > flat.nbytes:
        raise ValueError(f"the buffers need {used} bucket bytes, more than the bucket's "
                         f"{flat.nbytes}")
    scale = np.float32(divisor)
    offset = 0
    for p in parts:
        values, half = p.view(np.float32), flat[offset:offset + p.nbytes // 2].view(np.uint16)
        if unpack:
            wide = _bf16_to_f32(half) if wire == BF16 else half.view(np.float16).astype(np.float32)
            np.divide(wide, scale, out=values) if divisor > 1 else np.copyto(values, wide)
        else:
            x = values / scale if divisor > 1 else values
            with np.errstate(over="ignore"):  # beyond float16's range is inf, as in C
                half[...] = _f32_to_bf16(x) if wire == BF16 else \
                    x.astype(np.float16).view(np.uint16)
        offset += p.nbytes // 2
    return used


class _AtAddress:
    """What numpy's array interface needs to see ``nbytes`` bytes at ``addr``; holds the
    owner of that memory."""

    __slots__ = ("__array_interface__", "owner")

    def __init__(self, addr: int, format: str, shape: tuple, owner):
        self.__array_interface__ = {"data": (addr, False), "shape": tuple(shape),
                                    "typestr": np.dtype(format).str, "version": 3}
        self.owner = owner


def host_view(addr: int, nbytes: int, format: str, shape: tuple, owner) -> np.ndarray:
    """A writable C-contiguous array of ``shape`` and struct ``format`` over the ``nbytes``
    bytes at ``addr``, holding ``owner`` (Note [Host views] in csrc/view.c)."""
    shape = tuple(int(n) for n in shape)
    if np.dtype(format).itemsize * int(np.prod(shape, dtype=np.int64)) != nbytes:
        raise ValueError(f"host_view: shape {shape} of format {format} is not {nbytes} bytes")
    if not nbytes:
        return np.empty(shape, np.dtype(format))
    return np.asarray(_AtAddress(addr, format, shape, owner))


def tensor_view(x, tensor_type, strided, formats: dict):
    """A view of ``x`` (an exact ``tensor_type`` of layout ``strided`` on the CPU,
    C-contiguous, not empty, of a dtype ``formats`` names), holding it; None for anything else
    (the C twin's Note [Tensor views in C] in csrc/view.c)."""
    if type(x) is not tensor_type or x.layout is not strided or not x.is_cpu:
        return None
    fmt = formats.get(x.dtype)
    if fmt is None or not x.is_contiguous() or x.numel() == 0:
        return None
    return host_view(x.data_ptr(), x.nbytes, fmt, x.shape, x)
