"""``python -m mpidp.train``: see mpidp.train.cli. The command line's imports (torch) take
seconds: a Ctrl-C or SIGTERM then ends the rank with one line, not a traceback."""
import signal
import sys

from .interrupts import end_while_starting, raise_interrupted

signal.signal(signal.SIGTERM, raise_interrupted)
try:
    from .cli import main
except KeyboardInterrupt as exc:
    end_while_starting(exc)

sys.exit(main())
