"""The strategies between mirrored and the parameter server: post-local SGD (``localsgd``) and
DiLoCo (``diloco``) — ranks step alone and meet every ``--sync-every`` steps (Note [Local
steps])."""
from __future__ import annotations

import time
from typing import Any, Callable, Optional

import numpy as np
import torch

from ..comm import collectives
from .. import runtime
from ..runtime import timeline
from ..errors import MpidpError
from ..comm.fusion import grouped_allreduce_
from ..ddp.distributed import DistributedDataParallel
from ..comm.state_broadcast import broadcast_state_dict, broadcast_tensors_, gather_bytes
from ..comm import objects
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
# summary then see one model). A checkpoint between meetings changes nothing: it keeps rank 0's
# model and optimizer, DiLoCo's anchor and outer state, and every rank's own parameters,
# floating buffers and per-element optimizer state (gathered as bytes), which a resume on as
# many ranks scatters back — so --resume continues exactly as the uninterrupted run, whenever
# it was checkpointed (a signal included). A parameter trained on some ranks only between
# meetings leaves the ranks' optimizer states of different shapes: an error naming it. While
# localsgd's steps are mirrored's, buffers are broadcast from rank 0 as mirrored's are (after:
# averaged at meetings). With --sync-every 1 and SGD both are
# mirrored, up to rounding: they average updated parameters (or updates), mirrored gradients.
# Inner steps use the one-rank learning rate in diloco (its outer step averages deltas, not a
# larger batch's gradient; a log line says so when --lr-scaling or --warmup-epochs is given),
# --lr-scaling's in localsgd (after warm-up as during it). On resume, DiLoCo's outer optimizer
# takes this run's --outer-lr and --outer-momentum (a momentum of 0 drops its buffers), and a
# checkpoint more steps past its last meeting than this run's --sync-every (a smaller one)
# meets at once, before the first step, saying so in one line: its meeting is overdue, and
# counting on from there would not meet again before the epoch's end. So does a localsgd
# checkpoint between meetings resumed with a larger --local-sgd-warmup-steps that puts the
# ranks back into synchronous steps (which never count towards a meeting) while their models
# differ (meeting_on_resume decides both).


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
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        self.names, self.params = [n for n, _ in named], [p for _, p in named]
        self.optimizer = make_optimizer(self.params)
        self.stats = {"wait_s": 0.0}
        self.every, self.steps, self.since = settings.sync_every, 0, 0

    def step(self, loss: torch.Tensor) -> None:
        synchronous = self.steps < self.warmup
        self.ddp.require_backward_grad_sync = synchronous
        # the next forward broadcasts rank 0's buffers while steps are mirrored's
        self.ddp.broadcast_buffers = self.steps + 1 < self.warmup
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
        """The optimizer's per-element state, in parameter order. Collective: a parameter
        with state on some ranks only (no gradient on the others since the last meeting)
        is an error on every rank, naming it."""
        per_param = [[v for _, v in sorted(self.optimizer.state.get(p, {}).items())
                      if isinstance(v, torch.Tensor) and v.is_floating_point()
                      and v.shape == p.shape] for p in self.params]
        if runtime.size() > 1:
            have = np.array([len(t) for t in per_param], np.int64)
            least, most = have.copy(), have.copy()
            collectives.allreduce_(least, "min")
            collectives.allreduce_(most, "max")
            uneven = [name for name, lo, hi in zip(self.names, least, most) if lo != hi]
            if uneven:
                raise MpidpError(
                    f"--strategy {self.name}: parameter {uneven[0]!r} received a gradient on "
                    "some ranks only since the last meeting, so their optimizers' states "
                    "differ in shape; every rank must train every parameter (every rank "
                    "raises this error)")
        return [t for ts in per_param for t in ts]

    def _buffers(self) -> list:
        return [b for b in self.model.buffers() if b.is_floating_point()]

    def end_epoch(self) -> None:
        self.meet()

    def optimizer_state(self) -> Optional[dict]:
        return self.optimizer.state_dict() if runtime.rank() == 0 else None

    def load_optimizer(self, state: Optional[dict]) -> None:
        self.optimizer.load_state_dict(broadcast_state_dict(state, 0))

    def _own(self) -> list:
        """What differs between the ranks between meetings: parameters, floating buffers,
        per-element optimizer state (collective: ``_optimizer_tensors``)."""
        return [p.detach() for p in self.params] + self._buffers() + self._optimizer_tensors()

    def comm_state(self) -> Optional[dict]:
        """Between meetings every rank's own state, gathered as bytes (Note [Local steps]);
        None at a meeting (the model and optimizer rank 0 saves are everyone's)."""
        if self.since == 0:
            return None
        every = gather_bytes(self._own(), f"checkpoint: gathering every rank's {self.name} state")
        return {"kind": self.name, "since": self.since,
                "ranks": torch.from_numpy(every)} if every is not None else None

    def load_comm_state(self, state: Optional[dict]) -> None:
        g = runtime.group()
        since = int(state["since"]) if state is not None else 0
        since = int(objects.bcast(g, since, f"resume: every rank's {self.name} state"))
        if since == 0:
            return
        own = self._own()
        nbytes = sum(t.numel() * t.element_size() for t in own)
        every = state["ranks"].contiguous() if g.rank == 0 else \
            torch.empty(g.size, nbytes, dtype=torch.uint8)
        if tuple(every.shape) != (g.size, nbytes):
            raise MpidpError(f"--resume: the checkpoint's {self.name} state does not fit "
                             "this model and optimizer")
        if g.size > 1:
            broadcast_tensors_([every], 0)
        offset, mine = 0, every[g.rank]
        with torch.no_grad():
            for t in own:
                n = t.numel() * t.element_size()
                t.view(-1).view(torch.uint8).copy_(mine[offset:offset + n])
                offset += n
        self.since = since

    def resume_at(self, global_step: int) -> None:
        self.steps = global_step
        self.ddp.broadcast_buffers = self.steps < self.warmup
        why = meeting_on_resume(self.name, self.since, self.every, self.steps, self.warmup)
        if why is not None:
            self.notes.append(why)
            self.meet()


