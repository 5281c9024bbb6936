"""``python -m mpidp.train``: the command line of the training loop. Bad flags or inputs end
the job on every rank with one line on rank 0 and exit code 2, before any training collective;
Ctrl-C or SIGTERM end it with one line (Note [Interrupted run]) and exit code 130 or 143; with
--checkpoint-on-signal, SIGTERM or SIGUSR1 first checkpoint (Note [Checkpoint on signal] in
on_signal.py) and end it with exit code 143 or 138; a checkpoint or log it cannot write ends it
with 3 where a relaunch cannot help (a full disk: Note [Exit codes] in mpidp/runtime/exit.py),
else 1."""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import shlex
import signal
import sys
import time
from typing import Optional, Sequence

import torch

from .. import algorithms
from ..workloads import data, models
from .. import runtime
from ..runtime.abort import FORWARD_S, abort_job
from ..runtime.exit import REFUSED, output_failure
from ..errors import ConfigError, LaunchError, MismatchError, OutputError
from ..runtime.helpformat import DefaultsHelpFormatter, Parser
from . import checkpoint, in_job
from .interrupts import (PROG, claim_ending, end_while_starting, launcher_rank,
                         raise_interrupted, signal_of, wait_for_the_end, watching_interrupts)
from .loop import Trainer
from .on_signal import StoppedOnSignal, recording_signals
from .metrics import emit
from .devices import AMPS, DEVICES
from .settings import COMPRESSIONS, LR_SCALINGS, OPTIMIZERS, STRATEGIES, TrainSettings, check_world
from .setup import SetupError, agree

USAGE_ERROR = REFUSED  # Note [Exit codes] in mpidp/runtime/exit.py


def fail(message: str, rank: Optional[int] = None) -> None:
    """One line on rank 0, exit code 2 on every rank."""
    if (launcher_rank() if rank is None else rank) == 0:
        emit(f"{PROG}: error: {message}", sys.stderr)
    sys.exit(USAGE_ERROR)


class _Parser(Parser):
    def error(self, message: str):  # argparse's own errors: one line, rank 0, exit 2
        fail(message)


