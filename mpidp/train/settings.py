"""Every setting of a training run, its default and its check: the one table the command line
and ``mpidp.fit`` share."""
from __future__ import annotations

import dataclasses
import math
from typing import Callable, Optional

import torch

from .. import algorithms
from .devices import AMPS, DEVICES

STRATEGIES = ("mirrored", "central", "ps", "localsgd", "diloco")
LOCAL_STRATEGIES = ("localsgd", "diloco")  # every rank steps alone between meetings
COMPRESSIONS = ("none", "fp16", "bf16", "powersgd", "auto")
OPTIMIZERS = ("sgd", "momentum", "adam")
LR_SCALINGS = ("none", "linear", "sqrt")
MOMENTUM = 0.9  # --optimizer momentum: SGD with this momentum (Goyal et al. use 0.9)
# --lr when not given: per built-in data set, so that its defaults converge. The synthetic
# set's 784 Gaussian inputs (norm ~28, against the digits' 64 in [0, 1]) made 0.05 x 2 ranks
# with momentum diverge after a few epochs (held-out 46% -> 11% by epoch 30); 0.01 reaches
# 64% with the training loss at 3e-4 (tests/mpi/test_train.py). A factory's data set: 0.05.
DEFAULT_LR = {"digits": 0.05, "synthetic": 0.01}
SYNC_EVERY = 8  # --strategy localsgd, diloco: steps between meetings
# --strategy diloco: the outer Nesterov SGD. Douillard et al.'s lr 0.7; their momentum 0.9 goes
# with an inner AdamW. Over this tool's default inner optimizer (SGD with momentum 0.9) an
# outer momentum of 0.9 oscillates: digits, 2 ranks, batches of 16, H = 16, 20 epochs: 31.5%,
# 57.1%, 86.4% over three seeds; 0.5: 98.6-99.2% (bench/RESULTS.md, "Stragglers across the range")
OUTER_LR, OUTER_MOMENTUM = 0.7, 0.5


