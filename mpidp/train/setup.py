"""What a run settles before its first training collective: settings and inputs agreed by
every rank, outputs that can be written, and where a resumed run starts. A bad input on any
rank becomes the same SetupError on every rank, so no rank is left waiting."""
from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any, Callable

from .. import files
from ..errors import OutputError
from ..watchdog import collective
from . import checkpoint
from .settings import TrainSettings

# settings a resumed run must share with the run that wrote the checkpoint: they decide the
# data order, the step count and the shapes of model and optimizer state
RESUME_MUST_MATCH = ("strategy", "batch_size", "seed", "dataset", "synthetic_samples", "model",
                     "optimizer", "num_ps")


class SetupError(ValueError):
    """Bad settings or inputs found before training starts; raised on every rank alike."""


def agree(g, check: Callable[[], Any], name_rank: bool = True) -> Any:
    """Runs ``check`` (which must not communicate) on every rank; if it raises ValueError on
    any rank, every rank raises SetupError with the first failing rank's message (prefixed
    with the rank when not every rank failed, unless ``name_rank`` is False: a check only
    rank 0 makes). Every rank calls it."""
    try:
        result, message = check(), None
    except ValueError as exc:
        result, message = None, str(exc)
    with collective(g, "set-up: agreeing on a check's outcome"):
        messages = g.comm.allgather(message) if g.size > 1 else [message]
    failed = [(r, m) for r, m in enumerate(messages) if m is not None]
    if failed:
        r, m = failed[0]
        raise SetupError(m if len(failed) == g.size or not name_rank else f"rank {r}: {m}")
    return result


def same_everywhere(g, fingerprint: dict) -> None:
    """SetupError on every rank unless every rank passed the same ``fingerprint`` (the inputs
    that decide which collectives a run calls), naming the first rank and field that differ."""
    with collective(g, "set-up: comparing settings and data set sizes"):
        everyone = g.comm.allgather(fingerprint) if g.size > 1 else [fingerprint]
    for r, theirs in enumerate(everyone[1:], start=1):
        for key, value in everyone[0].items():
            if theirs.get(key) != value:
                raise SetupError(f"rank {r} has {key}={theirs.get(key)!r} where rank 0 has "
                                 f"{value!r}: every rank must train with the same settings "
                                 "and data set sizes")


def fingerprint(settings: TrainSettings, train_data, test_data) -> dict:
    s = dataclasses.asdict(settings)
    for private in ("progress", "verbose", "log_json", "threads_per_rank"):
        s.pop(private)  # may differ per rank without changing the collectives
    s["checkpoint_dir"] = bool(s["checkpoint_dir"])
    return dict(s, train_samples=len(train_data),
                test_samples=None if test_data is None else len(test_data))


def check_outputs(settings: TrainSettings) -> None:
    """On rank 0: the log file can be written, the checkpoint directory can be written and
    only by us (Note [Checkpoint directory] in checkpoint.py), and a fresh run does not mix
    its checkpoints with an earlier run's. ValueError otherwise."""
    if settings.log_json:
        try:
            files.check_writable(settings.log_json, "JSON log")
        except OutputError as exc:
            raise ValueError(f"--log-json {settings.log_json}: cannot write: {exc.strerror}") \
                from None
    if settings.checkpoint_dir:
        d = Path(settings.checkpoint_dir)
        try:
            d.mkdir(mode=0o700, parents=True, exist_ok=True)
        except OSError as exc:
            raise ValueError(f"--checkpoint-dir {d}: cannot create: {exc.strerror}") from None
        if not os.access(d, os.W_OK | os.X_OK):
            raise ValueError(f"--checkpoint-dir {d}: not writable")
        shared = checkpoint.shared_directory_problem(d)
        if shared and not settings.allow_shared_checkpoint_dir:
            raise ValueError(f"--checkpoint-dir {d} {shared}, who could replace its "
                             "checkpoints: use a directory only you can write to (chmod go-w), "
                             "or pass --allow-shared-checkpoint-dir")
        if not settings.resume and checkpoint.existing(d):
            raise ValueError(f"--checkpoint-dir {d} holds checkpoints of an earlier run: pass "
                             "--resume to continue it, or choose an empty directory")


def find_resume_point(settings: TrainSettings, world_size: int, model, train_samples: int,
                      warn: Callable[[str], None]) -> checkpoint.Checkpoint:
    """On rank 0: the newest good checkpoint (``checkpoint.read``: its digest, every key of
    a training checkpoint) that this run can continue, after warning through ``warn`` of each
    newer one passed over. ValueError, one line naming every checkpoint passed over, when
    there is none, or it was written by a run this one cannot continue."""
    skipped = []
    found = checkpoint.load_latest(settings.checkpoint_dir, skipped.append, checkpoint.KEYS)
    if found is None:
        why = f" ({'; '.join(skipped)})" if skipped else ""
        raise ValueError(f"--resume: no usable checkpoint in {settings.checkpoint_dir}{why}")
    for problem in skipped:
        warn(f"{problem}; passed over")
    path, state, _ = found
    saved = dict(state.get("settings", {}), world_size=state["world_size"],
                 train_samples=state.get("train_samples"))
    mine = dict(dataclasses.asdict(settings), world_size=world_size, train_samples=train_samples)
    for d in (saved, mine):  # the default number of servers is 1 (and None off ps)
        if d.get("strategy") == "ps":
            d["num_ps"] = d.get("num_ps") or 1
    for key in RESUME_MUST_MATCH + ("world_size", "train_samples"):
        if saved.get(key) != mine[key]:
            raise ValueError(f"--resume: {path} was written with {key}={saved.get(key)!r}, this "
                             f"run has {key}={mine[key]!r}; resume with the same value")
    shapes = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    saved_shapes = {k: tuple(v.shape) for k, v in state["model"].items()}
    if shapes != saved_shapes:
        raise ValueError(f"--resume: the model in {path} has other parameters than this one")
    if state["epoch"] > settings.epochs:
        raise ValueError(f"--resume: {path} is at epoch {state['epoch']}, beyond --epochs "
                         f"{settings.epochs}")
    return found


def default_threads(local_size: int) -> int:
    """Torch threads per rank: the cores the launcher bound this rank to, or, when it did not
    bind (the whole machine is allowed), the node's cores shared among its ranks."""
    allowed = len(os.sched_getaffinity(0))
    if allowed < (os.cpu_count() or allowed):
        return allowed
    return max(1, allowed // max(local_size, 1))

