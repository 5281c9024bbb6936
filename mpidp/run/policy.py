"""What the supervisor makes of a job's exit: whether a relaunch can help, and the words for
it (Note [What is retried])."""
from __future__ import annotations

import signal
from typing import NamedTuple, Optional

from ..runtime.exit import LASTING, REFUSED

# Note [What is retried]
# A relaunch helps where the job died of something outside its own input: a rank killed (the
# out-of-memory killer, a crashed process: Hydra reports it and exits non-zero), a node lost
# or a stall (the watchdog ends the job with 124), an exception on one rank (exit 1: a
# transient error of the file system or the network looks the same as a bug, and
# --max-restarts bounds the loop). It cannot help, and is never tried, where the job refused
# its input (exit 2: the same command would be refused again), where it failed for a cause
# that stays (exit 3: an output it cannot write, the disk full, a quota, a read-only file
# system, no permission; Note [Exit codes] in mpidp/runtime/exit.py), where the job was
# interrupted on purpose (130, 143 after Ctrl-C or SIGTERM to the job, 138 after
# --checkpoint-on-signal's SIGUSR1: someone wants it stopped; the supervisor's own SIGINT or
# SIGTERM is passed to the job and ends the supervision the same way), and where a run fails before its first
# checkpoint (a fresh one, or one told to --resume from a directory that holds none): there
# is nothing to resume from, and a failure that early is most likely the command's own.

NEVER = {REFUSED: "the command's input was refused",
         LASTING: "a cause a relaunch cannot fix (an output it could not write: a full disk, "
                  "a quota, a read-only file system, no permission)",
         128 + signal.SIGINT: "interrupted by SIGINT",
         128 + signal.SIGTERM: "interrupted by SIGTERM",
         128 + signal.SIGUSR1: "stopped on SIGUSR1 after its checkpoint"}
CAUSES = {124: "the watchdog ended it (a stalled rank or a lost node)",
          1: "a rank raised an exception"}
# a rank ended by a signal: Hydra's mpiexec exits with the signal's number, a shell or srun
# with 128 + it
for _signum, _what in ((signal.SIGKILL, "a rank was killed (SIGKILL)"),
                       (signal.SIGSEGV, "a rank crashed (SIGSEGV)"),
                       (signal.SIGBUS, "a rank crashed (SIGBUS)"),
                       (signal.SIGABRT, "a rank aborted (SIGABRT)")):
    CAUSES[_signum] = CAUSES[128 + _signum] = _what


class Verdict(NamedTuple):
    retry: bool
    why: str  # what the exit means, for the supervisor's line


def describe(code: int) -> str:
    """What exit code ``code`` of an mpidp job means."""
    if code in NEVER:
        return NEVER[code]
    if code in CAUSES:
        return CAUSES[code]
    return "a rank or the launcher failed"


def verdict(code: int, has_checkpoint: bool, signalled: Optional[int],
            silent: Optional[list] = None) -> Verdict:
    """Whether the job that ended with ``code`` is relaunched: ``has_checkpoint``, whether
    its directory holds one now; ``signalled``, the signal the supervisor got and passed on
    (None: none); ``silent``, the nodes whose silence made the supervisor end the job (Note
    [Heartbeat] in supervisor.py). Note [What is retried]."""
    why = f"exit {code}: {describe(code)}"
    if silent:
        why = f"exit {code}: {', '.join(silent)} stopped answering and the supervisor ended it"
    if signalled is not None:
        return Verdict(False, f"{why}; the supervisor was sent {signal.Signals(signalled).name}")
    if code == 0:
        return Verdict(False, "exit 0: the run finished")
    if code in NEVER and not silent:
        return Verdict(False, why)
    if not has_checkpoint:
        return Verdict(False, f"{why}, before its first checkpoint: nothing to resume from")
    return Verdict(True, why)
