"""Run under mpiexec: init is idempotent, the topology is consistent, a sub-communicator works
as the group, and (with BODY_RAISE_ON=r) an uncaught exception on rank r aborts the job."""
import os
import sys

import mpidp

failures = []
assert "mpi4py.MPI" not in sys.modules, "import mpidp started MPI"
from mpi4py import MPI  # noqa: E402

world = MPI.COMM_WORLD
raise_on = os.environ.get("BODY_RAISE_ON")
if os.environ.get("BODY_SUBCOMM"):
    sub = world.Split(world.Get_rank() % 2, world.Get_rank())
    g = mpidp.init(sub)
    if mpidp.size() != sub.Get_size() or mpidp.rank() != sub.Get_rank():
        failures.append("sub-communicator rank/size")
    import numpy as np
    got = mpidp.allreduce(np.ones(3, np.float32))
    if not (got == sub.Get_size()).all():
        failures.append(f"allreduce on sub-communicator gave {got}")
else:
    g = mpidp.init()
    if mpidp.init() is not g:
        failures.append("init is not idempotent")
    if (mpidp.rank(), mpidp.size()) != (world.Get_rank(), world.Get_size()):
        failures.append("rank/size differ from COMM_WORLD")
    if mpidp.local_size() != world.Get_size() or mpidp.node_count() != 1:
        failures.append(f"one machine: local_size {mpidp.local_size()} nodes {mpidp.node_count()}")
    if mpidp.local_rank() != world.Get_rank():
        failures.append("local rank")
if raise_on is not None:
    import time
    if world.Get_rank() == int(raise_on):
        raise RuntimeError("deliberate failure for the abort test")
    time.sleep(60)  # the others would wait here forever without the abort
for f in failures:
    print(f"FAIL rank {world.Get_rank()}: {f}", flush=True)
print(f"ok {world.Get_rank()}" if not failures else "failed", flush=True)
sys.exit(1 if failures else 0)
