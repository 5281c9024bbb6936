"""Ending a tool's process once its work is done, without the interpreter's last collections.

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

import gc
import sys


def exit_now(code) -> None:
    """Ends this process with exit status ``code`` as ``sys.exit`` does, its last garbage
    collections skipping what is alive now (Note [Ending without the interpreter's
    teardown]). Does not return."""
    gc.freeze()
    sys.exit(code)
