"""The parameter-server training mode behind the loop's strategy interface: servers serve an
epoch while workers take batches from a shared counter, pull (waiting for SSP), compute and
push; at each epoch end every rank holds the published parameters."""
from __future__ import annotations

import time
from typing import Any, Callable, Optional

import numpy as np
import torch

from .. import runtime
from ..runtime import timeline
from ..workloads.data import ShardSampler, batches
from ..comm.fingerprint import check_same_model
from ..comm.state_broadcast import broadcast_tensors_
from ..modes.ps import ParameterServer, Worker
from ..modes.ps_server import Server
from ..comm import objects
from .settings import scaled_lr
from .ps_state import reshard_optimizer_states
from .setup import SetupError
from .strategy_base import Strategy


# Note [Lookahead]
# With W workers a pushed gradient was computed at parameters the server has moved on from:
# the other workers' pushes land between a worker's pull and its push, and the server's
# momentum keeps moving the parameters after each. On the synthetic set (3 workers, SGD
# with momentum 0.9) that cost the asynchronous server 11 points against mirrored (42.7%
# against 54.0%), while with plain SGD it matched mirrored (49.0% against 48.0%): staleness
# and momentum together, not either alone. So each worker computes its gradient where the
# parameters are heading rather than where it read them: at the pulled parameters plus W - 1
# times their change since its previous pull. That interval saw about W pushes and about
# W - 1 land while a gradient is in flight, so staleness alone would suggest (W - 1)/W of the
# change; the server's momentum keeps moving the parameters after each update, and W - 1 is
# what measured best (below): an empirical coefficient, not a derived one. A slow worker's
# interval saw more pushes, so it looks further ahead, as its gradient will be staler. It
# costs one vector subtraction and addition per step and no communication. With one worker
# it is off (the run is sequential SGD, unchanged), an epoch's first step has no previous
# pull (so a resume from an epoch-end checkpoint stays exact), and --no-ps-lookahead turns
# it off. Measured (bench/training/run_ps_accuracy.sh, medians of 3): 3 workers 42.7% -> 55.7%, 2
# workers 55.8% -> 60.7% (mirrored 54.0%, 57.9%), Adam with 3 workers 64.7% -> 68.3%
# (mirrored 66.2%); the digits job stays at 98.6-99.2%. At 3 workers lookaheads of 0.5, 1
# and 2 ended at medians of 51.5%, 53.3% and 55.3% over 3-7 runs each. It is in the spirit
# of DANA's lookahead (Hakimi et al. 2019), which extrapolates by the momentum instead.


