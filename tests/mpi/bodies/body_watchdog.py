"""Run under mpiexec -n 3 with BODY_CASE:
- stopped: rank 1 stops (SIGSTOP) before collective #6; the watchdog ends the job and names
  rank 1 as not answering (exit 124);
- late: rank 2 stalls before collective #6; the watchdog names it as not arrived (with
  MPIDP_EMULATE_NODE_SIZE=1 the others wait inside MPI, across emulated nodes);
- debug (MPIDP_DEBUG=1, a short MPIDP_TIMEOUT_S): a rank that skips one of two identical
  all-reduces, and a rank in another object collective, are named on every rank; a quiet
  spell of two timeouts outside collectives and a late arrival well below the timeout end
  no job. Prints 'ok <rank>'."""
import os
import re
import signal
import sys
import time

import numpy as np

import mpidp
from mpidp import config
from mpidp.errors import MismatchError
from mpidp.runtime.frame import collective

g = mpidp.init()
rank, case = g.rank, os.environ["BODY_CASE"]
x = np.ones(4, np.float32)
for _ in range(5):
    mpidp.allreduce(x)

if case == "stopped":
    if rank == 1:
        os.kill(os.getpid(), signal.SIGSTOP)
    mpidp.allreduce(x)  # never completes: the watchdog ends the job
elif case == "late":
    if rank == 2:
        time.sleep(600)
    mpidp.allreduce(x, op="max")  # never completes: the watchdog ends the job
assert case == "debug", case
failures = []


def expect(cond, what):
    if not cond:
        failures.append(what)


def twice(skip):
    if not skip:
        mpidp.allreduce(x)  # the first of two identical all-reduces
    mpidp.allreduce(x)      # the second, from another line


try:
    twice(skip=rank == 1)
    failures.append("a skipped collective went unnoticed")
except MismatchError as exc:
    line = re.search(r"rank 1: allreduce float32\[4\] op=sum algorithm=\w+ at (.+?)\s+<- differs",
                     str(exc))
    expect(line is not None, f"skip message: {exc}")
    if rank == 1 and line:
        expect(line.group(1).startswith("body_watchdog.py:"), f"rank 1's call site: {exc}")

try:
    with collective(g, "phase one" if rank == 1 else "phase two"):
        g.comm.allgather(rank)
    failures.append("an object collective mismatch went unnoticed")
except MismatchError as exc:
    expect(re.search(r"rank 1: .*<- differs", str(exc)) is not None, f"object message: {exc}")
    if rank == 1:
        expect("rank 1: phase one at body_watchdog.py:" in str(exc), f"object name: {exc}")

# no false alarm: a long spell outside collectives, and an arrival late by less than the limit
timeout_s = config.get().timeout_s
time.sleep(2 * timeout_s)
if rank == 0:
    time.sleep(0.2)
got = mpidp.allreduce(np.full(3, rank + 1, np.float32))
expect(np.array_equal(got, np.full(3, 6, np.float32)), f"usable afterwards: {got}")

results = g.comm.allgather(failures)
if rank == 0:
    for r, fs in enumerate(results):
        for f in fs:
            print(f"FAIL rank {r}: {f}", flush=True)
g.comm.Barrier()
print(f"ok {rank}" if not any(results) else f"failed {rank}", flush=True)
sys.exit(1 if any(results) else 0)
