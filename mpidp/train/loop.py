"""The training loop shared by the command line and ``mpidp.fit``: sharded epochs, the
strategy's step, the learning-rate schedule, held-out evaluation, metrics, checkpoints and
resume."""
from __future__ import annotations

import dataclasses
import hashlib
import sys
import time
from typing import Callable, Optional

import numpy as np
import torch

from .. import collectives, runtime, timeline
from ..data import ShardSampler, batches
from ..watchdog import collective
from . import checkpoint, setup
from .report import Report, emit
from .settings import MOMENTUM, TrainSettings, check_world, scaled_lr, straggler_of
from .strategies import make_strategy

EVAL_BATCH = 512


def make_optimizer(settings: TrainSettings) -> Callable[[list], torch.optim.Optimizer]:
    def build(params: list) -> torch.optim.Optimizer:
        if settings.optimizer == "adam":
            return torch.optim.Adam(params, lr=settings.lr)
        momentum = MOMENTUM if settings.optimizer == "momentum" else 0.0
        return torch.optim.SGD(params, lr=settings.lr, momentum=momentum)
    return build


def parameters_sha256(module: torch.nn.Module) -> str:
    """A digest of every parameter and buffer, bit for bit (equal runs give equal digests)."""
    h = hashlib.sha256()
    for name, t in module.state_dict().items():
        h.update(name.encode())
        h.update(t.detach().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


@timeline.traced("evaluate")
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
        ValueError) on every rank before any training collective."""
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
            return self._train(g, model, train_data, test_data, loss_fn, sampler, resumed,
                               report, names)
        finally:
            report.close()

    def _train(self, g, model, train_data, test_data, loss_fn, sampler, resumed, report,
               names):
        s = self.settings
        loss_fn = loss_fn or torch.nn.functional.cross_entropy
        checkpoint.seed_rng(s.seed, g.rank)
        if g.rank == 0 and resumed:
            model.load_state_dict(resumed[1]["model"])
        strategy = make_strategy(s, model, make_optimizer(s))  # rank 0's parameters win
        steps = strategy.steps_per_epoch(sampler, len(train_data), s.batch_size)
        lr_ranks = strategy.lr_ranks or g.size
        straggler, slowdown = straggler_of(s.straggler) if s.straggler else (-1, 1.0)
        start_epoch, start_step, global_step, saved_path = 0, 0, 0, None
        if s.resume:
            path, state = resumed if g.rank == 0 else (None, None)
            strategy.load_optimizer(state["optimizer"] if state else None)
            rngs = state["rng"] if state else None
            where = (str(path), state["epoch"], state["step_in_epoch"], state["global_step"]) \
                if state else None
            with collective(g, "resume: scattering the checkpoint's RNG states"):
                checkpoint.set_rng_state(g.comm.scatter(rngs, root=0) if g.size > 1
                                         else rngs[0])
                saved_path, start_epoch, start_step, global_step = \
                    g.comm.bcast(where, root=0) if g.size > 1 else where
            report.line(f"resuming from {saved_path}: epoch {start_epoch + 1}, step "
                        f"{start_step}" if start_epoch < s.epochs else
                        f"{saved_path} is the end of the run: nothing left to train")
        resumed_from = saved_path
        if g.size > 1:  # start the clocks together: set-up (optimizer creation) is not waiting
            collectives.allreduce_(np.zeros(1))
        t_run = time.perf_counter()
        samples_total, wait_total, time_total = 0, 0.0, 0.0
        accuracy, event = None, {}
        for epoch in range(start_epoch, s.epochs):
            first = start_step if epoch == start_epoch else 0
            report.start_epoch(epoch, s.epochs, steps, first)
            t_epoch = time.perf_counter()
            compute_s = wait_s = loss_sum = 0.0
            samples, lr = 0, s.lr
            compute_s += strategy.serve_epoch(epoch, steps)
            for b, (x, y) in strategy.epoch_batches(train_data, sampler, epoch, first,
                                                    s.batch_size):
                lr = scaled_lr(s, lr_ranks, epoch + b / steps)
                strategy.set_lr(lr)
                t0 = time.perf_counter()
                waited = strategy.stats["wait_s"]
                strategy.zero_grad()
                with timeline.span("forward"):
                    loss = loss_fn(strategy.forward(x), y)
                strategy.step(loss)
                dt = time.perf_counter() - t0
                dw = strategy.stats["wait_s"] - waited
                if straggler == g.rank:  # --straggler: a testing aid, compute FACTOR× slower
                    time.sleep((slowdown - 1) * (dt - dw))
                    dt = time.perf_counter() - t0
                compute_s += dt - dw
                wait_s += dw
                loss_value = float(loss.detach())
                loss_sum += loss_value * len(y)
                samples += len(y)
                global_step += 1
                report.step(loss_value, len(y) * g.size / dt if dt > 0 else 0.0)
                if s.checkpoint_dir and s.checkpoint_every and b + 1 < steps and \
                        global_step % s.checkpoint_every == 0:
                    saved_path = self._save(g, strategy, model, (epoch, b + 1), global_step,
                                            len(train_data))
            t_end = time.perf_counter()
            strategy.end_epoch()
            wait_s += time.perf_counter() - t_end
            global_step = (epoch + 1) * steps  # the same on every rank (ps workers differ)
            time_s = time.perf_counter() - t_epoch
            accuracy = None
            if test_data is not None and ((s.eval_every and (epoch + 1) % s.eval_every == 0)
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
                     "test_accuracy": accuracy,
                     "samples_per_s": n_samples / wall_s if wall_s > 0 else 0.0,
                     "time_s": wall_s, "wait_fraction": float((waits / times).mean())
                     if times.min() > 0 else 0.0, "lr": lr,
                     "ranks": [{"rank": r, "compute_s": float(c), "wait_s": float(w),
                                "samples": int(n), "time_s": float(t)}
                               for r, (c, w, n, _, t) in enumerate(per_rank)]}
            report.end_epoch(event)
            if s.checkpoint_dir:
                saved_path = self._save(g, strategy, model, (epoch + 1, 0), global_step,
                                        len(train_data))
        total_s = time.perf_counter() - t_run
        if accuracy is None and test_data is not None:
            accuracy = evaluate(model, test_data, g)
        extra = strategy.report(total_s)
        strategy.free()
        summary = {"event": "summary", "strategy": s.strategy, "ranks": g.size,
                   "model": names[0], "dataset": names[1], "epochs": s.epochs,
                   "global_step": global_step, "final_accuracy": accuracy,
                   "final_train_loss": event.get("train_loss"), "total_s": total_s,
                   "samples_per_s": samples_total / total_s if total_s > 0 else 0.0,
                   "wait_fraction": wait_total / time_total if time_total > 0 else 0.0,
                   "parameters_sha256": parameters_sha256(model),
                   "checkpoint": str(saved_path) if saved_path else None,
                   "resumed_from": resumed_from, **extra}
        report.summary(summary)
        return summary

    @timeline.traced("checkpoint")
    def _save(self, g, strategy, model, position: tuple, global_step: int, train_samples: int):
        """Checkpoint at ``position`` = (epoch, batches done in it): every rank sends its RNG
        state, rank 0 writes. Every rank calls it."""
        s = self.settings
        with collective(g, "checkpoint: gathering every rank's RNG state"):
            rng = g.comm.gather(checkpoint.rng_state(), root=0) if g.size > 1 \
                else [checkpoint.rng_state()]
        optimizer = strategy.optimizer_state()  # collective for ps (servers hold it)
        if g.rank != 0:
            return None
        state = {"model": model.state_dict(), "optimizer": optimizer,
                 "epoch": position[0], "step_in_epoch": position[1],
                 "global_step": global_step, "world_size": g.size,
                 "train_samples": train_samples,
                 "data_order": {"seed": s.seed, "epoch": position[0],
                                "position": position[1]},
                 "rng": rng, "settings": dataclasses.asdict(s)}
        return checkpoint.save(s.checkpoint_dir, state, global_step, s.keep_checkpoints)


def _warn(text: str) -> None:
    emit(f"mpidp.train: warning: {text}", sys.stderr)


def fit(model: torch.nn.Module, train_data, test_data=None, *, loss_fn: Optional[Callable] = None,
        **settings) -> dict:
    """``Trainer(**settings).fit(model, train_data, test_data, loss_fn)``: the loop of
    ``python -m mpidp.train`` for your own model and data. Every rank calls it."""
    return Trainer(**settings).fit(model, train_data, test_data, loss_fn)
