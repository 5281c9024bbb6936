"""The training loop shared by the command line and ``mpidp.fit``: sharded epochs, the
strategy's step, the learning-rate schedule, held-out evaluation, metrics, checkpoints and
resume."""
from __future__ import annotations

import contextlib
import dataclasses
import sys
import time
from typing import Callable, Optional

import numpy as np
import torch

from ..comm import collectives
from .. import runtime
from ..runtime import recovery, timeline
from ..workloads.data import ShardSampler
from ..engine.gpu.device import torch_gpu
from ..runtime.frame import collective
from ..comm import objects
from . import async_checkpoint, checkpoint, devices, in_job, setup, stragglers
from .on_signal import StoppedOnSignal, arrive, recorded_signal, recording_signals
from .metrics import Report, emit
from .scoring import evaluate, parameters_sha256
from .settings import (LOCAL_STRATEGIES, TrainSettings, check_world, make_optimizer, scaled_lr,
                       straggler_of)
from .strategies import make_strategy
from .strategy_base import Strategy

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
        if in_job.joining():  # a replacement of a lost rank: Note [Recovering a run]
            return self._replace(g, model, train_data, test_data, loss_fn, names)
        setup.agree(g, lambda: (s.check(), check_world(s, g.size)))
        setup.same_everywhere(g, setup.fingerprint(s, train_data, test_data))
        sampler = setup.agree(g, lambda: ShardSampler(len(train_data), g.rank, g.size, s.seed))
        mine = torch_gpu(g.local_rank)
        gpus = objects.allgather(g, mine, "set-up: every rank's GPU")
        kind, why = setup.agree(g, lambda: devices.decide(s.device, s.strategy, gpus))
        # last of the checks, as it creates the checkpoint directory; rank 0 holds its lock
        # and the log's till the end (Note [One run per directory] in mpidp/run_lock.py)
        locks = setup.agree(g, lambda: setup.check_outputs(s) if g.rank == 0 else None,
                            name_rank=False)
        try:
            for lock in locks or ():
                if lock.warning:
                    _warn(lock.warning)
            return self._set_up_and_train(g, model, train_data, test_data, loss_fn, sampler,
                                          kind, why, names)
        finally:
            setup.release(locks)

    def _set_up_and_train(self, g, model, train_data, test_data, loss_fn, sampler, kind, why,
                          names):
        """``fit`` once its outputs are checked and held: the resume point, then ``_train``."""
        s = self.settings
        resumed = None
        if s.resume:
            resumed = setup.agree(g, lambda: setup.find_resume_point(
                s, g.size, model, len(train_data), _warn) if g.rank == 0 else None,
                name_rank=False)
        threads = s.threads_per_rank or setup.default_threads(g.host_size)
        torch.set_num_threads(threads)
        device = torch.device(kind)  # mpidp.init bound this rank's GPU (Note [Training device])
        names = names or (type(model).__name__, type(train_data).__name__)
        report = Report(g.rank, g.size, s.progress, s.verbose, s.log_json)
        try:
            with recording_signals() if s.checkpoint_on_signal else contextlib.nullcontext():
                report.line(f"training on {kind} ({why}), {threads} torch thread(s) per rank" + (
                    f", autocast {s.amp}" if s.amp != "off" else ""))
                return self._train(g, model.to(device), train_data, test_data, loss_fn,
                                   sampler, resumed, report, names)
        finally:
            report.close()

    def _replace(self, g, model, train_data, test_data, loss_fn, names):
        """``fit`` in a process started to replace a lost rank (Note [Recovering a run] in
        mpidp/train/in_job.py): this rank's own set-up, then the run taken up from the
        survivors (``in_job.rejoin``, collective with their recovery) and trained on."""
        s = self.settings
        s.check()  # the defaults it fills in (the learning rate): the survivors' settings
        kind, why = devices.decide(s.device, s.strategy, [torch_gpu(g.local_rank)] * g.size)
        torch.set_num_threads(s.threads_per_rank or setup.default_threads(g.host_size))
        report = Report(g.rank, g.size, s.progress, s.verbose, s.log_json)
        sampler = ShardSampler(len(train_data), g.rank, g.size, s.seed)
        try:
            return self._train(g, model.to(torch.device(kind)), train_data, test_data,
                               loss_fn, sampler, None, report, names or (
                                   type(model).__name__, type(train_data).__name__),
                               joining=True)
        finally:
            report.close()

    def _train(self, g, model, train_data, test_data, loss_fn, sampler, resumed, report,
               names, joining: bool = False):
        """The run after set-up: resume (or, ``joining``, the survivors' state: Note
        [Recovering a run]), the epochs, the summary. Every rank calls it; each step below
        is collective and comes in this order on every rank."""
        s = self.settings
        if joining:
            checkpoint.seed_rng(s.seed, g.rank)
        strategy = None if joining else _start_strategy(s, g, model, resumed)
        run = _Run(s, g, model, strategy, train_data, test_data,
                   loss_fn or torch.nn.functional.cross_entropy, sampler, report)
        try:
            if joining:
                first_epoch, cursor = in_job.rejoin(run, g, run.snapshots)
            else:
                first_epoch, cursor = run.resume(resumed) if s.resume else (0, 0)
                for line in strategy.notes:
                    report.line(line)
                run.start_snapshots(first_epoch, cursor)
            t_run = run.start_clocks() if not joining else time.perf_counter()
            while True:
                try:
                    for epoch in range(first_epoch, s.epochs):
                        run.train_epoch(epoch, cursor if epoch == first_epoch else 0)
                    return run.summarize(time.perf_counter() - t_run, names)
                except Exception as exc:  # a lost rank, where the run can go on without it
                    if run.snapshots is None or not recovery.is_process_failure(exc):
                        raise
                    g, (first_epoch, cursor) = in_job.recover(run, run.snapshots)
        finally:
            if run.writer is not None:
                run.writer.close()
            if run.report is not run.first_report:
                run.report.close()


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
    for communication, samples trained, their summed loss, the epoch's seconds, the seconds
    --straggler made it sleep (in compute_s too), the last learning rate."""
    lr: float
    compute_s: float = 0.0
    wait_s: float = 0.0
    samples: int = 0
    loss_sum: float = 0.0
    time_s: float = 0.0
    straggler_delay_s: float = 0.0

    def row(self) -> np.ndarray:
        """The 1x6 row every rank contributes to the epoch's allgather."""
        return np.array([[self.compute_s, self.wait_s, self.samples, self.loss_sum,
                          self.time_s, self.straggler_delay_s]])


