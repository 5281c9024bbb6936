"""What a run settles before its first training collective: settings and inputs agreed by
every rank, outputs that can be written, and where a resumed run starts. A bad input on any
rank becomes the same SetupError on every rank, so no rank is left waiting."""
from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any, Callable

from .. import files
from ..files import run_lock
from ..errors import OutputError
from ..comm import objects
from . import checkpoint, compress
from .ps_state import reshard_optimizer_states
from .settings import TrainSettings

# Note [What a resume may change]
# Every setting has one rule on --resume, in RESUME_RULES (a unit test checks that each field
# of TrainSettings has one):
# - MUST_MATCH: a resume with another value is refused in one line; they decide the data
#   order, the step count and the shapes of model and optimizer state.
# - REPORTED: this run's value is taken, and rank 0 says so in one line per setting that
#   differs from the checkpoint's ("resuming with --lr 0.02 (the checkpoint was trained with
#   0.05)"; ``changed_settings``): they change the training from the checkpoint on. A setting
#   left at its default counts as that default (--ps-lookahead's None is on); PowerSGD's own
#   settings count only where both runs compress with it (the --compression line says the
#   rest).
# - RESHAPED: --num-ps, said by the line of Note [Resuming on another number of ranks].
# - QUIET: where and how the same training runs (device, collective algorithm, buckets,
#   threads: its rounding at most), is checkpointed, scored and logged.
# Both kinds of line come from ``resume_lines``, on rank 0, after the "resuming from" line.
MUST_MATCH, REPORTED, RESHAPED, QUIET = "must match", "reported", "reshaped", "quiet"
RESUME_RULES = {
    **dict.fromkeys(("strategy", "batch_size", "seed", "dataset", "synthetic_samples", "model",
                     "optimizer"), MUST_MATCH),
    **dict.fromkeys(("epochs", "lr", "lr_scaling", "warmup_epochs", "amp", "zero",
                     "compression", "powersgd_rank", "powersgd_start_step", "sync_every",
                     "local_sgd_warmup_steps", "outer_lr", "outer_momentum", "staleness",
                     "staleness_lr", "ps_lookahead"), REPORTED),
    "num_ps": RESHAPED,
    **dict.fromkeys(("device", "algorithm", "bucket_mb", "threads_per_rank", "straggler",
                     "checkpoint_dir", "checkpoint_every", "keep_checkpoints", "resume",
                     "allow_shared_checkpoint_dir", "checkpoint_on_signal", "async_checkpoint",
                     "eval_every", "log_json", "progress", "verbose"), QUIET),
}
RESUME_MUST_MATCH = tuple(k for k, rule in RESUME_RULES.items() if rule == MUST_MATCH)
# what a setting left unset (None) means, where it means a value
_UNSET_MEANS = {"ps_lookahead": True, "local_sgd_warmup_steps": 0, "num_ps": 1,
                "powersgd_rank": compress.POWERSGD_RANK,
                "powersgd_start_step": compress.POWERSGD_START_STEP}

# Note [Resuming on another number of ranks]
# A checkpoint written by N ranks resumes on M. What moves, and how:
# - the data: the interrupted epoch continues from the checkpoint's sample cursor, the rest
#   of its permutation shared out over the M ranks (Note [Sample cursor] in mpidp/workloads/data.py), so
#   every sample of that epoch is taken once; later epochs are sharded over M as usual. The
#   global step counts the steps taken, whatever the number of ranks took them.
# - the learning rate follows --lr-scaling for M ranks (M workers under ps: it counts 1).
# - the model and the optimizer state are one copy under mirrored and central (ZeRO's is kept
#   unsharded): they load as they are. Under ps the servers' states move to another number
#   of workers as they are, and to another number of servers (--num-ps) re-cut by the new
#   shard map (ps_strategy.reshard_optimizer_states).
# - each rank's generator state: rank r < min(N, M) takes rank r's, a new rank keeps the
#   stream seeded for it; PowerSGD's per-rank errors start afresh (compress.py says so).
# What cannot move: localsgd's and diloco's per-rank parameters between meetings (M ranks
# cannot take up N diverged models, and averaging them would be a meeting the run never
# had). On another number of ranks such a checkpoint is passed over, in one line, for the
# newest one written at a meeting (every epoch's end is one), as a damaged one is; with none,
# the run is refused in one line naming each.


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
    messages = objects.allgather(g, message, "set-up: agreeing on a check's outcome")
    failed = [(r, m) for r, m in enumerate(messages) if m is not None]
    if failed:
        r, m = failed[0]
        raise SetupError(m if len(failed) == g.size or not name_rank else f"rank {r}: {m}")
    return result


