"""Ctrl-C and SIGTERM as the training tool sees them (Note [Interrupted run] in cli.py), in a
module that imports neither torch nor MPI: ``python -m mpidp.train`` arms it before its
imports, which take seconds, so that a signal then ends the rank with one line too."""
from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
import time
from typing import Callable, Iterator

from ..runtime import launcher

PROG = "mpidp.train"
GRACE_S = 1.0  # Note [A lost interrupt]: how long the main thread has to begin ending the run


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


# Note [A lost interrupt]
# Python runs a signal's handler in the main thread between two bytecodes, and the
# KeyboardInterrupt it raises can be lost: raised in a destructor or a weakref callback it is
# printed as "Exception ignored" and dropped (seen once in 190 interrupted runs: importlib's
# module-lock callback, in a lazy import at the first step), and a library that catches it
# ends it too. A main thread waiting in a call that no signal ends (an MPI call, a wait on
# another thread in C++) does not run the handler at all. The rank then trains on, or waits
# on, while the others end, and the job ends only by another rank's fallback, seconds later
# and with that rank's line (Note [Interrupted run] in cli.py; seen once in CI: rank 1's line
# after 4 s, rank 0 silent; which of these kept it so was not caught). So while the run
# trains, a thread watches too: Python writes the number of each signal it
# catches to a wakeup descriptor (signal.set_wakeup_fd) from its C handler, at once, whatever
# the main thread is doing. Where the signal ends the run (its handler is still the one that
# raises, not --checkpoint-on-signal's recorder, not SIG_IGN) and within GRACE_S the main
# thread has neither left the run (its exception on the way to the ending, or the run over)
# nor claimed the ending, the watcher claims it and ends the run with the same line.
# Whichever claims first ends the job; the other waits for the abort.

_ending = threading.Lock()


def claim_ending() -> bool:
    """True for the first caller only, of the main thread and the watcher: it ends the run."""
    return _ending.acquire(blocking=False)


def wait_for_the_end() -> None:
    """For the thread that did not claim the ending: the other one aborts the job meanwhile.
    Does not return."""
    while True:
        time.sleep(3600)


def _ends_run(signum: int) -> bool:
    """Whether ``signum``'s handler now is one that interrupts the run."""
    return signal.getsignal(signum) in (signal.default_int_handler, raise_interrupted)


@contextlib.contextmanager
def watching_interrupts(end: Callable[[KeyboardInterrupt], None]) -> Iterator[None]:
    """Within it, a signal that should interrupt the run and that the main thread has not
    acted on within GRACE_S makes a thread call ``end`` (Note [A lost interrupt]), which
    ends the job. Main thread only."""
    read_fd, write_fd = os.pipe()
    os.set_blocking(write_fd, False)  # the C handler must never block on it
    previous = signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)
    over = threading.Event()  # the run left the block: whatever comes now is not the watcher's

    def watch() -> None:
        acted = False
        with os.fdopen(read_fd, "rb", buffering=0) as pipe:
            while got := pipe.read(64):  # b"": the run is over, the writing end closed
                for signum in got:
                    if not acted and signum in (signal.SIGINT, signal.SIGTERM) \
                            and _ends_run(signum):
                        acted = True
                        if not over.wait(GRACE_S) and claim_ending():
                            end(Interrupted(signum))

    thread = threading.Thread(target=watch, name="mpidp-interrupt-watch", daemon=True)
    thread.start()
    try:
        yield
    finally:
        over.set()
        signal.set_wakeup_fd(previous)
        os.close(write_fd)  # the watcher reads the end of the pipe, closes it and returns