class _Run:
    """One ``fit`` after set-up: the model in its strategy, the data, and where the run stands
    (the global step, the last checkpoint written, the last epoch's event and held-out score,
    the totals the summary averages). Its public methods are collective."""

    def __init__(self, settings: TrainSettings, g, model: torch.nn.Module, strategy: Strategy,
                 train_data, test_data, loss_fn: Callable, sampler: ShardSampler,
                 report: Report):
        s = self.settings = settings
        self.g, self.model, self.strategy, self.report = g, model, strategy, report
        self.first_report = report  # the caller's, which it closes (``rebind`` makes others)
        self.train_data, self.test_data, self.loss_fn = train_data, test_data, loss_fn
        self.sampler = sampler
        self.steps = strategy.steps_per_epoch(sampler, len(train_data), s.batch_size) \
            if strategy is not None else 0  # a replacement's: from ``rebind``
        self.lr_ranks = (strategy.lr_ranks if strategy is not None else 0) or g.size
        # Note [Recovering a run] in mpidp/train/in_job.py: None where a lost rank ends the run
        self.snapshots = in_job.Snapshots() if g.recovery != "off" and (
            strategy is None or in_job.recoverable(s, strategy) is None) else None
        self.straggler, self.slowdown = straggler_of(s.straggler) if s.straggler else (-1, 1.0)
        self.global_step = 0
        self.checkpoint = None  # the last checkpoint: its path on rank 0, None elsewhere
        self.resumed_from: Optional[str] = None
        self.meeting_checkpoint: Optional[str] = None  # local SGD, DiLoCo: the newest at one
        self.accuracy: Optional[float] = None  # the last held-out score
        self.event: dict = {}  # the last epoch's
        self.samples_total, self.wait_total, self.time_total = 0, 0.0, 0.0
        self.stop_signum = 0  # agreed by every rank: Note [Checkpoint on signal]
        self.straggling: Optional[int] = None  # the rank last reported as the straggler
        self._agreement = np.zeros(1, np.int64)
        self.device = next(model.parameters()).device
        self.writer = async_checkpoint.Writer(s.checkpoint_dir, s.keep_checkpoints,
                                              report.line) \
            if s.async_checkpoint and g.rank == 0 else None
        self.retention = checkpoint.Retention(report.line)  # Note [Checkpoint retention]
        self.checkpoint_wait_s = 0.0  # rank 0's seconds of training spent on checkpoints

    # ---- before the first epoch ---------------------------------------------------------

    def start_snapshots(self, epoch: int, cursor: int) -> None:
        """Under in-job recovery: the first snapshot (Note [Recovering a run]), or the line
        saying why this run ends at a lost rank instead."""
        if self.g.recovery == "off":
            return
        why = in_job.recoverable(self.settings, self.strategy)
        if why is not None:
            self.report.line(f"in-job recovery: not for {why}; a lost rank ends the run "
                             "(python -m mpidp.run relaunches it)")
            return
        self.report.line(f"in-job recovery: on ({recovery.library()}): a lost rank is "
                         + ("replaced in the job" if self.g.recovery == "respawn" else
                            "left behind; the others go on"))
        self.snapshots.take(self, (epoch, 0, cursor))

    def rebind(self, g) -> None:
        """The run on ``g``, the group remade after a lost rank (Note [Recovering a run]): a
        new strategy around the model (collective over ``g``), this rank's shard, the
        report of its rank. Every rank of ``g`` calls it."""
        s = self.settings
        if self.strategy is not None:
            self.strategy.abandon()
        self.g = g
        self.sampler = ShardSampler(len(self.train_data), g.rank, g.size, s.seed)
        self.strategy = make_strategy(s, self.model, make_optimizer(s))
        self.steps = self.strategy.steps_per_epoch(self.sampler, len(self.train_data),
                                                   s.batch_size)
        self.lr_ranks = self.strategy.lr_ranks or g.size
        if (self.report.rank, self.report.size) != (g.rank, g.size):
            if self.report is not self.first_report:  # one an earlier recovery made
                self.report.close()
            self.report = Report(g.rank, g.size, s.progress, s.verbose, s.log_json)
        if self.writer is None and s.async_checkpoint and g.rank == 0:
            self.writer = async_checkpoint.Writer(s.checkpoint_dir, s.keep_checkpoints,
                                                  self.report.line)

    def resume(self, resumed: Optional[checkpoint.Checkpoint]) -> tuple:
        """Every rank takes up the checkpoint rank 0 found (``resumed``, on rank 0): the
        optimizer state, each rank's RNG state, the position; rank 0 says which checkpoint,
        with its digest, and what changed: settings (Note [What a resume may change]), the
        number of ranks (Note [Resuming on another number of ranks]). Returns (epoch, its
        sample cursor: Note [Sample cursor])."""
        g = self.g
        path, state, digest = resumed if g.rank == 0 else (None, None, None)
        if path is not None:  # read and hashed once: Note [Checkpoint retention]
            (self.writer if self.writer is not None else self.retention).verified(path)
        self.strategy.load_optimizer(state["optimizer"] if state else None)
        self.strategy.load_comm_state(state.get("comm_hook") if state else None)
        if self.strategy.scaler is not None:  # the same on every rank: Note [Training device]
            scaler = objects.bcast(g, state.get("amp_scaler") if state else None,
                                   "resume: broadcasting the gradient scaler's state")
            if scaler:
                self.strategy.scaler.load_state_dict(scaler)
        where = (str(path), state["epoch"], state["step_in_epoch"], state["global_step"],
                 checkpoint.cursor_of(state, self.settings.batch_size),
                 setup.resume_lines(state, self.settings, g.size, self.lr_ranks,
                                    len(self.train_data))) if state else None
        self.checkpoint, epoch, step, self.global_step, cursor, changes = objects.bcast(
            g, where, "resume: broadcasting the checkpoint's position")
        rngs = checkpoint.rng_states_for(state["rng"], g.size) if state else None
        rng = objects.scatter(g, rngs, "resume: scattering the checkpoint's RNG states")
        if rng is not None:  # None: a rank the checkpoint had not; its seeded stream stays
            checkpoint.set_rng_state(rng)
        self.resumed_from = self.checkpoint
        if state and self.settings.strategy in LOCAL_STRATEGIES:  # rank 0, the writer
            self.meeting_checkpoint = setup.newest_meeting_checkpoint(
                self.settings.checkpoint_dir, resumed)
        self.strategy.resume_at(self.global_step)
        which = f"{self.checkpoint} (sha256 {digest[:12]})" if digest else self.checkpoint
        self.report.line(f"resuming from {which}: epoch {epoch + 1}, step {step}"
                         if epoch < self.settings.epochs else
                         f"{which} is the end of the run: nothing left to train")
        for line in changes:  # Note [What a resume may change] in setup.py
            self.report.line(line)
        return epoch, cursor

    def start_clocks(self) -> float:
        """Returns the run's start time, taken on every rank together (set-up, such as the
        optimizer's creation, is not waiting)."""
        if self.g.size > 1:
            collectives.allreduce_(np.zeros(1))
        return time.perf_counter()

    # ---- one epoch ----------------------------------------------------------------------

    def train_epoch(self, epoch: int, cursor: int) -> None:
        """Epoch ``epoch`` from sample position ``cursor`` (Note [Sample cursor]): its steps,
        the held-out score when due, the epoch's event from every rank's figures, the
        end-of-epoch checkpoint."""
        # a cursor past the epoch's samples: its steps all done, its end not (a recovery that
        # went on from its last step: Note [Recovering a run] in mpidp/train/in_job.py)
        first = self.steps if cursor >= self.sampler.length else \
            self.steps - self.strategy.steps_left(self.sampler, epoch, cursor,
                                                  self.settings.batch_size, self.steps)
        self.report.start_epoch(epoch, self.settings.epochs, self.steps, first)
        figures = self._train_steps(epoch, first, cursor)
        self.accuracy = self._evaluate_if_due(epoch)
        self.event = self._epoch_event(epoch, first, figures)
        self.report.end_epoch(self.event)
        self._report_straggler(epoch)
        if self.settings.checkpoint_dir:
            self._save((epoch + 1, 0, 0))
        if self.snapshots is not None:
            self.snapshots.epoch_done(epoch, self.samples_total)
        if self.stop_signum and epoch + 1 < self.settings.epochs:
            self._stop()

    def _train_steps(self, epoch: int, first: int, cursor: int) -> _EpochFigures:
        """A server's serving, a worker's (every mirrored or central rank's) steps, batches
        ``first`` on from sample position ``cursor``, then the strategy's epoch end; returns
        this rank's figures."""
        figures = _EpochFigures(lr=self.settings.lr)
        t_epoch = time.perf_counter()
        step0 = self.global_step
        figures.compute_s += self.strategy.serve_epoch(epoch, self.steps)
        for b, (x, y) in () if first == self.steps else self.strategy.epoch_batches(
                self.train_data, self.sampler, epoch, first, self.settings.batch_size, cursor):
            self._step(epoch, b, x, y, figures, self.sampler.cursor_after(
                cursor, b + 1 - first, self.settings.batch_size))
        t_end = time.perf_counter()
        self.strategy.end_epoch()
        figures.wait_s += time.perf_counter() - t_end
        # the same on every rank (ps workers took different numbers of steps)
        self.global_step = step0 + self.steps - first
        figures.time_s = time.perf_counter() - t_epoch
        return figures

    def _step(self, epoch: int, b: int, x, y, figures: _EpochFigures, cursor: int) -> None:
        """Batch ``b``: learning rate, forward, the strategy's step, the figures, a
        checkpoint when one is due inside the epoch (``cursor``: the epoch's sample cursor
        after this step)."""
        s, strategy = self.settings, self.strategy
        figures.lr = scaled_lr(s, self.lr_ranks, epoch + b / self.steps)
        strategy.set_lr(figures.lr)
        t0 = time.perf_counter()
        waited = strategy.stats["wait_s"]
        strategy.zero_grad()
        x, y = devices.to_device((x, y), self.device)
        with timeline.span("forward"), devices.autocast(self.device, s.amp):
            loss = self.loss_fn(strategy.forward(x), y)
        strategy.step(loss)
        dt = time.perf_counter() - t0
        dw = strategy.stats["wait_s"] - waited
        if self.straggler == self.g.rank:
            dt = self._straggle(t0, dt - dw, figures)
        figures.compute_s += dt - dw
        figures.wait_s += dw
        loss_value = float(loss.detach())
        figures.loss_sum += loss_value * len(y)
        figures.samples += len(y)
        self.global_step += 1
        if self.snapshots is not None:
            self.snapshots.take(self, (epoch, b + 1, cursor))
        self.report.step(loss_value, len(y) * self.g.size / dt if dt > 0 else 0.0)
        if s.checkpoint_on_signal:
            self.stop_signum = self._agree_on_signal()
        due = s.checkpoint_every and self.global_step % s.checkpoint_every == 0
        if s.checkpoint_dir and b + 1 < self.steps and (due or self.stop_signum):
            self._save((epoch, b + 1, cursor))
            if self.stop_signum:
                self._stop()

    def _agree_on_signal(self) -> int:
        """The signal some rank has recorded (the highest number; 0: none), the same on every
        rank (Note [Checkpoint on signal]). Every rank calls it, after each step."""
        self._agreement[0] = recorded_signal()
        if self.g.size > 1:
            collectives.allreduce_(self._agreement, "max")
        return int(self._agreement[0])

    def _straggle(self, t0: float, compute_s: float, figures: _EpochFigures) -> float:
        """--straggler, a testing aid: this rank computes FACTOR× slower, sleeping (FACTOR-1)×
        the ``compute_s`` of its step (added to ``figures``' straggler_delay_s). Returns the
        step's seconds since ``t0``, the sleep included."""
        delay_s = (self.slowdown - 1) * compute_s
        time.sleep(delay_s)
        figures.straggler_delay_s += delay_s
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
        compute, waits, counts, losses, times, _ = per_rank.T
        n_samples = int(counts.sum())
        wall_s = float(times.max())  # the epoch ends with its slowest rank
        self.samples_total += n_samples
        self.wait_total += float(waits.mean())
        self.time_total += float(times.mean())
        return {"event": "epoch", "epoch": epoch + 1, "epochs": self.settings.epochs,
                "steps": self.steps - first, "epoch_steps": self.steps,
                "global_step": self.global_step,
                "train_loss": float(losses.sum() / max(n_samples, 1)),
                "test_accuracy": self.accuracy,
                "samples_per_s": n_samples / wall_s if wall_s > 0 else 0.0,
                "time_s": wall_s, "wait_fraction": float((waits / times).mean())
                if times.min() > 0 else 0.0, "lr": figures.lr,
                "ranks": [{"rank": r, "compute_s": float(c), "wait_s": float(w),
                           "samples": int(n), "time_s": float(t), "straggler_delay_s": float(d)}
                          for r, (c, w, n, _, t, d) in enumerate(per_rank)]}

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
        """Checkpoint at ``position`` = (epoch, batches done in it, its sample cursor): every
        rank sends its RNG state, rank 0 writes (and keeps its path in ``checkpoint``; others
        keep None)."""
        s, g = self.settings, self.g
        if g.size > 1:
            with collective(g, "checkpoint: every rank arriving"):
                arrive(g.comm)
        rng = objects.gather(g, checkpoint.rng_state(),
                             "checkpoint: gathering every rank's RNG state")
        optimizer = self.strategy.optimizer_state()  # collective for ps (servers hold it)
        hook = self.strategy.comm_state()  # collective
        scaler = self.strategy.scaler.state_dict() if self.strategy.scaler else None
        if g.rank != 0:
            self.checkpoint = None
            return
        state = {"model": self.model.state_dict(), "optimizer": optimizer,
                 "epoch": position[0], "step_in_epoch": position[1],
                 "global_step": self.global_step, "world_size": g.size,
                 "train_samples": len(self.train_data),
                 "data_order": {"seed": s.seed, "epoch": position[0],
                                "position": position[1], "cursor": position[2]},
                 "rng": rng, "settings": dataclasses.asdict(s),
                 **({"comm_hook": hook} if hook is not None else {}),
                 **({"amp_scaler": scaler} if scaler is not None else {})}
        assert set(checkpoint.KEYS) <= set(state) | {"format"}, "resume reads checkpoint.KEYS"
        t0 = time.perf_counter()
        kept = (self.resumed_from, self.meeting_checkpoint)  # Note [Checkpoint retention]
        if self.writer is not None:  # Note [Asynchronous checkpoints]
            self.checkpoint = self.writer.submit(state, self.global_step, kept)
        else:
            self.checkpoint = checkpoint.save(s.checkpoint_dir, state, self.global_step,
                                              s.keep_checkpoints, self.retention, kept)
        if s.strategy in LOCAL_STRATEGIES and not checkpoint.steps_past_meeting(state):
            self.meeting_checkpoint = str(self.checkpoint)
        self.checkpoint_wait_s += time.perf_counter() - t0

    def _stop(self) -> None:
        """Ends training on every rank after the checkpoint of Note [Checkpoint on signal]:
        rank 0 once it is on disk (the write in flight included), the others after meeting
        it there, so no rank ends the job while rank 0 still writes."""
        self._written()
        if self.g.size > 1:
            arrive(self.g.comm)
        raise StoppedOnSignal(self.stop_signum, self.checkpoint)

    def _written(self) -> None:
        """Returns once the last checkpoint is on disk (rank 0 with --async-checkpoint: the
        write in flight); raises what writing it raised."""
        if self.writer is not None:
            t0 = time.perf_counter()
            self.writer.wait()
            self.checkpoint_wait_s += time.perf_counter() - t0

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
        self._written()
        summary = {"event": "summary", "strategy": s.strategy, "ranks": g.size,
                   "device": self.device.type, "amp": s.amp,
                   "model": names[0], "dataset": names[1], "epochs": s.epochs,
                   "global_step": self.global_step, "final_accuracy": self.accuracy,
                   "final_train_loss": self.event.get("train_loss"), "total_s": total_s,
                   "samples_per_s": self.samples_total / total_s if total_s > 0 else 0.0,
                   "wait_fraction": self.wait_total / self.time_total
                   if self.time_total > 0 else 0.0,
                   "parameters_sha256": parameters_sha256(self.model),
                   "checkpoint": str(self.checkpoint) if self.checkpoint else None,
                   "checkpoint_wait_s": self.checkpoint_wait_s,
                   "checkpoint_write_s": self.writer.write_s if self.writer is not None
                   else self.checkpoint_wait_s,
                   "resumed_from": self.resumed_from, **extra}
        self.report.summary(summary, s.log_json)
        return summary


def _warn(text: str) -> None:
    emit(f"mpidp.train: warning: {text}", sys.stderr)


def fit(model: torch.nn.Module, train_data, test_data=None, *, loss_fn: Optional[Callable] = None,
        **settings) -> dict:
    """``Trainer(**settings).fit(model, train_data, test_data, loss_fn)``: the loop of
    ``python -m mpidp.train`` for your own model and data. Every rank calls it."""
    return Trainer(**settings).fit(model, train_data, test_data, loss_fn)
