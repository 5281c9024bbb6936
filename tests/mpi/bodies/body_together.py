"""Run under mpiexec at any world size: the bodies named on the command line, one after another
in this one process on every rank, each as it runs alone (as ``__main__``), so that they cost
one launch and one import of torch, not one each. Each body prints 'ok <rank>'; the first
that fails ends the process with its exit code, after a line naming it."""
import runpy
import sys
from pathlib import Path

HERE = Path(__file__).parent


def say(text: str) -> None:
    sys.stdout.write(text + "\n")  # one write: another rank's output cannot split the line
    sys.stdout.flush()


for name in sys.argv[1:]:
    say(f"body_together: {name}")
    try:
        runpy.run_path(str(HERE / name), run_name="__main__")
    except SystemExit as exc:  # a body that ends with sys.exit(0) has passed
        if exc.code not in (None, 0):
            say(f"body_together: {name} failed (exit {exc.code})")
            raise
