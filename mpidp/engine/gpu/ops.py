"""The GPU array seam: our CUDA kernels (mpidp/engine/gpu/kernels/*.cu) compiled at run time by CuPy
(NVRTC), one module per device, launched on a given stream. ``DeviceOps`` is the namespace
the ring calls (``reduce_into``, ``divide``) plus the buckets' multi-tensor ``pack`` and
``unpack``."""
from __future__ import annotations

import threading
from importlib import resources
from typing import Sequence

import numpy as np

from ..dtypes import BF16, F16, F32, F64, FLOATING, I32, I64
from .device import cupy

SOURCES = ("reduce.cu", "pack.cu")
DTYPE_SUFFIX = {F16: "f16", BF16: "bf16", F32: "f32", F64: "f64", I32: "i32", I64: "i64"}
OP_SUFFIX = ("sum", "min", "max")
THREADS = 256
MAX_TENSORS_PER_LAUNCH = 65535  # CUDA's limit on gridDim.y: one block row per tensor
_VECTOR_BYTES = 16

_modules: dict = {}   # (device id, source name) -> cupy.RawModule
_lock = threading.Lock()

# Note [Tables kept on the device]: a multi-tensor launch reads the tensors' addresses, offsets
# and counts from a table in device memory. Uploading it is a copy from pageable host memory
# that the kernel waits for: three such copies per call cost 0.08 ms on an H200 (pack of 64
# tensors of 64 MiB together at 29% of a device copy's rate, against 87% at 256 MiB). One
# upload holds all three, and it is kept, keyed by the stream, the addresses and the counts:
# a bucket packs the same gradients step after step, so after the first step a pack is one
# launch. The table is a function of its key (the device, the stream, the addresses, the
# counts), so a kept one is never stale; addresses freed and reused by other tensors give the
# same table. MAX_TABLES bounds what is kept.
_tables: dict = {}
MAX_TABLES = 256


def kernel_dir():
    return resources.files("mpidp.engine.gpu") / "kernels"


def source(name: str) -> str:
    """The kernel source with elementwise.cuh pasted in place of its #include: CuPy's disk
    cache keys on the source text, so a changed header must change the text."""
    header = (kernel_dir() / "elementwise.cuh").read_text()
    return (kernel_dir() / name).read_text().replace('#include "elementwise.cuh"', header)


def compile_options() -> tuple:
    return ("--std=c++17",)


def function(source_name: str, name: str):
    """Kernel ``name`` of ``source_name`` for the current device, compiled on first use (and
    cached on disk by CuPy across runs)."""
    cp = cupy()
    key = (cp.cuda.Device().id, source_name)
    module = _modules.get(key)
    if module is None:
        with _lock:
            module = _modules.get(key)
            if module is None:
                module = cp.RawModule(code=source(source_name), options=compile_options())
                _modules[key] = module
    return module.get_function(name)


