"""Run under mpiexec -n 2 with torch.distributed on the "mpidp" backend, a fault on rank 1 by
argv[1]: ``raise`` (an uncaught exception: the traceback and mpidp's one-line cause must still
be printed, torch's exception hook notwithstanding, and the job must end), ``stall`` (rank 1
never joins an all-reduce: the watchdog names it), ``monitored`` (rank 1 comes 4 s late to a
monitored barrier with a 1 s timeout: rank 0 raises naming it, rank 1 raises that rank 0 did
not release it; both print what they caught and finish)."""
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist

import mpidp.dist

fault = sys.argv[1]
dist.init_process_group("mpidp")
rank = dist.get_rank()
t = torch.ones(4)
dist.all_reduce(t)
if fault == "monitored":
    if rank == 1:
        time.sleep(4)
    try:
        mpidp.dist.monitored_barrier(timeout=timedelta(seconds=1), wait_all_ranks=True)
    except RuntimeError as exc:
        print(f"caught {rank}: {exc}", flush=True)
    dist.barrier()
    print(f"ok {rank}", flush=True)
    sys.exit(0)
if rank == 1:
    if fault == "raise":
        raise RuntimeError("injected fault")
    time.sleep(120)  # stall: the others wait in the next all-reduce
dist.all_reduce(t)
print(f"ok {rank}", flush=True)