def parser() -> argparse.ArgumentParser:
    d = TrainSettings()
    p = _Parser(prog=f"python -m {PROG}", formatter_class=DefaultsHelpFormatter,
                description="Data-parallel training of a PyTorch model on the ranks of an MPI "
                "job: mpirun -np N python -m mpidp.train [flags]. With no flags: an MLP on the "
                "8x8 handwritten digits shipped with mpidp (>= 95% held-out accuracy).")
    a = p.add_argument
    a("--strategy", choices=STRATEGIES, default=d.strategy,
      help="mirrored: every rank a replica, gradients all-reduced; central: rank 0 holds "
      "parameters and optimizer, gradients reduced to it; ps: asynchronous parameter server "
      "on dedicated ranks (see --num-ps, --staleness); localsgd: post-local SGD, ranks step "
      "alone and average every --sync-every steps; diloco: DiLoCo, an outer Nesterov step on "
      "the averaged deltas every --sync-every steps")
    a("--model", default=d.model, help="built-in (mlp, cnn) or package.module:factory, a "
      "callable taking no arguments and returning a torch.nn.Module")
    a("--dataset", default=d.dataset, help="built-in (digits, synthetic) or "
      "package.module:factory returning (train, test) map-style datasets of (input, label)")
    a("--synthetic-samples", type=int, default=d.synthetic_samples,
      help="training samples of --dataset synthetic (1/8 as many held out)")
    a("--epochs", type=int, default=d.epochs, help="passes over the training set")
    a("--batch-size", type=int, default=d.batch_size, help="samples per step on each rank")
    a("--lr", type=float, default=d.lr, help="learning rate for one rank (see --lr-scaling); "
      "default: 0.05, on --dataset synthetic 0.01")
    a("--lr-scaling", choices=LR_SCALINGS, default=d.lr_scaling,
      help="learning rate on N ranks: --lr times 1, N or sqrt(N)")
    a("--warmup-epochs", type=float, default=d.warmup_epochs,
      help="ramp the learning rate linearly from --lr to its scaled value over this many "
      "epochs (Goyal et al. 2017)")
    a("--optimizer", choices=OPTIMIZERS, default=d.optimizer,
      help="sgd, momentum (SGD with momentum 0.9) or adam")
    a("--bucket-mb", type=float, default=d.bucket_mb, help="gradient bucket size in MiB")
    a("--algorithm", choices=algorithms.NAMES[algorithms.HOST], default=d.algorithm,
      help="all-reduce algorithm of the mirrored strategy")
    a("--seed", type=int, default=d.seed,
      help="seeds model initialisation, data order and per-rank random streams")
    a("--checkpoint-dir", default=d.checkpoint_dir, help="where checkpoints are written (default: none written)")
    a("--checkpoint-every", type=int, default=d.checkpoint_every,
      help="also checkpoint every N steps (0: only at the end of each epoch)")
    a("--keep-checkpoints", type=int, default=d.keep_checkpoints,
      help="how many of the newest checkpoints are kept")
    a("--checkpoint-on-signal", action="store_true", default=d.checkpoint_on_signal,
      help="on SIGTERM or SIGUSR1 (Slurm's warning before a time limit), every rank finishes "
      "its step, a checkpoint is written, and the job ends with exit code 128 + the signal's "
      "number (without it SIGTERM ends the job at once and SIGUSR1 kills it)")
    a("--device", choices=DEVICES, default=d.device,
      help="auto: CUDA when every rank has a GPU of its own (mirrored, localsgd, diloco), "
      "else the CPU; the first lines say which and why")
    a("--amp", choices=AMPS, default=d.amp,
      help="automatic mixed precision: forward and loss under autocast in bf16, or fp16 with "
      "a gradient scaler (mirrored)")
    a("--async-checkpoint", action="store_true", default=d.async_checkpoint,
      help="write checkpoints in a background thread while training goes on (training "
      "waits only for a copy of the state in host memory; one write in flight at a time)")
    a("--resume", action="store_true", default=d.resume,
      help="continue from the newest good checkpoint in --checkpoint-dir (on any number of "
      "ranks)")
    a("--allow-shared-checkpoint-dir", action="store_true",
      default=d.allow_shared_checkpoint_dir,
      help="accept a --checkpoint-dir that other users can write to (owned by another user, "
      "or group- or world-writable); refused otherwise, since they could replace the "
      "checkpoints a --resume loads")
    a("--log-json", default=d.log_json, metavar="FILE",
      help="append a JSON line per epoch (with every rank's compute and wait time) and a "
      "final summary to FILE (default: no JSON log)")
    a("--eval-every", type=int, default=d.eval_every,
      help="score held-out accuracy every N epochs (0: only at the end)")
    a("--threads-per-rank", type=int, default=d.threads_per_rank,
      help="torch threads per rank (default: the machine's cores / the job's ranks on "
           "it, emulated nodes or not)")
    a("--num-ps", type=int, default=d.num_ps,
      help="--strategy ps: how many ranks are servers (the last ones; default 1)")
    a("--staleness", type=int, default=d.staleness,
      help="--strategy ps: a worker may be at most S steps ahead of the slowest (SSP); 0 is "
      "lock-step (default: fully asynchronous)")
    a("--staleness-lr", action="store_true", default=d.staleness_lr,
      help="--strategy ps: scale each pushed gradient by 1/its measured staleness "
      "(Zhang et al. 2016)")
    a("--ps-lookahead", action=argparse.BooleanOptionalAction, default=d.ps_lookahead,
      help="--strategy ps with several workers: compute each gradient at the pulled "
      "parameters extrapolated by (workers - 1) x their change since the previous pull, "
      "where the server will be when it lands (default: on)")
    a("--compression", choices=COMPRESSIONS, default=d.compression,
      help="--strategy mirrored: gradients averaged over a float16 or bfloat16 wire (half the "
      "bytes), with PowerSGD (low-rank, error feedback), or auto: bf16 where a measured "
      "all-reduce across nodes says it pays, else none (the log says why)")
    a("--powersgd-rank", type=int, default=d.powersgd_rank,
      help="--compression powersgd: rank of each gradient matrix's approximation (default 1)")
    a("--powersgd-start-step", type=int, default=d.powersgd_start_step,
      help="--compression powersgd: steps of plain averaging first (default 10)")
    a("--zero", action="store_true", default=d.zero,
      help="--strategy mirrored: ZeRO-1 — each rank holds the optimizer state of 1/N of the "
      "parameters; gradients are reduce-scattered to their owners and the updated parameters "
      "all-gathered")
    a("--sync-every", type=int, default=d.sync_every,
      help="--strategy localsgd, diloco: steps each rank takes alone between meetings "
      "(default 8)")
    a("--local-sgd-warmup-steps", type=int, default=d.local_sgd_warmup_steps,
      help="--strategy localsgd: synchronous (mirrored) steps first (default 0)")
    a("--outer-lr", type=float, default=d.outer_lr,
      help="--strategy diloco: learning rate of the outer SGD (default 0.7)")
    a("--outer-momentum", type=float, default=d.outer_momentum,
      help="--strategy diloco: Nesterov momentum of the outer SGD (default 0.5)")
    a("--straggler", default=d.straggler, metavar="RANK:FACTOR",
      help="testing aid: rank RANK computes FACTOR times more slowly (it sleeps after each "
      "step), with every strategy (default: none)")
    a("--progress", action=argparse.BooleanOptionalAction, default=d.progress,
      help="within a long epoch, a progress line from rank 0 every 10 s (the first after 2 s)")
    a("--verbose", action="store_true", default=d.verbose, help="log from every rank")
    return p


