"""The training loop shared by the command line and ``mpidp.fit``: sharded epochs, the
strategy's step, the learning-rate schedule, held-out evaluation, metrics, checkpoints and
resume."""
from __future__ import annotations

import contextlib
import dataclasses
import signal
import sys
import time
from typing import Callable, Iterator, Optional

import numpy as np
import torch

from .. import collectives, runtime, timeline
from ..data import ShardSampler
from ..watchdog import collective
from . import checkpoint, setup, stragglers
from .report import Report, emit
from .scoring import evaluate, parameters_sha256
from .settings import TrainSettings, check_world, make_optimizer, scaled_lr, straggler_of
from .strategies import make_strategy
from .strategy_base import Strategy

# Note [Checkpoint on signal]
# With --checkpoint-on-signal, SIGTERM and SIGUSR1 (what Slurm sends before a time limit, e.g.
# `#SBATCH --signal=USR1@120`; Hydra's mpiexec forwards both to every rank) do not end the run
# at once: the handler only records the signal (a rank waiting in the shared-memory protocol
# waits on, since the handler raises nothing). The signal may reach the ranks at different
# steps, so after each step every rank contributes the number of the signal it has seen (0:
# none) to a one-element max all-reduce, and every rank acts on the same answer at the same
# step boundary: it writes the checkpoint --checkpoint-every would write there (after an
# epoch's last step, the epoch-end one), so --resume continues bit for bit, then raises
# StoppedOnSignal, which the command line ends as an interrupted run (Note [Interrupted run]
# in cli.py) with exit code 128 + the signal's number. A signal recorded after the last step
# lets the run finish: its last checkpoint is the end of the run. SIGINT keeps interrupting at
# once. The all-reduce runs only with the flag, at every step: ~1 µs on 2 ranks of one node
# (the one-call shared-memory path) against ~1.3 ms for a step of the default MLP; agreeing
# every K steps instead would save nothing measurable and only delay the stop.

_SIGNALS_TO_CHECKPOINT = (signal.SIGTERM, signal.SIGUSR1)


class SignalRecord:
    """The first of SIGTERM or SIGUSR1 received while installed (0: none yet)."""

    def __init__(self):
        self.signum = 0

    def record(self, signum: int, frame) -> None:
        self.signum = self.signum or signum


_recording: Optional[SignalRecord] = None


@contextlib.contextmanager
def recording_signals() -> Iterator[SignalRecord]:
    """Within it SIGTERM and SIGUSR1 are only recorded (Note [Checkpoint on signal]); the
    previous handlers come back after. Nested uses share the outer record. Main thread only."""
    global _recording
    if _recording is not None:
        yield _recording
        return
    record = SignalRecord()
    previous = {s: signal.signal(s, record.record) for s in _SIGNALS_TO_CHECKPOINT}
    _recording = record
    try:
        yield record
    finally:
        _recording = None
        for s, handler in previous.items():
            signal.signal(s, handler)


class StoppedOnSignal(Exception):
    """Every rank stopped training at the same step after ``signum`` and wrote a checkpoint
    (Note [Checkpoint on signal]): ``path`` on rank 0, None elsewhere."""

    def __init__(self, signum: int, path):
        super().__init__(f"checkpoint written on {signal.Signals(signum).name}: {path}")
        self.signum, self.path = signum, path



def _arrive(comm) -> None:
    """Returns once every rank of ``comm`` has called it: MPI_Ibarrier polled from Python, so
    a Ctrl-C or SIGTERM to this rank raises here while it waits (Note [Interrupted run] in
    cli.py). A blocking MPI call would hold the signal until the others came, and they may be
    ending on the same signal: the job would then end with another rank's line, rank 0's
    withheld (seen in CI: rank 0 in the checkpoint's MPI_Gather, rank 1 already stopped)."""
    request = comm.Ibarrier()
    while not request.Test():
        time.sleep(0.0002)

