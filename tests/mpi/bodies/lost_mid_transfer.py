"""Ranks lost inside large all-reduces, under fault tolerance with MPIDP_RECOVERY=shrink, at 4
ranks: every rank all-reduces 16 MiB again and again (messages far above Open MPI's eager
limit, in flight over its tcp transport), first with MPI's own all-reduce, then with mpidp's
ring. In each phase one rank kills itself (SIGKILL) from a thread, at a random moment into its
third call's transfers; every survivor must learn of it (an MPI error of a lost process,
never a wait for ever: Note [A peer lost mid-transfer] in mpidp/runtime/recovery.py), shrink
with the others, and go on. Each survivor prints 'lost_mid_transfer: <algorithm>: rank <r>
learned of the loss after <n> calls: <error>' per phase and, at the end, 'ok <rank>' once an
all-reduce on the 2 left is exact. A body still running after BODY_HANG_S (60 s: a whole
run takes a few seconds) writes its stacks, the wait among them, and exits 1."""
import faulthandler
import os
import random
import signal
import threading
import time

import torch

import mpidp
from mpidp.runtime import recovery, world

COUNT = 4 << 20  # float32: 16 MiB
PHASES = (("mpi", 3), ("ring", 2))  # (algorithm, the rank of the group then that is killed)

faulthandler.dump_traceback_later(float(os.environ.get("BODY_HANG_S", "60")), exit=True)
g = mpidp.init()
assert (g.size, g.recovery) == (4, "shrink"), (g.size, g.recovery)
x = torch.empty(COUNT)
for algorithm, victim in PHASES:
    calls = [0]
    if g.rank == victim:
        def kill_inside(calls=calls):
            while calls[0] < 2:
                time.sleep(0.001)
            time.sleep(random.uniform(0.0, 0.05))
            os.kill(os.getpid(), signal.SIGKILL)
        threading.Thread(target=kill_inside, daemon=True).start()
    try:
        while True:
            mpidp.allreduce_(x.fill_(1), algorithm=algorithm)
            assert torch.equal(x, torch.full_like(x, g.size)), (algorithm, g.rank, calls[0])
            calls[0] += 1
    except Exception as exc:  # noqa: BLE001 - a lost process is what this body waits for
        if not recovery.is_process_failure(exc):
            raise
        print(f"lost_mid_transfer: {algorithm}: rank {g.rank} learned of the loss after "
              f"{calls[0]} calls: {exc}", flush=True)
    size = g.size
    g, lost, replaced, _ = world.recover()
    assert (list(lost), replaced, g.size) == ([victim], False, size - 1), (lost, g.size)
y = torch.full((COUNT,), float(g.rank + 1))
mpidp.allreduce_(y)
assert torch.equal(y, torch.full_like(y, 3.0)), y[:4]
faulthandler.cancel_dump_traceback_later()
print(f"ok {g.rank}", flush=True)
