"""Bucketed fusion of many tensors into a few flat buffers: the pure bucket assignment, the
Bucket that packs and unpacks through the C extension, and the fused collectives for users
with their own loops (Horovod's names): ``grouped_allreduce``, ``grouped_allreduce_``,
``broadcast_parameters``, ``broadcast_optimizer_state``.

Every function that communicates is collective: every rank calls it with tensors of the same
shapes and dtypes, in the same order."""
from __future__ import annotations

import sys
from collections.abc import Mapping
from typing import Any, Iterable, Optional, Sequence

import numpy as np

from . import algorithms, collectives, host_kernels, runtime, timeline
from .dtypes import FLOATING, I64, NUMPY_STORAGE, as_host_array, flat_host_array, write_back
from .gpu import is_device_array
from .watchdog import collective


def assign_buckets(sizes_bytes: Sequence[int], dtypes: Sequence[Any], cap_bytes: int,
                   first_cap_bytes: Optional[int] = None,
                   order: Optional[Sequence[int]] = None,
                   max_count: Optional[int] = None) -> tuple:
    """Groups tensors into buckets: a pure function of their sizes (bytes) and dtypes.

    Tensors are taken in ``order`` (default: as given); each dtype fills its own bucket (no
    tensor is ever up-cast), and a bucket closes once it holds ``cap_bytes`` or more — the
    first bucket of each dtype already at ``first_cap_bytes`` (PyTorch DDP's small first
    bucket, so communication starts early in backward), or at ``max_count`` tensors when
    given. A tensor larger than the cap gets a bucket of its own. Returns a tuple of buckets,
    each a tuple of tensor indices, ordered by where their first tensor comes in ``order`` —
    the order they become ready and launch."""
    n = len(sizes_bytes)
    if len(dtypes) != n:
        raise ValueError(f"{n} sizes but {len(dtypes)} dtypes")
    if cap_bytes <= 0:
        raise ValueError(f"cap_bytes must be positive, got {cap_bytes}")
    first = cap_bytes if first_cap_bytes is None else first_cap_bytes
    if first <= 0:
        raise ValueError(f"first_cap_bytes must be positive, got {first_cap_bytes}")
    if max_count is not None and max_count < 1:
        raise ValueError(f"max_count must be at least 1, got {max_count}")
    order = tuple(range(n)) if order is None else tuple(order)
    if sorted(order) != list(range(n)):
        raise ValueError(f"order must be a permutation of 0..{n - 1}")
    closed: list = []
    open_: dict = {}        # dtype -> [indices, bytes]
    started: set = set()    # dtypes whose first bucket has closed
    for i in order:
        if sizes_bytes[i] < 0:
            raise ValueError(f"tensor {i} has a negative size {sizes_bytes[i]}")
        slot = open_.setdefault(dtypes[i], [[], 0])
        slot[0].append(i)
        slot[1] += sizes_bytes[i]
        if slot[1] >= (cap_bytes if dtypes[i] in started else first) or \
                len(slot[0]) == max_count:
            closed.append(tuple(slot[0]))
            started.add(dtypes[i])
            del open_[dtypes[i]]
    closed.extend(tuple(slot[0]) for slot in open_.values())
    position = {t: k for k, t in enumerate(order)}
    return tuple(sorted(closed, key=lambda b: position[b[0]]))


# Note [Zero-copy buckets]
# On one node (algorithm shm) with cross-memory attach, a bucket need not be packed at all:
# each rank publishes its tensors' addresses as a segment table in its shared-memory record,
# and the rank that reduces a slice reads that slice from every rank's tensors and writes the
# result (with the average's division) straight back into them. Packing and unpacking — two
# full copies of every gradient — disappear, and each byte is read once and written once on
# the node. Up to SHM_MAX_SEGMENTS (256) tensors per bucket, above the inline size; otherwise,
# across nodes, or in staging-window mode the bucket is packed, reduced and unpacked. Ranks
# may take different paths for the same bucket (csrc/shm.c maps each rank's own layout).