def settings_from(argv: Optional[Sequence[str]]) -> TrainSettings:
    args = parser().parse_args(argv)
    fields = {f.name for f in dataclasses.fields(TrainSettings)}
    return TrainSettings(**{k: v for k, v in vars(args).items() if k in fields})


def build(settings: TrainSettings) -> tuple:
    """(model, data sets) named by the settings; ValueError naming what is wrong."""
    sets = data.load(settings.dataset, settings.synthetic_samples)
    torch.manual_seed(settings.seed)
    if ":" in settings.model:
        model = data.call_factory(settings.model, "model")
        if not isinstance(model, torch.nn.Module):
            raise ValueError(f"model {settings.model!r}: the factory returned "
                             f"{type(model).__name__}, not a torch.nn.Module")
    else:
        model = models.build(settings.model, sets.input_shape, sets.num_classes)
    return model, sets


# Note [Interrupted run]
# Ctrl-C on mpiexec makes Hydra send SIGINT to every rank (a second Ctrl-C kills them); SIGTERM
# to mpiexec (Slurm's pre-emption, `kill`) is forwarded to every rank likewise. main makes
# SIGTERM raise as SIGINT does (Interrupted, a KeyboardInterrupt), and a rank waiting in the
# shared-memory protocol notices either within ~50 ms (Note [Interrupting a wait] in
# csrc/shm.c). The job then ends at once, without another collective, which ranks already
# gone or interrupted elsewhere would never join: rank 0 writes one line (the newest good
# checkpoint and the command that resumes from it) and aborts the job with exit code 128 +
# the signal's number, as shells report a process a signal ended (130 for SIGINT, 143 for
# SIGTERM); the other ranks give it time to do so (Note [Forwarding before abort] in
# mpidp/runtime/abort.py) before they abort the job themselves with the same line, naming their rank:
# the signal reached that rank alone (`kill` of one process). A rank whose main thread lost
# the interrupt, or waits where no signal reaches it, is ended by a watching thread instead,
# with the same line (Note [A lost interrupt] in interrupts.py). With --checkpoint-on-signal,
# SIGTERM and SIGUSR1 are only recorded, and the run ends this way after every rank has
# checkpointed at one step (Note [Checkpoint on signal] in on_signal.py); SIGINT still ends
# it at once. Before MPI has started
# (the imports of `python -m mpidp.train`, which take seconds, and MPI_Init) there is no job
# to abort: each rank ends on its own with the same exit code, rank 0 with the line
# "interrupted while starting" (interrupts.py, which __main__ arms before its imports).

def resume_command(argv: Sequence[str], world_size: int) -> str:
    """The command line that resumes the run of ``argv`` on ``world_size`` ranks."""
    args = list(argv) + ([] if "--resume" in argv else ["--resume"])
    return (f"mpiexec -n {world_size} {shlex.quote(sys.executable)} -m {PROG} "
            + " ".join(shlex.quote(a) for a in args))


def interrupted_line(signum: int, settings: TrainSettings, argv: Sequence[str],
                     world_size: int, who: str = "") -> str:
    """The line for a run ended by ``signum``: the newest good checkpoint in the settings'
    directory and the command line that resumes from it (Note [Interrupted run]). ``who``:
    "rank N " where a rank other than 0 says it."""
    what = f"{PROG}: {who}interrupted by {signal.Signals(signum).name}"
    if not settings.checkpoint_dir:
        return f"{what} (no --checkpoint-dir: nothing to resume from)"
    found = checkpoint.load_latest(settings.checkpoint_dir, lambda problem: None,
                                   checkpoint.KEYS)
    if found is None:
        return f"{what}; no good checkpoint in {settings.checkpoint_dir} yet"
    return f"{what}; newest good checkpoint {found.path}; resume with: " \
        + resume_command(argv, world_size)


def stopped_line(stop: StoppedOnSignal, argv: Sequence[str], world_size: int) -> str:
    """Rank 0's line for a run that checkpointed on a signal (Note [Checkpoint on signal] in
    on_signal.py): the checkpoint and the command line that resumes from it."""
    return (f"{PROG}: checkpoint written on {signal.Signals(stop.signum).name}: {stop.path}; "
            f"resume with: {resume_command(argv, world_size)}")