def meeting_on_resume(name: str, since: int, every: int, steps: int,
                      warmup: int) -> Optional[str]:
    """Whether the ranks must meet as they resume, before the first step (Note [Local
    steps]): the line that says why, or None. ``since``: the checkpoint's steps past the
    ranks' last meeting; ``every``: this run's --sync-every; ``steps``: the global step
    resumed at; ``warmup``: this run's --local-sgd-warmup-steps (0 for diloco). Pure."""
    if since >= every:  # a smaller --sync-every
        return (f"--strategy {name}: the checkpoint is {since} steps past the ranks' last "
                f"meeting and --sync-every is {every}: they meet now")
    if since > 0 and steps < warmup:  # a larger warm-up: synchronous steps from differing models
        return (f"--strategy {name}: the checkpoint is {since} steps past the ranks' last "
                f"meeting and --local-sgd-warmup-steps is {warmup}: steps {steps + 1} to "
                f"{warmup} are synchronous again, so they meet now")
    return None


class LocalSGD(_Meeting):
    """Post-local SGD (Note [Local steps])."""

    name = "localsgd"

    def __init__(self, model: torch.nn.Module, make_optimizer: Callable, settings: Any):
        super().__init__(model, make_optimizer, settings)
        self.warmup = settings.local_sgd_warmup_steps or 0
        self.ddp.broadcast_buffers = self.warmup > 0

    def _meet(self) -> None:
        grouped_allreduce_([p.detach() for p in self.params] + self._buffers()
                           + self._optimizer_tensors(), "avg")


class DiLoCo(_Meeting):
    """DiLoCo (Note [Local steps])."""

    lr_ranks = 1
    name = "diloco"

    def __init__(self, model: torch.nn.Module, make_optimizer: Callable, settings: Any):
        super().__init__(model, make_optimizer, settings)
        self.settings = settings
        self.anchor = [p.detach().clone() for p in self.params]
        if settings.lr_scaling != "none" or settings.warmup_epochs:
            self.notes.append("--strategy diloco: inner steps take --lr as one rank would "
                              "(--lr-scaling and --warmup-epochs do not apply)")
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
        return {"inner": inner, "outer": self.outer.state_dict(),
                "anchor": [a.clone() for a in self.anchor]} if inner is not None else None

    def load_optimizer(self, state: Optional[dict]) -> None:
        if runtime.rank() == 0:
            inner, outer = state["inner"], state["outer"]
            anchor = [a.contiguous() for a in state["anchor"]]
        else:
            inner = outer = None
            anchor = [torch.empty_like(a) for a in self.anchor]
        self.optimizer.load_state_dict(broadcast_state_dict(inner, 0))
        self.outer.load_state_dict(broadcast_state_dict(outer, 0))
        for group in self.outer.param_groups:  # this run's --outer-lr, --outer-momentum
            group.update(lr=self.settings.outer_lr, momentum=self.settings.outer_momentum,
                         nesterov=self.settings.outer_momentum > 0)
        if not self.settings.outer_momentum:
            self.outer.state.clear()
        broadcast_tensors_(anchor, 0)
        with torch.no_grad():
            for a, saved in zip(self.anchor, anchor):
                a.copy_(saved)  # the last meeting's parameters