class Bucket:
    """One flat host buffer holding tensors of one dtype back to back.

    ``indices`` name the tensors (in the caller's numbering), ``counts`` their elements;
    ``host`` is the buffer as the collectives see it."""

    __slots__ = ("indices", "counts", "offsets", "dtype", "flat", "host", "divisor")

    def __init__(self, indices: Sequence[int], counts: Sequence[int], dtype: int):
        self.indices = tuple(indices)
        self.counts = tuple(int(c) for c in counts)
        self.offsets = tuple(int(o) for o in np.cumsum((0,) + self.counts[:-1]))
        self.dtype = dtype
        self.flat = np.empty(sum(self.counts), NUMPY_STORAGE[dtype])
        self.host = flat_host_array(self.flat, dtype)
        self.divisor = 1  # what the last reduce_ left for unpacking to divide by

    @property
    def nbytes(self) -> int:
        return self.flat.nbytes

    @property
    def buffer(self):
        """The bucket as the collectives take it (DeviceBucket's is a device array)."""
        return self.host

    def allreduce_(self, op: str, algorithm: str) -> None:
        """All-reduces the bucket's buffer in place (collective)."""
        collectives.allreduce_(self.host, op, algorithm)

    def capture_stream(self) -> None:
        """Host buffers have no stream to order by (DeviceBucket's capture one)."""

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
                        host_kernels.pack(self.flat[o:o + count], [v])
                return
        host_kernels.pack(self.flat, views)

    def reduce_(self, sources: Sequence[Any], destinations: Sequence[Any], op: str,
                algorithm: str) -> None:
        """All-reduces this bucket's tensors: ``sources`` in (None packs zeros), results into
        ``destinations`` (None skips; the same tensors as ``sources`` for in place). ``op``:
        sum, avg, min, max. In place on one node the tensors are reduced where they lie
        (Note [Zero-copy buckets]); otherwise they are packed, reduced and unpacked, the
        average's division fused into the unpack. Collective: every rank calls it for the
        same bucket, and every rank sends the same op whichever path it takes."""
        g = runtime.group()
        shm = g.size > 1 and algorithms.choose(g, algorithm, self.nbytes) == "shm"
        if shm and all(s is not None and s is d for s, d in zip(sources, destinations)):
            arrays = [as_host_array(t) for t in sources]
            if all(a.contiguous for a in arrays) and collectives.allreduce_segments_(
                    [a.flat for a in arrays], self.dtype, op, algorithm):
                return
        # Note [Zero-copy buckets]: on shm the slice owners divide (as the zero-copy path
        # does); elsewhere the division rides in the unpack
        fused = op == "avg" and not shm
        self.divisor = g.size if fused else 1
        self.pack(sources)
        collectives.allreduce_(self.host, "sum" if fused else op, algorithm)
        self.unpack(destinations, self.divisor)

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
        host_kernels.unpack(self.flat, views, self.dtype, divisor)
        for a in arrays:
            if a is not None:
                write_back(a)  # non-contiguous destinations were unpacked into a copy

    def unpack_one(self, position: int, destination: Any, divisor: Optional[int] = None) -> None:
        """Unpacks only the tensor at ``position`` of this bucket (divided by ``divisor``,
        default: what the last ``reduce_`` left to divide)."""
        divisor = self.divisor if divisor is None else divisor
        lo = self.offsets[position]
        a = as_host_array(destination)
        host_kernels.unpack(self.flat[lo:lo + self.counts[position]], [a.flat], self.dtype,
                            divisor)
        write_back(a)


def _tensor_list(tensors: Any, what: str) -> list:
    if isinstance(tensors, Mapping):
        return list(tensors.values())
    if isinstance(tensors, (str, bytes)) or not isinstance(tensors, Iterable):
        raise TypeError(f"{what} must be a list of tensors, a state_dict or named_parameters(),"
                        f" got {type(tensors).__name__}")
    items = list(tensors)
    # named_parameters(): pairs of (name, tensor)
    return [i[1] if isinstance(i, tuple) and len(i) == 2 and isinstance(i[0], str) else i
            for i in items]


def plan(tensors: Sequence[Any], cap_bytes: int, first_cap_bytes: Optional[int] = None,
         order: Optional[Sequence[int]] = None, max_count: Optional[int] = None) -> list:
    """Buckets for ``tensors`` (assign_buckets on their sizes and dtypes), allocated: host
    Buckets, or DeviceBuckets on the tensors' GPU for device tensors."""
    arrays = _views(tensors)
    sizes = [a.flat.nbytes for a in arrays]
    groups = assign_buckets(sizes, [a.dtype for a in arrays], cap_bytes, first_cap_bytes,
                            order, max_count)
    if arrays and is_device_array(arrays[0]):
        from .gpu.buckets import DeviceBucket
        return [DeviceBucket(b, [len(arrays[i].flat) for i in b], arrays[b[0]].dtype,
                             arrays[0].device) for b in groups]
    return [Bucket(b, [len(arrays[i].flat) for i in b], arrays[b[0]].dtype) for b in groups]


