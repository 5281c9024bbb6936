"""Synchronous mirrored training: ``DistributedDataParallel``, PyTorch DDP's interface on
mpidp's fused all-reduce, with each bucket's all-reduce overlapping the rest of backward."""
from __future__ import annotations

import contextlib
import functools
import queue
import threading
import time
from typing import Any, Optional

import numpy as np
import torch

from . import collectives, runtime, timeline
from .errors import MpidpError
from .fingerprint import check_same_buckets, check_same_model
from .buckets import BucketBase
from .fusion import plan
from .state_broadcast import broadcast_tensors_

FIRST_BUCKET_CAP_BYTES = 1 << 20  # PyTorch DDP's first bucket (Note [Bucket order])

# Note [Bucket order]
# Buckets are first filled in reverse registration order (gradients of the last layers are
# ready first). During the first synchronised backward every rank records the order in which
# its gradients actually became ready; afterwards rank 0's order is broadcast and the buckets
# are rebuilt once from it, so every rank has the same buckets in the same order. Buckets
# launch strictly in index order (a ready bucket waits for the ones before it), so every rank
# issues the same all-reduces in the same order whatever its thread timing.

# Note [Communication thread]
# One thread per DistributedDataParallel reduces the buckets one after another — on one node
# a zero-copy all-reduce of the gradients where they lie (Note [Zero-copy buckets] in
# fusion.py), elsewhere pack -> all-reduce (sum) -> unpack with the division by the number of
# ranks fused into the unpack — while autograd goes on computing gradients in the main
# thread; the C calls release the GIL. Only that thread calls MPI while backward runs, and the
# main thread waits for it before it calls MPI again, so MPI_THREAD_SERIALIZED suffices
# (checked at construction; mpidp.init asks for MULTIPLE).

# Note [Gradients as bucket views]
# By default gradients are packed into the bucket, all-reduced as a sum, and unpacked with the
# division fused into the copy. With gradient_as_bucket_view=True (torch's flag) each .grad
# becomes a view of its bucket slot after the first reduction: the all-reduce averages in
# place and nothing is unpacked, and with zero_grad(set_to_none=False) autograd accumulates
# straight into the bucket, so nothing is packed either. Gradients are still packed when
# autograd made fresh tensors (zero_grad's default set_to_none=True).


def _communicate(tasks: queue.SimpleQueue, results: queue.SimpleQueue, board) -> None:
    """The communication thread's loop: one task per bucket, one result (None, or the
    exception) per task. The watchdog's ``board`` says which bucket is being reduced."""
    while True:
        task = tasks.get()
        if task is None:
            return
        bucket, sources, destinations, algorithm, position = task
        board.context = ("DDP gradient bucket {} of {}", *position)
        t0, error = time.perf_counter(), None
        try:
            if destinations is None:  # gradients are bucket views: average in place
                bucket.pack(sources, skip_own_slots=True)
                bucket.allreduce_("avg", algorithm)
            else:
                bucket.reduce_(sources, destinations, "avg", algorithm)
        except BaseException as exc:  # reported by the main thread at the end of backward
            error = exc
        board.context = None
        results.put((error, time.perf_counter() - t0))


def _stop(tasks: queue.SimpleQueue, thread: threading.Thread, timeout_s: float) -> bool:
    """Ends the communication thread after the task it is in (shutdown closed the context
    its waits are in first: Note [Stopping the users first] in mpidp/resources.py) and joins
    it; True once it has ended. Buckets still queued are dropped: nobody waits for them."""
    while not tasks.empty():
        try:
            tasks.get_nowait()
        except queue.Empty:
            break
    tasks.put(None)
    thread.join(timeout_s)
    return not thread.is_alive()


