"""``python -m mpidp.doctor``: see mpidp.doctor."""
from ..runtime.exit import exit_now
from . import main

exit_now(main())  # Note [Ending without the interpreter's teardown] in mpidp/runtime/exit.py
