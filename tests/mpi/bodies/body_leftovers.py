"""Run under mpiexec: the files this live job holds (its ranks' /dev/shm/mpich_shm_*, its
proxy's /tmp/hydra_hwloc_xmlfile_*) are not reported as a dead job's; rank 0 writes them, one a
line, to the file BODY_LEFTOVERS_HELD names (stdout interleaves the ranks' lines). With
BODY_LEFTOVERS_ABORT=1 the job then ends in MPI_Abort, leaving them behind for the outer test
to find (Note [Leftover files] in mpidp.doctor.leftovers)."""
import os
import sys

from mpi4py import MPI

from mpidp.doctor import leftovers

world = MPI.COMM_WORLD
rank = world.Get_rank()
world.Barrier()
with open("/proc/self/maps") as f:
    mine = {line.split(None, 5)[5].strip() for line in f if "/mpich_shm_" in line}
proxy = os.path.join("/proc", str(os.getppid()), "fd")
for fd in os.listdir(proxy):
    try:
        target = os.readlink(os.path.join(proxy, fd))
    except OSError:
        continue
    if os.path.basename(target).startswith("hydra_hwloc_xmlfile_"):
        mine.add(target)
dead = {f.path for f in leftovers.dead_files()}
failures = [f"{p} is reported as a dead job's" for p in mine & dead]
if not any("/mpich_shm_" in p for p in mine):
    failures.append("no /dev/shm/mpich_shm_* mapped: MPICH's shared memory changed?")
for failure in failures:
    print(f"FAIL rank {rank}: {failure}", flush=True)
failed_anywhere = world.allreduce(len(failures))  # every rank has looked before any aborts
if rank == 0 and os.environ.get("BODY_LEFTOVERS_HELD"):
    with open(os.environ["BODY_LEFTOVERS_HELD"], "w") as f:
        f.write("".join(f"{path}\n" for path in sorted(mine)))
if os.environ.get("BODY_LEFTOVERS_ABORT") and not failed_anywhere:
    if rank == 0:
        world.Abort(3)
    world.Barrier()  # the abort ends this rank here
print(f"ok {rank}" if not failures else "failed", flush=True)
sys.exit(1 if failures else 0)