def _views(tensors: Sequence[Any]) -> list:
    """Host or device views of ``tensors``, which must be all on the host or all on one GPU."""
    on_device = [is_device_array(t) for t in tensors]
    if not any(on_device):
        return [as_host_array(t, "each tensor") for t in tensors]
    from .gpu.arrays import as_device_array
    if not all(on_device):
        raise TypeError("tensors must be all on the host or all on the GPU; got a mix")
    views = [as_device_array(t, "each tensor") for t in tensors]
    devices = sorted({v.device for v in views})
    if len(devices) > 1:
        raise ValueError(f"tensors on GPUs {devices}; one rank's tensors must share one GPU")
    return views


# Fusion buffers of grouped_allreduce, kept between calls (Horovod keeps its fusion buffer):
# (cap, (dtype, count) of every tensor) -> buckets. A training loop calls with one signature.
_PLANS: dict = {}
_PLANS_KEPT = 4


def _cached_plan(arrays: list, cap_bytes: int, max_count: Optional[int]) -> list:
    key = (cap_bytes, max_count,
           tuple((a.dtype, len(a.flat), getattr(a, "device", None)) for a in arrays))
    buckets = _PLANS.pop(key, None)
    if buckets is None:
        buckets = plan(arrays, cap_bytes, max_count=max_count)
        while len(_PLANS) >= _PLANS_KEPT:
            del _PLANS[next(iter(_PLANS))]
    _PLANS[key] = buckets  # most recently used last
    return buckets


def grouped_allreduce_(tensors: Sequence[Any], op: str = "avg", algorithm: str = "auto",
                       bucket_cap_mb: float = 64) -> list:
    """All-reduces every tensor in place through a few fused buckets (one per dtype and
    ``bucket_cap_mb`` MiB); ``op``: sum, avg, min, max. Returns the tensors. Every rank calls
    it with the same shapes and dtypes in the same order."""
    items = _tensor_list(tensors, "tensors")
    return _grouped(items, items, op, algorithm, bucket_cap_mb)


def grouped_allreduce(tensors: Sequence[Any], op: str = "avg", algorithm: str = "auto",
                      bucket_cap_mb: float = 64) -> list:
    """Like ``grouped_allreduce_`` but returns new tensors; the inputs are unchanged."""
    items = _tensor_list(tensors, "tensors")
    outs = []
    for t, a in zip(items, _views(items)):
        if is_device_array(a):
            from .gpu.arrays import empty_like
            outs.append(empty_like(a)[0])
        else:
            outs.append(t.new_empty(t.shape) if a.is_torch else np.empty_like(t, order="C"))
    return _grouped(items, outs, op, algorithm, bucket_cap_mb)


def _grouped(items, outs, op, algorithm, bucket_cap_mb):
    if not isinstance(bucket_cap_mb, (int, float)) or not bucket_cap_mb > 0:
        raise ValueError(f"bucket_cap_mb must be a positive number, got {bucket_cap_mb!r}")
    if op not in ("sum", "avg", "min", "max"):
        raise ValueError(f"unknown op {op!r}; accepted: sum, avg, min, max")
    arrays = _views([_writable(t) for t in items])
    results = arrays if outs is items else _views(outs)
    on_device = bool(arrays) and is_device_array(arrays[0])
    avg = op == "avg"
    if avg and any(a.dtype not in FLOATING for a in arrays):
        raise ValueError("op 'avg' needs floating tensors; use 'sum' for integers")
    cap = int(bucket_cap_mb * (1 << 20))
    g = runtime.group()
    # in place on one node: buckets small enough in tensor count to go zero-copy
    zero_copy = outs is items and g.size > 1 and not on_device and \
        algorithms.choose(g, algorithm, cap) == "shm"
    for bucket in _cached_plan(arrays, cap, g.shm().max_segments if zero_copy else None):
        bucket.reduce_([arrays[i] for i in bucket.indices], [results[i] for i in bucket.indices],
                       op, algorithm)
    return outs


def _writable(t: Any) -> Any:
    """The tensor to write results into: torch leaves are written through a detached view."""
    return t.detach() if getattr(t, "requires_grad", False) else t


# ---- broadcast of parameters and optimizer state ---------------------------------------------

def _byte_view(t: Any) -> np.ndarray:
    """Raw bytes of a contiguous CPU tensor or numpy array of any dtype."""
    if isinstance(t, np.ndarray):
        return t.reshape(-1).view(np.uint8)
    import torch
    return t.detach().reshape(-1).view(torch.uint8).numpy()


