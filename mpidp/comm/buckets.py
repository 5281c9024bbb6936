"""Buckets: one flat buffer holding tensors of one dtype back to back, packed, all-reduced
and unpacked — ``Bucket`` on the host (the C extension's pack and unpack) and, in
mpidp.comm.device_buckets, ``DeviceBucket`` on a GPU — both on one base that
asks mpidp.engine.planner.plan_bucket once per reduction how to go: zero-copy or packed, which
algorithm, where the average divides. DistributedDataParallel, CentralStorage and
grouped_allreduce hold them."""
from __future__ import annotations

import contextlib
from typing import Any, Optional, Sequence

import numpy as np

from . import collectives
from ..engine import host_ops
from ..runtime import timeline
from ..engine.planner import DEVICE, HOST, plan_bucket
from ..engine.blocks import partition
from ..engine.dtypes import F16, NUMPY_STORAGE, as_host_array, flat_host_array, write_back


class BucketBase:
    """What every bucket has: ``indices`` name its tensors (in the caller's numbering),
    ``counts`` their elements and ``offsets`` where each starts, ``dtype`` their dtype code,
    ``flat`` the buffer, ``buffer`` the buffer as the collectives take it, and ``divisor``
    what the last ``reduce_`` left for unpacking to divide by. Subclasses give ``pack``,
    ``unpack``, ``unpack_one``, ``torch_view``, ``allreduce_`` and the stream hooks."""

    __slots__ = ("indices", "counts", "offsets", "dtype", "flat", "buffer", "divisor")
    where = HOST

    def __init__(self, indices: Sequence[int], counts: Sequence[int], dtype: int):
        self.indices = tuple(indices)
        self.counts = tuple(int(c) for c in counts)
        self.offsets = tuple(int(o) for o in np.cumsum((0,) + self.counts[:-1]))
        self.dtype = dtype
        self.divisor = 1

    @property
    def nbytes(self) -> int:
        return self.flat.nbytes

    def _zero_copy_views(self, sources: Sequence[Any], destinations: Sequence[Any]):
        """The flat views to reduce where they lie, or None where they cannot be."""
        return None

    def reduce_(self, sources: Sequence[Any], destinations: Sequence[Any], op: str,
                algorithm: str, g) -> None:
        """All-reduces this bucket's tensors: ``sources`` in (None packs zeros), results into
        ``destinations`` (None skips; the same tensors as ``sources`` for in place). ``op``:
        sum, avg, min, max. Planned once (mpidp.engine.planner.plan_bucket): in place on one node
        the tensors are reduced where they lie (Note [Zero-copy buckets]); otherwise packed,
        reduced and unpacked, the average's division fused into the unpack where the
        algorithm does not divide itself. Collective: every rank calls it for the same
        bucket, and every rank sends the same op whichever path it takes. ``g``: the group
        (Note [Group-explicit collectives] in mpidp/comm/collectives.py)."""
        views = self._zero_copy_views(sources, destinations)
        p = plan_bucket(self.where, algorithm, collectives.facts(g, self.where == DEVICE),
                        self.nbytes, len(self.indices), views is not None, op)
        if p.zero_copy:
            collectives.allreduce_segments_(g, views, self.dtype, op)
            return
        self.divisor = g.size if p.divide_in_unpack else 1
        self.pack(sources)
        self.allreduce_("sum" if p.divide_in_unpack else op, p.algorithm.name, g)
        self.unpack(destinations, self.divisor)


    def reduce_scatter_(self, sources: Sequence[Any], algorithm: str, dtype: Any,
                        g) -> None:
        """``sources`` packed (None: zeros; own slots stay), reduce-scattered, and this rank's
        block of the average written back where it came from: into the bucket and the
        sources (Note [ZeRO] in mpidp/ddp/zero.py); the rest keeps this rank's own values.
        ``dtype``: the bucket's torch dtype; ``g``: as ``reduce_``'s. Collective."""
        with self.stream_context():
            self.pack(sources, skip_own_slots=True)
            flat = self.torch_flat(dtype)
            block = collectives.reduce_scatter_in(g, flat, "avg", algorithm if algorithm in
                                                  ("ring", "mpi") else "auto")
            lo, n = partition(len(flat), g.size)[g.rank]
            flat[lo:lo + n].copy_(block)
            for s, o, c in zip(sources, self.offsets, self.counts):
                a, b = max(lo, o), min(lo + n, o + c)
                if s is None or a >= b or (s.is_contiguous() and
                                           s.data_ptr() == flat[o:].data_ptr()):
                    continue  # nothing of it here, or it is its own slot (written above)
                part = s.detach().view(-1) if s.is_contiguous() else s.detach().reshape(-1)
                part[a - o:b - o].copy_(block[a - lo:b - lo])
                if not s.is_contiguous():
                    s.detach().copy_(part.view(s.shape))
        self.divisor = 1  # unpack_one of a parameter unused here: its averaged block too


# Note [Zero-copy buckets]
# On one node (algorithm shm) with cross-memory attach, a bucket need not be packed at all:
# each rank publishes its tensors' addresses as a segment table in its shared-memory record,
# and the rank that reduces a slice reads that slice from every rank's tensors and writes the
# result (with the average's division) straight back into them. Packing and unpacking — two
# full copies of every gradient — disappear, and each byte is read once and written once on
# the node. Up to SHM_MAX_SEGMENTS (256) tensors per bucket, above the inline size; otherwise,
# across nodes, or in staging-window mode the bucket is packed, reduced and unpacked. Ranks
# may take different paths for the same bucket (csrc/shm.c maps each rank's own layout).


