"""Bucketed fusion of many tensors into a few flat buffers: the pure bucket assignment, the
allocation of buckets (mpidp.comm.buckets) for a list of tensors, and the fused all-reduce for
users with their own loops (Horovod's names): ``grouped_allreduce``, ``grouped_allreduce_``.

Every function that communicates is collective: every rank calls it with tensors of the same
shapes and dtypes, in the same order."""
from __future__ import annotations

import contextlib
import zlib
from collections.abc import Mapping
from typing import Any, Iterable, Optional, Sequence

import numpy as np

from . import collectives
from .agreement import agreed
from .. import runtime
from .buckets import Bucket
from ..engine.dtypes import DTYPE_NAMES, FLOATING, as_host_array
from ..engine.gpu import is_device_array
from ..engine.gpu.arrays import as_device_array
from ..engine.gpu.arrays import empty_like as device_empty_like
from .device_buckets import DeviceBucket  # these import no CuPy until a device array arrives
from ..engine.header import ALLREDUCE
from ..engine.planner import DEVICE, HOST, max_tensors
from ..errors import MismatchError


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


def tensor_list(tensors: Any, what: str) -> list:
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
        return [DeviceBucket(b, [len(arrays[i].flat) for i in b], arrays[b[0]].dtype,
                             arrays[0].device) for b in groups]
    return [Bucket(b, [len(arrays[i].flat) for i in b], arrays[b[0]].dtype) for b in groups]


def _views(tensors: Sequence[Any]) -> list:
    """Host or device views of ``tensors``, which must be all on the host or all on one GPU."""
    on_device = [is_device_array(t) for t in tensors]
    if not any(on_device):
        return [as_host_array(t, "each tensor") for t in tensors]
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
_NOTHING = contextlib.nullcontext()
# group -> (the layout of this rank's last grouped call on it that did not raise, the group's
# count of collectives that raised then: Board.failed) (Note [A group's layout]); a group
# freed keeps its entry, a few strings
_LAST_LAYOUT: dict = {}

# Note [A group's layout]
# A bucket's header holds its total count, which [t4, t2] and [t2, t4] share: where the ranks'
# layouts (shapes and dtypes in order, the bucket cap) differ, their buckets would add one
# tensor into another. So the first bucket carries the layout (mpidp.comm.agreement.agreed:
# Note [Agreement before refusal]) — where it differs from this rank's previous grouped call
# on the group, the first call included, or where any collective on the group raised since
# (the board counts them: Board.failed in mpidp/runtime/watchdog.py), or after a join;
# otherwise it keeps the one C call (a stamp costs the Python path, tens of microseconds on a
# small group). That is enough: ranks whose layouts agree change them at the same calls, so
# they stamp alike; a layout that differs on some rank at a call where the previous call
# agreed differs from its previous one on at least one rank, whose stamp meets another rank's
# other stamp, or none. It needs every rank to forget at the same calls: a collective that
# raises raises on every rank (Note [Agreement before refusal]), whichever path each took —
# refused before fusion (Horovod's own checks), one tensor at a time, the one C call — so
# counting them, not the grouped calls that raised, keeps the ranks alike; a joined rank
# sees the others' all-reduces only as headers, so every rank forgets when the join ends
# (``forget``, from mpidp.comm.joined). A group of no tensors always exchanges a header of no
# elements (``agree_on_nothing``): it is rare, and skipping it on a rank whose empty group is
# unchanged would pair another rank's refusal with this rank's next collective.


def forget(g) -> None:
    """Every rank's next grouped call on group ``g`` carries its layout (Note [A group's
    layout]). Every rank of ``g`` calls it at the same point (the end of a join)."""
    _LAST_LAYOUT.pop(g, None)


def _cached_plan(arrays: list, cap_bytes: int, max_count: Optional[int]) -> tuple:
    """(buckets, the layout's text) for ``arrays``: the text, which every rank's first bucket
    carries (Note [Agreement before refusal] in mpidp/comm/agreement.py), says the shapes and
    dtypes in order and the bucket cap, on which the buckets depend."""
    key = (cap_bytes, max_count,
           tuple((a.dtype, a.shape, getattr(a, "device", None)) for a in arrays))
    planned = _PLANS.pop(key, None)
    if planned is None:
        planned = (plan(arrays, cap_bytes, max_count=max_count), _layout(arrays, cap_bytes))
        while len(_PLANS) >= _PLANS_KEPT:
            del _PLANS[next(iter(_PLANS))]
    _PLANS[key] = planned  # most recently used last
    return planned


