"""The training loop shared by the command line and ``mpidp.fit``: sharded epochs, the
strategy's step, the learning-rate schedule, held-out evaluation, metrics, checkpoints and
resume."""
from __future__ import annotations

import dataclasses
import hashlib
import os
import random
import time
from typing import Any, Callable, Optional

import numpy as np
import torch

from .. import collectives, runtime
from ..data import ShardSampler, batches, steps_per_epoch
from . import checkpoint
from .report import Report
from .settings import MOMENTUM, TrainSettings, scaled_lr
from .strategies import make_strategy

EVAL_BATCH = 512


class SetupError(ValueError):
    """Bad settings or inputs found before training starts; raised on every rank alike."""


def agree(g, check: Callable[[], Any]) -> Any:
    """Runs ``check`` on every rank; if it raises ValueError on any rank, every rank raises
    SetupError with the first failing rank's message (so no rank goes on to wait in a
    collective). Every rank calls it."""
    try:
        result, message = check(), None
    except ValueError as exc:
        result, message = None, str(exc)
    messages = g.comm.allgather(message) if g.size > 1 else [message]
    failed = [(r, m) for r, m in enumerate(messages) if m is not None]
    if failed:
        r, m = failed[0]
        raise SetupError(m if len(failed) == g.size else f"rank {r}: {m}")
    return result


def make_optimizer(settings: TrainSettings) -> Callable[[list], torch.optim.Optimizer]:
    def build(params: list) -> torch.optim.Optimizer:
        if settings.optimizer == "adam":
            return torch.optim.Adam(params, lr=settings.lr)
        momentum = MOMENTUM if settings.optimizer == "momentum" else 0.0
        return torch.optim.SGD(params, lr=settings.lr, momentum=momentum)
    return build


def default_threads(local_size: int) -> int:
    """The cores this process may use shared among the ranks of its node."""
    return max(1, len(os.sched_getaffinity(0)) // max(local_size, 1))


def parameters_sha256(module: torch.nn.Module) -> str:
    """A digest of every parameter and buffer, bit for bit (equal runs give equal digests)."""
    h = hashlib.sha256()
    for name, t in module.state_dict().items():
        h.update(name.encode())
        h.update(t.detach().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def _rng_state() -> dict:
    np_state = np.random.get_state()
    return {"torch": torch.get_rng_state(),
            "numpy": torch.from_numpy(np_state[1].astype(np.int64)),
            "numpy_pos": int(np_state[2]), "python": random.getstate()}


def _set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    np.random.set_state(("MT19937", state["numpy"].numpy().astype(np.uint32),
                         state["numpy_pos"], 0, 0.0))
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))


def evaluate(module: torch.nn.Module, test, g) -> float:
    """Held-out accuracy: every rank scores its share, the counts are summed. Every rank
    calls it."""
    sampler = ShardSampler(len(test), g.rank, g.size, shuffle=False, pad=False)
    counts = np.zeros(2, np.int64)
    was_training = module.training
    module.eval()
    with torch.no_grad():
        for x, y in batches(test, sampler.indices(0), EVAL_BATCH):
            counts += (int((module(x).argmax(1) == y).sum()), len(y))
    module.train(was_training)
    if g.size > 1:
        collectives.allreduce_(counts, "sum")
    return float(counts[0] / max(counts[1], 1))


