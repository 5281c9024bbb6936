"""A synchronous ``dist.all_reduce`` of a CPU tensor as torch's users call it, side by side in one
launch: on an mpidp group, on gloo (torch's default group here), against
``comm.Allreduce(MPI.IN_PLACE, buf)`` from mpi4py and ``mpidp.allreduce_(tensor)`` called
directly (the backend's floor: what it adds is torch's front and its own dispatch). Launch
under MPI:

    mpiexec -n 2 python bench/collectives/dist_latency.py [--sizes 8,4K,64K,1M] [--iters 1000]
        [--repeats 5] [--warmup 50] [--json FILE]
    mpiexec -n 2 python bench/collectives/dist_latency.py --layers [--sizes 8]

``--layers`` times instead where one call of the mpidp group goes, one layer down at a time
(the same tensor each call, the layers alternated): torch's ``dist.all_reduce``, the method
torch calls (``ProcessGroup.allreduce``), the group's ordering (``_run``), the operation
(``mpidp.backend.ops.all_reduce``: the one C call through the tensor's view), and
``mpidp.allreduce_`` for reference.

Per size, blocks run in turn (MPI, mpidp.allreduce_, dist mpidp, dist gloo, MPI, ...)
``--repeats`` times; each block is a warm-up, a barrier, then ``time.perf_counter`` around N
calls over rotated float32 tensors (N = ``--iters`` up to 4 KiB, fewer above: 16 MiB of
calls, at least 20). The table gives the median over repeats of the rank average (rank
maximum) per call and the median of each repeat's paired ratio
(bench/collectives/small_messages.py's ``run_blocks`` and ``summarize``). #wrong: elements differing from the exact sum of small
integers, one checked call per size and column, summed over ranks."""
from __future__ import annotations

import argparse
import os
import os
import sys
import time

# the backend registered by this build's own module, not through the installed entry point,
# which bench/ab.py's other build would resolve into this checkout: mpidp.dist, its name in
# every build (Note [The backend's old name] in mpidp/dist.py)
os.environ["TORCH_DEVICE_BACKEND_AUTOLOAD"] = "0"

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import mpidp  # noqa: E402
import mpidp.dist  # noqa: E402,F401 - registers the backend
from mpidp import files  # noqa: E402
from mpidp.bench.harness import Gloo, format_size, parse_size, rotation

from small_messages import count_wrong, run_blocks, summarize  # noqa: E402 - its sibling

COLUMNS = ("mpi", "mpidp_allreduce_", "dist_mpidp", "dist_gloo")


def loop(seq, call) -> float:
    """Seconds for ``call(t)`` over every tensor of ``seq``."""
    t0 = time.perf_counter()
    for t in seq:
        call(t)
    return time.perf_counter() - t0


