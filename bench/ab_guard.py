"""The named benchmarks of bench/ab.py and the guard set: the figures every change touching
engine/, comm/, ddp/ or the torch.distributed backend runs A/B against its parent before it
lands (docs/benchmarks.md, "A/B before a change lands").

Each is one launch giving several figures. Where a launch can also time a reference that no
change of ours moves (MPI_Allreduce, training with no all-reduce), a second figure is the ratio
to it within the launch: a launch on a busier moment of the machine slows both alike, so that
ratio varies less between launches than the time itself. The sizes of each launch (iterations,
repeats) are chosen so that the guard at PAIRS pairs takes about 10 minutes on the project's
2-core machine; --pairs raises it."""
from __future__ import annotations

from ab_figures import Bench, Figure

PAIRS = 4  # A B, B A, A B, B A: each build first in half the pairs

_AR = "{mpiexec} -n 2 {python} -m mpidp.bench allreduce --algorithms auto,mpi --json {json}"
_ROTATED = "rotated"  # the bench's default --buffers: sets filling 64 MiB (data from memory)


def _allreduce(size: int, label: str, regime: str = _ROTATED) -> tuple:
    """In-place mpidp.allreduce_ of an ordinary float32 array: µs, and ÷ MPI_Allreduce in the
    same launch (both in place)."""
    row = f"rows[size={size},algorithm=%s].in_place.time_us.avg"
    return (Figure(f"allreduce_ {label} in place, {regime}", row % "auto", "lower", "µs"),
            Figure(f"allreduce_ {label} ÷ MPI_Allreduce, {regime}",
                   f"{row % 'auto'} / {row % 'mpi'}", "lower", "ratio"))


_MULTINODE = ("{python} {driver}/tests/harness/multinode_cluster.py --nodes 2 -- {mpiexec} -n 2 "
              "-ppn 1 {python} -m mpidp.bench allreduce --algorithms auto,mpi --json {json}")
_ONE_NODE = (("nranks", 2), ("nodes", 1))
_TWO_NODES = (("nranks", 2), ("nodes", 2))

BENCHES = (
    Bench("allreduce-small",
          _AR + " -b 8 -e 64K -f 8192 -n 2000 -w 200 -r 5",
          _allreduce(8, "8 B") + _allreduce(64 << 10, "64 KiB"), expect=_ONE_NODE,
          about="one node, 2 ranks: 8 B and 64 KiB, 2000 calls x 5 repeats, buffers rotated "
                "through 64 sets (8 MiB per rank at 64 KiB)"),
    Bench("allreduce-large",
          _AR + " -b 1M -e 64M -f 64 -n 30 -w 5 -r 3",
          _allreduce(1 << 20, "1 MiB") + _allreduce(64 << 20, "64 MiB"), expect=_ONE_NODE,
          about="one node, 2 ranks: 1 MiB and 64 MiB, 30 calls x 3 repeats, buffers rotated "
                "through sets filling 64 MiB (data from memory)"),
    Bench("allreduce-cached",
          _AR + " -b 64K -e 64M -f 4 -n 30 -w 5 -r 3 --buffers 3",
          _allreduce(64 << 10, "64 KiB", "3 sets") + _allreduce(1 << 20, "1 MiB", "3 sets")
          + _allreduce(64 << 20, "64 MiB", "3 sets"), expect=_ONE_NODE,
          about="one node, 2 ranks, 3 buffer sets (data in cache up to the cache's size): the "
                "other regime, not in the guard"),
    Bench("train-mlp",
          "{mpiexec} -n 2 {python} -m mpidp.bench train --models mlp --modes none,mpidp "
          "--steps 20 --warmup 5 --repeats 3 --json {json}",
          (Figure("DDP MLP samples/s", "rows[model=mlp,mode=mpidp].samples_per_s", "higher",
                  "samples/s"),
           Figure("DDP MLP ÷ no all-reduce", "rows[model=mlp,mode=mpidp].samples_per_s / "
                  "rows[model=mlp,mode=none].samples_per_s", "higher", "ratio")),
          about="mpidp DDP, MLP 784-2048-2048-10, batch 64/rank, 2 ranks x 1 thread, 25 MiB "
                "buckets; and the same model with no all-reduce in the launch"),
    Bench("dist-8B",
          "{mpiexec} -n 2 {python} {driver}/bench/collectives/dist_latency.py --sizes 8 "
          "--repeats 5 --json {json}",
          (Figure("dist.all_reduce 8 B, mpidp group", "rows[size=8].avg_us[2]", "lower", "µs"),
           Figure("dist.all_reduce 8 B ÷ MPI_Allreduce", "rows[size=8].ratio_avg[2]", "lower",
                  "ratio")),
          expect=(("nranks", 2),),
          about="torch.distributed all_reduce of a CPU tensor on an mpidp group, 1000 calls x "
                "5 repeats alternated with MPI_Allreduce (the script is the driver's)"),
    Bench("multinode-64K",
          _MULTINODE + " -b 64K -e 64K -n 300 -w 30 -r 5",
          _allreduce(64 << 10, "64 KiB", "2 nodes, rotated"), expect=_TWO_NODES, needs="root",
          about="two emulated nodes (network namespaces, unshaped veths), 1 rank each: 64 KiB, "
                "300 calls x 5 repeats"),
    Bench("multinode-16M",
          _MULTINODE + " -b 16M -e 16M -n 10 -w 2 -r 3",
          _allreduce(16 << 20, "16 MiB", "2 nodes, rotated"), expect=_TWO_NODES, needs="root",
          about="two emulated nodes, 1 rank each: 16 MiB, 10 calls x 3 repeats"),
)

GUARD = ("allreduce-small", "allreduce-large", "train-mlp", "dist-8B", "multinode-64K",
         "multinode-16M")
