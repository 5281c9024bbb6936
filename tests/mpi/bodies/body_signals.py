"""Run under mpiexec -n 2: a rank waiting in the shared-memory protocol notices a signal
(Note [Interrupting a wait] in csrc/shm.c), and shutdown stops DDP's communication thread
before it frees the windows that thread waits in (Note [Stopping the users first] in
mpidp/runtime/resources.py). Rank 1 arrives late, or never: rank 0 waits alone and sends itself
SIGINT after WAIT_S; it must raise KeyboardInterrupt within a second, not wait for rank 1,
and while it waits it must sleep, not spin (Note [Waiting for a late rank] in csrc/shm.c).
Rank 1 stays away until rank 0 tells it (a point-to-point message) that its checks are over,
or for LATE_S at most: it can never arrive while rank 0 still waits, and the job does not
sit out a fixed delay after rank 0 is done.

BODY_CASE=allreduce: rank 0 waits in an in-place all-reduce of BODY_BYTES (8: inline, the
one-call path; 65536: sliced), is interrupted, and then no later call enters.
BODY_CASE=ddp: rank 0's DDP communication thread waits in a bucket's all-reduce while the
main thread, waiting for it, is interrupted; shutdown must end and join that thread."""
import os
import signal
import sys
import threading
import time

import numpy as np

import mpidp
from mpidp.errors import CommunicationError

WAIT_S = 0.5
LATE_S = 3.0  # rank 1's longest absence: twice the longest rank 0 may wait (WAIT_S + 1 s)
DONE_TAG = 14  # rank 0 to rank 1: its checks are over
case = os.environ["BODY_CASE"]
g = mpidp.init()
assert g.size == 2 and g.local_size == 2, "run on 2 ranks of one node"
failures = []


def tell_rank_1_done() -> None:
    """Rank 0, once its checks of the interrupted wait are over: rank 1 may stop being late."""
    g.comm.Send(np.zeros(1, np.uint8), dest=1, tag=DONE_TAG)


def stay_away_until_rank_0_is_done(limit_s: float) -> None:
    """Rank 1: joins nothing until rank 0's message comes, or for ``limit_s`` at most."""
    deadline = time.monotonic() + limit_s
    while not g.comm.Iprobe(source=0, tag=DONE_TAG):
        if time.monotonic() >= deadline:
            return
        time.sleep(0.01)
    g.comm.Recv(np.zeros(1, np.uint8), source=0, tag=DONE_TAG)


def interrupted_within(call) -> float:
    """Seconds from the signal to the KeyboardInterrupt out of ``call`` (inf: none)."""
    timer = threading.Timer(WAIT_S, os.kill, (os.getpid(), signal.SIGINT))
    t0 = time.monotonic()
    timer.start()
    try:
        call()
    except KeyboardInterrupt:
        return time.monotonic() - t0 - WAIT_S
    finally:
        timer.cancel()
    return float("inf")


mpidp.allreduce_(np.ones(4, np.float32))  # both ranks: the context exists, the fast path too
if case == "allreduce":
    if g.rank == 0:
        nbytes = int(os.environ["BODY_BYTES"])
        cpu0 = time.process_time()
        late = interrupted_within(lambda: mpidp.allreduce_(np.ones(nbytes // 4, np.float32)))
        cpu = time.process_time() - cpu0
        if not late < 1.0:
            failures.append(f"{nbytes}-byte all-reduce: interrupted after {late:.2f} s")
        if not cpu < WAIT_S / 2:  # Note [Waiting for a late rank] in csrc/shm.c: it naps
            failures.append(f"{nbytes}-byte all-reduce: waiting {WAIT_S + late:.2f} s for "
                            f"rank 1 took {cpu:.2f} s of CPU, as if spinning")
        try:  # the context is out of step now: no later call enters
            mpidp.allreduce_(np.ones(4, np.float32))
            failures.append("a call after the interrupt entered the protocol")
        except CommunicationError as exc:
            if "interrupted" not in str(exc):
                failures.append(f"the refusal does not say why: {exc}")
        tell_rank_1_done()
    else:
        stay_away_until_rank_0_is_done(LATE_S)  # never joins: rank 0 gives up first
elif case == "ddp":
    import torch
    model = torch.nn.Linear(64, 64)
    ddp = mpidp.DistributedDataParallel(model)
    if g.rank == 0:
        x = torch.randn(8, 64)
        late = interrupted_within(lambda: ddp(x).sum().backward())
        if not late < 1.0:
            failures.append(f"backward: interrupted after {late:.2f} s")
        thread = ddp._scheduler.thread if ddp._scheduler is not None else None
        if thread is None or not thread.is_alive():
            failures.append("the communication thread should still wait in its bucket")
        tell_rank_1_done()
    else:
        stay_away_until_rank_0_is_done(2.0)  # joins no backward: only shutdown
        thread = None
    mpidp.shutdown()  # collective: both ranks; frees the windows
    if thread is not None and thread.is_alive():
        failures.append("shutdown left the communication thread running")
else:
    raise SystemExit(f"unknown BODY_CASE {case!r}")

if failures:
    print(f"rank {g.rank} FAILED: " + "; ".join(failures), flush=True)
    sys.exit(1)
print(f"ok {g.rank}", flush=True)