class Trainer:
    """Trains a model with the settings of ``python -m mpidp.train`` (TrainSettings, or the
    same names as keywords). ``fit`` is collective: every rank calls it with the same model
    architecture and data set."""

    def __init__(self, settings: Optional[TrainSettings] = None, **overrides):
        settings = settings if settings is not None else TrainSettings()
        self.settings = dataclasses.replace(settings, **overrides)

    def fit(self, model: torch.nn.Module, train_data, test_data=None,
            loss_fn: Optional[Callable] = None) -> dict:
        """Trains ``model`` (a fresh module, the same architecture on every rank; rank 0's
        initial parameters win) on ``train_data`` (a map-style dataset of (input, label)),
        scoring accuracy on ``test_data`` each ``eval_every`` epochs. Returns the summary
        (also printed as JSON by rank 0). Bad settings raise SetupError (a ValueError) on
        every rank before any training collective."""
        s = self.settings
        g = runtime.init()
        agree(g, s.check)
        torch.set_num_threads(s.threads_per_rank or default_threads(g.local_size))
        sampler = agree(g, lambda: ShardSampler(len(train_data), g.rank, g.size, s.seed))
        resumed = agree(g, lambda: self._load_checkpoint(g)) if s.resume else None
        report = Report(g.rank, g.size, s.progress, s.verbose, s.log_json)
        try:
            return self._train(g, model, train_data, test_data, loss_fn, sampler, resumed,
                               report)
        finally:
            report.close()

    def _load_checkpoint(self, g) -> Optional[tuple]:
        """Rank 0 finds the newest good checkpoint; every rank learns where to start."""
        s = self.settings
        found, problems = None, []
        if g.rank == 0:
            found = checkpoint.load_latest(s.checkpoint_dir, problems.append)
            for p in problems:
                print(f"mpidp.train: warning: {p}", flush=True)
            if found is not None:
                saved = found[1]
                if saved["world_size"] != g.size or saved["strategy"] != s.strategy:
                    found = ("mismatch", f"--resume: {found[0]} was written by "
                             f"{saved['world_size']} ranks with --strategy {saved['strategy']}; "
                             f"this run has {g.size} ranks with --strategy {s.strategy}")
        where = None
        if g.rank == 0 and found is not None:
            where = found if found[0] == "mismatch" else (str(found[0]), found[1]["epoch"],
                                                          found[1]["step_in_epoch"])
        where = g.comm.bcast(where, root=0) if g.size > 1 else where
        if where is None:
            raise ValueError(f"--resume: no usable checkpoint in {s.checkpoint_dir}")
        if where[0] == "mismatch":
            raise ValueError(where[1])
        return where, (found[1] if g.rank == 0 else None)

    def _train(self, g, model, train_data, test_data, loss_fn, sampler, resumed, report):
        s = self.settings
        loss_fn = loss_fn or torch.nn.functional.cross_entropy
        torch.manual_seed(s.seed * 65536 + g.rank)  # per-rank streams (dropout, augmentation)
        state = resumed[1] if resumed else None
        if state is not None:
            model.load_state_dict(state["model"])
        strategy = make_strategy(s, model, make_optimizer(s))
        start_epoch, start_step = 0, 0
        if resumed:
            (path, start_epoch, start_step), _ = resumed
            strategy.load_optimizer(state["optimizer"] if state else None)
            rng = g.comm.scatter(state["rng"] if state else None, root=0) \
                if g.size > 1 else state["rng"][0]
            _set_rng_state(rng)
            report.line(f"resuming from {path}: epoch {start_epoch + 1}, step {start_step}")
        steps = steps_per_epoch(sampler, s.batch_size)
        global_step = start_epoch * steps + start_step
        saved_path, accuracy, event = None, None, {}
        if g.size > 1:  # start the clocks together: set-up (optimizer creation) is not waiting
            collectives.allreduce_(np.zeros(1))
        t_run = time.perf_counter()
        samples_total, wait_total, time_total = 0, 0.0, 0.0
        for epoch in range(start_epoch, s.epochs):
            first = start_step if epoch == start_epoch else 0
            report.start_epoch(epoch, s.epochs, steps, first)
            t_epoch = time.perf_counter()
            compute_s = wait_s = loss_sum = 0.0
            samples = 0
            for b, (x, y) in enumerate(batches(train_data, sampler.indices(epoch),
                                               s.batch_size, first), start=first):
                strategy.set_lr(scaled_lr(s, g.size, epoch + b / steps))
                t0 = time.perf_counter()
                waited = strategy.stats["wait_s"]
                strategy.zero_grad()
                loss = loss_fn(strategy.forward(x), y)
                strategy.step(loss)
                dt = time.perf_counter() - t0
                dw = strategy.stats["wait_s"] - waited
                compute_s += dt - dw
                wait_s += dw
                loss_value = float(loss.detach())
                loss_sum += loss_value * len(y)
                samples += len(y)
                global_step += 1
                report.step(loss_value, len(y) * g.size / dt if dt > 0 else 0.0)
                if s.checkpoint_dir and s.checkpoint_every and b + 1 < steps and \
                        global_step % s.checkpoint_every == 0:
                    saved_path = self._save(g, strategy, model, epoch, b, steps, global_step)
            time_s = time.perf_counter() - t_epoch
            if test_data is not None and s.eval_every and ((epoch + 1) % s.eval_every == 0
                                                           or epoch + 1 == s.epochs):
                accuracy = evaluate(model, test_data, g)
            per_rank = collectives.allgather(
                np.array([[compute_s, wait_s, samples, loss_sum, time_s]]))
            compute, waits, counts, losses, times = per_rank.T
            n_samples = int(counts.sum())
            wall_s = float(times.max())  # the epoch ends with its slowest rank
            samples_total += n_samples
            wait_total += float(waits.mean())
            time_total += float(times.mean())
            event = {"event": "epoch", "epoch": epoch + 1, "epochs": s.epochs,
                     "steps": steps - first, "global_step": global_step,
                     "train_loss": float(losses.sum() / max(n_samples, 1)),
                     "test_accuracy": accuracy if test_data is not None else None,
                     "samples_per_s": n_samples / wall_s if wall_s > 0 else 0.0,
                     "time_s": wall_s, "wait_fraction": float((waits / times).mean()),
                     "lr": scaled_lr(s, g.size, epoch + 1),
                     "ranks": [{"rank": r, "compute_s": float(c), "wait_s": float(w),
                                "samples": int(n), "time_s": float(t)}
                               for r, (c, w, n, _, t) in enumerate(per_rank)]}
            report.end_epoch(event)
            if s.checkpoint_dir:
                saved_path = self._save(g, strategy, model, epoch, steps - 1, steps, global_step)
        total_s = time.perf_counter() - t_run
        if accuracy is None and test_data is not None:
            accuracy = evaluate(model, test_data, g)
        summary = {"event": "summary", "strategy": s.strategy, "ranks": g.size,
                   "model": s.model, "dataset": s.dataset, "epochs": s.epochs,
                   "global_step": global_step, "final_accuracy": accuracy,
                   "final_train_loss": event.get("train_loss"), "total_s": total_s,
                   "samples_per_s": samples_total / total_s if total_s > 0 else 0.0,
                   "wait_fraction": wait_total / time_total if time_total > 0 else 0.0,
                   "parameters_sha256": parameters_sha256(model),
                   "checkpoint": str(saved_path) if saved_path else None,
                   "resumed_from": resumed[0][0] if resumed else None}
        report.summary(summary)
        return summary

    def _save(self, g, strategy, model, epoch: int, b: int, steps: int, global_step: int):
        """Checkpoint after batch ``b`` of ``epoch``: every rank sends its RNG state, rank 0
        writes. Every rank calls it."""
        s = self.settings
        rng = g.comm.gather(_rng_state(), root=0) if g.size > 1 else [_rng_state()]
        if g.rank != 0:
            return None
        position = (epoch + 1, 0) if b + 1 == steps else (epoch, b + 1)
        state = {"model": model.state_dict(), "optimizer": strategy.optimizer_state(),
                 "epoch": position[0], "step_in_epoch": position[1],
                 "global_step": global_step, "world_size": g.size, "strategy": s.strategy,
                 "data_order": {"seed": s.seed, "epoch": position[0],
                                "position": position[1]},
                 "rng": rng, "settings": dataclasses.asdict(s)}
        return checkpoint.save(s.checkpoint_dir, state, global_step, s.keep_checkpoints)


def fit(model: torch.nn.Module, train_data, test_data=None, *, loss_fn: Optional[Callable] = None,
        **settings) -> dict:
    """``Trainer(**settings).fit(model, train_data, test_data, loss_fn)``: the loop of
    ``python -m mpidp.train`` for your own model and data. Every rank calls it."""
    return Trainer(**settings).fit(model, train_data, test_data, loss_fn)