class Trainer:
    """Trains a model with the settings of ``python -m mpidp.train`` (TrainSettings, or the
    same names as keywords). ``fit`` is collective: every rank calls it with the same model
    architecture, data set sizes and settings (checked)."""

    def __init__(self, settings: Optional[TrainSettings] = None, **overrides):
        settings = settings if settings is not None else TrainSettings()
        self.settings = dataclasses.replace(settings, **overrides)

    def fit(self, model: torch.nn.Module, train_data, test_data=None,
            loss_fn: Optional[Callable] = None, names: Optional[tuple] = None) -> dict:
        """Trains ``model`` (a fresh module, the same architecture on every rank; rank 0's
        initial parameters win) on ``train_data`` (a map-style dataset of (input, label)),
        scoring accuracy on ``test_data`` every ``eval_every`` epochs and at the end.
        ``names``: (model, data set) as the summary should call them. Returns the summary
        (also printed as JSON by rank 0). Bad settings or inputs raise SetupError (a
        ValueError) on every rank before any training collective. With
        ``checkpoint_on_signal``, SIGTERM or SIGUSR1 end training on every rank at one step
        with a checkpoint and StoppedOnSignal (Note [Checkpoint on signal])."""
        s = self.settings
        g = runtime.init()
        setup.agree(g, lambda: (s.check(), check_world(s, g.size)))
        setup.same_everywhere(g, setup.fingerprint(s, train_data, test_data))
        sampler = setup.agree(g, lambda: ShardSampler(len(train_data), g.rank, g.size, s.seed))
        setup.agree(g, lambda: setup.check_outputs(s) if g.rank == 0 else None, name_rank=False)
        resumed = None
        if s.resume:
            resumed = setup.agree(g, lambda: setup.find_resume_point(
                s, g.size, model, len(train_data), _warn) if g.rank == 0 else None,
                name_rank=False)
        torch.set_num_threads(s.threads_per_rank or setup.default_threads(g.local_size))
        names = names or (type(model).__name__, type(train_data).__name__)
        report = Report(g.rank, g.size, s.progress, s.verbose, s.log_json)
        try:
            with recording_signals() if s.checkpoint_on_signal else contextlib.nullcontext():
                return self._train(g, model, train_data, test_data, loss_fn, sampler, resumed,
                                   report, names)
        finally:
            report.close()

    def _train(self, g, model, train_data, test_data, loss_fn, sampler, resumed, report,
               names):
        """The run after set-up: resume, the epochs, the summary. Every rank calls it; each
        step below is collective and comes in this order on every rank."""
        s = self.settings
        strategy = _start_strategy(s, g, model, resumed)
        run = _Run(s, g, model, strategy, train_data, test_data,
                   loss_fn or torch.nn.functional.cross_entropy, sampler, report)
        first_epoch, first_step = run.resume(resumed) if s.resume else (0, 0)
        for line in strategy.notes:
            report.line(line)
        t_run = run.start_clocks()
        for epoch in range(first_epoch, s.epochs):
            run.train_epoch(epoch, first_step if epoch == first_epoch else 0)
        return run.summarize(time.perf_counter() - t_run, names)


def _start_strategy(s: TrainSettings, g, model: torch.nn.Module,
                    resumed: Optional[checkpoint.Checkpoint]) -> Strategy:
    """Seeds this rank's RNGs and wraps ``model`` in the training mode of ``s``; rank 0's
    parameters (the checkpoint's when resuming) win. Every rank calls it."""
    checkpoint.seed_rng(s.seed, g.rank)
    if g.rank == 0 and resumed:
        model.load_state_dict(resumed.state["model"])
    return make_strategy(s, model, make_optimizer(s))


@dataclasses.dataclass
class _EpochFigures:
    """One rank's figures for one epoch: seconds computing (a server's: serving) and waiting
    for communication, samples trained, their summed loss, the epoch's seconds, the last
    learning rate."""
    lr: float
    compute_s: float = 0.0
    wait_s: float = 0.0
    samples: int = 0
    loss_sum: float = 0.0
    time_s: float = 0.0

    def row(self) -> np.ndarray:
        """The 1x5 row every rank contributes to the epoch's allgather."""
        return np.array([[self.compute_s, self.wait_s, self.samples, self.loss_sum,
                          self.time_s]])


