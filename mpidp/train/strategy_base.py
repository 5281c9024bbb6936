"""The interface between the training loop and a training mode (``Strategy``): forward, step
(backward and the optimizer), learning rate, optimizer state for checkpoints. The modes live in
``strategies`` (mirrored, central) and ``ps_strategy`` (parameter server); both import this
module and nothing imports them back, so ``strategies`` can name every mode at module level."""
from __future__ import annotations

from typing import Any, Callable, Optional

import torch

from ..workloads.data import batches


class Strategy:
    """What the loop needs of a training mode. ``forward`` runs the model, ``stats`` holds
    ``wait_s`` (seconds spent waiting for communication), ``optimizer`` is None on ranks that
    hold no optimizer."""

    forward: Callable
    stats: dict
    optimizer: Optional[torch.optim.Optimizer]
    is_server = False  # a parameter-server rank: serves instead of training (ps_strategy)
    lr_ranks: Optional[int] = None  # the ranks --lr-scaling counts (None: every rank)
    scaler: Optional[torch.amp.GradScaler] = None  # --amp fp16 (Note [Training device])

    def __init__(self, model: torch.nn.Module):
        self.model = model
        self.notes: list = []  # lines for the log, said once by the loop

    def steps_per_epoch(self, sampler: Any, train_samples: int, batch_size: int) -> int:
        """Steps of one epoch (as checkpoint positions count them)."""
        return -(-len(sampler) // batch_size)

    def steps_left(self, sampler: Any, epoch: int, cursor: int, batch_size: int,
                   steps: int) -> int:
        """Steps left of an epoch of ``steps`` once its first ``cursor`` samples are taken
        (Note [Sample cursor] in mpidp/workloads/data.py)."""
        return -(-len(sampler.indices(epoch, cursor)) // batch_size) if cursor else steps

    def epoch_batches(self, train_data: Any, sampler: Any, epoch: int, first: int,
                      batch_size: int, cursor: int):
        """(batch number, (x, y)) of this rank's batches in ``epoch``, numbered from
        ``first``: its shard of the epoch's permutation from sample position ``cursor`` on."""
        return enumerate(batches(train_data, sampler.indices(epoch, cursor), batch_size),
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

    def comm_state(self) -> Optional[dict]:
        """Collective: the communication hook's state a checkpoint keeps (rank 0; None
        elsewhere, or without one)."""
        return None

    def load_comm_state(self, state: Optional[dict]) -> None:
        """Collective: rank 0 passes what ``comm_state`` gave (or None), others None."""

    def resume_at(self, global_step: int) -> None:
        """Every rank: the run resumes after ``global_step`` steps."""

    def end_epoch(self) -> None:
        """Every rank calls it after its last step of an epoch."""

    def report(self, total_s: float) -> dict:
        """Collective: what the final summary of a run of ``total_s`` adds for this mode."""
        return {}

    def abandon(self) -> None:
        """Leaves the mode after its group lost a rank (Note [Recovering a run] in
        mpidp/train/in_job.py): its DDP's hooks off the model. This rank only."""
        abandon = getattr(self.forward, "abandon", None)
        if abandon is not None:
            abandon()

    def free(self) -> None:
        """Collective: resources the mode holds (windows)."""
