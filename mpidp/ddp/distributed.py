"""Synchronous mirrored training: ``DistributedDataParallel``, PyTorch DDP's interface on
mpidp's fused all-reduce, with each bucket's all-reduce overlapping the rest of backward."""
from __future__ import annotations

import contextlib
import functools
import time
import warnings
from typing import Any, Callable, Optional

import numpy as np
import torch
from torch.distributed.algorithms.join import Join

from ..comm import collectives
from .. import config, runtime
from . import sync_bn
from ..runtime import timeline
from .audit import ReplicaDivergenceError, checksums, divergence
from .hooks import attach, check_hook, describe_hook, fused_wire, reduce_scatters, run_hook
from .args import agree, check_audit, validate
from .join import JoinSupport
from ..errors import MismatchError, MpidpError
from ..comm.fingerprint import check_same, check_same_buckets, check_same_model
from ..comm import scheduler
from ..comm.buckets import BucketBase
from ..comm.fusion import plan
from ..comm.scheduler import FIRST_BUCKET_BYTES, BucketLaunch, SchedulerStoppedError
from ..comm.state_broadcast import broadcast_tensors_

# Note [Bucket order]
# Buckets are first filled in reverse registration order (gradients of the last layers are
# ready first). During the first synchronised backward every rank records the order in which
# its gradients actually became ready; afterwards rank 0's order is broadcast and the buckets
# are rebuilt once from it, so every rank has the same buckets in the same order. Buckets
# launch strictly in index order (a ready bucket waits for the ones before it), so every rank
# issues the same all-reduces in the same order whatever its thread timing: each to the
# group's communication thread (mpidp.comm.scheduler.BucketLaunch, which Horovod's
# DistributedOptimizer launches its buckets with too), while autograd goes on.

# Note [Gradients as bucket views]
# By default gradients are packed into the bucket, all-reduced as a sum, and unpacked with the
# division fused into the copy. With gradient_as_bucket_view=True (torch's flag) each .grad
# becomes a view of its bucket slot after the first reduction: the all-reduce averages in
# place and nothing is unpacked, and with zero_grad(set_to_none=False) autograd accumulates
# straight into the bucket, so nothing is packed either. Gradients are still packed when
# autograd made fresh tensors (zero_grad's default set_to_none=True).


