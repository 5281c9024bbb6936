"""DistributedOptimizer's all-reduces during the backward pass (Note [Gradients during
backward]): each optimizer's buckets, launched as their gradients become final, in one order
on every rank, on the communication thread of the group made by ``init`` (mpidp.comm.
scheduler), which every DistributedOptimizer of the process shares; and the gate that puts
hvd's other collectives in their place in that order."""
from __future__ import annotations

import contextlib
import functools
import itertools
import threading
import weakref
from typing import Callable, Sequence

import torch

from .. import runtime
from ..comm import scheduler
from ..comm.fusion import assign_buckets
from ..comm.scheduler import FIRST_BUCKET_BYTES, BucketLaunch
from ..engine import header

BUCKET_CAP_BYTES = 25 << 20    # a larger bucket only starts its all-reduce later (DDP's cap)

# Note [Gradients during backward]
# Horovod's DistributedOptimizer starts each gradient's all-reduce from a hook as autograd
# accumulates it, and its background thread negotiates an order with the other ranks. mpidp
# negotiates nothing: an optimizer's parameters are cut into buckets once (its own order
# reversed, since the last layers' gradients are ready first: mpidp's size-capped buckets,
# or Horovod's groups= / num_groups= where given), and buckets launch strictly in that order,
# a ready bucket waiting for the ones before it, so every rank queues the same all-reduces in
# the same order whatever its timing (mpidp.comm.scheduler.BucketLaunch, as DDP's). The
# communication thread of the group made by ``init`` runs the queue for every
# DistributedOptimizer (two optimizers stepping on one backward queue into its one order:
# Note [One communication thread per group] in mpidp/comm/scheduler.py).
# synchronize() launches what is left (a parameter without a gradient
# contributes zeros, as in Horovod) and waits for every bucket. A sparse gradient is
# gathered in its bucket's place, outside its fused buffer (Note [Sparse gradients] in
# mpidp/horovod/sparse.py).
# A collective hvd makes on the user's thread while an optimizer has buckets under way —
# SyncBatchNorm's backward, the backward of hvd.allreduce / allgather / broadcast, a metric
# between backward and step, a process set added — goes through ``gate``: it waits until the
# thread has done the buckets queued before it and runs with the thread parked
# (Scheduler.parked), so it too has one place in the order on every rank. Outside the
# backward pass the gate first launches every bucket left (with zeros; the optimizers in the
# order they were made), because a rank where some parameter got no gradient holds back a
# bucket the others have queued. Where ranks still differ — such a rank inside the backward
# pass, a rank whose backward made no bucket ready at all, two optimizers whose buckets
# became ready in another order — one rank's call meets another's: each bucket's all-reduce
# carries the names of its tensors in its header (Resources.stamped; Horovod's names, from
# named_parameters, or allreduce.noname.<set>.<optimizer>.<index>), so the check raises on
# every rank, naming the buckets, instead of averaging one tensor with another.
# On a GPU each bucket runs on the stream its gradients were produced on, and the caller's
# stream waits for it. A bucket queued to a thread that stopped (hvd.shutdown) fails at
# synchronize (SchedulerStoppedError) instead of being waited for.

_lock = threading.RLock()  # hooks may run on several autograd threads (CPU and GPU parameters)
# serial -> a weak reference to each Buckets with a gradient final since its last finish
# (hvd's calls are gated then; a plain dict: its truth is read on hvd's every call); weak, so
# an optimizer dropped without a step leaves a dead entry that the next gate removes
active: dict = {}
_serials = itertools.count()  # Buckets in the order they were made: the flush's order


def _scheduler() -> scheduler.Scheduler:
    """The communication thread of the group made by ``init``, started on first use."""
    return scheduler.of(runtime.init_group(), "mpidp-hvd-comm")


def _running():
    """The communication thread of the group made by ``init`` where it runs, else None."""
    return scheduler.find(runtime.init_group()) if runtime.is_initialized() else None


@contextlib.contextmanager
def gate():
    """The block's collectives in their place after the buckets: outside the backward pass
    every bucket with a gradient final is launched first, the rest with zeros (a rank where
    some parameter got no gradient would otherwise hold back a bucket the others queued),
    then the thread, once done with what was queued, waits for the block."""
    s = _running()
    if s is not None and s.here():
        yield  # on the thread itself (a Compression's own hvd call), or inside a gate
        return
    with _lock:
        if torch._C._current_autograd_node() is None:
            for serial in sorted(active):
                buckets = active[serial]()
                if buckets is None:
                    del active[serial]
                else:
                    buckets.launch_rest()
    s = _running()
    if s is None:
        yield
        return
    with s.parked():
        yield


def tag(k: int, n: int, names: Sequence[str], gathered: Sequence[str] = ()) -> int:
    """The stamp bucket ``k`` of ``n``'s all-reduce carries in its header (Resources.stamped),
    from the names of its tensors and of those whose sparse gradients it gathers (Note
    [Sparse gradients] in mpidp/horovod/sparse.py)."""
    tensors = names[0] if len(names) == 1 else \
        f"{names[0]} … {names[-1]}, {len(names)} tensors"
    sparse = f", sparse gradients gathered: {', '.join(gathered)}" if gathered else ""
    return header.site_hash(f"DistributedOptimizer bucket {k + 1} of {n} ({tensors}{sparse})")