@dataclasses.dataclass
class TrainSettings:
    """A training run's settings (each is a command-line flag of ``python -m mpidp.train``,
    with ``_`` for ``-``). ``check()`` raises ValueError naming the first bad value."""

    strategy: str = "mirrored"
    model: str = "mlp"
    dataset: str = "digits"
    synthetic_samples: int = 8192
    epochs: int = 20
    batch_size: int = 32
    lr: Optional[float] = None  # None: the data set's (DEFAULT_LR), set by check()
    lr_scaling: str = "linear"
    warmup_epochs: float = 0.0
    optimizer: str = "momentum"
    bucket_mb: float = 25.0
    algorithm: str = "auto"
    seed: int = 0
    checkpoint_dir: Optional[str] = None
    checkpoint_every: int = 0
    keep_checkpoints: int = 3
    resume: bool = False
    allow_shared_checkpoint_dir: bool = False  # Note [Checkpoint directory] in checkpoint.py
    checkpoint_on_signal: bool = False  # Note [Checkpoint on signal] in on_signal.py
    async_checkpoint: bool = False  # Note [Asynchronous checkpoints] in async_checkpoint.py
    log_json: Optional[str] = None
    eval_every: int = 1
    threads_per_rank: Optional[int] = None
    progress: bool = True
    verbose: bool = False
    num_ps: Optional[int] = None       # --strategy ps: server ranks (default 1)
    staleness: Optional[int] = None    # --strategy ps: SSP bound S (None: fully asynchronous)
    staleness_lr: bool = False         # --strategy ps: scale each push by 1/its staleness
    ps_lookahead: Optional[bool] = None  # --strategy ps: Note [Lookahead] (default on)
    straggler: Optional[str] = None    # RANK:FACTOR, a testing aid for every strategy
    compression: str = "none"          # mirrored: the gradients' communication hook
    powersgd_rank: Optional[int] = None        # --compression powersgd (default 1)
    powersgd_start_step: Optional[int] = None  # --compression powersgd (default 10)
    zero: bool = False                 # mirrored: ZeRO-1, the optimizer state sharded
    sync_every: Optional[int] = None   # localsgd, diloco: steps between meetings (default 8)
    local_sgd_warmup_steps: Optional[int] = None  # localsgd: mirrored steps first (default 0)
    outer_lr: Optional[float] = None   # diloco: the outer SGD's learning rate (default 0.7)
    outer_momentum: Optional[float] = None  # diloco: its Nesterov momentum (default 0.5)
    device: str = "auto"               # Note [Training device] in devices.py
    amp: str = "off"                   # autocast: off, bf16, fp16 (with a gradient scaler)

    def check(self) -> "TrainSettings":
        _choice("--strategy", self.strategy, STRATEGIES)
        if self.strategy != "ps":
            given = [f for f, v in (("--num-ps", self.num_ps), ("--staleness", self.staleness),
                                    ("--staleness-lr", self.staleness_lr or None),
                                    ("--[no-]ps-lookahead", self.ps_lookahead))
                     if v is not None]
            if given:
                raise ValueError(f"{', '.join(given)} only apply to --strategy ps, not "
                                 f"{self.strategy}")
        else:
            if self.num_ps is not None:
                _at_least("--num-ps", self.num_ps, 1)
            if self.staleness is not None:
                _at_least("--staleness", self.staleness, 0)
            if self.checkpoint_every:
                raise ValueError("--checkpoint-every: the parameter server checkpoints at epoch "
                                 "ends only (workers run asynchronously within an epoch)")
            if self.checkpoint_on_signal:
                raise ValueError("--checkpoint-on-signal: the parameter server checkpoints at "
                                 "epoch ends only (workers run asynchronously within an epoch, "
                                 "so they cannot stop at one step together)")
        if self.straggler is not None:
            straggler_of(self.straggler)
        self._check_compression()
        self._check_local()
        _choice("--device", self.device, DEVICES)
        _choice("--amp", self.amp, AMPS)
        if self.amp == "fp16" and (self.strategy != "mirrored" or self.zero):
            raise ValueError("--amp fp16 scales the loss, and every rank must make the same "
                             "skip-or-step decision: it needs --strategy mirrored without "
                             "--zero; use --amp bf16 (no scaler) here")
        if self.amp == "fp16" and self.compression == "powersgd":
            raise ValueError("--amp fp16 with --compression powersgd: PowerSGD would keep the "
                             "scaled gradients' errors, and one overflow would stay in them; "
                             "use --amp bf16")
        _choice("--optimizer", self.optimizer, OPTIMIZERS)
        _choice("--lr-scaling", self.lr_scaling, LR_SCALINGS)
        _choice("--algorithm", self.algorithm, algorithms.NAMES[algorithms.HOST])
        _at_least("--epochs", self.epochs, 1)
        _at_least("--batch-size", self.batch_size, 1)
        _at_least("--synthetic-samples", self.synthetic_samples, 1)
        _at_least("--checkpoint-every", self.checkpoint_every, 0)
        _at_least("--keep-checkpoints", self.keep_checkpoints, 1)
        _at_least("--eval-every", self.eval_every, 0)
        if self.threads_per_rank is not None:
            _at_least("--threads-per-rank", self.threads_per_rank, 1)
        _at_least("--seed", self.seed, 0)
        if self.seed >= 1 << 32:
            raise ValueError(f"--seed must be below 2**32, got {self.seed!r}")
        if self.lr is None:
            self.lr = DEFAULT_LR.get(self.dataset, DEFAULT_LR["digits"])
        _positive("--lr", self.lr)
        _positive("--bucket-mb", self.bucket_mb)
        if self.bucket_mb * (1 << 20) < 1:
            raise ValueError(f"--bucket-mb {self.bucket_mb!r} is less than one byte")
        if not self.warmup_epochs >= 0:
            raise ValueError(f"--warmup-epochs must be >= 0, got {self.warmup_epochs!r}")
        if self.resume and not self.checkpoint_dir:
            raise ValueError("--resume needs --checkpoint-dir (where to find the checkpoints)")
        if self.checkpoint_every and not self.checkpoint_dir:
            raise ValueError("--checkpoint-every needs --checkpoint-dir (where to write them)")
        if self.checkpoint_on_signal and not self.checkpoint_dir:
            raise ValueError("--checkpoint-on-signal needs --checkpoint-dir (where to write the "
                             "checkpoint)")
        if self.async_checkpoint and not self.checkpoint_dir:
            raise ValueError("--async-checkpoint needs --checkpoint-dir (where to write them)")
        if self.allow_shared_checkpoint_dir and not self.checkpoint_dir:
            raise ValueError("--allow-shared-checkpoint-dir needs --checkpoint-dir")
        return self


    def _check_local(self) -> None:
        for flag, value, where in (
                ("--sync-every", self.sync_every, LOCAL_STRATEGIES),
                ("--local-sgd-warmup-steps", self.local_sgd_warmup_steps, ("localsgd",)),
                ("--outer-lr", self.outer_lr, ("diloco",)),
                ("--outer-momentum", self.outer_momentum, ("diloco",))):
            if value is not None and self.strategy not in where:
                raise ValueError(f"{flag} applies to --strategy {' and '.join(where)}, not "
                                 f"{self.strategy}")
        if self.strategy in LOCAL_STRATEGIES:
            self.sync_every = SYNC_EVERY if self.sync_every is None else self.sync_every
            _at_least("--sync-every", self.sync_every, 1)
        if self.local_sgd_warmup_steps is not None:
            _at_least("--local-sgd-warmup-steps", self.local_sgd_warmup_steps, 0)
        if self.strategy == "diloco":
            self.outer_lr = OUTER_LR if self.outer_lr is None else self.outer_lr
            self.outer_momentum = OUTER_MOMENTUM if self.outer_momentum is None \
                else self.outer_momentum
            _positive("--outer-lr", self.outer_lr)
            if not isinstance(self.outer_momentum, (int, float)) or \
                    not 0 <= self.outer_momentum < 1:
                raise ValueError(f"--outer-momentum must be in [0, 1), got "
                                 f"{self.outer_momentum!r}")

    def _check_compression(self) -> None:
        _choice("--compression", self.compression, COMPRESSIONS)
        if self.zero and self.strategy != "mirrored":
            raise ValueError(f"--zero applies to --strategy mirrored, not {self.strategy}")
        if self.zero and self.compression != "none":
            raise ValueError(f"--zero reduce-scatters the gradients itself: it does not "
                             f"combine with --compression {self.compression}")
        if self.compression != "none" and self.strategy != "mirrored":
            raise ValueError(f"--compression {self.compression} applies to --strategy "
                             f"mirrored, not {self.strategy}")
        for flag, value, least in (("--powersgd-rank", self.powersgd_rank, 1),
                                   ("--powersgd-start-step", self.powersgd_start_step, 0)):
            if value is None:
                continue
            if self.compression != "powersgd":
                raise ValueError(f"{flag} applies to --compression powersgd, not "
                                 f"{self.compression}")
            _at_least(flag, value, least)