def _blocks(work_items: int) -> int:
    """Grid size for a grid-stride loop over ``work_items``: enough blocks to fill the device,
    no more (each thread then loops)."""
    cp = cupy()
    sms = cp.cuda.Device().attributes["MultiProcessorCount"]
    return max(1, min(-(-work_items // THREADS), sms * 8))


class DeviceOps:
    """The ring's array namespace on CuPy buffers; every kernel runs on ``stream``."""

    def __init__(self, stream):
        self.stream = stream

    def reduce_into(self, dst, src, dtype: int, op: int, divisor: int = 1) -> None:
        """dst = dst op src, then divided by ``divisor`` when it is > 1, in one pass."""
        count = len(dst)
        if count == 0:
            return
        assert len(src) == count and dst.dtype == src.dtype
        if divisor > 1 and dtype not in FLOATING:
            raise ValueError("the average needs a floating dtype")
        lanes = _VECTOR_BYTES // dst.itemsize
        kernel = function("reduce.cu", f"mpidp_reduce_{DTYPE_SUFFIX[dtype]}_{OP_SUFFIX[op]}")
        with self.stream:
            kernel((_blocks(-(-count // lanes)),), (THREADS,),
                   (dst, src, np.int64(count), np.int64(divisor)))

    def divide(self, buf, dtype: int, divisor: int) -> None:
        """buf = buf / divisor (floating dtypes)."""
        if dtype not in FLOATING:
            raise ValueError("divide needs a floating dtype")
        count = len(buf)
        if count == 0 or divisor == 1:
            return
        kernel = function("reduce.cu", f"mpidp_divide_{DTYPE_SUFFIX[dtype]}")
        with self.stream:
            kernel((_blocks(-(-count // (_VECTOR_BYTES // buf.itemsize))),), (THREADS,),
                   (buf, np.int64(count), np.int64(divisor)))

    def _table(self, tensors: Sequence, itemsize: int, in_bytes: bool) -> tuple:
        """(pointers, offsets, counts) on the device, and the longest count: Note [Tables
        kept on the device]."""
        counts = [len(t) for t in tensors]
        scale = itemsize if in_bytes else 1
        key = (cupy().cuda.Device().id, self.stream.ptr, scale,
               tuple(t.data.ptr for t in tensors), tuple(counts))
        table = _tables.get(key)
        if table is None:
            cp, n = cupy(), len(counts)
            host = np.empty(3 * n, dtype=np.int64)
            host[:n] = np.array(key[3], dtype=np.uint64).view(np.int64)
            host[n:2 * n] = np.cumsum([0] + counts[:-1], dtype=np.int64) * scale
            host[2 * n:] = np.array(counts, dtype=np.int64) * scale
            with self.stream:  # copied on the stream the kernels run on
                flat = cp.asarray(host)
            if len(_tables) >= MAX_TABLES:
                _tables.clear()
            table = _tables[key] = (flat[:n].view(cp.uint64), flat[n:2 * n], flat[2 * n:],
                                    max(counts, default=0))
        return table

    def pack(self, bucket, tensors: Sequence) -> None:
        """Copies the flat CuPy arrays ``tensors`` back to back into ``bucket`` (one launch
        per MAX_TENSORS_PER_LAUNCH tensors)."""
        for lo, part in _batches(bucket, tensors):
            self._copy(part, tensors[lo:lo + MAX_TENSORS_PER_LAUNCH], unpack=False)

    def unpack(self, bucket, tensors: Sequence, dtype: int, divisor: int = 1) -> None:
        """Copies ``bucket`` out into ``tensors``, divided by ``divisor`` (> 1: the average)
        in the same pass (one launch per MAX_TENSORS_PER_LAUNCH tensors)."""
        for lo, part in _batches(bucket, tensors):
            chunk = tensors[lo:lo + MAX_TENSORS_PER_LAUNCH]
            if divisor == 1:
                self._copy(part, chunk, unpack=True)
            else:
                self._unpack_divide(part, chunk, dtype, divisor)

    def cast(self, bucket, tensors: Sequence, wire: int, divisor: int, unpack: bool) -> None:
        """The float32 CuPy arrays ``tensors`` packed into the 16-bit ``bucket`` (``wire``:
        F16 or BF16), or with ``unpack`` read back from it, divided by ``divisor`` on the way
        (Note [Casting buckets] in csrc/kernels.c; one launch per MAX_TENSORS_PER_LAUNCH
        tensors)."""
        kernel = function("pack.cu", f"mpidp_cast_{DTYPE_SUFFIX[wire]}")
        for lo, part in _batches(bucket, tensors):
            chunk = tensors[lo:lo + MAX_TENSORS_PER_LAUNCH]
            pointers, offsets, counts, longest = self._table(chunk, 1, in_bytes=False)
            with self.stream:
                kernel((_blocks(longest), len(chunk)), (THREADS,),
                       (part, pointers, offsets, counts, np.int64(divisor),
                        np.int32(1 if unpack else 0)))

    def _unpack_divide(self, bucket, tensors: Sequence, dtype: int, divisor: int) -> None:
        pointers, offsets, counts, longest = self._table(tensors, 1, in_bytes=False)
        kernel = function("pack.cu", f"mpidp_unpack_divide_{DTYPE_SUFFIX[dtype]}")
        with self.stream:
            kernel((_blocks(longest), len(tensors)), (THREADS,),
                   (bucket, pointers, offsets, counts, np.int64(divisor)))

    def _copy(self, bucket, tensors: Sequence, unpack: bool) -> None:
        pointers, offsets, sizes, longest = self._table(tensors, bucket.itemsize,
                                                        in_bytes=True)
        longest *= bucket.itemsize  # in bytes, as the copy counts
        kernel = function("pack.cu", "mpidp_copy_bytes")
        with self.stream:
            kernel((_blocks(-(-longest // _VECTOR_BYTES)), len(tensors)), (THREADS,),
                   (bucket, pointers, offsets, sizes, np.int32(1 if unpack else 0)))


def _batches(bucket, tensors: Sequence):
    """(first tensor index, the bucket from that tensor's slot on) per launch."""
    offset = 0
    for lo in range(0, len(tensors), MAX_TENSORS_PER_LAUNCH):
        yield lo, bucket[offset:]
        offset += sum(len(t) for t in tensors[lo:lo + MAX_TENSORS_PER_LAUNCH])
