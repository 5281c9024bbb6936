"""In-place all-reduce latency as a user sees it: ``mpidp.allreduce_`` (numpy array, CPU torch
tensor) against ``comm.Allreduce(MPI.IN_PLACE, buf)`` called directly from mpi4py, each in its
own tight loop with no harness layer per call. Launch under MPI:

    mpiexec -n 2 python bench/collectives/small_messages.py [--sizes 8,64,512,4096,65536] [--iters 2000]
        [--repeats 7] [--warmup 100] [--large] [--json FILE]

Per size, blocks run in turn (MPI, mpidp numpy, mpidp torch, MPI, ...) ``--repeats`` times;
each block is a warm-up, a barrier, then ``time.perf_counter`` around ``--iters`` calls over
rotated float32 buffers. A block's time per call is reduced over ranks (harness ``stats``);
the table gives the median over repeats of the rank average and of the rank maximum, and the
median of each repeat's paired ratio to MPI. ``--large`` adds 32 MiB and 64 MiB (mpidp numpy
vs MPI) against the memory-copy bound (harness ``memory_ceiling``), as ``python -m
mpidp.bench allreduce`` reports it. #wrong: elements differing from the exact sum of small
integers, one checked call per size and column, summed over ranks."""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import numpy as np
import torch

import mpidp
from mpidp import files
from mpidp.bench.harness import format_size, memory_ceiling, parse_size, rotation, stats

LARGE_SIZES = (32 << 20, 64 << 20)


def loop_mpi(seq, allreduce, in_place) -> float:
    """Seconds for ``comm.Allreduce(MPI.IN_PLACE, b)`` over every buffer of ``seq``."""
    t0 = time.perf_counter()
    for b in seq:
        allreduce(in_place, b)
    return time.perf_counter() - t0


def loop_mpidp(seq, allreduce_) -> float:
    """Seconds for ``mpidp.allreduce_(b)`` over every buffer of ``seq``."""
    t0 = time.perf_counter()
    for b in seq:
        allreduce_(b)
    return time.perf_counter() - t0


def run_blocks(comm, runs, repeats: int, warmup: int) -> np.ndarray:
    """runs: (loop, seq, extra args) per column, run in turn ``repeats`` times. Returns every
    rank's seconds per call, shape (ranks, repeats, columns), the same on every rank."""
    local = np.empty((repeats, len(runs)))
    for r in range(repeats):
        for c, (loop, seq, extra) in enumerate(runs):
            loop(seq[:warmup], *extra)
            comm.Barrier()
            local[r, c] = loop(seq, *extra) / len(seq)
    return np.stack(comm.allgather(local))  # outside every timed block


def summarize(per_rank: np.ndarray) -> dict:
    """Medians over repeats of the rank average and maximum (µs), and of the paired ratio of
    each column to column 0 (MPI) within a repeat."""
    ranks, repeats, cols = per_rank.shape
    blocks = [[stats(per_rank[:, r, c]) for c in range(cols)] for r in range(repeats)]
    med = lambda key, c: statistics.median(b[c][key] for b in blocks)
    ratio = lambda key, c: statistics.median(b[c][key] / b[0][key] for b in blocks)
    return {"avg_us": [med("avg", c) * 1e6 for c in range(cols)],
            "max_us": [med("max", c) * 1e6 for c in range(cols)],
            "ratio_avg": [ratio("avg", c) for c in range(cols)],
            "ratio_max": [ratio("max", c) for c in range(cols)],
            "per_rank_us": (per_rank * 1e6).round(3).tolist()}


def count_wrong(comm, count: int, seed: int, calls) -> list:
    """One call per column on small integers: elements differing from the exact sum, per
    column, summed over ranks."""
    n, rank = comm.Get_size(), comm.Get_rank()
    inputs = [np.random.default_rng([seed, count, r]).integers(-8, 9, count).astype(np.float32)
              for r in range(n)]
    exact = np.sum(inputs, axis=0)
    wrong = np.array([np.count_nonzero(np.asarray(call(inputs[rank].copy())) != exact)
                      for call in calls], dtype=np.int64)
    total = np.empty_like(wrong)
    comm.Allreduce(wrong, total)
    return total.tolist()


