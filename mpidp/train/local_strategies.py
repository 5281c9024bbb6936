"""The strategies between mirrored and the parameter server: post-local SGD (``localsgd``) and
DiLoCo (``diloco``) — ranks step alone and meet every ``--sync-every`` steps (Note [Local
steps])."""
from __future__ import annotations

import time
from typing import Any, Callable, Optional

import torch

from .. import runtime, timeline
from ..fusion import grouped_allreduce_
from ..mirrored import DistributedDataParallel
from ..state_broadcast import broadcast_state_dict
from .strategy_base import Strategy

# Note [Local steps]
# localsgd (post-local SGD, Lin et al. 2020): the first --local-sgd-warmup-steps steps are
# mirrored's (gradients averaged in backward); after them every rank steps its optimizer on
# its own gradients, and every --sync-every steps the ranks meet: parameters, floating
# buffers and the optimizer's per-element state (momentum, Adam's moments: averaging them is
# what keeps a meeting equivalent to one optimizer; step counts agree already) are averaged.
# diloco (Douillard et al. 2023): every rank runs --sync-every inner steps of its optimizer
# from the last meeting's parameters (the anchor); at a meeting the ranks average their
# parameters' deltas from the anchor (the outer gradient), an outer SGD with Nesterov momentum
# (--outer-lr, --outer-momentum) steps the anchor, and every rank continues from it. The inner
# optimizers' states are averaged there too (the paper keeps them per rank; averaged, a
# checkpoint holds the whole run). Both meet at every epoch end (the held-out score and the
# summary then see one model) and before every checkpoint, so --resume continues exactly as the
# uninterrupted run (which meets at the same steps). With --sync-every 1 and SGD both are
# mirrored, up to rounding: they average updated parameters (or updates), mirrored gradients.
# Inner steps use the one-rank learning rate in diloco (its outer step averages deltas, not a
# larger batch's gradient), --lr-scaling's in localsgd (after warm-up as during it).


class _Meeting(Strategy):
    """What localsgd and diloco share: DDP for the synchronous steps (buffers not broadcast:
    they are averaged at meetings), the step count, meetings at epoch ends and checkpoints."""

    warmup = 0

    def __init__(self, model: torch.nn.Module, make_optimizer: Callable, settings: Any):
        super().__init__(model)
        self.ddp = DistributedDataParallel(model, bucket_cap_mb=settings.bucket_mb,
                                           algorithm=settings.algorithm,
                                           broadcast_buffers=False)
        self.forward = self.ddp
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.optimizer = make_optimizer(self.params)
        self.stats = {"wait_s": 0.0}
        self.every, self.steps, self.since = settings.sync_every, 0, 0

    def step(self, loss: torch.Tensor) -> None:
        synchronous = self.steps < self.warmup
        self.ddp.require_backward_grad_sync = synchronous
        waited = self.ddp.comm_stats["wait_s"]
        with timeline.span("backward"):
            loss.backward()
        self.stats["wait_s"] += self.ddp.comm_stats["wait_s"] - waited
        with timeline.span("optimizer step"):
            self.optimizer.step()
        self.steps += 1
        if synchronous:
            return
        self.since += 1
        if self.since == self.every:
            self.meet()

    def meet(self) -> None:
        """Collective: the ranks' models become one (Note [Local steps])."""
        if self.since == 0:
            return
        if runtime.size() > 1 or self._needs_outer():
            start = time.perf_counter()
            with timeline.span("meeting"):
                self._meet()
            self.stats["wait_s"] += time.perf_counter() - start
        self.since = 0

    def _needs_outer(self) -> bool:
        return False

    def _optimizer_tensors(self) -> list:
        """The optimizer's per-element state, in parameter order (the same on every rank)."""
        out = []
        for p in self.params:
            state = self.optimizer.state.get(p, {})
            out += [v for _, v in sorted(state.items()) if isinstance(v, torch.Tensor)
                    and v.is_floating_point() and v.shape == p.shape]
        return out

    def _buffers(self) -> list:
        return [b for b in self.model.buffers() if b.is_floating_point()]

    def end_epoch(self) -> None:
        self.meet()

    def optimizer_state(self) -> Optional[dict]:
        self.meet()  # a checkpoint is a meeting (Note [Local steps])
        return self.optimizer.state_dict() if runtime.rank() == 0 else None

    def load_optimizer(self, state: Optional[dict]) -> None:
        self.optimizer.load_state_dict(broadcast_state_dict(state, 0))

    def resume_at(self, global_step: int) -> None:
        self.steps, self.since = global_step, 0


class LocalSGD(_Meeting):
    """Post-local SGD (Note [Local steps])."""

    def __init__(self, model: torch.nn.Module, make_optimizer: Callable, settings: Any):
        super().__init__(model, make_optimizer, settings)
        self.warmup = settings.local_sgd_warmup_steps or 0

    def _meet(self) -> None:
        grouped_allreduce_([p.detach() for p in self.params] + self._buffers()
                           + self._optimizer_tensors(), "avg")


class DiLoCo(_Meeting):
    """DiLoCo (Note [Local steps])."""

    lr_ranks = 1

    def __init__(self, model: torch.nn.Module, make_optimizer: Callable, settings: Any):
        super().__init__(model, make_optimizer, settings)
        self.anchor = [p.detach().clone() for p in self.params]
        momentum = settings.outer_momentum
        self.outer = torch.optim.SGD(self.anchor, lr=settings.outer_lr, momentum=momentum,
                                     nesterov=momentum > 0)

    def _needs_outer(self) -> bool:
        return True  # one rank too: the outer optimizer steps

    def _meet(self) -> None:
        deltas = [a - p.detach() for a, p in zip(self.anchor, self.params)]
        if runtime.size() > 1:
            grouped_allreduce_(deltas + self._buffers() + self._optimizer_tensors(), "avg")
        for a, d in zip(self.anchor, deltas):
            a.grad = d
        self.outer.step()
        with torch.no_grad():
            for a, p in zip(self.anchor, self.params):
                p.copy_(a)

    def optimizer_state(self) -> Optional[dict]:
        inner = super().optimizer_state()
        return {"inner": inner, "outer": self.outer.state_dict()} if inner is not None else None

    def load_optimizer(self, state: Optional[dict]) -> None:
        if runtime.rank() == 0:
            inner, outer = state["inner"], state["outer"]
        else:
            inner = outer = None
        self.optimizer.load_state_dict(broadcast_state_dict(inner, 0))
        self.outer.load_state_dict(broadcast_state_dict(outer, 0))
        with torch.no_grad():
            for a, p in zip(self.anchor, self.params):
                a.copy_(p)  # the checkpoint's parameters: the last meeting's