def _layout(arrays: list, cap_bytes: int, shown: int = 4) -> str:
    """The text of a group's layout: its tensors' dtypes and shapes (the first ``shown``, and
    a CRC of them all), and the bucket cap."""
    every = [f"{DTYPE_NAMES[a.dtype]}{list(a.shape)}" for a in arrays]
    text = ", ".join(every[:shown]) + (f", ... ({len(every)} tensors, layout "
                                       f"{zlib.crc32(' '.join(every).encode()):#010x})"
                                       if len(every) > shown else "")
    return f"a group of [{text}] in buckets of {cap_bytes} bytes"


def grouped_allreduce_(tensors: Sequence[Any], op: str = "avg", algorithm: str = "auto",
                       bucket_cap_mb: float = 64) -> list:
    """All-reduces every tensor in place through a few fused buckets (one per dtype and
    ``bucket_cap_mb`` MiB); ``op``: sum, avg, min, max. Returns the tensors. Every rank calls
    it with the same shapes and dtypes in the same order."""
    return _grouped(tensors, True, op, algorithm, bucket_cap_mb)


def grouped_allreduce(tensors: Sequence[Any], op: str = "avg", algorithm: str = "auto",
                      bucket_cap_mb: float = 64) -> list:
    """Like ``grouped_allreduce_`` but returns new tensors; the inputs are unchanged."""
    return _grouped(tensors, False, op, algorithm, bucket_cap_mb)


def _new_like(t: Any, a: Any) -> Any:
    if is_device_array(a):
        return device_empty_like(a)[0]
    return t.new_empty(t.shape) if a.is_torch else np.empty_like(t, order="C")


def _grouped(tensors, in_place: bool, op, algorithm, bucket_cap_mb):
    """The fused all-reduce behind both calls. Every check is made before the first bucket
    goes out; a rank whose input fails one refuses the first all-reduce instead, so every
    rank raises (the front door's rule, mpidp.comm.collectives)."""
    g = runtime.group()
    try:
        items = tensor_list(tensors, "tensors")
        if not isinstance(bucket_cap_mb, (int, float)) or not bucket_cap_mb > 0:
            raise ValueError(f"bucket_cap_mb must be a positive number, got {bucket_cap_mb!r}")
        if op not in ("sum", "avg", "min", "max"):
            raise ValueError(f"unknown op {op!r}; accepted: sum, avg, min, max")
        arrays = _views([writable_view(t) for t in items])
        if op == "avg" and any(a.dtype not in FLOATING for a in arrays):
            raise ValueError("op 'avg' needs floating tensors; use 'sum' for integers")
        on_device = bool(arrays) and is_device_array(arrays[0])
        if in_place:
            outs, results = items, arrays
            for a in arrays:
                collectives.check_writable(a)
        else:
            outs = [_new_like(t, a) for t, a in zip(items, arrays)]
            results = _views(outs)
        cap = int(bucket_cap_mb * (1 << 20))
        # in place on one node: buckets small enough in tensor count to go zero-copy
        count = max_tensors(DEVICE if on_device else HOST,
                            collectives.check_algorithm(algorithm, on_device),
                            collectives.facts(g, on_device), cap, in_place)
        buckets, layout = _cached_plan(arrays, cap, count)
    except Exception as exc:
        _LAST_LAYOUT.pop(g, None)
        collectives.refuse(g, ALLREDUCE, exc)
        raise
    last = _LAST_LAYOUT.pop(g, None)
    changed = last is None or last[1] != g.board.failed or (
        last[0] is not layout and last[0] != layout)  # Note [A group's layout]
    if not buckets and g.size > 1:  # an empty group still meets the others' first bucket,
        with agreed(g, layout):     # as a header of no elements
            collectives.agree_on_nothing(g, ALLREDUCE)
    for k, bucket in enumerate(buckets):
        try:
            with agreed(g, layout) if k == 0 and changed else _NOTHING:
                bucket.reduce_([arrays[i] for i in bucket.indices],
                               [results[i] for i in bucket.indices], op, algorithm, g)
        except MismatchError as exc:
            if k or layout in str(exc):
                raise
            raise _with_layout(exc, g.rank, layout) from None
    _LAST_LAYOUT[g] = (layout, g.board.failed)
    if in_place:
        for a in arrays:
            collectives.bump_version(a)
    return outs


def _with_layout(exc: MismatchError, rank: int, layout: str) -> MismatchError:
    """``exc`` saying this rank's layout too (a rank whose layout is unchanged sends none:
    Note [A group's layout])."""
    out = MismatchError(f"{exc}\n  rank {rank} (this rank) called it with {layout}")
    out.headers, out.said = getattr(exc, "headers", None), layout
    return out


def writable_view(t: Any) -> Any:
    """The tensor to write results into: torch leaves are written through a detached view."""
    return t.detach() if getattr(t, "requires_grad", False) else t
