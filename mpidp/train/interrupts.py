"""Ctrl-C and SIGTERM as the training tool sees them (Note [Interrupted run] in cli.py), in a
module that imports neither torch nor MPI: ``python -m mpidp.train`` arms it before its
imports, which take seconds, so that a signal then ends the rank with one line too."""
from __future__ import annotations

import os
import signal
import sys

from ..runtime import launcher

PROG = "mpidp.train"


class Interrupted(KeyboardInterrupt):
    """Raised in the main thread by the signal ``signum`` (SIGTERM) as Ctrl-C raises
    KeyboardInterrupt."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def raise_interrupted(signum: int, frame) -> None:
    """A signal handler: SIGTERM raises as SIGINT does."""
    raise Interrupted(signum)


def signal_of(exc: BaseException) -> int:
    """The signal behind ``exc``, a KeyboardInterrupt (SIGINT unless it says otherwise)."""
    return getattr(exc, "signum", signal.SIGINT)


def launcher_rank() -> int:
    """This process's rank as the launcher set it (0 outside a launcher), before MPI starts."""
    view = launcher.launcher_view()
    return view.rank if view is not None and view.rank is not None else 0


def end_while_starting(exc: KeyboardInterrupt) -> None:
    """Ends this rank after a signal that came before MPI started (imports, MPI_Init): there
    is no job to abort yet, so every rank ends on its own, rank 0 with one line. Does not
    return."""
    if launcher_rank() == 0:
        sys.stderr.write(f"{PROG}: interrupted while starting\n")
        sys.stderr.flush()
    os._exit(128 + signal_of(exc))