def buffers(nbytes: int, iters: int, seed: int):
    """``iters`` references to rotated float32 arrays of small random integers (never zeros)."""
    count = max(1, nbytes // 4)
    rng = np.random.default_rng(seed)
    sets = [rng.integers(1, 5, count).astype(np.float32) for _ in range(rotation(count * 4))]
    return [sets[i % len(sets)] for i in range(iters)], count


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", default="8,64,512,4096,65536",
                   help="comma-separated bytes (K/M suffixes allowed); empty: none")
    p.add_argument("--iters", type=int, default=2000, help="calls per timed block")
    p.add_argument("--warmup", type=int, default=100, help="untimed calls before each block")
    p.add_argument("--repeats", type=int, default=7, help="blocks per column, alternated")
    p.add_argument("--large", action="store_true", help="also 32 MiB and 64 MiB vs the copy bound")
    p.add_argument("--large-iters", type=int, default=10, help="calls per large block")
    p.add_argument("--json", metavar="FILE", help="write every figure as JSON (rank 0)")
    args = p.parse_args()

    mpidp.init()  # first: it starts MPI (MPIDP_* environment defaults apply)
    from mpi4py import MPI  # already initialised by mpidp.init()
    comm = MPI.COMM_WORLD
    rank, n = mpidp.rank(), mpidp.size()
    seed = comm.bcast(time.time_ns() % (1 << 32), root=0)  # fresh data every run
    allreduce_ = mpidp.allreduce_  # bound to a local name, as a user might
    mpi_args = (comm.Allreduce, MPI.IN_PLACE)
    calls_np = (lambda b: comm.Allreduce(MPI.IN_PLACE, b) or b, allreduce_)
    out = {"nranks": n, "argv": sys.argv, "iters": args.iters, "repeats": args.repeats,
           "large_iters": args.large_iters,
           "mpi": " ".join(MPI.Get_library_version().splitlines()[0].split()), "small": [], "large": []}

    for nbytes in [parse_size(s) for s in args.sizes.split(",") if s.strip()]:
        seq, count = buffers(nbytes, args.iters, seed + rank)
        tseq = [torch.from_numpy(b.copy()) for b in seq[:rotation(count * 4)]]
        tseq = [tseq[i % len(tseq)] for i in range(args.iters)]
        per_rank = run_blocks(comm, [(loop_mpi, seq, mpi_args), (loop_mpidp, seq, (allreduce_,)),
                                     (loop_mpidp, tseq, (allreduce_,))], args.repeats, args.warmup)
        wrong = count_wrong(comm, count, seed, (*calls_np,
                                                lambda b: allreduce_(torch.from_numpy(b)).numpy()))
        out["small"].append({"size": count * 4, "count": count, "wrong": wrong,
                             "columns": ["mpi", "mpidp_numpy", "mpidp_torch"], **summarize(per_rank)})

    if args.large:
        ceiling = memory_ceiling(comm)
        out["ceiling"] = ceiling
        factor = 2 * (n - 1) / n if n > 1 else 1.0
        for nbytes in LARGE_SIZES:
            seq, count = buffers(nbytes, args.large_iters, seed + rank)
            per_rank = run_blocks(comm, [(loop_mpi, seq, mpi_args),
                                         (loop_mpidp, seq, (allreduce_,))], args.repeats, 2)
            del seq
            s = summarize(per_rank)
            algbw = [nbytes / (t * 1e-6) / 1e9 for t in s["avg_us"]]
            out["large"].append({"size": nbytes, "count": count, "columns": ["mpi", "mpidp_numpy"],
                                 "wrong": count_wrong(comm, count, seed, calls_np),
                                 "algbw_GBps": algbw, "busbw_GBps": [a * factor for a in algbw],
                                 "of_copy_bound": [a / ceiling["bound_algbw_GBps"]
                                                   for a in algbw], **s})

    if rank == 0:
        print(report(out))
        if args.json:
            os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
            files.write_json(args.json, out, what="benchmark results")
    failed = any(sum(r["wrong"]) for r in out["small"] + out["large"])
    mpidp.shutdown()
    return 1 if failed else 0


def report(out: dict) -> str:
    """Markdown tables: µs cells are 'rank average (rank maximum)', medians over repeats."""
    us = lambda r, c: f"{r['avg_us'][c]:.2f} ({r['max_us'][c]:.2f})"
    x = lambda r, key, c: f"{r[key][c]:.2f}x"
    lines = [f"# {out['nranks']} ranks, float32 sum in place, {out['mpi']}; "
             f"iters {out['iters']}, repeats {out['repeats']} (alternated); "
             "µs per call = median over repeats of rank avg (rank max)", ""]
    if out["small"]:
        lines += ["| size | MPI_Allreduce µs | mpidp numpy µs | mpidp torch µs | numpy/MPI | "
                  "torch/MPI | numpy/MPI (max) | torch/MPI (max) | #wrong |",
                  "|---|---|---|---|---|---|---|---|---|"]
        lines += [f"| {format_size(r['size'])} | {us(r, 0)} | {us(r, 1)} | {us(r, 2)} | "
                  f"{x(r, 'ratio_avg', 1)} | {x(r, 'ratio_avg', 2)} | {x(r, 'ratio_max', 1)} | "
                  f"{x(r, 'ratio_max', 2)} | {sum(r['wrong'])} |" for r in out["small"]]
    if out["large"]:
        c = out["ceiling"]
        lines += ["", f"copy bound: copy {c['copy_GBps']:.2f} GB/s (numpy), "
                  f"{c.get('stream_copy_GBps', 0):.2f} GB/s (non-temporal stores), add "
                  f"{c['add_GBps']:.2f} GB/s per rank, {out['nranks']} ranks at once (harness "
                  f"memory_ceiling); % of bound = algbw / the faster copy; "
                  f"{out['large_iters']} calls per block", "",
                  "| size | MPI_Allreduce µs | mpidp µs | MPI busbw GB/s | mpidp busbw GB/s | "
                  "MPI/mpidp time | MPI % of bound | mpidp % of bound | #wrong |",
                  "|---|---|---|---|---|---|---|---|---|"]
        lines += [f"| {format_size(r['size'])} | {us(r, 0)} | {us(r, 1)} | "
                  f"{r['busbw_GBps'][0]:.2f} | {r['busbw_GBps'][1]:.2f} | "
                  f"{1 / r['ratio_avg'][1]:.2f}x | {r['of_copy_bound'][0]:.0%} | "
                  f"{r['of_copy_bound'][1]:.0%} | {sum(r['wrong'])} |" for r in out["large"]]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
