"""Ending the whole job from one rank: the message on stderr, a pause for the launcher to
forward it, then MPI_Abort. The abort hooks, the watchdog and the doctor's deadlines all end
a job this way.

Note [Forwarding before abort]
MPI_Abort makes Hydra tear the job down at once, and what a rank wrote to stderr just
before may still sit in the pipes between the rank, its proxy and mpiexec; Hydra drops it,
now and then (seen in this project's tests as an empty stderr from a job that did abort).
A second's pause after the flush lets the launcher forward the message first.

Note [The process's own stderr]
A framework may have swapped ``sys.stderr`` for a buffer it prints after the exception hook
returns: torch.distributed's hook does so to prefix each line with the rank. An abort never
returns, so the message also goes to the process's own stderr (``sys.__stderr__``), the one
the launcher forwards."""
from __future__ import annotations

import sys
import time

from ..engine.library import mpi

FORWARD_S = 1.0


def abort_job(message: str, code: int) -> None:
    """Writes ``message`` to stderr (Note [The process's own stderr]), waits for the
    launcher to forward it, and aborts every rank of MPI_COMM_WORLD with exit code ``code``.
    Does not return."""
    try:
        for stream in dict.fromkeys((sys.stderr, sys.__stderr__)):
            if stream is not None:
                try:
                    stream.write(message)
                    stream.flush()
                except (OSError, ValueError):  # a closed or broken stream: try the next
                    pass
        time.sleep(FORWARD_S)
    finally:
        MPI = mpi()
        MPI.COMM_WORLD.Abort(code)
