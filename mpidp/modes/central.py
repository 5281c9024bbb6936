"""Central-storage training (TensorFlow's CentralStorageStrategy on MPI): every rank computes
gradients on its replica, the gradients are reduced to the root (a reduce, not an all-reduce),
the root alone holds the optimizer and its state and steps, and broadcasts the new
parameters."""
from __future__ import annotations

import time
from typing import Any, Callable, Optional

import torch

from ..comm import collectives
from .. import runtime
from ..runtime import timeline
from ..comm.fingerprint import check_same_buckets, check_same_model
from ..comm.fusion import plan
from ..comm.state_broadcast import broadcast_tensors_

DEFAULT_BUCKET_CAP_BYTES = 25 << 20


class CentralStorage:
    """Wraps ``module`` for central-storage training. ``make_optimizer(parameters)`` is called
    on the root only; ``self.optimizer`` is None elsewhere. After ``loss.backward()`` call
    ``step()`` on every rank: gradients averaged over the ranks on the root, the root's
    optimizer steps, every replica receives the new parameters and the root's buffers.

    Construct on every rank after ``mpidp.init()``; the root's parameters and buffers are
    broadcast, and names, shapes and dtypes are compared across ranks (a mismatch raises on
    every rank). ``bucket_cap_bytes``: size of the fused buffers gradients and parameters
    travel in."""

    def __init__(self, module: torch.nn.Module, make_optimizer: Callable[[list], Any],
                 root: int = 0, bucket_cap_bytes: int = DEFAULT_BUCKET_CAP_BYTES):
        if not isinstance(module, torch.nn.Module):
            raise TypeError(f"module must be a torch.nn.Module, got {type(module).__name__}")
        g = runtime.group()
        collectives.check_root(root, g.size)
        if not isinstance(bucket_cap_bytes, int) or bucket_cap_bytes < 1:
            raise ValueError(f"bucket_cap_bytes must be a positive integer, got "
                             f"{bucket_cap_bytes!r}")
        check_same_model(g, module, "CentralStorage")
        self.module, self.root, self._size = module, root, g.size
        self.is_root = g.rank == root
        self._params = [p for p in module.parameters() if p.requires_grad]
        self._buffers = list(module.buffers())
        broadcast_tensors_([p.detach() for p in module.parameters()] + self._buffers, root)
        self.optimizer: Optional[Any] = make_optimizer(self._params) if self.is_root else None
        self._buckets = plan([p.detach() for p in self._params], bucket_cap_bytes) \
            if self._params else []
        check_same_buckets(g, self._buckets, "CentralStorage")
        self.comm_stats = {"steps": 0, "wait_s": 0.0, "comm_s": 0.0}

    def __call__(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.module.zero_grad(set_to_none=set_to_none)

    def step(self) -> None:
        """Reduces the gradients to the root, steps the root's optimizer and broadcasts the
        parameters. A parameter without a gradient contributes zeros. Every rank calls it."""
        if self._size == 1:  # the root's own gradients are the average: nothing to move
            self.optimizer.step()
            self.comm_stats["steps"] += 1
            return
        t0 = time.perf_counter()
        for bucket in self._buckets:
            params = [self._params[i] for i in bucket.indices]
            bucket.pack([p.grad for p in params])
            collectives.reduce_(bucket.buffer, self.root, "sum")
            if self.is_root:
                for p in params:
                    if p.grad is None:
                        p.grad = torch.zeros_like(p)
                bucket.unpack([p.grad for p in params], self._size)
        reduced = time.perf_counter()
        if self.is_root:
            with timeline.span("optimizer step"):
                self.optimizer.step()
        stepped = time.perf_counter()
        for bucket in self._buckets:
            params = [self._params[i].detach() for i in bucket.indices]
            if self.is_root:
                bucket.pack(params)
            collectives.broadcast_(bucket.buffer, self.root)
            if not self.is_root:
                bucket.unpack(params)
        if self._buffers:  # the root's running statistics are the model's
            broadcast_tensors_(self._buffers, self.root)
        comm_s = (reduced - t0) + (time.perf_counter() - stepped)
        self.comm_stats["steps"] += 1
        self.comm_stats["comm_s"] += comm_s
        self.comm_stats["wait_s"] += comm_s
