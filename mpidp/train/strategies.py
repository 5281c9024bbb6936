"""The training modes behind one small interface for the loop: forward, step (backward and
the optimizer), learning rate, optimizer state for checkpoints."""
from __future__ import annotations

from typing import Any, Callable, Optional

import torch

from .. import runtime, timeline
from ..central import CentralStorage
from ..data import batches
from ..fusion import broadcast_optimizer_state
from ..mirrored import DistributedDataParallel


class Strategy:
    """What the loop needs of a training mode. ``forward`` runs the model, ``stats`` holds
    ``wait_s`` (seconds spent waiting for communication), ``optimizer`` is None on ranks that
    hold no optimizer."""

    forward: Callable
    stats: dict
    optimizer: Optional[torch.optim.Optimizer]
    is_server = False  # a parameter-server rank: serves instead of training (ps_strategy)
    lr_ranks: Optional[int] = None  # the ranks --lr-scaling counts (None: every rank)

    def __init__(self, model: torch.nn.Module):
        self.model = model

    def steps_per_epoch(self, sampler: Any, train_samples: int, batch_size: int) -> int:
        """Steps of one epoch (as checkpoint positions count them)."""
        return -(-len(sampler) // batch_size)

    def epoch_batches(self, train_data: Any, sampler: Any, epoch: int, first: int,
                      batch_size: int):
        """(batch number, (x, y)) of this rank's batches in ``epoch`` from batch ``first``:
        its shard of the epoch's permutation."""
        return enumerate(batches(train_data, sampler.indices(epoch), batch_size, first),
                         start=first)

    def serve_epoch(self, epoch: int, steps: int) -> float:
        """A server rank's share of an epoch; returns its busy seconds (0: no serving)."""
        return 0.0

    def zero_grad(self) -> None:
        self.model.zero_grad(set_to_none=True)

    def step(self, loss: torch.Tensor) -> None:
        """Backward, gradient communication, optimizer step. Every rank calls it."""
        raise NotImplementedError

    def set_lr(self, lr: float) -> None:
        if self.optimizer is not None:
            for group in self.optimizer.param_groups:
                group["lr"] = lr

    def optimizer_state(self) -> Optional[dict]:
        """The optimizer state a checkpoint keeps (rank 0 writes it)."""
        return self.optimizer.state_dict() if self.optimizer is not None else None

    def load_optimizer(self, state: Optional[dict]) -> None:
        """Rank 0 passes the checkpoint's state, others None. Every rank calls it."""
        raise NotImplementedError

    def end_epoch(self) -> None:
        """Every rank calls it after its last step of an epoch."""

    def report(self, total_s: float) -> dict:
        """Collective: what the final summary of a run of ``total_s`` adds for this mode."""
        return {}

    def free(self) -> None:
        """Collective: resources the mode holds (windows)."""


class Mirrored(Strategy):
    """Every rank a replica with its own optimizer; gradients all-reduced during backward."""

    def __init__(self, model: torch.nn.Module, make_optimizer: Callable, settings: Any):
        super().__init__(model)
        self.forward = DistributedDataParallel(model, bucket_cap_mb=settings.bucket_mb,
                                               algorithm=settings.algorithm)
        self.optimizer = make_optimizer([p for p in model.parameters() if p.requires_grad])
        self.stats = self.forward.comm_stats

    def step(self, loss: torch.Tensor) -> None:
        with timeline.span("backward"):
            loss.backward()
        with timeline.span("optimizer step"):
            self.optimizer.step()

    def load_optimizer(self, state: Optional[dict]) -> None:
        if runtime.rank() == 0:
            self.optimizer.load_state_dict(state)
        if runtime.size() > 1:
            broadcast_optimizer_state(self.optimizer, 0)


class Central(Strategy):
    """Rank 0 holds the optimizer; gradients reduced to it, parameters broadcast back."""

    def __init__(self, model: torch.nn.Module, make_optimizer: Callable, settings: Any):
        super().__init__(model)
        self.forward = CentralStorage(model, make_optimizer,
                                      bucket_cap_bytes=int(settings.bucket_mb * (1 << 20)))
        self.optimizer = self.forward.optimizer
        self.stats = self.forward.comm_stats

    def step(self, loss: torch.Tensor) -> None:
        with timeline.span("backward"):
            loss.backward()
        with timeline.span("central step"):
            self.forward.step()

    def load_optimizer(self, state: Optional[dict]) -> None:
        if self.optimizer is not None:
            self.optimizer.load_state_dict(state)


STRATEGIES = {"mirrored": Mirrored, "central": Central}


def make_strategy(settings: Any, model: torch.nn.Module, make_optimizer: Callable) -> Strategy:
    """The training mode ``settings.strategy`` around ``model``. Collective."""
    if settings.strategy == "ps":
        from .ps_strategy import ParameterServerStrategy
        return ParameterServerStrategy(model, make_optimizer, settings)
    return STRATEGIES[settings.strategy](model, make_optimizer, settings)