class ParameterServerStrategy(Strategy):
    """Workers: ``epoch_batches`` hands out batches of one global permutation through a
    shared counter (a fast worker takes more), ``zero_grad`` pulls, ``step`` pushes. Servers:
    ``serve_epoch`` applies the optimizer (state on the server) to what arrives."""

    def __init__(self, model: torch.nn.Module, make_optimizer: Callable, settings: Any):
        super().__init__(model)
        g = runtime.group()
        self.settings = settings
        self.params = [p for p in model.parameters() if p.requires_grad]
        bad = [str(p.dtype) for p in self.params if p.dtype != torch.float32]
        if bad:  # every rank has the same model: every rank raises, before any collective
            raise SetupError(f"--strategy ps holds float32 parameters; the model has {bad[0]}")
        check_same_model(g, model, "ParameterServer")
        self.buffers = list(model.buffers())
        broadcast_tensors_([p.detach() for p in model.parameters()] + self.buffers, 0)
        flat0 = torch.nn.utils.parameters_to_vector(self.params).detach().numpy()
        self.ps = ParameterServer(g.comm, settings.num_ps or 1, [p.numel() for p in self.params],
                                  flat0)
        self.is_server = self.ps.is_server
        self.flat = np.empty(len(flat0), np.float32)
        self.forward = model
        self.stats = {"wait_s": 0.0}
        self.optimizer: Optional[torch.optim.Optimizer] = None
        if self.is_server:
            self.server = Server(self.ps)
            self.shard = torch.nn.Parameter(torch.from_numpy(self.server.params()))
            self.optimizer = make_optimizer([self.shard])
        else:
            self.worker = Worker(self.ps, settings.staleness)
        # Note [Lookahead]
        self.lookahead = np.float32(self.ps.num_workers - 1) \
            if settings.ps_lookahead is not False and not self.is_server else np.float32(0)
        self._previous: Optional[np.ndarray] = None  # the last pull (lookahead only)

    # ---- workers ------------------------------------------------------------------------

    lr_ranks = 1  # Note [Asynchronous steps]

    def steps_per_epoch(self, sampler, train_samples: int, batch_size: int) -> int:
        return -(-train_samples // batch_size)  # every batch of the set, shared by workers

    def epoch_batches(self, train_data, sampler, epoch: int, first: int, batch_size: int,
                      cursor: int):
        """(batch number, (x, y)) for the batches this worker takes in ``epoch`` from a
        shared counter over one permutation of the whole set (none on servers). Epochs start
        whole: the parameter server checkpoints at epoch ends only."""
        assert first == 0 and cursor == 0, "ps checkpoints at epoch ends only"
        if self.is_server:
            return
        order = ShardSampler(len(train_data), 0, 1, self.settings.seed).indices(epoch)
        total = -(-len(order) // batch_size)
        while True:
            t0 = time.perf_counter()
            b = self.worker.next_batch(total)
            self.stats["wait_s"] += time.perf_counter() - t0
            if b >= total:
                return
            yield b, next(batches(train_data, order[b * batch_size:(b + 1) * batch_size],
                                  batch_size))

    def zero_grad(self) -> None:
        self.model.zero_grad(set_to_none=True)
        t0 = time.perf_counter()
        self.worker.pull(self.flat)
        self.stats["wait_s"] += time.perf_counter() - t0
        if self.lookahead:  # Note [Lookahead]
            if self._previous is None:
                self._previous = self.flat.copy()
                self._change = np.empty_like(self.flat)
            else:  # in place: no vector allocated per step
                change = np.subtract(self.flat, self._previous, out=self._change)
                self._previous[...] = self.flat
                change *= self.lookahead
                self.flat += change
        self._load_flat()

    def _load_flat(self) -> None:
        """The model's parameters become views of the pulled flat vector (no copy)."""
        torch.nn.utils.vector_to_parameters(torch.from_numpy(self.flat), self.params)

    def step(self, loss: torch.Tensor) -> None:
        with timeline.span("backward"):
            loss.backward()
        t0 = time.perf_counter()
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in self.params]
        self.worker.push(torch.cat([g.reshape(-1) for g in grads]).numpy(),
                         self.settings.staleness_lr)
        self.stats["wait_s"] += time.perf_counter() - t0

    def set_lr(self, lr: float) -> None:
        pass  # the servers' optimizers follow the schedule (serve_epoch)

    # ---- servers ------------------------------------------------------------------------

    def serve_epoch(self, epoch: int, batches_per_epoch: int) -> float:
        if not self.is_server:
            return 0.0
        s, busy = self.settings, self.server.busy_s

        def apply(params: np.ndarray, grad_sum: np.ndarray, pushes: int) -> None:
            # Note [Asynchronous steps]: each push is one batch's step, so the learning rate
            # is the one-rank rate (no --lr-scaling: pushes are not averaged into a larger
            # batch) and pushes drained together are summed (for plain SGD as if applied one
            # after another; momentum and Adam see one step of the sum)
            progress = min(1.0, self.server.epoch_pushes / max(batches_per_epoch, 1))
            for group in self.optimizer.param_groups:
                group["lr"] = scaled_lr(s, 1, epoch + progress)
            # the step updates ``params`` in place: the shard's storage is re-pointed to it
            self.shard.data = torch.from_numpy(params)
            self.shard.grad = torch.from_numpy(grad_sum)
            self.optimizer.step()

        self.server.serve_epoch(apply)
        return self.server.busy_s - busy

    # ---- every rank ---------------------------------------------------------------------

    def end_epoch(self) -> None:
        """Collective: workers have finished, servers drained; every rank loads the
        published parameters, then the servers reset their clocks for the next epoch."""
        self._previous = None  # an epoch's first step looks ahead of nothing (Note [Lookahead])
        if not self.is_server:
            self.worker.finish_epoch()
        self.ps.barrier("ps epoch end: every worker finished")
        with self.ps.board.waiting(("ps epoch end: reading the published parameters",)):
            self.ps.read_all(self.flat)
        self._load_flat()
        if self.buffers:  # rank 0's running statistics (a worker's) are the model's
            broadcast_tensors_(self.buffers, 0)
        self.ps.barrier("ps epoch end: every rank read the parameters")
        if self.is_server:
            self.server.reset_epoch()
        self.ps.barrier("ps epoch end: the servers reset")

    def optimizer_state(self) -> Optional[list]:
        """Collective: every server's optimizer state, gathered on rank 0 (by rank)."""
        mine = self.optimizer.state_dict() if self.optimizer is not None else None
        return objects.gather(self.ps.group, mine,
                              "checkpoint: gathering the servers' optimizer state",
                              comm=self.ps.comm)

    def load_optimizer(self, state: Optional[list]) -> None:
        """Rank 0 passes the checkpoint's per-server states, re-cut when it had another
        number of servers (Note [Resuming on another number of ranks] in setup.py)."""
        if state is not None:
            state = [None] * self.ps.num_workers + reshard_optimizer_states(  # servers last
                state, len(self.ps.shards), len(self.flat))
        mine = objects.scatter(self.ps.group, state,
                               "resume: scattering the servers' optimizer state",
                               comm=self.ps.comm)
        if self.optimizer is not None and mine is not None:
            self.optimizer.load_state_dict(mine)

    def report(self, total_s: float) -> dict:
        """Collective: the staleness histogram and the servers' counts and rates, on every
        rank."""
        seen = objects.allgather(self.ps.group, None if self.is_server else
                                 self.worker.staleness_seen,
                                 "summary: gathering the ps staleness", comm=self.ps.comm)
        served = objects.allgather(self.ps.group, (self.server.applies, self.server.pushes,
                                                   self.server.busy_s)
                                   if self.is_server else None,
                                   "summary: gathering the ps figures", comm=self.ps.comm)
        values = [v for lst in seen if lst for v in lst]
        histogram = {str(k): int(c) for k, c in zip(*np.unique(values, return_counts=True))} \
            if values else {}
        servers = [x for x in served if x is not None]
        pushes = int(sum(x[1] for x in servers)) // len(servers)  # each reaches every server
        rate = 1.0 / total_s if total_s > 0 else 0.0
        return {"staleness_histogram": histogram,
                "staleness_mean": float(np.mean(values)) if values else 0.0,
                "pushes": pushes, "pushes_per_s": pushes * rate,  # one pull precedes each
                "server_applies": [x[0] for x in servers],
                "server_applies_per_s": [x[0] * rate for x in servers],
                "server_busy_s": [x[2] for x in servers],
                "workers": self.ps.num_workers, "servers": len(servers),
                "ps_memory": self.ps.memory}

    def free(self) -> None:
        self.ps.free()