def broadcast_tensors_(tensors: Sequence[Any], root: int = 0,
                       bucket_cap_bytes: int = 64 << 20) -> None:
    """Overwrites every tensor with root's, through fused byte buckets (any dtype). Every rank
    passes tensors of the same shapes and dtypes in the same order."""
    items = list(tensors)
    contiguous, copied = zip(*[_contiguous(t) for t in items]) if items else ((), ())
    sizes = [_byte_view(t).nbytes for t in contiguous]
    groups = assign_buckets(sizes, [0] * len(sizes), bucket_cap_bytes)
    me = runtime.rank()
    for b in groups:
        total = sum(sizes[i] for i in b)
        words = np.zeros((total + 7) // 8, np.int64)  # bytes travel as 64-bit words
        raw = words.view(np.uint8)
        if me == root:
            host_kernels.pack(raw, [_byte_view(contiguous[i]) for i in b])
        collectives.broadcast_(flat_host_array(words, I64), root)
        if me != root:
            _unpack_bytes(raw, [contiguous[i] for i in b])
    for original, c, was_copied in zip(items, contiguous, copied):
        if not was_copied or me == root:
            continue
        if isinstance(original, np.ndarray):
            np.copyto(original, c)
        elif is_device_array(original) and not hasattr(original, "copy_"):  # CuPy
            original[...] = sys.modules["cupy"].asarray(c)
        else:
            _writable(original).copy_(c)


def _contiguous(t: Any) -> tuple:
    """(``t`` itself, detached, False) where contiguous, else (a contiguous copy, True). A
    device array travels as a host copy: parameters are broadcast once at start-up, and the
    buffers broadcast per forward are small (running statistics)."""
    if is_device_array(t):
        if hasattr(t, "detach"):
            return t.detach().cpu().contiguous(), True
        return sys.modules["cupy"].asnumpy(t), True
    if isinstance(t, np.ndarray):
        return (t, False) if t.flags.c_contiguous else (np.ascontiguousarray(t), True)
    torch = sys.modules.get("torch")
    if torch is None or not isinstance(t, torch.Tensor):
        raise TypeError(f"each tensor must be a numpy.ndarray or a CPU torch.Tensor, got "
                        f"{type(t).__module__}.{type(t).__qualname__}")
    t = t.detach()
    if t.device.type != "cpu":
        raise TypeError(f"tensor on device {t.device}; host collectives take CPU tensors")
    return (t, False) if t.is_contiguous() else (t.contiguous(), True)


def _unpack_bytes(raw: np.ndarray, tensors: Sequence[Any]) -> None:
    """The inverse of packing byte views (any item size, so not the typed C unpack)."""
    offset = 0
    for t in tensors:
        v = _byte_view(t)
        v[...] = raw[offset:offset + v.nbytes]
        offset += v.nbytes


def broadcast_parameters(params: Any, root: int = 0) -> None:
    """Overwrites every rank's parameters with root's, in place (Horovod's name): ``params``
    is a ``state_dict()``, ``named_parameters()`` or a list of tensors. Every rank calls it."""
    collectives.check_root(root, runtime.size())
    broadcast_tensors_(_tensor_list(params, "params"), root)


def broadcast_optimizer_state(optimizer: Any, root: int = 0) -> None:
    """Gives every rank root's optimizer state (moments, step counts, hyper-parameters such
    as the learning rate), loaded with ``optimizer.load_state_dict``. The structure travels
    pickled, the tensors in fused buckets. Every rank calls it, with the same parameters."""
    import torch
    collectives.check_root(root, runtime.size())
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"optimizer must be a torch.optim.Optimizer, got "
                        f"{type(optimizer).__name__}")
    g = runtime.group()
    tensors: list = []
    structure = None
    if g.rank == root:
        state = optimizer.state_dict()

        def strip(value):
            if isinstance(value, torch.Tensor):
                tensors.append(value.detach().cpu().contiguous())
                return ("mpidp-tensor", len(tensors) - 1, tuple(value.shape), str(value.dtype))
            if isinstance(value, dict):
                return {k: strip(v) for k, v in value.items()}
            return value
        structure = {"state": {k: strip(v) for k, v in state["state"].items()},
                     "param_groups": state["param_groups"]}
    with collective(g, "broadcast_optimizer_state: the state's structure"):
        structure = g.comm.bcast(structure, root=root)
    if g.rank != root:
        def fill(value):
            if isinstance(value, tuple) and len(value) == 4 and value[0] == "mpidp-tensor":
                t = torch.empty(value[2], dtype=getattr(torch, value[3].split(".")[-1]))
                tensors.append(t)
                return t
            if isinstance(value, dict):
                return {k: fill(v) for k, v in value.items()}
            return value
        structure = {"state": {k: fill(v) for k, v in structure["state"].items()},
                     "param_groups": structure["param_groups"]}
    broadcast_tensors_(tensors, root)
    if g.rank != root:
        optimizer.load_state_dict(structure)