def same_everywhere(g, fingerprint: dict) -> None:
    """SetupError on every rank unless every rank passed the same ``fingerprint`` (the inputs
    that decide which collectives a run calls), naming the first rank and field that differ."""
    everyone = objects.allgather(g, fingerprint, "set-up: comparing settings and data set sizes")
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


def check_outputs(settings: TrainSettings) -> list:
    """On rank 0: the log file can be written, the checkpoint directory can be written and
    only by us (Note [Checkpoint directory] in checkpoint.py), no other run uses either (Note
    [One run per directory] in mpidp/run_lock.py: their locks, taken here, are returned, to be
    held for the run's life and released by ``release``), and a fresh run does not mix its
    checkpoints with an earlier run's. ValueError otherwise, with no lock held."""
    locks: list = []
    try:
        log = settings.log_json
        if log:
            try:
                files.check_writable(log, "JSON log")
            except OutputError as exc:
                raise ValueError(f"--log-json {log}: cannot write: {exc.strerror}") from None
        if settings.checkpoint_dir:
            d = Path(settings.checkpoint_dir)
            _check_directory(d, settings)
            locks.append(run_lock.lock_run(d, f"--checkpoint-dir {d}", directory=True))
            if not settings.resume and checkpoint.existing(d):  # checked under the lock
                raise ValueError(f"--checkpoint-dir {d} holds checkpoints of an earlier run: "
                                 "pass --resume to continue it, or choose an empty directory")
        if log:
            locks.append(run_lock.lock_run(log, f"--log-json {log}", directory=False))
    except BaseException:
        release(locks)
        raise
    return locks


def release(locks) -> None:
    """Lets go of the locks ``check_outputs`` took (None, or an empty list: none)."""
    for lock in reversed(locks or ()):
        lock.release()


def _check_directory(d: Path, settings: TrainSettings) -> None:
    """The checkpoint directory exists (created 0700) and only we can write to it."""
    run_lock.checkpoint_directory(d, settings.resume)
    if not os.access(d, os.W_OK | os.X_OK):
        raise ValueError(f"--checkpoint-dir {d}: not writable")
    shared = checkpoint.shared_directory_problem(d)
    if shared and not settings.allow_shared_checkpoint_dir:
        raise ValueError(f"--checkpoint-dir {d} {shared}, who could replace its "
                         "checkpoints: use a directory only you can write to (chmod go-w), "
                         "or pass --allow-shared-checkpoint-dir")


def newest_meeting_checkpoint(directory, resumed: checkpoint.Checkpoint):
    """Under local SGD and DiLoCo, the path of the newest good checkpoint at or below the one
    a run resumes from that was written at a meeting (the one retention must keep: Note
    [Checkpoint retention]), or None; reads older checkpoints only when the resumed one is
    between meetings."""
    if not checkpoint.steps_past_meeting(resumed.state):
        return str(resumed.path)
    found = checkpoint.load_latest(
        directory, lambda problem: None, checkpoint.KEYS,
        lambda older: "between meetings" if checkpoint.steps_past_meeting(older.state) else None,
        below=checkpoint.step_of(resumed.path))
    return None if found is None else str(found.path)


def find_resume_point(settings: TrainSettings, world_size: int, model, train_samples: int,
                      warn: Callable[[str], None]) -> checkpoint.Checkpoint:
    """On rank 0: the newest good checkpoint (``checkpoint.read``: its digest, every key of
    a training checkpoint) that this run can continue, after warning through ``warn`` of each
    newer one passed over. ValueError, one line naming every checkpoint passed over, when
    there is none, or it was written by a run this one cannot continue."""
    def between_meetings(found):  # Note [Resuming on another number of ranks]
        state = found.state
        if state["world_size"] != world_size and checkpoint.steps_past_meeting(state):
            return (f"{found.path} holds {state['world_size']} ranks' own "
                    f"{state.get('settings', {}).get('strategy')} models between meetings, "
                    f"which cannot move to {world_size} ranks")
        return None

    skipped = []
    found = checkpoint.load_latest(settings.checkpoint_dir, skipped.append, checkpoint.KEYS,
                                   between_meetings)
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
    for key in RESUME_MUST_MATCH + ("train_samples",):
        if saved.get(key) != mine[key]:
            raise ValueError(f"--resume: {path} was written with {key}={saved.get(key)!r}, this "
                             f"run has {key}={mine[key]!r}; resume with the same value")
    servers, saved_servers = mine.get("num_ps"), saved.get("num_ps")
    if mine["strategy"] == "ps" and servers != saved_servers:  # fails here, on every rank
        total = sum(p.numel() for p in model.parameters() if p.requires_grad)
        try:
            reshard_optimizer_states(state["optimizer"], servers, total)
        except (ValueError, KeyError, TypeError, RuntimeError) as exc:
            raise ValueError(f"--resume: the servers' optimizer state in {path} cannot be "
                             f"re-cut from {saved_servers} to {servers} servers: {exc}") \
                from None
    shapes = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    saved_shapes = {k: tuple(v.shape) for k, v in state["model"].items()}
    if shapes != saved_shapes:
        raise ValueError(f"--resume: the model in {path} has other parameters than this one")
    if state["epoch"] > settings.epochs:
        raise ValueError(f"--resume: {path} is at epoch {state['epoch']}, beyond --epochs "
                         f"{settings.epochs}")
    return found


