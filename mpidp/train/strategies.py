"""The training modes (mirrored, central; the parameter server's from ``ps_strategy``, local
SGD's and DiLoCo's from ``local_strategies``) behind the loop's ``Strategy`` interface
(``strategy_base``), and ``make_strategy``, which picks one by name."""
from __future__ import annotations

from typing import Any, Callable, Optional

import numpy as np
import torch

from ..comm import collectives
from .. import runtime
from ..runtime import timeline
from ..modes.central import CentralStorage
from ..comm.state_broadcast import broadcast_optimizer_state, broadcast_state_dict
from ..ddp.distributed import DistributedDataParallel
from ..ddp.powersgd import PowerSGDState
from ..ddp.zero import ZeroRedundancyOptimizer, reduce_scatter_hook
from . import compress, devices
from .local_strategies import DiLoCo, LocalSGD
from .ps_strategy import ParameterServerStrategy
from .strategy_base import Strategy

__all__ = ["STRATEGIES", "Central", "Mirrored", "ParameterServerStrategy", "Strategy",
           "make_strategy"]


class Mirrored(Strategy):
    """Every rank a replica with its own optimizer; gradients all-reduced during backward."""

    def __init__(self, model: torch.nn.Module, make_optimizer: Callable, settings: Any):
        super().__init__(model)
        self.forward = DistributedDataParallel(model, bucket_cap_mb=settings.bucket_mb,
                                               algorithm=settings.algorithm)
        params = [p for p in model.parameters() if p.requires_grad]
        self.optimizer = make_optimizer(params)
        self.stats = self.forward.comm_stats
        self.zero = settings.zero
        if self.zero:  # Note [ZeRO] in mpidp/ddp/zero.py
            self.optimizer = ZeroRedundancyOptimizer(params, type(self.optimizer),
                                                     **self.optimizer.defaults)
            self.forward.register_comm_hook(self.optimizer, reduce_scatter_hook)
        self.compression, self.hook_state = settings.compression, None
        if self.compression == "auto":
            self.compression, why = compress.choose(list(model.parameters()),
                                                    settings.algorithm)
            self.notes.append(f"--compression auto: {self.compression} ({why})")
        if self.compression != "none":
            self.hook_state, hook = compress.make_hook(self.compression, settings)
            self.forward.register_comm_hook(self.hook_state, hook)
        self.scaler = devices.scaler_for(params[0].device, settings.amp) if params else None

    def step(self, loss: torch.Tensor) -> None:
        if self.scaler is not None:  # every rank has the same averaged gradients, so takes
            with timeline.span("backward"):  # the same skip-or-step decision
                self.scaler.scale(loss).backward()
            with timeline.span("optimizer step"):
                self.scaler.step(self.optimizer)
                self.scaler.update()
            return
        with timeline.span("backward"):
            loss.backward()
        with timeline.span("optimizer step"):
            self.optimizer.step()

    def load_optimizer(self, state: Optional[dict]) -> None:
        if self.zero:  # every rank takes its slices of the whole state
            self.optimizer.load_state_dict(broadcast_state_dict(state, 0))
            return
        if runtime.rank() == 0:
            self.optimizer.load_state_dict(state)
        if runtime.size() > 1:
            broadcast_optimizer_state(self.optimizer, 0)

    def optimizer_state(self) -> Optional[dict]:
        if not self.zero:
            return super().optimizer_state()
        self.optimizer.consolidate_state_dict(to=0)  # collective
        return self.optimizer.state_dict() if runtime.rank() == 0 else None

    def comm_state(self) -> Optional[dict]:
        if not isinstance(self.hook_state, PowerSGDState):
            return None
        return compress.gather_state(self.hook_state, list(self.model.parameters()))

    def load_comm_state(self, state: Optional[dict]) -> None:
        if isinstance(self.hook_state, PowerSGDState):
            missing = compress.scatter_state(state, self.hook_state,
                                             list(self.model.parameters()))
            if missing:
                self.notes.append(missing)

    def report(self, total_s: float) -> dict:
        """Collective: the compression, and with --zero each rank's optimizer state bytes."""
        out: dict = {"compression": self.compression}
        if self.zero:
            held = np.array([[self.optimizer.local_state_bytes()]], np.int64)
            every = collectives.allgather(held) if runtime.size() > 1 else held
            out["zero_optimizer_state_bytes"] = [int(b) for b in every[:, 0]]
        return out


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


STRATEGIES = {"mirrored": Mirrored, "central": Central, "ps": ParameterServerStrategy,
              "localsgd": LocalSGD, "diloco": DiLoCo}


def make_strategy(settings: Any, model: torch.nn.Module, make_optimizer: Callable) -> Strategy:
    """The training mode ``settings.strategy`` (a key of ``STRATEGIES``) around ``model``.
    Collective: every rank calls it with the same settings."""
    return STRATEGIES[settings.strategy](model, make_optimizer, settings)
