"""``python tests/harness/run_body.py BODY [ARGS...]``: runs test body BODY (a path) as
``__main__`` with ``ARGS``, as ``python BODY ARGS...`` would, and ends as mpidp's tools end
(Note [Ending without the interpreter's teardown] in mpidp/runtime/exit.py): a launched rank's
last garbage collections skip torch's objects. An exception a body raises
takes the ordinary path (its traceback, mpidp's abort hooks); ``sys.exit(code)`` and the
body's end exit with that code."""
import runpy
import sys

from mpidp.runtime.exit import exit_now

path, sys.argv = sys.argv[1], sys.argv[1:]
sys.path[0] = str(__import__("pathlib").Path(path).parent)  # the body's own folder, as python's
try:
    runpy.run_path(path, run_name="__main__")
except SystemExit as exc:
    exit_now(exc.code)
exit_now(0)
