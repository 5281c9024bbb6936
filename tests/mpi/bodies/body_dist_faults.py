"""Run under mpiexec -n 2 with torch.distributed on the "mpidp" backend, a fault on rank 1 by
argv[1]: ``raise`` (an uncaught exception: the traceback and mpidp's one-line cause must still
be printed, torch's exception hook notwithstanding, and the job must end), ``stall`` (rank 1
never joins an all-reduce: the watchdog names it), ``monitored`` (rank 1 comes 4 s late to a
monitored barrier with a 1 s timeout: rank 0 raises naming it, rank 1 raises that rank 0 did
not release it; both print what they caught and finish), ``timeout`` (at any world size of 2 or
more: a barrier on a sub-group of the first and the last rank made with timeout=1 s while
the last one sleeps 5 s: the first's asynchronous barrier raises torch's DistBackendError from
wait within a few seconds naming the barrier and the late rank, its next (synchronous)
operation on the group raises naming that timeout,
and every rank destroys the group and finishes), ``torch_timeout`` (torch's own
_test_barrier_timeout: only rank 0 of a full group with timeout=1 s calls barrier, and must
raise matching " (Timed out|closed|timeout) " no earlier than the timeout; also a barrier's
own timeout= on a group whose timeout is long). Each timed-out rank prints
"caught <rank> <seconds waited>: <message>" and every rank "ok <rank>" (Note [A group's
timeout] in mpidp/backend/group.py)."""
import re
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist

import mpidp.backend

fault = sys.argv[1]
dist.init_process_group("mpidp")
rank = dist.get_rank()
t = torch.ones(4)
dist.all_reduce(t)
if fault == "monitored":
    if rank == 1:
        time.sleep(4)
    try:
        dist.monitored_barrier(timeout=timedelta(seconds=1), wait_all_ranks=True)  # torch's
    except RuntimeError as exc:
        print(f"caught {rank}: {exc}", flush=True)
    dist.barrier()
    print(f"ok {rank}", flush=True)
    sys.exit(0)
if fault == "timeout":
    late = dist.get_world_size() - 1
    members = [0, late]
    pg = dist.new_group(members, timeout=timedelta(seconds=1))
    if rank in members:
        dist.barrier(group=pg)  # the group works before anyone is late
        if rank == late:
            time.sleep(5)
        start = time.monotonic()
        try:  # asynchronous: it times out on the group's thread and raises from wait
            dist.barrier(group=pg, async_op=True).wait()
            print(f"passed {rank} {time.monotonic() - start:.1f}", flush=True)
        except RuntimeError as exc:
            print(f"caught {rank} {time.monotonic() - start:.1f} {type(exc).__name__}: {exc}",
                  flush=True)
        try:
            dist.all_reduce(t, group=pg)
            print(f"after {rank}: all_reduce passed", flush=True)
        except RuntimeError as exc:
            print(f"after {rank}: {type(exc).__name__}: {exc}", flush=True)
    dist.destroy_process_group(pg)  # every rank, as torch asks
    dist.all_reduce(t)  # the default group goes on
    print(f"ok {rank}", flush=True)
    sys.exit(0)
if fault == "torch_timeout":
    timeout = timedelta(seconds=1)
    pg = dist.new_group(timeout=timeout)  # torch's _init_full_group_test(timeout=...)
    if dist.get_rank(pg) == 0:  # as torch's _test_barrier_timeout: rank 0 alone
        expected = time.time() + timeout.total_seconds()
        try:
            dist.barrier(pg)
        except Exception as exc:  # noqa: BLE001 - torch's test catches any
            matched = re.search(" (Timed out|closed|timeout) ", str(exc)) is not None
            print(f"caught {rank} matched={matched} early={time.time() < expected - 0.1}: "
                  f"{exc}", flush=True)
    # the others leave the group once rank 0's barrier has timed out, as in torch's harness (a
    # rank that destroys it while rank 0 waits has shut down: rank 0 would raise at once,
    # Note [A rank that has shut down] in csrc/shm.c)
    dist.barrier()
    dist.destroy_process_group(pg)
    long = dist.new_group(timeout=timedelta(seconds=300))  # barrier(timeout=) overrides it
    if rank == 0:
        start = time.monotonic()
        try:
            dist.barrier(group=long, timeout=timedelta(seconds=0.5))
        except RuntimeError as exc:
            print(f"barrier timeout {rank} {time.monotonic() - start:.1f}: {exc}", flush=True)
    dist.barrier()  # as above
    dist.destroy_process_group(long)
    dist.all_reduce(t)
    print(f"ok {rank}", flush=True)
    sys.exit(0)
if rank == 1:
    if fault == "raise":
        raise RuntimeError("injected fault")
    time.sleep(120)  # stall: the others wait in the next all-reduce
dist.all_reduce(t)
print(f"ok {rank}", flush=True)
