"""DeviceBucket: the GPU twin of mpidp.comm.buckets.Bucket, on the same base — one flat device
buffer holding tensors of one dtype back to back, packed and unpacked by one multi-tensor
kernel launch each (mpidp/engine/gpu/kernels/pack.cu), all-reduced on the device, so
DistributedDataParallel and grouped_allreduce keep their buckets on the device."""
from __future__ import annotations

import sys
from typing import Any, Optional, Sequence


from . import collectives
from ..engine.planner import DEVICE
from .buckets import BucketBase
from ..engine.dtypes import F16, NUMPY_STORAGE
from ..engine.gpu.arrays import (
    DeviceArray,
    as_device_array,
    external_stream,
    producer_stream,
    write_back)
from ..engine.gpu.device import cupy
from ..engine.gpu.ops import DeviceOps


class DeviceBucket(BucketBase):
    """One flat device buffer; ``buffer`` is it as a DeviceArray. Everything runs on the bucket's GPU
    (whichever device the calling thread has current) and on one stream: the one captured by
    ``capture_stream`` (DDP: the stream backward ran on), else the first tensor's producer
    (torch's current stream), so gradients, packing, the all-reduce, the unpack and the
    optimizer step stay in stream order."""

    __slots__ = ("device", "stream", "wire")
    where = DEVICE

    def __init__(self, indices: Sequence[int], counts: Sequence[int], dtype: int, device: int):
        super().__init__(indices, counts, dtype)
        cp = cupy()
        self.device = device
        with cp.cuda.Device(device):
            self.flat = cp.empty(sum(self.counts), NUMPY_STORAGE[dtype])
        # the bucket as the collectives see it: a DeviceArray keeps bfloat16's dtype code
        self.buffer = DeviceArray(self.flat, self.flat, dtype, self.flat.shape, False, True,
                                  device)
        self.stream = None
        self.wire = None  # the 16-bit bucket of reduce_cast_

    def capture_stream(self) -> None:
        """Remembers the calling thread's current torch stream on the bucket's GPU (DDP calls
        it where the gradients are produced, before handing the bucket to its thread)."""
        self.stream = external_stream(sys.modules["torch"].cuda.current_stream(self.device))

    def join_stream(self) -> None:
        """The calling thread's current torch stream waits for the bucket's work."""
        if self.stream is not None:
            torch = sys.modules["torch"]
            torch.cuda.current_stream(self.device).wait_stream(
                torch.cuda.ExternalStream(self.stream.ptr, device=self.device))

    def _stream(self, first: Optional[DeviceArray]):
        """The stream the bucket's work runs on: the captured one, else ``first``'s
        producer, else CuPy's current stream."""
        if self.stream is not None:
            return self.stream
        return producer_stream(first) if first is not None else cupy().cuda.get_current_stream()

    def _ops(self, arrays) -> DeviceOps:
        return DeviceOps(self._stream(next((a for a in arrays if a is not None), None)))

    def reduce_(self, sources: Sequence[Any], destinations: Sequence[Any], op: str,
                algorithm: str, g) -> None:
        """BucketBase.reduce_ with the pack, the all-reduce and the unpack on one stream: the
        captured one, else the first source's producer for this call. (The all-reduce alone
        sees no tensor: on CuPy's current stream it would not wait for a pack on a torch side
        stream, which CUDA does not order against the legacy default stream.)"""
        if self.stream is not None:
            super().reduce_(sources, destinations, op, algorithm, g)
            return
        first = next((s for s in sources if s is not None), None)
        self.stream = self._stream(None if first is None else as_device_array(first))
        try:
            super().reduce_(sources, destinations, op, algorithm, g)
        finally:
            self.stream = None

    def allreduce_(self, op: str, algorithm: str, g) -> None:
        """All-reduces the bucket in place over ``g`` (BucketBase.reduce_'s), in its
        stream's order."""
        with cupy().cuda.Device(self.device), self._ops([]).stream:
            collectives.allreduce_in(g, self.buffer, op,
                                     algorithm, True)

    def pack(self, sources: Sequence[Any], skip_own_slots: bool = False) -> None:
        """Copies ``sources`` (None packs zeros) into the bucket in one launch; with
        ``skip_own_slots`` a source that already is its own slot stays where it is."""
        with cupy().cuda.Device(self.device):
            self._pack(sources, skip_own_slots)

    def _pack(self, sources: Sequence[Any], skip_own_slots: bool) -> None:
        cp = cupy()
        arrays = [None if s is None else as_device_array(s) for s in sources]
        ops = self._ops(arrays)
        with ops.stream:
            views = [cp.zeros(c, self.flat.dtype) if a is None else a.flat
                     for a, c in zip(arrays, self.counts)]
        base, itemsize = self.flat.data.ptr, self.flat.itemsize
        if skip_own_slots:
            keep = [v.data.ptr != base + o * itemsize for v, o in zip(views, self.offsets)]
            for v, o, k in zip(views, self.offsets, keep):
                if k:
                    ops.pack(self.flat[o:o + len(v)], [v])
            return
        ops.pack(self.flat, views)

    def reduce_cast_(self, sources: Sequence[Any], destinations: Optional[Sequence[Any]],
                     wire: int, algorithm: str, g) -> None:
        """Bucket.reduce_cast_ on the device: the casts are one launch each
        (Note [Compressed buckets] in mpidp/ddp/compression.py). Collective."""
        cp = cupy()
        with cp.cuda.Device(self.device):
            size = g.size
            before, after = (size, 1) if wire == F16 else (1, size)
            arrays = [None if s is None else as_device_array(s) for s in sources]
            ops = self._ops(arrays)
            with ops.stream:
                if self.wire is None:
                    self.wire = cp.empty(len(self.flat), NUMPY_STORAGE[wire])
                views = [cp.zeros(c, self.flat.dtype) if a is None else a.flat
                         for a, c in zip(arrays, self.counts)]
            ops.cast(self.wire, views, wire, before, unpack=False)
            with ops.stream:
                collectives.allreduce_in(g, DeviceArray(self.wire, self.wire, wire,
                                                        self.wire.shape, False, True,
                                                        self.device), "sum", algorithm, True)
            outs = [None if d is None else as_device_array(d)
                    for d in (destinations or [None] * len(self.counts))]
            flats = [self.flat[o:o + c] if a is None else a.flat
                     for a, o, c in zip(outs, self.offsets, self.counts)]
            ops.cast(self.wire, flats, wire, after, unpack=True)
            for a in outs:
                if a is not None:
                    write_back(a)
        self.divisor = 1

    def stream_context(self):
        """torch work on the stream ``capture_stream`` took (the gradients'), as a context."""
        torch = sys.modules["torch"]
        if self.stream is None:
            return torch.cuda.device(self.device)
        return torch.cuda.stream(torch.cuda.ExternalStream(self.stream.ptr, device=self.device))

    def torch_flat(self, dtype: Any) -> Any:
        """The whole buffer as a 1-D torch tensor of torch dtype ``dtype`` (the bucket's)."""
        t = sys.modules["torch"].from_dlpack(self.flat)
        return t.view(dtype) if t.dtype != dtype else t

    def torch_view(self, position: int, like: Any) -> Any:
        """A torch tensor shaped and typed as ``like`` that is the slot at ``position``."""
        torch = sys.modules["torch"]
        lo = self.offsets[position]
        t = torch.from_dlpack(self.flat[lo:lo + self.counts[position]])
        if t.dtype != like.dtype:
            t = t.view(like.dtype)  # bfloat16 is stored as 16-bit integers
        return t.view(like.shape)

    def unpack(self, destinations: Sequence[Any], divisor: int = 1) -> None:
        """Copies the bucket into ``destinations`` (None skips), divided by ``divisor``, in
        one launch."""
        with cupy().cuda.Device(self.device):
            self._unpack(destinations, divisor)

    def _unpack(self, destinations: Sequence[Any], divisor: int) -> None:
        arrays = [None if d is None else as_device_array(d) for d in destinations]
        ops = self._ops(arrays)
        keep = [(a.flat, o) for a, o in zip(arrays, self.offsets) if a is not None]
        # slots of skipped tensors are stepped over: one launch per run of kept tensors
        for run in _runs(keep):
            lo = run[0][1]
            ops.unpack(self.flat[lo:], [f for f, _ in run], self.dtype, divisor)
        for a in arrays:
            if a is not None:
                write_back(a)

    def unpack_one(self, position: int, destination: Any,
                   divisor: Optional[int] = None) -> None:
        divisor = self.divisor if divisor is None else divisor
        with cupy().cuda.Device(self.device):
            a = as_device_array(destination)
            lo = self.offsets[position]
            self._ops([a]).unpack(self.flat[lo:lo + self.counts[position]], [a.flat],
                                  self.dtype, divisor)
            write_back(a)


def _runs(kept: list) -> list:
    """Groups (flat, offset) pairs into runs whose slots are back to back in the bucket."""
    runs: list = []
    for flat, offset in kept:
        if runs and runs[-1][-1][1] + len(runs[-1][-1][0]) == offset:
            runs[-1].append((flat, offset))
        else:
            runs.append([(flat, offset)])
    return runs
