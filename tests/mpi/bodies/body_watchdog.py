"""Run under mpiexec -n 3 with BODY_CASE:
- stopped: rank 1 stops (SIGSTOP) before collective #6; the watchdog ends the job and names
  rank 1 as not answering (exit 124);
- late: rank 2 stalls before collective #6; the watchdog names it as not arrived (with
  MPIDP_EMULATE_NODE_SIZE=1 the others wait inside MPI, across emulated nodes);
- departed (a long MPIDP_TIMEOUT_S): rank 2 leaves cleanly (sys.exit(0)) while the others
  are in an all-reduce: on one node each of them raises a CommunicationError naming rank 2
  and goes on to leave cleanly too (prints 'raised <rank>: <message>'); across emulated nodes
  (MPIDP_EMULATE_NODE_SIZE=1), waiting inside MPI, their watchdog ends the job naming it;
- lost (a long MPIDP_TIMEOUT_S): rank 2's process ends abruptly (os._exit(0): no shutdown,
  and a launcher that does not end the job for it) while the others are in an all-reduce on
  one node: each of them raises a CommunicationError naming rank 2 as ended, and exits with
  code 3 (MPI cannot finalize without rank 2);
- debug (MPIDP_DEBUG=1, a short MPIDP_TIMEOUT_S): a rank that skips one of two identical
  all-reduces, and a rank in another object collective, are named on every rank; through
  every entry point (mpidp's, Horovod's, the torch.distributed backend's, on the caller's
  thread and on the group's), a rank calling a look-alike collective from another line
  raises a MismatchError naming both lines on every rank, and the same line passes; a quiet
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
from mpidp.errors import CommunicationError, MismatchError
from mpidp.runtime.frame import collective

case = os.environ["BODY_CASE"]
if case == "debug":  # imported before init: no rank waits in a collective for another's import
    import torch
    import torch.distributed as dist
    import mpidp.horovod as hvd
g = mpidp.init()
rank = g.rank
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
elif case in ("departed", "lost"):
    if rank == 2:  # lost: no shutdown, no word left; the launcher does not end the job
        sys.exit(0) if case == "departed" else os._exit(0)
    try:
        mpidp.allreduce(x)
        print(f"FAIL rank {rank}: an all-reduce completed without rank 2", flush=True)
        sys.exit(1)
    except CommunicationError as exc:  # on one node; across nodes the job ends before
        print(f"raised {rank}: {exc}", flush=True)
        if case == "lost":  # MPI cannot finalize without rank 2; no abort either, which
            os._exit(3)     # could end the other survivor before it has raised too
    sys.exit(0)
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

# Every entry point, with torch's autograd or torch.distributed's front (and the backend's
# thread) between the script and mpidp: rank 1 calls from the line marked "b", the others from
# the line marked "a" (each call alone on its line)
dist.init_process_group("mpidp")
hvd.init()
N = g.size
LINES = {}
with open(__file__) as source:
    for number, text in enumerate(source, 1):
        mark = re.search(r"# site (a|b) of (\S+)$", text)
        if mark:
            LINES[mark.group(2), mark.group(1)] = number


def via_mpidp(t, b):
    x = t.numpy()
    if b:
        return mpidp.allreduce_(x)  # site b of mpidp.allreduce_
    return mpidp.allreduce_(x)  # site a of mpidp.allreduce_


def via_hvd_allreduce(t, b):
    if b:
        return hvd.allreduce(t, op=hvd.Sum)  # site b of hvd.allreduce
    return hvd.allreduce(t, op=hvd.Sum)  # site a of hvd.allreduce


def via_hvd_allreduce_(t, b):
    if b:
        return hvd.allreduce_(t, op=hvd.Sum)  # site b of hvd.allreduce_
    return hvd.allreduce_(t, op=hvd.Sum)  # site a of hvd.allreduce_


def via_hvd_broadcast(t, b):
    if b:
        return hvd.broadcast(t, root_rank=0)  # site b of hvd.broadcast
    return hvd.broadcast(t, root_rank=0)  # site a of hvd.broadcast


def via_hvd_allgather(t, b):
    if b:
        return hvd.allgather(t)  # site b of hvd.allgather
    return hvd.allgather(t)  # site a of hvd.allgather


def via_dist(t, b):
    if b:
        dist.all_reduce(t)  # site b of dist.all_reduce
    else:
        dist.all_reduce(t)  # site a of dist.all_reduce
    return t


def via_dist_async(t, b):  # on the group's thread: the site is taken when the call is made
    if b:
        work = dist.all_reduce(t, async_op=True)  # site b of dist.all_reduce(async_op)
    else:
        work = dist.all_reduce(t, async_op=True)  # site a of dist.all_reduce(async_op)
    work.wait()
    return t


SUM = torch.full((4,), float(N * (N + 1) // 2))
GATHERED = torch.arange(1, N + 1, dtype=torch.float32).repeat_interleave(4)
ENTRY_POINTS = (("mpidp.allreduce_", via_mpidp, SUM), ("hvd.allreduce", via_hvd_allreduce, SUM),
                ("hvd.allreduce_", via_hvd_allreduce_, SUM),
                ("hvd.broadcast", via_hvd_broadcast, torch.ones(4)),
                ("hvd.allgather", via_hvd_allgather, GATHERED),
                ("dist.all_reduce", via_dist, SUM),
                ("dist.all_reduce(async_op)", via_dist_async, SUM))
for name, call, want in ENTRY_POINTS:
    a, b = LINES[name, "a"], LINES[name, "b"]
    try:
        call(torch.full((4,), float(rank + 1)), rank == 1)
        failures.append(f"{name}: a look-alike call from another line went unnoticed")
    except MismatchError as exc:
        text = str(exc)
        expect(re.search(rf"rank 0: [^\n]* at body_watchdog\.py:{a}\n", text) is not None and
               re.search(rf"rank 1: [^\n]* at body_watchdog\.py:{b}  <- differs from rank 0",
                         text) is not None, f"{name}: lines {a} and {b} not named: {text}")
    got = call(torch.full((4,), float(rank + 1)), False)  # the same line on every rank
    got = torch.as_tensor(got)
    expect(torch.equal(got, want), f"{name} from one line: {got.tolist()}, want {want.tolist()}")

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