class _Run:
    """One ``fit`` after set-up: the model in its strategy, the data, and where the run stands
    (the global step, the last checkpoint written, the last epoch's event and held-out score,
    the totals the summary averages). Its public methods are collective."""

    def __init__(self, settings: TrainSettings, g, model: torch.nn.Module, strategy: Strategy,
                 train_data, test_data, loss_fn: Callable, sampler: ShardSampler,
                 report: Report):
        s = self.settings = settings
        self.g, self.model, self.strategy, self.report = g, model, strategy, report
        self.train_data, self.test_data, self.loss_fn = train_data, test_data, loss_fn
        self.sampler = sampler
        self.steps = strategy.steps_per_epoch(sampler, len(train_data), s.batch_size)
        self.lr_ranks = strategy.lr_ranks or g.size
        self.straggler, self.slowdown = straggler_of(s.straggler) if s.straggler else (-1, 1.0)
        self.global_step = 0
        self.checkpoint = None  # the last checkpoint: its path on rank 0, None elsewhere
        self.resumed_from: Optional[str] = None
        self.accuracy: Optional[float] = None  # the last held-out score
        self.event: dict = {}  # the last epoch's
        self.samples_total, self.wait_total, self.time_total = 0, 0.0, 0.0
        self.stop_signum = 0  # agreed by every rank: Note [Checkpoint on signal]
        self.straggling: Optional[int] = None  # the rank last reported as the straggler
        self._agreement = np.zeros(1, np.int64)

    # ---- before the first epoch ---------------------------------------------------------

    def resume(self, resumed: Optional[checkpoint.Checkpoint]) -> tuple:
        """Every rank takes up the checkpoint rank 0 found (``resumed``, on rank 0): the
        optimizer state, each rank's RNG state, the position; rank 0 says which checkpoint,
        with its digest. Returns (epoch, batches done in it)."""
        g = self.g
        path, state, digest = resumed if g.rank == 0 else (None, None, None)
        self.strategy.load_optimizer(state["optimizer"] if state else None)
        self.strategy.load_comm_state(state.get("comm_hook") if state else None)
        rngs = state["rng"] if state else None
        where = (str(path), state["epoch"], state["step_in_epoch"], state["global_step"]) \
            if state else None
        with collective(g, "resume: scattering the checkpoint's RNG states"):
            checkpoint.set_rng_state(g.comm.scatter(rngs, root=0) if g.size > 1 else rngs[0])
            self.checkpoint, epoch, step, self.global_step = \
                g.comm.bcast(where, root=0) if g.size > 1 else where
        self.resumed_from = self.checkpoint
        self.strategy.resume_at(self.global_step)
        which = f"{self.checkpoint} (sha256 {digest[:12]})" if digest else self.checkpoint
        self.report.line(f"resuming from {which}: epoch {epoch + 1}, step {step}"
                         if epoch < self.settings.epochs else
                         f"{which} is the end of the run: nothing left to train")
        return epoch, step

    def start_clocks(self) -> float:
        """Returns the run's start time, taken on every rank together (set-up, such as the
        optimizer's creation, is not waiting)."""
        if self.g.size > 1:
            collectives.allreduce_(np.zeros(1))
        return time.perf_counter()

    # ---- one epoch ----------------------------------------------------------------------

    def train_epoch(self, epoch: int, first: int) -> None:
        """Epoch ``epoch`` from batch ``first``: its steps, the held-out score when due, the
        epoch's event from every rank's figures, the end-of-epoch checkpoint."""
        self.report.start_epoch(epoch, self.settings.epochs, self.steps, first)
        figures = self._train_steps(epoch, first)
        self.accuracy = self._evaluate_if_due(epoch)
        self.event = self._epoch_event(epoch, first, figures)
        self.report.end_epoch(self.event)
        self._report_straggler(epoch)
        if self.settings.checkpoint_dir:
            self._save((epoch + 1, 0))
        if self.stop_signum and epoch + 1 < self.settings.epochs:
            raise StoppedOnSignal(self.stop_signum, self.checkpoint)

    def _train_steps(self, epoch: int, first: int) -> _EpochFigures:
        """A server's serving, a worker's (every mirrored or central rank's) steps, then the
        strategy's epoch end; returns this rank's figures."""
        figures = _EpochFigures(lr=self.settings.lr)
        t_epoch = time.perf_counter()
        figures.compute_s += self.strategy.serve_epoch(epoch, self.steps)
        for b, (x, y) in self.strategy.epoch_batches(self.train_data, self.sampler, epoch,
                                                     first, self.settings.batch_size):
            self._step(epoch, b, x, y, figures)
        t_end = time.perf_counter()
        self.strategy.end_epoch()
        figures.wait_s += time.perf_counter() - t_end
        self.global_step = (epoch + 1) * self.steps  # the same on every rank (ps workers differ)
        figures.time_s = time.perf_counter() - t_epoch
        return figures

    def _step(self, epoch: int, b: int, x, y, figures: _EpochFigures) -> None:
        """Batch ``b``: learning rate, forward, the strategy's step, the figures, a
        checkpoint when one is due inside the epoch."""
        s, strategy = self.settings, self.strategy
        figures.lr = scaled_lr(s, self.lr_ranks, epoch + b / self.steps)
        strategy.set_lr(figures.lr)
        t0 = time.perf_counter()
        waited = strategy.stats["wait_s"]
        strategy.zero_grad()
        with timeline.span("forward"):
            loss = self.loss_fn(strategy.forward(x), y)
        strategy.step(loss)
        dt = time.perf_counter() - t0
        dw = strategy.stats["wait_s"] - waited
        if self.straggler == self.g.rank:
            dt = self._straggle(t0, dt - dw)
        figures.compute_s += dt - dw
        figures.wait_s += dw
        loss_value = float(loss.detach())
        figures.loss_sum += loss_value * len(y)
        figures.samples += len(y)
        self.global_step += 1
        self.report.step(loss_value, len(y) * self.g.size / dt if dt > 0 else 0.0)
        if s.checkpoint_on_signal:
            self.stop_signum = self._agree_on_signal()
        due = s.checkpoint_every and self.global_step % s.checkpoint_every == 0
        if s.checkpoint_dir and b + 1 < self.steps and (due or self.stop_signum):
            self._save((epoch, b + 1))
            if self.stop_signum:
                raise StoppedOnSignal(self.stop_signum, self.checkpoint)

    def _agree_on_signal(self) -> int:
        """The signal some rank has recorded (the highest number; 0: none), the same on every
        rank (Note [Checkpoint on signal]). Every rank calls it, after each step."""
        self._agreement[0] = _recording.signum if _recording is not None else 0
        if self.g.size > 1:
            collectives.allreduce_(self._agreement, "max")
        return int(self._agreement[0])

    def _straggle(self, t0: float, compute_s: float) -> float:
        """--straggler, a testing aid: this rank computes FACTOR× slower, sleeping (FACTOR-1)×
        the ``compute_s`` of its step. Returns the step's seconds since ``t0``, the sleep
        included."""
        time.sleep((self.slowdown - 1) * compute_s)
        return time.perf_counter() - t0

    def _evaluate_if_due(self, epoch: int) -> Optional[float]:
        """Held-out accuracy every ``eval_every`` epochs and after the last; None when not
        due or without held-out data."""
        s = self.settings
        if self.test_data is not None and ((s.eval_every and (epoch + 1) % s.eval_every == 0)
                                           or epoch + 1 == s.epochs):
            return evaluate(self.model, self.test_data, self.g)
        return None

    def _epoch_event(self, epoch: int, first: int, figures: _EpochFigures) -> dict:
        """The epoch's event (the JSON line and the log line) from every rank's ``figures``,
        gathered; adds them to the run's totals."""
        per_rank = collectives.allgather(figures.row())
        compute, waits, counts, losses, times = per_rank.T
        n_samples = int(counts.sum())
        wall_s = float(times.max())  # the epoch ends with its slowest rank
        self.samples_total += n_samples
        self.wait_total += float(waits.mean())
        self.time_total += float(times.mean())
        return {"event": "epoch", "epoch": epoch + 1, "epochs": self.settings.epochs,
                "steps": self.steps - first, "global_step": self.global_step,
                "train_loss": float(losses.sum() / max(n_samples, 1)),
                "test_accuracy": self.accuracy,
                "samples_per_s": n_samples / wall_s if wall_s > 0 else 0.0,
                "time_s": wall_s, "wait_fraction": float((waits / times).mean())
                if times.min() > 0 else 0.0, "lr": figures.lr,
                "ranks": [{"rank": r, "compute_s": float(c), "wait_s": float(w),
                           "samples": int(n), "time_s": float(t)}
                          for r, (c, w, n, _, t) in enumerate(per_rank)]}

    def _report_straggler(self, epoch: int) -> None:
        """Note [Straggler report] in mpidp/train/stragglers.py."""
        ranks = self.event["ranks"]
        g = self.g
        found = stragglers.straggler([r["compute_s"] for r in ranks],
                                     [r["samples"] for r in ranks],
                                     [g.hosts[g.node_of[r]] for r in range(g.size)],
                                     epoch + 1, self.global_step)
        if found is not None and found["rank"] != self.straggling:
            self.report.line(stragglers.describe(found))
            self.report.record(found)
        self.straggling = None if found is None else found["rank"]

    @timeline.traced("checkpoint")
    def _save(self, position: tuple) -> None:
        """Checkpoint at ``position`` = (epoch, batches done in it): every rank sends its RNG
        state, rank 0 writes (and keeps its path in ``checkpoint``; others keep None)."""
        s, g = self.settings, self.g
        with collective(g, "checkpoint: gathering every rank's RNG state"):
            if g.size > 1:
                _arrive(g.comm)
            rng = g.comm.gather(checkpoint.rng_state(), root=0) if g.size > 1 \
                else [checkpoint.rng_state()]
        optimizer = self.strategy.optimizer_state()  # collective for ps (servers hold it)
        hook = self.strategy.comm_state()  # collective
        if g.rank != 0:
            self.checkpoint = None
            return
        state = {"model": self.model.state_dict(), "optimizer": optimizer,
                 "epoch": position[0], "step_in_epoch": position[1],
                 "global_step": self.global_step, "world_size": g.size,
                 "train_samples": len(self.train_data),
                 "data_order": {"seed": s.seed, "epoch": position[0],
                                "position": position[1]},
                 "rng": rng, "settings": dataclasses.asdict(s),
                 **({"comm_hook": hook} if hook is not None else {})}
        assert set(checkpoint.KEYS) <= set(state) | {"format"}, "resume reads checkpoint.KEYS"
        self.checkpoint = checkpoint.save(s.checkpoint_dir, state, self.global_step,
                                          s.keep_checkpoints)

    # ---- after the last epoch -----------------------------------------------------------

    def summarize(self, total_s: float, names: tuple) -> dict:
        """The run's summary (a run of ``total_s``; ``names``: model, data set): the final
        held-out score if the last epoch took none, the strategy's figures; frees the
        strategy. Rank 0 prints it."""
        s, g = self.settings, self.g
        if self.accuracy is None and self.test_data is not None:
            self.accuracy = evaluate(self.model, self.test_data, g)
        extra = self.strategy.report(total_s)
        self.strategy.free()
        summary = {"event": "summary", "strategy": s.strategy, "ranks": g.size,
                   "model": names[0], "dataset": names[1], "epochs": s.epochs,
                   "global_step": self.global_step, "final_accuracy": self.accuracy,
                   "final_train_loss": self.event.get("train_loss"), "total_s": total_s,
                   "samples_per_s": self.samples_total / total_s if total_s > 0 else 0.0,
                   "wait_fraction": self.wait_total / self.time_total
                   if self.time_total > 0 else 0.0,
                   "parameters_sha256": parameters_sha256(self.model),
                   "checkpoint": str(self.checkpoint) if self.checkpoint else None,
                   "resumed_from": self.resumed_from, **extra}
        self.report.summary(summary)
        return summary


def _warn(text: str) -> None:
    emit(f"mpidp.train: warning: {text}", sys.stderr)


def fit(model: torch.nn.Module, train_data, test_data=None, *, loss_fn: Optional[Callable] = None,
        **settings) -> dict:
    """``Trainer(**settings).fit(model, train_data, test_data, loss_fn)``: the loop of
    ``python -m mpidp.train`` for your own model and data. Every rank calls it."""
    return Trainer(**settings).fit(model, train_data, test_data, loss_fn)