class DistributedDataParallel(torch.nn.Module):
    """Wraps ``module`` for synchronous data-parallel training, as ``torch.nn.parallel.
    DistributedDataParallel`` does: construct it on every rank after ``mpidp.init()``; after
    each ``loss.backward()`` every gradient holds its average over the ranks.

    - On construction rank 0's parameters and buffers are broadcast, and parameter names,
      shapes and dtypes are compared across ranks (a mismatch raises on every rank).
    - ``bucket_cap_mb``: bucket size in MiB (the first bucket at most 1 MiB); one per dtype.
    - ``algorithm``: the all-reduce algorithm of mpidp.allreduce (auto, shm, ring, hier, mpi).
    - ``broadcast_buffers``: rank 0's buffers are broadcast at every forward with grad enabled.
    - ``find_unused_parameters``: a parameter with no gradient on a rank contributes zeros (or
      its accumulated gradient); without it, such a parameter is an error naming it.
    - ``no_sync()``: gradients accumulate locally; the next synchronised backward reduces the
      sum.
    Accepted for drop-in compatibility with torch's signature: ``device_ids`` and
    ``output_device`` (None, or the module's one device: on a GPU the buckets stay on it,
    mpidp.gpu), ``dim=0``, ``process_group=None``, ``static_graph``
    (a hint, no effect here); ``gradient_as_bucket_view`` as torch's (Note [Gradients as
    bucket views])."""

    def __init__(self, module: torch.nn.Module, device_ids: Any = None,
                 output_device: Any = None, dim: int = 0, broadcast_buffers: bool = True,
                 process_group: Any = None, bucket_cap_mb: Optional[float] = 25,
                 find_unused_parameters: bool = False, gradient_as_bucket_view: bool = False,
                 static_graph: bool = False, algorithm: str = "auto"):
        super().__init__()
        _validate(module, device_ids, output_device, dim, process_group, bucket_cap_mb,
                  algorithm)
        g = runtime.group()
        _check_thread_level()
        self.module = module
        self.broadcast_buffers = bool(broadcast_buffers)
        self.find_unused_parameters = bool(find_unused_parameters)
        self.algorithm = algorithm
        self.gradient_as_bucket_view = bool(gradient_as_bucket_view)
        self.bucket_cap_bytes = int((25 if bucket_cap_mb is None else bucket_cap_mb) * (1 << 20))
        self.require_backward_grad_sync = True  # torch's name; False inside no_sync()
        named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
        self._names = [n for n, _ in named]
        self._params = [p for _, p in named]
        self._module_buffers = list(module.buffers())
        check_same_model(g, module, "DistributedDataParallel")
        broadcast_tensors_([p.detach() for p in module.parameters()] + self._module_buffers, 0)
        self._size = g.size
        self._on_gpu = any(p.is_cuda for p in self._params)
        self._build(tuple(reversed(range(len(self._params)))))  # Note [Bucket order]
        self._rebuilt = False
        self._in_backward = False
        self._tasks: queue.SimpleQueue = queue.SimpleQueue()
        self._results: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: Optional[threading.Thread] = None
        self.comm_stats = {"steps": 0, "wait_s": 0.0, "comm_s": 0.0}
        for i, p in enumerate(self._params):
            p.register_post_accumulate_grad_hook(functools.partial(self._mark_ready, i))

    # ---- buckets ------------------------------------------------------------------------

    def _build(self, order: tuple) -> None:
        """Buckets from ``order``, their layout checked across ranks. Every rank calls it."""
        first = min(FIRST_BUCKET_CAP_BYTES, self.bucket_cap_bytes)
        self._buckets = plan([p.detach() for p in self._params], self.bucket_cap_bytes, first,
                             order) if self._params else []
        check_same_buckets(runtime.group(), self._buckets, "DistributedDataParallel")
        self._bucket_of = [0] * len(self._params)
        self._slots = [None] * len(self._params)  # Note [Gradients as bucket views]
        for b, bucket in enumerate(self._buckets):
            for pos, i in enumerate(bucket.indices):
                self._bucket_of[i] = b
                if self.gradient_as_bucket_view:
                    self._slots[i] = bucket.torch_view(pos, self._params[i])

    @property
    def bucket_indices(self) -> tuple:
        """The current buckets, each a tuple of indices into the trainable parameters."""
        return tuple(b.indices for b in self._buckets)

    # ---- forward and backward -----------------------------------------------------------

    def forward(self, *args, **kwargs):
        if self._in_backward:
            raise MpidpError("forward called while the previous backward is still reducing")
        if self.broadcast_buffers and self._module_buffers and self._size > 1 \
                and torch.is_grad_enabled():
            broadcast_tensors_(self._module_buffers, 0)
        return self.module(*args, **kwargs)

    @contextlib.contextmanager
    def no_sync(self):
        """Within this context backward accumulates gradients locally without communicating;
        the first synchronised backward after it reduces the accumulated sum."""
        previous = self.require_backward_grad_sync
        self.require_backward_grad_sync = False
        try:
            yield
        finally:
            self.require_backward_grad_sync = previous

    def _start_backward(self) -> None:
        self._in_backward = True
        self._ready = [False] * len(self._params)
        self._pending = [len(b.indices) for b in self._buckets]
        self._next = 0
        self._order: list = []
        if self._thread is None:
            g = runtime.group()
            self._thread = threading.Thread(target=_communicate, daemon=True,
                                            args=(self._tasks, self._results, g.board),
                                            name="mpidp-ddp-comm")
            self._thread.start()
            # Note [Stopping the users first] in mpidp/resources.py
            g.resources.add_user(functools.partial(_stop, self._tasks, self._thread))
        torch.autograd.Variable._execution_engine.queue_callback(self._finish_backward)

    def _mark_ready(self, i: int, param: torch.Tensor) -> None:
        """Gradient hook: parameter i's gradient is final for this backward."""
        if not self.require_backward_grad_sync:
            return
        if not self._in_backward:
            self._start_backward()
        if self._ready[i]:
            raise MpidpError(f"parameter {self._names[i]!r} received its gradient twice in one "
                             "backward (reentrant backward or a shared parameter used across "
                             "two backward passes); mpidp reduces each gradient once")
        self._ready[i] = True
        if not self._rebuilt:
            self._order.append(i)  # Note [Bucket order]
        self._count_down(i)

    def _count_down(self, i: int) -> None:
        b = self._bucket_of[i]
        self._pending[b] -= 1
        while self._next < len(self._buckets) and self._pending[self._next] == 0:
            self._launch(self._buckets[self._next])
            self._next += 1

    def _launch(self, bucket: BucketBase) -> None:
        if timeline.ON:
            timeline.instant("bucket ready", {"bucket": self._next, "bytes": bucket.nbytes})
        if self._size == 1 and not self.gradient_as_bucket_view:
            self._results.put((None, 0.0))  # one rank: each gradient already is the average
            return
        params = [self._params[i] for i in bucket.indices]
        sources = [p.grad for p in params]
        # parameters without a gradient here are settled after the used-map exchange
        dests = None if self.gradient_as_bucket_view else \
            [p.grad if self._ready[i] else None for i, p in zip(bucket.indices, params)]
        bucket.capture_stream()  # on a GPU: the stream these gradients were produced on
        self._tasks.put((bucket, sources, dests, self.algorithm,
                         (self._next + 1, len(self._buckets))))

    @timeline.traced("wait for buckets")
    def _finish_backward(self) -> None:
        """Runs when autograd finishes: every bucket reduced and unpacked, unused parameters
        settled, buckets rebuilt after the first iteration."""
        try:
            for i, ready in enumerate(self._ready):
                if not ready:
                    self._count_down(i)
            t0 = time.perf_counter()
            error, comm_s = None, 0.0
            for _ in self._buckets:
                exc, seconds = self._results.get()
                comm_s += seconds
                error = error or exc
            for bucket in self._buckets:
                bucket.join_stream()  # on a GPU: the optimizer's stream after the unpacks
            self.comm_stats["wait_s"] += time.perf_counter() - t0
            self.comm_stats["comm_s"] += comm_s
            self.comm_stats["steps"] += 1
            if error is not None:
                raise error
            self._settle_unused()
            if self.gradient_as_bucket_view:
                for i, p in enumerate(self._params):
                    if self._ready[i] and p.grad is not self._slots[i]:
                        p.grad = self._slots[i]
            if not self._rebuilt:
                self._rebuild()
        finally:
            self._in_backward = False

    def _settle_unused(self) -> None:
        used = np.array(self._ready, dtype=np.int32)
        if self._size > 1:  # a host array: the module's algorithm is for its device's arrays
            collectives.allreduce_(used, "sum", "auto" if self._on_gpu else self.algorithm)
        elif used.all():
            return
        if not self.find_unused_parameters:
            missing = [f"{self._names[i]} (on {self._size - int(u)} of {self._size} ranks)"
                       for i, u in enumerate(used) if u < self._size]
            if missing:
                raise MpidpError(
                    "these parameters received no gradient in this backward: "
                    + ", ".join(missing) + ". Pass find_unused_parameters=True to "
                    "DistributedDataParallel if parts of the model are legitimately unused "
                    "(every rank raises this error)")
            return
        for i, ready in enumerate(self._ready):
            if ready or used[i] == 0:
                continue  # unused on every rank: the gradient stays as it was (None)
            p = self._params[i]
            if self.gradient_as_bucket_view:
                p.grad = self._slots[i]
                continue
            if p.grad is None:
                p.grad = torch.empty_like(p)
            bucket = self._buckets[self._bucket_of[i]]
            bucket.unpack_one(bucket.indices.index(i), p.grad)

    def _rebuild(self) -> None:
        """Note [Bucket order]: rank 0's ready order, broadcast, becomes everyone's."""
        seen = set(self._order)
        order = np.array(self._order + [i for i in reversed(range(len(self._params)))
                                        if i not in seen], dtype=np.int64)
        if self._size > 1:
            collectives.broadcast_(order, 0)
        self._build(tuple(int(i) for i in order))
        self._rebuilt = True


