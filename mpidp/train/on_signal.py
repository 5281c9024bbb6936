"""--checkpoint-on-signal: SIGTERM and SIGUSR1 recorded rather than acted on, the ranks' agreement
on the step to stop at, and the exception that ends training there (Note [Checkpoint on
signal])."""
from __future__ import annotations

import contextlib
import signal
import time
from typing import Iterator, Optional

from ..runtime import mpi

# Note [Checkpoint on signal]
# With --checkpoint-on-signal, SIGTERM and SIGUSR1 (what Slurm sends before a time limit, e.g.
# `#SBATCH --signal=USR1@120`; Hydra's mpiexec forwards both to every rank) do not end the run
# at once: the handler only records the signal (a rank waiting in the shared-memory protocol
# waits on, since the handler raises nothing). The signal may reach the ranks at different
# steps, so after each step every rank contributes the number of the signal it has seen (0:
# none) to a one-element max all-reduce, and every rank acts on the same answer at the same
# step boundary: it writes the checkpoint --checkpoint-every would write there (after an
# epoch's last step, the epoch-end one), so --resume continues bit for bit, waits until rank
# 0 has it on disk (with --async-checkpoint, the write in flight; the other ranks meet rank 0
# in a polled barrier, so none ends the job while rank 0 still writes), then raises
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



def arrive(comm) -> None:
    """Returns once every rank of ``comm`` has called it: MPI_Ibarrier polled from Python, so
    a Ctrl-C or SIGTERM to this rank raises here while it waits (Note [Interrupted run] in
    cli.py). A blocking MPI call would hold the signal until the others came, and they may be
    ending on the same signal: the job would then end with another rank's line, rank 0's
    withheld (seen in CI: rank 0 in the checkpoint's MPI_Gather, rank 1 already stopped)."""
    request = mpi.ibarrier(comm)
    while not mpi.test(request):
        time.sleep(0.0002)


def recorded_signal() -> int:
    """The signal recorded so far (0: none, or not recording)."""
    return _recording.signum if _recording is not None else 0
