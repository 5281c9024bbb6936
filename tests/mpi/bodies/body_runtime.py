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
    # one failed request of several raises its own error, not MPI_ERR_IN_STATUS (which names
    # none: Note [A peer lost mid-transfer] in mpidp/runtime/recovery.py)
    import numpy as np
    from mpidp.engine import library
    requests = [MPI.COMM_SELF.Irecv(np.zeros(1, np.uint8), 0, 77),
                MPI.COMM_SELF.Isend(np.zeros(8, np.uint8), 0, 77)]
    try:
        library.wait_all(requests)
        failures.append("wait_all: a truncated receive completed")
    except MPI.Exception as exc:
        if exc.Get_error_class() != MPI.ERR_TRUNCATE:
            failures.append(f"wait_all raised {exc} for a truncated receive")
    if (mpidp.rank(), mpidp.size()) != (world.Get_rank(), world.Get_size()):
        failures.append("rank/size differ from COMM_WORLD")
    # BODY_PER_NODE ranks on each node, placed in blocks (mpiexec -ppn): one machine unless set
    per_node = int(os.environ.get("BODY_PER_NODE", world.Get_size()))
    nodes = world.Get_size() // per_node
    r = world.Get_rank()
    if (mpidp.local_size(), mpidp.node_count()) != (per_node, nodes):
        failures.append(f"{nodes} node(s) of {per_node}: local_size {mpidp.local_size()}, "
                        f"node_count {mpidp.node_count()}")
    if (mpidp.local_rank(), g.node_index, g.node_of) != \
            (r % per_node, r // per_node, tuple(q // per_node for q in range(world.Get_size()))):
        failures.append(f"local rank {mpidp.local_rank()}, node {g.node_index}, map {g.node_of}")
    host = MPI.Get_processor_name()
    names = world.allgather(host)
    if g.hosts[g.node_index] != host or len(set(names)) != nodes or \
            any((names[q] == host) != (q // per_node == r // per_node) for q in range(len(names))):
        failures.append(f"host names {names}, node map's {g.hosts}")
    # one rank per node: a small in-place all-reduce is one C call (csrc/exchange.c)
    fast = g.resources.fast_allreduce
    from mpidp.engine import host_ops
    if nodes > 1 and per_node == 1 and host_ops.EXTENSION is not None:
        import numpy as np
        x = np.arange(5, dtype=np.float32) + r
        want = np.arange(5, dtype=np.float32) * world.Get_size() + sum(range(world.Get_size()))
        if fast is None or type(fast.__self__).__name__ != "CheckedContext" or \
                fast(x, "sum") is not x or not np.array_equal(x, want):
            failures.append(f"the one-call path across nodes: {fast}, got {x}")
    # the shared-memory context spans this node's ranks only, single-copy where it can be
    ctx = g.resources.shm()
    if ctx is not None:
        members = g.node_comm.allgather(host)
        if len(members) != per_node or set(members) != {host}:
            failures.append(f"shm context spans {members}")
        want = os.environ.get("BODY_SHM_MODE")
        if want and ctx.mode_name != want:
            failures.append(f"shm peers {ctx.mode_name}, expected {want}")
if raise_on is not None:
    import time
    if world.Get_rank() == int(raise_on):
        raise RuntimeError("deliberate failure for the abort test")
    time.sleep(60)  # the others would wait here forever without the abort
for f in failures:
    print(f"FAIL rank {world.Get_rank()}: {f}", flush=True)
print(f"ok {world.Get_rank()}" if not failures else "failed", flush=True)
sys.exit(1 if failures else 0)
