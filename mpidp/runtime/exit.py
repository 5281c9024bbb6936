"""Ending a tool's process once its work is done, without the interpreter's last collections;
what its exit code says (Note [Exit codes]).

Note [Ending without the interpreter's teardown]
A rank of ``python -m mpidp.train`` spent over a second after its last line (measured on this
project's 2-core machine: a 2-rank job of the tool's digits took 7.0 s end to end, of which
5.6 s until its ranks' work was done): the interpreter dismantles every module it imported —
torch, torch._dynamo (which torch.optim imports at the first optimizer), sympy — and its last
garbage collections walk every one of their millions of objects. The tools end with
``exit_now(code)``: ``gc.freeze()`` moves every object alive to the permanent generation,
which those collections skip, and then ``sys.exit(code)``, so that everything else of a normal
exit happens as before: the threads that are not daemons joined, the ``atexit`` handlers
(mpidp's shutdown), MPI finalised by mpi4py in the interpreter's teardown. (Leaving with
``os._exit`` after those steps saved a little more, and made Hydra now and then kill a rank
still in its teardown when another had left: not worth it.) Library code (``mpidp.fit`` in a
user's script) never calls it: a user's process ends as the user ends it."""
from __future__ import annotations

import errno
import gc
import sys


def exit_now(code) -> None:
    """Ends this process with exit status ``code`` as ``sys.exit`` does, its last garbage
    collections skipping what is alive now (Note [Ending without the interpreter's
    teardown]). In a job that lost a process, MPI is finalised here, within
    recovery.FINALIZE_AFTER_LOSS_S (Note [Ending a job that lost a process] in recovery.py).
    Does not return."""
    gc.freeze()
    recovery = sys.modules.get(f"{__package__}.recovery")  # not imported: nothing was lost
    if recovery is not None and recovery.lost_in_this_job():
        from .world import finalize_within
        finalize_within(recovery.FINALIZE_AFTER_LOSS_S)
    sys.exit(code)


# Note [Exit codes]
# What the exit code of mpidp's tools (python -m mpidp.train, python -m mpidp.run) says, so
# that a supervisor, a scheduler or a script can tell what a retry can fix (Note [What is
# retried] in mpidp/run/policy.py; the table in docs/operations.md):
#   0        the run finished
#   1        failed for a cause that may pass (an exception on a rank, an output error that
#            may be transient, such as EIO): a relaunch from the newest checkpoint may help
#   2        refused: bad flags or inputs, an output that cannot be used, a directory or log
#            in use by another run; nothing ran, and the same command is refused again
#   3        failed for a cause a relaunch cannot fix: an output the run could not write
#            because the disk is full, a quota or a file-size limit is reached, the file
#            system is read-only or permission is denied (LASTING_ERRNOS)
#   124      the watchdog ended a stalled job
#   128 + N  ended by signal N (130 Ctrl-C, 143 SIGTERM, 138 --checkpoint-on-signal's SIGUSR1)
REFUSED = 2
LASTING = 3
LASTING_ERRNOS = frozenset((errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EROFS,
                            errno.EACCES, errno.EPERM))


def output_failure(exc: OSError) -> int:
    """The exit code of a run ended by ``exc``, an output it could not write: LASTING where
    its cause stays (a full disk, ...), else 1 (Note [Exit codes])."""
    return LASTING if exc.errno in LASTING_ERRNOS else 1