def _validate(module, device_ids, output_device, dim, process_group, bucket_cap_mb, algorithm):
    if not isinstance(module, torch.nn.Module):
        raise TypeError(f"module must be a torch.nn.Module, got {type(module).__name__}")
    home = {p.device for p in module.parameters()}
    if len(home) > 1:
        raise ValueError(f"the module's parameters are on several devices ({sorted(map(str, home))});"
                         " one rank's replica lives on one device")
    for what, value in (("device_ids", device_ids), ("output_device", output_device)):
        devices = value if isinstance(value, (list, tuple)) else [value]
        if what == "device_ids" and len(devices) > 1:
            raise ValueError(f"device_ids={value!r}: one device per rank (as torch's DDP for a "
                             "single-device module)")
        for d in devices:
            if d is None:
                continue
            dev = torch.device(f"cuda:{d}" if isinstance(d, int) else d)
            here = next(iter(home), None)
            if here is not None and (dev.type != here.type or
                                     dev.index is not None and dev.index != here.index):
                raise ValueError(f"{what}={value!r}: the module's parameters are on "
                                 f"{next(iter(home))}; move the module there first "
                                 "(module.to(device)), as with torch's DDP")
    if dim != 0:
        raise ValueError(f"dim={dim!r}: only dim=0 is supported (as torch's default)")
    if process_group is not None:
        raise ValueError("process_group: pass the communicator to mpidp.init(comm) instead")
    if bucket_cap_mb is not None and (not isinstance(bucket_cap_mb, (int, float))
                                      or isinstance(bucket_cap_mb, bool)
                                      or not bucket_cap_mb > 0):
        raise ValueError(f"bucket_cap_mb must be a positive number, got {bucket_cap_mb!r}")
    collectives.check_algorithm(algorithm, any(p.is_cuda for p in module.parameters()))


def _check_thread_level() -> None:
    """Note [Communication thread]: SERIALIZED or better."""
    from mpi4py import MPI
    level = MPI.Query_thread()
    if level < MPI.THREAD_SERIALIZED:
        raise MpidpError(f"DistributedDataParallel needs MPI_THREAD_SERIALIZED or better; "
                         f"MPI was initialised with level {level} (let mpidp.init() start MPI,"
                         " or call MPI.Init_thread(MPI.THREAD_MULTIPLE) yourself)")