def _end_interrupted(exc: BaseException, settings: TrainSettings, argv: Sequence[str],
                     rank: int, world_size: int) -> None:
    """Ends the job after ``exc``, a KeyboardInterrupt or StoppedOnSignal (Note [Interrupted
    run]). Does not return."""
    quiet = (signal.SIGINT, signal.SIGTERM) + \
        ((signal.SIGUSR1,) if settings.checkpoint_on_signal else ())
    for s in quiet:  # a second signal must not interrupt this
        signal.signal(s, signal.SIG_IGN)
    if not claim_ending():  # the watcher ends the run (Note [A lost interrupt])
        wait_for_the_end()
    _end_job(exc, settings, argv, rank, world_size)


def _end_job(exc: BaseException, settings: TrainSettings, argv: Sequence[str], rank: int,
             world_size: int) -> None:
    """``_end_interrupted`` once this thread has claimed the ending: the line, then the
    abort. Does not return."""
    signum = exc.signum if isinstance(exc, StoppedOnSignal) else signal_of(exc)
    who = "" if rank == 0 else f"rank {rank} "
    if rank != 0:  # rank 0 ends the job, with its line, before this, if the signal reached it
        time.sleep(FORWARD_S + 2.0)
    try:
        line = stopped_line(exc, argv, world_size) if isinstance(exc, StoppedOnSignal) \
            else interrupted_line(signum, settings, argv, world_size, who)
    except Exception as error:  # the line must not become a traceback
        line = f"{PROG}: {who}interrupted by {signal.Signals(signum).name} ({error})"
    abort_job(line + "\n", 128 + signum)


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    previous = signal.signal(signal.SIGTERM, raise_interrupted)  # Note [Interrupted run]
    try:
        try:
            settings = settings_from(argv)
            settings.check()
        except ValueError as exc:
            fail(str(exc))
        except KeyboardInterrupt as exc:
            end_while_starting(exc)
        # with the flag, SIGTERM and SIGUSR1 are only recorded from here on
        with recording_signals() if settings.checkpoint_on_signal else contextlib.nullcontext():
            return _run(settings, argv)
    finally:
        signal.signal(signal.SIGTERM, previous)


def _run(settings: TrainSettings, argv: Sequence[str]) -> int:
    try:
        g = runtime.init()
    except LaunchError as exc:
        fail(str(exc).removeprefix("mpidp: "))
    except (ConfigError, MismatchError) as exc:  # MPIDP_* settings, raised on every rank
        fail(str(exc))
    except KeyboardInterrupt as exc:  # MPI may be half started: every rank ends on its own
        end_while_starting(exc)
    ending = functools.partial(_end_job, settings=settings, argv=argv, rank=g.rank,
                               world_size=g.size)
    try:
        with watching_interrupts(ending):  # Note [A lost interrupt] in interrupts.py
            _train(settings, g)
    except SetupError as exc:
        fail(str(exc), g.rank)
    except OutputError as exc:  # a checkpoint or the log could not be written: the job ends,
        # with 3 where a relaunch would fail the same way (Note [Exit codes])
        abort_job(f"{PROG}: error: rank {g.rank}: {exc}; aborting the job\n",
                  output_failure(exc))
    except (KeyboardInterrupt, StoppedOnSignal) as exc:  # Ctrl-C, SIGTERM: Note [Interrupted run]
        _end_interrupted(exc, settings, argv, g.rank, g.size)
    except Exception as exc:  # an interrupt that code it hit turned into its own error
        interrupt = _interrupt_behind(exc)
        if interrupt is None:
            raise
        _end_interrupted(interrupt, settings, argv, g.rank, g.size)
    return 0


def _train(settings: TrainSettings, g) -> None:
    """The run on group ``g``, from the checks every rank agrees on to the last epoch."""
    # a replacement of a lost rank checks alone: the others are training (Note [Recovering
    # a run] in mpidp/train/in_job.py)
    checked = (lambda check: check()) if in_job.joining() else (lambda check: agree(g, check))
    checked(lambda: check_world(settings, g.size))  # before the banner names the ranks
    model, sets = checked(lambda: build(settings))
    if g.rank == 0 and not in_job.joining():
        servers = settings.num_ps or 1
        ranks = f"{g.size} ranks ({g.size - servers} worker(s), {servers} server(s))" \
            if settings.strategy == "ps" else f"{g.size} rank(s)"
        emit(f"{PROG}: {settings.strategy} on {ranks}, {g.node_count} node(s); "
             f"{data.describe(settings.dataset, sets)}; model {settings.model} "
             f"({sum(p.numel() for p in model.parameters()):,} parameters)")
    Trainer(settings).fit(model, sets.train, sets.test, names=(settings.model, settings.dataset))


def _interrupt_behind(exc: BaseException) -> Optional[KeyboardInterrupt]:
    """The KeyboardInterrupt that ``exc`` was raised while handling, if any: torch.save, say,
    interrupted inside a write, raises its own RuntimeError on the way out."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        if isinstance(exc, KeyboardInterrupt):
            return exc
        seen.add(id(exc))
        exc = exc.__cause__ or exc.__context__
    return None