def groups_of(params: Sequence[torch.Tensor], groups, cap_bytes: int) -> tuple:
    """The buckets (tuples of indices into ``params``, in launch order): Horovod's ``groups``
    (a number of contiguous groups, or lists of parameters, each one not in a list a group of
    its own), else mpidp's size-capped buckets; the last parameters first."""
    n = len(params)
    if groups is None:
        cap = min(cap_bytes, BUCKET_CAP_BYTES)
        return assign_buckets([p.numel() * p.element_size() for p in params],
                              [p.dtype for p in params], cap, min(FIRST_BUCKET_BYTES, cap),
                              tuple(reversed(range(n))))
    if isinstance(groups, bool) or not isinstance(groups, (int, list)) or \
            (isinstance(groups, int) and groups < 1):
        raise ValueError(f"groups should be a positive integer or a list of lists of "
                         f"torch.Tensor, got {groups!r}")
    if isinstance(groups, int):
        return tuple(tuple(run) for run in reversed(_split(n, groups)) if run)
    index = {id(p): i for i, p in enumerate(params)}
    taken: dict = {}
    made = []
    for k, members in enumerate(groups):
        if not isinstance(members, (list, tuple)):
            raise ValueError(f"groups[{k}] should be a list of parameters")
        mine = []
        for p in members:
            if not isinstance(p, torch.Tensor):
                raise ValueError(f"groups[{k}] holds a {type(p).__name__}, not a parameter")
            if not p.requires_grad:
                continue  # frozen: no gradient to reduce, as Horovod hooks none
            i = index.get(id(p))
            if i is None:
                raise ValueError(f"groups[{k}] holds a tensor that is not one of the "
                                 "optimizer's parameters")
            if i in taken:
                raise ValueError(f"a parameter is in groups[{taken[i]}] and groups[{k}]")
            taken[i] = k
            mine.append(i)
        if mine:
            made.append(tuple(sorted(mine)))
    made += [(i,) for i in range(n) if i not in taken]
    # complete when its first parameter's gradient is, which backward makes last
    return tuple(sorted(made, key=lambda b: -b[0]))


def _split(n: int, parts: int) -> list:
    """range(n) in ``parts`` contiguous runs as even as can be (the first ones longer)."""
    size, extra = divmod(n, parts)
    out, start = [], 0
    for k in range(parts):
        end = start + size + (k < extra)
        out.append(range(start, end))
        start = end
    return out


class Buckets:
    """One optimizer's buckets over its ``params``: ``ready(i)`` as parameter i's gradient is
    final, ``finish()`` at synchronize. ``task(params, k)`` (called on the launching thread)
    returns the function that all-reduces bucket k's gradients on the thread."""

    def __init__(self, params: list, buckets: tuple,
                 task: Callable[[list, int], Callable[[], None]]):
        self.params, self.buckets, self._task = params, buckets, task
        self.serial, self._ref = next(_serials), weakref.ref(self)
        self._launch = BucketLaunch([len(b) for b in buckets],
                                    {i: k for k, b in enumerate(buckets) for i in b},
                                    "DistributedOptimizer gradient bucket {} of {}")
        self.stats = {"steps": 0, "buckets": 0, "launched_in_backward": 0}
        self._streams: list = []

    def ready(self, i: int) -> None:
        with _lock:
            active[self.serial] = self._ref
            for k in self._launch.ready(i):
                self._submit(k)
                self.stats["launched_in_backward"] += 1

    def launch_rest(self) -> None:
        with _lock:
            for k in self._launch.rest():
                self._submit(k)

    def _submit(self, k: int) -> None:
        members = [self.params[i] for i in self.buckets[k]]
        fn = self._task(members, k)
        if members[0].is_cuda:  # the stream the gradients were produced on
            stream = torch.cuda.current_stream(members[0].device)
            self._streams.append(stream)
            fn = functools.partial(_on_stream, stream, fn)
        if self._launch.scheduler is None:  # this pass's first bucket
            self._launch.scheduler = _scheduler()
        self._launch.submit(k, fn)

    def abandon(self) -> None:
        """Forgets this pass, launched buckets and all, without waiting (after a lost rank,
        the state restored: hvd.elastic, Note [Elastic on in-job recovery] in
        mpidp/horovod/elastic.py)."""
        with _lock:
            self._launch.abandon()
            self._streams = []
            active.pop(self.serial, None)

    def finish(self) -> None:
        """Launches the buckets not launched yet, waits for every one, and raises the first
        error a bucket met (every rank then raises: a refused or failed all-reduce fails on
        every rank)."""
        try:
            self.launch_rest()
        finally:
            error, _ = self._launch.wait()
            for stream in self._streams:
                torch.cuda.current_stream(stream.device).wait_stream(stream)
            self.stats["steps"] += 1
            self.stats["buckets"] += len(self.buckets)
            with _lock:
                self._streams = []
                active.pop(self.serial, None)
                self._launch.begin(None)
        if error is not None:
            raise error


def _on_stream(stream, fn: Callable[[], None]) -> None:
    with torch.cuda.stream(stream):
        fn()