class DistributedDataParallel(torch.nn.Module, JoinSupport):
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
    mpidp.engine.gpu), ``dim=0``, ``process_group=None``, ``static_graph``
    (a hint, no effect here); ``gradient_as_bucket_view`` as torch's (Note [Gradients as
    bucket views]).
    ``torch.nn.SyncBatchNorm`` layers in ``module`` become mpidp.SyncBatchNorm (on any device;
    Note [Synchronised batch statistics] in mpidp/ddp/sync_bn.py); one bound to a process group
    of its own is refused."""

    def __init__(self, module: torch.nn.Module, device_ids: Any = None,
                 output_device: Any = None, dim: int = 0, broadcast_buffers: bool = True,
                 process_group: Any = None, bucket_cap_mb: Optional[float] = 25,
                 find_unused_parameters: bool = False, gradient_as_bucket_view: bool = False,
                 static_graph: bool = False, algorithm: str = "auto",
                 audit_every: Optional[int] = None, audit_action: Optional[str] = None):
        torch.nn.Module.__init__(self)
        JoinSupport.__init__(self)
        g = runtime.group()
        cfg = config.get()
        every = cfg.audit_every if audit_every is None else audit_every
        action = cfg.audit_action if audit_action is None else audit_action
        agree(g, lambda: (validate(module, device_ids, output_device, dim, process_group,
                                   bucket_cap_mb, algorithm), check_audit(every, action)),
              [("broadcast_buffers", bool(broadcast_buffers)),
               ("find_unused_parameters", bool(find_unused_parameters)),
               ("gradient_as_bucket_view", bool(gradient_as_bucket_view)),
               ("algorithm", algorithm), ("bucket_cap_mb", bucket_cap_mb),
               ("audit_every", every), ("audit_action", action)])
        scheduler.check_thread_level()
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
        self.audit_every, self.audit_action = every, action
        self._audit_names = [n for n, _ in module.named_parameters()]
        self.sync_batchnorm_layers = sync_bn.adopt(module, self._reduce_in_order)
        check_same_model(g, module, "DistributedDataParallel")
        broadcast_tensors_([p.detach() for p in module.parameters()] + self._module_buffers, 0)
        self._size = g.size
        self._on_gpu = any(p.is_cuda for p in self._params)
        self._build(tuple(reversed(range(len(self._params)))))  # Note [Bucket order]
        self._rebuilt = False
        self._hook: Optional[tuple] = None  # (state, hook): Note [Communication hooks]
        self._hook_agreed = False
        self._order: list = []  # Note [Bucket order]: the ready order of the first backward
        self._in_backward = False
        self._scheduler: Optional[scheduler.Scheduler] = None  # from the first backward
        self.comm_stats = {"steps": 0, "wait_s": 0.0, "comm_s": 0.0}
        self._grad_hooks = [p.register_post_accumulate_grad_hook(
            functools.partial(self._mark_ready, i)) for i, p in enumerate(self._params)]

    # ---- buckets ------------------------------------------------------------------------

    def _build(self, order: tuple) -> None:
        """Buckets from ``order``, their layout checked across ranks. Every rank calls it."""
        first = min(FIRST_BUCKET_BYTES, self.bucket_cap_bytes)
        self._buckets = plan([p.detach() for p in self._params], self.bucket_cap_bytes, first,
                             order) if self._params else []
        check_same_buckets(runtime.group(), self._buckets, "DistributedDataParallel")
        self._bucket_index = {id(b): k for k, b in enumerate(self._buckets)}
        self._hook_buffers: dict = {}  # Note [Communication hooks]
        self._bucket_of = [0] * len(self._params)
        self._slots = [None] * len(self._params)  # Note [Gradients as bucket views]
        for b, bucket in enumerate(self._buckets):
            for pos, i in enumerate(bucket.indices):
                self._bucket_of[i] = b
                if self.gradient_as_bucket_view:
                    self._slots[i] = bucket.torch_view(pos, self._params[i])
        self._bucket_launch = BucketLaunch([len(b.indices) for b in self._buckets],
                                           self._bucket_of, "DDP gradient bucket {} of {}")

    @property
    def bucket_indices(self) -> tuple:
        """The current buckets, each a tuple of indices into the trainable parameters."""
        return tuple(b.indices for b in self._buckets)

    # ---- forward and backward -----------------------------------------------------------

    def forward(self, *args, **kwargs):
        if self._in_backward:
            raise MpidpError("forward called while the previous backward is still reducing")
        if torch.is_grad_enabled():
            work = Join.notify_join_context(self)  # Note [Uneven inputs]
            if work is not None:
                work.wait()
                self._syncing_ranks(int(self.require_backward_grad_sync))
        if self.broadcast_buffers and self._module_buffers and self._size > 1 \
                and torch.is_grad_enabled():
            broadcast_tensors_(self._module_buffers, 0)
        return self.module(*args, **kwargs)

    def abandon(self) -> None:
        """Leaves this DDP after its group lost a rank (Note [In-job recovery] in
        mpidp/runtime/recovery.py): its gradient hooks come off the module, so a DDP made on
        the group's successor is the only one that reduces. This rank only."""
        for handle in self._grad_hooks:
            handle.remove()
        self._grad_hooks = []

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

    def register_comm_hook(self, state: Any, hook: Callable) -> None:
        """torch's ``register_comm_hook``: every bucket is averaged by ``hook(state, bucket)``
        (a future of the averaged flat tensor) instead of mpidp's all-reduce (Note
        [Communication hooks] in mpidp/ddp/hooks.py). Once, before the first backward."""
        check_hook(state, hook)
        if self._hook is not None:
            raise RuntimeError("register_comm_hook can only be called once")
        if self.comm_stats["steps"] or self._in_backward:
            raise RuntimeError("register_comm_hook must be called before the first backward")
        attach(state, hook, self)  # Note [Hook capabilities] in mpidp/ddp/hooks.py
        self._hook = (state, hook)

    def _agree_on_hook(self) -> None:
        """At the first synchronised backward (or its shadow under Join): whether a
        communication hook is registered must agree across ranks, or they would reduce their
        buckets on different groups, and then which hook with which state (Note
        [Communication hooks]); a MismatchError on every rank otherwise, and the next
        synchronised backward checks again. Collective."""
        if self._size > 1:
            mine = np.array([[int(self._hook is not None)]], np.int64)
            flags = collectives.allgather(mine)[:, 0]
            if len(set(flags.tolist())) > 1:
                raise MismatchError(
                    f"rank {runtime.rank()}: DistributedDataParallel: a communication hook is "
                    "registered on ranks " + ", ".join(str(r) for r, f in enumerate(flags) if f)
                    + " only: call register_comm_hook on every rank (every rank raises this "
                    "error)")
            if self._hook is not None:  # the same hook and state: Note [Communication hooks]
                check_same(runtime.group(), describe_hook(*self._hook),
                           "DistributedDataParallel", "the communication hooks")
        self._hook_agreed = True

    def _start_backward(self) -> None:
        self._in_backward = True
        self._ready = [False] * len(self._params)
        self._order: list = []
        if self._scheduler is None or self._scheduler.stopped:
            # Note [One communication thread per group] in mpidp/comm/scheduler.py
            self._scheduler = scheduler.of(runtime.group(), "mpidp-ddp-comm")
        self._bucket_launch.begin(self._scheduler)
        torch.autograd.Variable._execution_engine.queue_callback(self._finish_backward)
        if not self._hook_agreed:  # after the thread started: a wait here is a bucket's wait
            try:
                self._agree_on_hook()
            except BaseException:
                self._in_backward = False
                raise

    def _reduce_in_order(self, t: torch.Tensor) -> None:
        """A SyncBatchNorm layer's all-reduce (sum, in place): during backward after the
        buckets launched before it, with the communication thread parked, so every rank
        makes its collectives in one order (Note [One communication thread per group] in
        mpidp/comm/scheduler.py); otherwise here."""
        if self._size == 1:
            return
        if not self._in_backward or self._scheduler is None:
            collectives.allreduce_(t, "sum")
            return
        with self._scheduler.parked():
            collectives.allreduce_(t, "sum")

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
        launch = self._bucket_launch
        for k in launch.ready(i):
            launch.submit(k, self._bucket_task(k))

    def _bucket_task(self, k: int) -> Optional[Callable[[], None]]:
        """Bucket ``k``'s reduction, to run on the communication thread (BucketLaunch); None
        where there is nothing to do."""
        bucket = self._buckets[k]
        if timeline.ON:
            timeline.instant("bucket ready", {"bucket": k, "bytes": bucket.nbytes})
        if self._size == 1 and not self.gradient_as_bucket_view and \
                (self._hook is None or reduce_scatters(self._hook[1])):
            return None  # one rank: each gradient already is the average
        params = [self._params[i] for i in bucket.indices]
        sources = [p.grad for p in params]
        # parameters without a gradient here are settled after the used-map exchange
        dests = None if self.gradient_as_bucket_view else \
            [p.grad if self._ready[i] else None for i, p in zip(bucket.indices, params)]
        bucket.capture_stream()  # on a GPU: the stream these gradients were produced on
        return self._reduction(bucket, sources, dests)

    def _reduce(self, bucket: BucketBase, sources: list, destinations) -> None:
        """Averages one bucket (collective): ``_reduction``'s, run here."""
        self._reduction(bucket, sources, destinations)()

    def _reduction(self, bucket: BucketBase, sources: list, destinations) -> Callable:
        """The averaging of one bucket, to call (collective): mpidp's all-reduce — the
        bucket's own method where it is one, so that the communication thread calls down
        only — or the communication hook (Note [Communication hooks] in
        mpidp/ddp/hooks.py)."""
        hook, g = self._hook, runtime.group()  # the group, passed down from here
        if hook is None or (reduce_scatters(hook[1]) and not self._rebuilt):
            if destinations is None:  # Note [Gradients as bucket views]
                return functools.partial(_average_in_place, bucket, sources, self.algorithm,
                                         g)
            return functools.partial(bucket.reduce_, sources, destinations, "avg",
                                     self.algorithm, g)
        if reduce_scatters(hook[1]):  # Note [ZeRO] in mpidp/ddp/zero.py
            return functools.partial(bucket.reduce_scatter_, sources, self.algorithm,
                                     self._params[bucket.indices[0]].dtype, g)
        wire = fused_wire(hook[1], bucket)
        if wire is not None:  # Note [Compressed buckets] in mpidp/ddp/compression.py
            return functools.partial(bucket.reduce_cast_, sources, destinations, wire,
                                     self.algorithm, g)
        k = self._bucket_index[id(bucket)]
        return functools.partial(run_hook, *hook, bucket, sources, destinations,
                                 [self._params[i] for i in bucket.indices], k,
                                 k == len(self._buckets) - 1, self._hook_buffers)

    @timeline.traced("wait for buckets")
    def _finish_backward(self) -> None:
        """Runs when autograd finishes: every bucket reduced and unpacked, unused parameters
        settled, buckets rebuilt after the first iteration."""
        try:
            launch = self._bucket_launch
            for k in launch.rest():  # those holding a parameter without a gradient
                launch.submit(k, self._bucket_task(k))
            t0 = time.perf_counter()
            error, comm_s = launch.wait()
            for bucket in self._buckets:
                bucket.join_stream()  # on a GPU: the optimizer's stream after the unpacks
            self.comm_stats["wait_s"] += time.perf_counter() - t0
            self.comm_stats["comm_s"] += comm_s
            self.comm_stats["steps"] += 1
            if isinstance(error, SchedulerStoppedError):
                raise error  # shutdown has begun: no collective can follow
            self._settle_unused(error)
            if self.audit_every and self.comm_stats["steps"] % self.audit_every == 0:
                self._audit()
            if self.gradient_as_bucket_view:
                for i, p in enumerate(self._params):
                    if self._ready[i] and p.grad is not self._slots[i]:
                        p.grad = self._slots[i]
            if not self._rebuilt:
                self._rebuild()
        finally:
            self._in_backward = False

    def _audit(self) -> None:
        """Note [Replica audit] in mpidp/ddp/audit.py. Collective."""
        mine = checksums(list(self.module.parameters()))
        table = collectives.allgather(mine.reshape(1, -1)) if self._size > 1 else mine[None]
        message = divergence(table, self._audit_names, self.comm_stats["steps"])
        if message is None:
            return
        if self.audit_action == "warn":
            if runtime.rank() == 0:
                warnings.warn(message, RuntimeWarning, stacklevel=2)
            return
        raise ReplicaDivergenceError(message + " (every rank raises this error)")

    def _exchange_used(self, ready, failed: bool) -> np.ndarray:
        """How many ranks used each parameter, and (last) how many failed to reduce their
        buckets (a communication hook's error may be one rank's alone). Collective."""
        used = np.array(list(ready) + [int(failed)], dtype=np.int32)
        if self._size > 1:  # a host array: the module's algorithm is for its device's arrays
            collectives.allreduce_(used, "sum", "auto" if self._on_gpu else self.algorithm)
        return used

    def _settle_unused(self, error: Optional[BaseException]) -> None:
        """Every rank learns which parameters were used anywhere, and whether a rank failed
        (``error``: this rank's), which then raises on every rank."""
        used = self._exchange_used(self._ready, error is not None)
        failed = int(used[-1])
        used = used[:-1]
        if error is not None:
            raise error
        if failed:
            raise MpidpError(f"{failed} rank(s) failed to reduce this backward's gradients "
                             "(their own error says why); every other rank raises this error")
        if used.all() and self._size == 1:
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


def _average_in_place(bucket: BucketBase, sources: list, algorithm: str, g) -> None:
    """Averages ``bucket`` over the ranks in place, ``sources`` packed first where they are
    not its views already (None: zeros; Note [Gradients as bucket views]). Collective."""
    bucket.pack(sources, skip_own_slots=True)
    bucket.allreduce_("avg", algorithm, g)