def _choice(flag: str, value, choices) -> None:
    if value not in choices:
        raise ValueError(f"{flag} {value!r}: expected one of {', '.join(choices)}")


def _at_least(flag: str, value, minimum: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ValueError(f"{flag} must be an integer >= {minimum}, got {value!r}")


def _positive(flag: str, value) -> None:
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not value > 0 \
            or not math.isfinite(value):
        raise ValueError(f"{flag} must be a finite number > 0, got {value!r}")


def scaled_lr(settings: TrainSettings, size: int, epoch_progress: float) -> float:
    """The learning rate after ``epoch_progress`` epochs (a float: 2.5 is half-way through the
    third) on ``size`` ranks: ``--lr`` times 1, size or sqrt(size) per ``--lr-scaling``,
    reached by a linear ramp from ``--lr`` over ``--warmup-epochs`` (gradual warm-up, Goyal
    et al. 2017)."""
    factor = {"none": 1.0, "linear": float(size), "sqrt": size ** 0.5}[settings.lr_scaling]
    if settings.warmup_epochs > 0 and epoch_progress < settings.warmup_epochs:
        factor = 1.0 + (factor - 1.0) * epoch_progress / settings.warmup_epochs
    return settings.lr * factor


def straggler_of(text: str) -> tuple:
    """``RANK:FACTOR`` -> (rank, factor); ValueError naming the flag otherwise."""
    rank, sep, factor = str(text).partition(":")
    try:
        r, f = int(rank), float(factor)
    except ValueError:
        r, f = -1, 0.0
    if not sep or r < 0 or not f >= 1 or not math.isfinite(f):
        raise ValueError(f"--straggler {text!r}: expected RANK:FACTOR with RANK >= 0 and "
                         "FACTOR >= 1 (e.g. 1:2 makes rank 1 compute twice as slowly)")
    return r, f


def check_world(settings: TrainSettings, size: int) -> None:
    """The checks that need the number of ranks."""
    if settings.strategy == "ps":
        k = settings.num_ps or 1
        if not k < size:
            raise ValueError(f"--num-ps {k} needs at least {k + 1} ranks (servers plus at least "
                             f"one worker); this job has {size}")
    if settings.straggler is not None and straggler_of(settings.straggler)[0] >= size:
        raise ValueError(f"--straggler {settings.straggler}: no rank "
                         f"{straggler_of(settings.straggler)[0]} in a job of {size}")


def make_optimizer(settings: TrainSettings) -> Callable[[list], torch.optim.Optimizer]:
    """A factory of ``--optimizer``'s optimizer on given parameters."""
    def build(params: list) -> torch.optim.Optimizer:
        if settings.optimizer == "adam":
            return torch.optim.Adam(params, lr=settings.lr)
        momentum = MOMENTUM if settings.optimizer == "momentum" else 0.0
        return torch.optim.SGD(params, lr=settings.lr, momentum=momentum)
    return build
