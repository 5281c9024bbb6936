"""Run under mpiexec -n 2 with torch.distributed on the "mpidp" backend, a fault on rank 1 by
argv[1]: ``raise`` (an uncaught exception: the traceback and mpidp's one-line cause must still
be printed, torch's exception hook notwithstanding, and the job must end), ``stall`` (rank 1
never joins an all-reduce: the watchdog names it)."""
import sys
import time

import torch
import torch.distributed as dist

fault = sys.argv[1]
dist.init_process_group("mpidp")
rank = dist.get_rank()
t = torch.ones(4)
dist.all_reduce(t)
if rank == 1:
    if fault == "raise":
        raise RuntimeError("injected fault")
    time.sleep(120)  # stall: the others wait in the next all-reduce
dist.all_reduce(t)
print(f"ok {rank}", flush=True)