def default_threads(host_size: int) -> int:
    """Torch threads per rank: the cores the launcher bound this rank to, or, when it did not
    bind (the whole machine is allowed), the machine's cores shared among the ``host_size``
    ranks on it. The machine's, not the node's: where nodes are emulated on one host
    (MPIDP_EMULATE_NODE_SIZE, and in-job recovery on Open MPI) a node's count would give every
    rank all the cores, and the ranks' thread pools, spinning against one another, trained
    digits 50x slower (406 samples/s against 20,261 with one thread each, 2 ranks)."""
    allowed = len(os.sched_getaffinity(0))
    if allowed < (os.cpu_count() or allowed):
        return allowed
    return max(1, allowed // max(host_size, 1))


def changed_settings(saved: dict, settings: TrainSettings) -> list:
    """One log line per REPORTED setting (Note [What a resume may change]) whose value in
    ``settings`` differs from ``saved`` (the checkpoint's settings, as a dict), in the order
    of TrainSettings; a setting the checkpoint does not record is passed over."""
    mine = dataclasses.asdict(settings)
    lines = []
    for name in mine:
        if RESUME_RULES[name] != REPORTED or name not in saved:
            continue
        if name.startswith("powersgd_") and \
                not saved.get("compression") == mine["compression"] == "powersgd":
            continue
        then, now = (_UNSET_MEANS.get(name) if v is None else v for v in (saved[name],
                                                                         mine[name]))
        if then != now:
            lines.append(_changed_line("--" + name.replace("_", "-"), then, now))
    return lines


def _changed_line(flag: str, then, now) -> str:
    """"resuming with --lr 0.02 (the checkpoint was trained with 0.05)"; a switch (True,
    False) or an unset value (None) is said as with or without the flag."""
    if now is None or now is False:
        this = f"without {flag}"
    else:
        this = f"with {flag}" if now is True else f"with {flag} {now}"
    that = "without it" if then is None or then is False else \
        "with it" if then is True else f"with {then}"
    return f"resuming {this} (the checkpoint was trained {that})"


def resume_lines(state: dict, settings: TrainSettings, size: int, lr_ranks: int,
                 train_samples: int) -> list:
    """On rank 0: what a resume from the checkpoint ``state`` on ``size`` ranks says after
    its "resuming from" line: one line per changed setting (``changed_settings``), then, on
    another number of ranks or servers, ``resized_line``."""
    saved = state["settings"]
    lines = changed_settings(saved, settings)
    saved_size, servers = int(state["world_size"]), saved.get("num_ps") or 1
    if saved_size != size or (settings.strategy == "ps" and servers != (settings.num_ps or 1)):
        lines.append(resized_line(saved_size, size, settings, lr_ranks,
                                  checkpoint.cursor_of(state, settings.batch_size),
                                  train_samples, servers))
    return lines


def resized_line(saved_size: int, size: int, settings: TrainSettings, lr_ranks: int,
                 cursor: int, train_samples: int, saved_servers: int = 1) -> str:
    """The log line of a resume on ``size`` ranks from a checkpoint of ``saved_size`` (Note
    [Resuming on another number of ranks]); under ps, of ``saved_servers`` servers."""
    if settings.strategy == "ps":  # epoch ends only: no cursor
        servers = settings.num_ps or 1
        data = f"the epochs now shared by {size - servers} workers, {servers} server(s)"
        if servers != saved_servers:
            data += f" (the servers' optimizer state re-cut from {saved_servers})"
    elif cursor:
        data = (f"the rest of the epoch ({train_samples - cursor} of {train_samples} samples, "
                f"from position {cursor}) shared out over {size}")
    else:
        data = f"epochs sharded over {size}"
    lr = "" if settings.strategy in ("ps", "diloco") else \
        f"; --lr-scaling {settings.lr_scaling} now counts {lr_ranks} ranks"
    new = f"rank {saved_size} starts its generator" if size == saved_size + 1 else \
        f"ranks {saved_size}-{size - 1} start their generators"
    rng = f"; {new} from --seed" if size > saved_size else ""
    return (f"the checkpoint was written by {saved_size} ranks, this run has {size}: {data}"
            f"{lr}{rng}")
