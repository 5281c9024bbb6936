"""``python -m mpidp.train``: see mpidp.train.cli. The command line's imports (torch) take
seconds: a Ctrl-C or SIGTERM then ends the rank with one line, not a traceback."""
import signal
import sys

from .interrupts import PROG, end_while_starting, launcher_rank, raise_interrupted

signal.signal(signal.SIGTERM, raise_interrupted)
if launcher_rank() == 0 and not {"-h", "--help"} & set(sys.argv[1:]):
    sys.stdout.write(f"{PROG}: starting (loading PyTorch, then MPI)\n")  # seconds, cold
    sys.stdout.flush()
try:
    from .cli import main
except KeyboardInterrupt as exc:
    end_while_starting(exc)

code = main()
# the run is over: a late Ctrl-C or SIGTERM must not interrupt mpidp.shutdown and
# MPI_Finalize (atexit), where one rank's traceback would leave the others in a collective
signal.signal(signal.SIGINT, signal.SIG_IGN)
signal.signal(signal.SIGTERM, signal.SIG_IGN)
from ..runtime.exit import exit_now  # noqa: E402 - here: torch is imported by now anyway
exit_now(code)  # Note [Ending without the interpreter's teardown]