def tensors(nbytes: int, iters: int, seed: int):
    """``iters`` references to rotated float32 tensors of small random integers."""
    count = max(1, nbytes // 4)
    rng = np.random.default_rng(seed)
    sets = [torch.from_numpy(rng.integers(1, 5, count).astype(np.float32))
            for _ in range(rotation(count * 4))]
    return [sets[i % len(sets)] for i in range(iters)], count


def in_place_on(call):
    """``call`` (in place on a tensor) as count_wrong calls: on an array, returning it."""
    def on_array(a: np.ndarray) -> np.ndarray:
        call(torch.from_numpy(a))
        return a
    return on_array


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", default="8,4K,64K,1M", help="comma-separated bytes (K/M suffixes)")
    p.add_argument("--iters", type=int, default=1000, help="calls per timed block up to 4 KiB")
    p.add_argument("--warmup", type=int, default=50, help="untimed calls before each block")
    p.add_argument("--repeats", type=int, default=5, help="blocks per column, alternated")
    p.add_argument("--json", metavar="FILE", help="write every figure as JSON (rank 0)")
    p.add_argument("--layers", action="store_true", help="time the layers of one call")
    args = p.parse_args()
    if args.layers:
        return layers(args)

    mpidp.init()
    from mpi4py import MPI  # already initialised by mpidp.init()
    comm = MPI.COMM_WORLD
    rank, n = comm.Get_rank(), comm.Get_size()
    gloo = Gloo(comm, backend_group=True)  # gloo's default group and an mpidp group of all
    group = gloo.mpidp_group
    seed = comm.bcast(time.time_ns() % (1 << 32), root=0)
    allreduce_, in_place = mpidp.allreduce_, MPI.IN_PLACE
    calls = (lambda t: comm.Allreduce(in_place, t.numpy()),
             allreduce_,
             lambda t: dist.all_reduce(t, group=group),
             dist.all_reduce)
    out = {"nranks": n, "argv": sys.argv, "repeats": args.repeats, "columns": list(COLUMNS),
           "mpi": " ".join(MPI.Get_library_version().splitlines()[0].split()),
           "torch": torch.__version__, "rows": []}
    for nbytes in [parse_size(s) for s in args.sizes.split(",") if s.strip()]:
        iters = max(20, min(args.iters, (16 << 20) // max(nbytes, 1)))
        seq, count = tensors(nbytes, iters, seed + rank)
        per_rank = run_blocks(comm, [(loop, seq, (c,)) for c in calls], args.repeats,
                              min(args.warmup, iters))
        row = {"size": count * 4, "count": count, "iters": iters,
               "wrong": count_wrong(comm, count, seed, [in_place_on(c) for c in calls]),
               **summarize(per_rank)}
        out["rows"].append(row)
    if rank == 0:
        print(report(out))
        if args.json:
            os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
            files.write_json(args.json, out, what="benchmark results")
    failed = any(sum(r["wrong"]) for r in out["rows"])
    gloo.close()
    mpidp.shutdown()
    return 1 if failed else 0


def layers(args) -> int:
    """``--layers``: µs per call of each layer of a synchronous all-reduce on the default
    mpidp group, medians over repeats of the rank average."""
    from mpidp.backend import ops  # the backend's own layers, timed one by one
    dist.init_process_group("mpidp")
    from mpi4py import MPI  # initialised by the group
    comm = MPI.COMM_WORLD
    pg = dist.distributed_c10d._get_default_group()
    opts = dist.AllreduceOptions()
    opts.reduceOp, opts.asyncOp = dist.ReduceOp.SUM, False
    SUM = dist.ReduceOp.SUM
    for nbytes in [parse_size(s) for s in args.sizes.split(",") if s.strip()]:
        t = torch.ones(max(1, nbytes // 4))
        calls = {"dist.all_reduce": lambda: dist.all_reduce(t),
                 "ProcessGroup.allreduce": lambda: pg.allreduce([t], opts),
                 "ProcessGroup._run": lambda: pg._run(opts, lambda: ops.all_reduce(
                     pg.g, t, SUM), [t]),
                 "ops.all_reduce": lambda: ops.all_reduce(pg.g, t, SUM),
                 "mpidp.allreduce_": lambda: mpidp.allreduce_(t)}
        times = {k: [] for k in calls}
        iters = max(20, min(args.iters * 5, (64 << 20) // max(nbytes, 1)))
        for _ in range(args.repeats):
            for name, call in calls.items():
                for _ in range(args.warmup):
                    call()
                comm.Barrier()
                t0 = time.perf_counter()
                for _ in range(iters):
                    call()
                mine = (time.perf_counter() - t0) / iters
                times[name].append(comm.allreduce(mine) / comm.Get_size())
        if comm.Get_rank() == 0:
            print(f"# {format_size(t.nbytes)}, {comm.Get_size()} ranks: µs per call, median "
                  f"of {args.repeats} x {iters}")
            for name, v in times.items():
                print(f"{name:24s} {sorted(v)[len(v) // 2] * 1e6:8.2f}")
    dist.destroy_process_group()
    return 0


def report(out: dict) -> str:
    """A Markdown table: µs cells are 'rank average (rank maximum)', medians over repeats;
    ratios are paired within a repeat."""
    us = lambda r, c: f"{r['avg_us'][c]:.2f} ({r['max_us'][c]:.2f})"
    ratio = lambda r, a, b: sorted(  # median over repeats of column a / column b, rank avg
        np.mean(r["per_rank_us"], axis=0)[:, a] / np.mean(r["per_rank_us"], axis=0)[:, b]
    )[len(r["per_rank_us"][0]) // 2]
    lines = [f"# {out['nranks']} ranks, float32 sum in place, torch {out['torch']}, "
             f"{out['mpi']}; repeats {out['repeats']} (alternated); µs per call = median over "
             "repeats of rank avg (rank max)", "",
             "| size | calls | MPI_Allreduce µs | mpidp.allreduce_ µs | dist mpidp µs | "
             "dist gloo µs | gloo / dist mpidp | dist mpidp / allreduce_ | #wrong |",
             "|---|---|---|---|---|---|---|---|---|"]
    lines += [f"| {format_size(r['size'])} | {r['iters']} | {us(r, 0)} | {us(r, 1)} | "
              f"{us(r, 2)} | {us(r, 3)} | {ratio(r, 3, 2):.1f}x | {ratio(r, 2, 1):.2f}x | "
              f"{sum(r['wrong'])} |" for r in out["rows"]]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