class Bucket(BucketBase):
    """One flat host buffer; ``buffer`` is it as a HostArray of the bucket's dtype."""

    __slots__ = ("wire",)

    def __init__(self, indices: Sequence[int], counts: Sequence[int], dtype: int):
        super().__init__(indices, counts, dtype)
        self.flat = np.empty(sum(self.counts), NUMPY_STORAGE[dtype])
        self.buffer = flat_host_array(self.flat, dtype)
        self.wire: Optional[np.ndarray] = None  # the 16-bit bucket of reduce_cast_

    @timeline.traced("cast, all-reduce, cast back")
    def reduce_cast_(self, sources: Sequence[Any], destinations: Optional[Sequence[Any]],
                     wire: int, algorithm: str, g) -> None:
        """Averages this float32 bucket's tensors over a 16-bit wire (``wire``: F16 or BF16)
        as Note [Compressed buckets] in mpidp/ddp/compression.py defines it: ``sources`` (None:
        zeros) cast into the wire bucket, all-reduced (sum), cast back into
        ``destinations`` (None, or a None entry: this bucket's own slots); ``g``: as
        ``reduce_``'s. Collective."""
        if self.wire is None:
            self.wire = np.empty(len(self.flat), np.uint16)
        before, after = (g.size, 1) if wire == F16 else (1, g.size)
        views = [np.zeros(c, np.float32) if s is None else as_host_array(s).flat
                 for s, c in zip(sources, self.counts)]
        host_ops.cast_segments(self.wire, views, wire, self.dtype, before, False)
        collectives.allreduce_in(g, flat_host_array(self.wire, wire), "sum", algorithm, True)
        destinations = destinations or [None] * len(self.counts)
        arrays = [None if d is None else as_host_array(d) for d in destinations]
        outs = [self.flat[o:o + c] if a is None else a.flat
                for a, o, c in zip(arrays, self.offsets, self.counts)]
        host_ops.cast_segments(self.wire, outs, wire, self.dtype, after, True)
        for a in arrays:
            if a is not None:
                write_back(a)
        self.divisor = 1  # unpack_one of a parameter unused here reads its averaged slot

    def allreduce_(self, op: str, algorithm: str, g) -> None:
        """All-reduces the bucket's buffer in place over ``g`` (as ``reduce_``'s). Collective."""
        collectives.allreduce_in(g, self.buffer, op,
                                 algorithm, True)

    def capture_stream(self) -> None:
        """Host buffers have no stream to order by (DeviceBucket's capture one)."""

    def stream_context(self):
        """torch work on this bucket's stream (a host bucket's: nothing to order)."""
        return contextlib.nullcontext()

    def join_stream(self) -> None:
        """See capture_stream."""

    @timeline.traced("pack")
    def pack(self, sources: Sequence[Any], skip_own_slots: bool = False) -> None:
        """Copies ``sources`` (one per index; None packs zeros) into the buffer, in one C call.
        With ``skip_own_slots``, a source that already is its own slot of this bucket (a
        gradient held as a bucket view) stays where it is."""
        views = [np.zeros(c, self.flat.dtype) if s is None else as_host_array(s).flat
                 for s, c in zip(sources, self.counts)]
        if skip_own_slots:
            base, itemsize = self.flat.ctypes.data, self.flat.itemsize
            own = [v.ctypes.data == base + o * itemsize for v, o in zip(views, self.offsets)]
            if any(own):
                for v, is_own, count, o in zip(views, own, self.counts, self.offsets):
                    if not is_own:
                        host_ops.pack(self.flat[o:o + count], [v])
                return
        host_ops.pack(self.flat, views)

    def _zero_copy_views(self, sources: Sequence[Any], destinations: Sequence[Any]):
        if not all(s is not None and s is d for s, d in zip(sources, destinations)):
            return None
        arrays = [as_host_array(t) for t in sources]
        if all(a.contiguous and a.flat.flags.writeable for a in arrays):
            return [a.flat for a in arrays]
        return None

    def torch_flat(self, dtype: Any) -> Any:
        """The whole buffer as a 1-D torch tensor of torch dtype ``dtype`` (the bucket's)."""
        import torch  # deferred for cost: buckets also serve numpy callers
        t = torch.from_numpy(self.flat)
        return t.view(dtype) if t.dtype != dtype else t

    def torch_view(self, position: int, like: Any) -> Any:
        """A torch tensor shaped and typed as ``like`` that is the slot at ``position``."""
        import torch
        lo = self.offsets[position]
        t = torch.from_numpy(self.flat[lo:lo + self.counts[position]])
        if t.dtype != like.dtype:
            t = t.view(like.dtype)  # bfloat16 is stored as 16-bit integers
        return t.view(like.shape)

    @timeline.traced("unpack")
    def unpack(self, destinations: Sequence[Any], divisor: int = 1) -> None:
        """Copies the buffer into ``destinations`` (one per index; None skips that tensor),
        divided by ``divisor`` in the same pass, in one C call."""
        arrays = [None if d is None else as_host_array(d) for d in destinations]
        views = [np.empty(c, self.flat.dtype) if a is None else a.flat
                 for a, c in zip(arrays, self.counts)]
        host_ops.unpack(self.flat, views, self.dtype, divisor)
        for a in arrays:
            if a is not None:
                write_back(a)  # non-contiguous destinations were unpacked into a copy

    def unpack_one(self, position: int, destination: Any, divisor: Optional[int] = None) -> None:
        """Unpacks only the tensor at ``position`` of this bucket (divided by ``divisor``,
        default: what the last ``reduce_`` left to divide)."""
        divisor = self.divisor if divisor is None else divisor
        lo = self.offsets[position]
        a = as_host_array(destination)
        host_ops.unpack(self.flat[lo:lo + self.counts[position]], [a.flat], self.dtype,
                            divisor)
        write_back(a)
