"""Horovod 0.28.1 against mpidp, side by side in one launch: time per in-place all-reduce
(float32 sum of CPU torch tensors) of Horovod's ``horovod.torch.allreduce_``, mpidp's drop-in
``mpidp.horovod.allreduce_``, ``mpidp.allreduce_`` and mpi4py's ``comm.Allreduce(MPI.IN_PLACE,
numpy view)``; with ``--train``, samples/s of the training benchmark's MLP (5.8 M parameters,
``mpidp.bench.train.MODELS``) under Horovod's DistributedOptimizer, mpidp.horovod's, mpidp's
DistributedDataParallel and no all-reduce at all (the bound). Needs Horovod's venv
(bench/horovod/build_horovod.sh); launch under MPI:

    mpiexec -n 2 bench/out/horovod-venv/bin/python bench/horovod/horovod_compare.py
        [--sizes 8,1K,64K,1M,16M,64M] [--reps 5] [--train] [--no-horovod] [--json FILE]

Both libraries live in one process on MPI_COMM_WORLD: ``mpidp.init()`` starts MPI (mpi4py,
MPI_THREAD_MULTIPLE), then ``hvd.init()`` finds it started, takes it as it is and leaves it
to mpi4py to finalize. Horovod's background thread then runs all the time (a cycle every
HOROVOD_CYCLE_TIME ms, 1 by default; Horovod reads the variable itself): idle, it keeps a core
busy on rank 1 (busy-polling MPI for the coordinator, rank 0), and its MPI calls share the
library with the other columns'. ``--no-horovod`` runs the same launch without Horovod, the
reference for mpidp against MPI.

Regime: per size, ``--reps`` repetitions of each column in turn (alternated, so drift hits all
alike), each a warm-up, a barrier, then ``time.perf_counter`` around a loop of calls scaled to
size (about 256 MiB per loop, 4 to 1000 calls) over buffers rotated as the harness rotates
them (up to 64 within 64 MiB: sizes up to 64 KiB run from cache, 16 MiB and up from memory).
A repetition's time is the slowest rank's; the table gives medians over repetitions, and
medians of each repetition's paired ratios of times: X/MPI (below 1: X is faster than MPI)
and hvd/X (above 1: X is faster than Horovod). Horovod's calls carry a name per buffer (its
response cache hits, as under DistributedOptimizer). #wrong: elements differing from the exact
sum of small integers, one checked call per column, summed over ranks."""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import numpy as np
import torch

import mpidp
import mpidp.horovod as hvd2
from mpidp import files
from mpidp.bench.harness import format_size, parse_size, rotation
from mpidp.bench.train import MODELS
from mpidp.workloads import models

COLUMNS = ("mpi", "horovod", "mpidp.horovod", "mpidp")


def per_call_s(comm, call, seq, warmup: int) -> float:
    """The slowest rank's seconds per ``call(k, buffer)`` over ``seq``, pairs (k, buffer) with
    k the buffer's index (every rank calls)."""
    for k, b in seq[:warmup]:
        call(k, b)
    comm.Barrier()
    t0 = time.perf_counter()
    for k, b in seq:
        call(k, b)
    return max(comm.allgather((time.perf_counter() - t0) / len(seq)))


def latency(comm, hvd, nbytes: int, reps: int, seed: int) -> dict:
    """One size: every column ``reps`` times in turn; median µs and paired ratios."""
    from mpi4py import MPI  # here, not at the top: importing it would start MPI before mpidp
    count, rank = max(1, nbytes // 4), comm.Get_rank()
    sets = rotation(count * 4)
    calls = max(4, min(1000, (256 << 20) // (count * 4)))
    rng = np.random.default_rng([seed, rank])
    bufs = [torch.from_numpy(rng.integers(1, 5, count).astype(np.float32)) for _ in range(sets)]
    seq = [(i % sets, bufs[i % sets]) for i in range(calls)]
    names = [f"b{nbytes}.{k}" for k in range(sets)]  # made once: the loops time the libraries
    fns = {"mpi": lambda k, t: comm.Allreduce(MPI.IN_PLACE, t.numpy()),
           "horovod": hvd and (lambda k, t: hvd.allreduce_(t, name=names[k], op=hvd.Sum)),
           "mpidp.horovod": lambda k, t: hvd2.allreduce_(t, name=names[k], op=hvd2.Sum),
           "mpidp": lambda k, t: mpidp.allreduce_(t)}
    cols = [c for c in COLUMNS if fns[c]]
    times = {c: [] for c in cols}
    for _ in range(reps):
        for c in cols:
            times[c].append(per_call_s(comm, fns[c], seq, warmup=sets))
    del bufs, seq
    inputs = [np.random.default_rng([seed, count, r]).integers(-8, 9, count).astype(np.float32)
              for r in range(comm.Get_size())]
    exact = np.sum(inputs, axis=0)
    wrong = 0
    for c in cols:
        t = torch.from_numpy(inputs[rank].copy())
        fns[c](0, t)
        wrong += int(np.count_nonzero(t.numpy() != exact))
    ratio = lambda c, ref: statistics.median(a / b for a, b in zip(times[c], times[ref]))
    return {"size": count * 4, "calls": calls, "buffers": sets,
            "wrong": comm.allreduce(wrong),
            "us": {c: statistics.median(times[c]) * 1e6 for c in cols},
            "vs_mpi": {c: ratio(c, "mpi") for c in cols},
            "horovod_over": {c: ratio("horovod", c) for c in cols} if hvd else {},
            "drop_in_over_own": ratio("mpidp.horovod", "mpidp"),  # the drop-in's cost
            "all_us": {c: [t * 1e6 for t in times[c]] for c in cols}}


class Trainer:
    """The training benchmark's MLP under one way of reducing its gradients."""

    def __init__(self, mode: str, hvd, rank: int):
        shape, self.batch, kwargs = MODELS["mlp"]
        torch.manual_seed(0)
        self.model = models.mlp(in_features=shape[0], **kwargs)
        if mode == "mpidp DDP":
            self.model = mpidp.DistributedDataParallel(self.model)
        opt = torch.optim.SGD(self.model.parameters(), lr=0.01, momentum=0.9)
        lib = {"horovod": hvd, "mpidp.horovod": hvd2}.get(mode)
        self.optimizer = opt if lib is None else lib.DistributedOptimizer(
            opt, named_parameters=self.model.named_parameters())
        gen = torch.Generator().manual_seed(rank)
        self.data = [(torch.randn((self.batch,) + shape, generator=gen),
                      torch.randint(0, 10, (self.batch,), generator=gen)) for _ in range(4)]
        self.i = 0

    def step(self) -> None:
        x, y = self.data[self.i % len(self.data)]
        self.i += 1
        self.optimizer.zero_grad()
        torch.nn.functional.cross_entropy(self.model(x), y).backward()
        self.optimizer.step()


def training(comm, hvd, steps: int, warmup: int, reps: int) -> dict:
    """samples/s (all ranks) per mode: medians over ``reps`` windows of ``steps`` steps, the
    modes alternated within each repetition; a window's time is the slowest rank's."""
    modes = [m for m in ("horovod", "mpidp.horovod", "mpidp DDP", "none") if hvd or m != "horovod"]
    runs = {m: Trainer(m, hvd, comm.Get_rank()) for m in modes}
    rates = {m: [] for m in modes}
    for _ in range(reps):
        for m, run in runs.items():
            for _ in range(warmup):
                run.step()
            comm.Barrier()
            t0 = time.perf_counter()
            for _ in range(steps):
                run.step()
            elapsed = max(comm.allgather(time.perf_counter() - t0))
            rates[m].append(comm.Get_size() * run.batch * steps / elapsed)
    params = sum(p.numel() for p in runs["none"].model.parameters())
    return {"params": params, "batch_per_rank": runs["none"].batch, "steps": steps,
            "samples_per_s": {m: statistics.median(rates[m]) for m in modes},
            "drop_in_over_ddp": statistics.median(  # DistributedOptimizer ÷ mpidp's DDP
                a / b for a, b in zip(rates["mpidp.horovod"], rates["mpidp DDP"])),
            "drop_in_rate": statistics.median(rates["mpidp.horovod"]),
            "all_samples_per_s": rates}


def report(out: dict) -> str:
    """Markdown tables for people (rank 0)."""
    lat, hvd = out["latency"], out["horovod"]
    cols = [c for c in COLUMNS if hvd or c != "horovod"]
    lines = [f"# {out['ranks']} ranks, {out['mpi']}; horovod {hvd or 'not initialised'}, "
             f"HOROVOD_CYCLE_TIME={out['cycle_time'] or 'unset (1 ms)'}; torch threads "
             f"{out['threads']}; medians of {out['reps']} repetitions, slowest rank", ""]
    if lat:
        head = " | ".join(f"{c} µs" for c in cols)
        ratios = [f"{c}/MPI" for c in cols[1:]] + ([f"hvd/{c}" for c in cols[2:]] if hvd else [])
        lines += [f"| size | calls | {head} | {' | '.join(ratios)} | #wrong |",
                  "|---" * (3 + len(cols) + len(ratios)) + "|"]
        for r in lat:
            cells = [f"{r['us'][c]:.1f}" for c in cols]
            cells += [f"{r['vs_mpi'][c]:.2f}x" for c in cols[1:]]
            cells += [f"{r['horovod_over'][c]:.1f}x" for c in cols[2:]] if hvd else []
            lines.append(f"| {format_size(r['size'])} | {r['calls']} | {' | '.join(cells)} | "
                         f"{r['wrong']} |")
    if out.get("train"):
        t = out["train"]
        rates = t["samples_per_s"]
        lines += ["", f"MLP {t['params'] / 1e6:.2f} M parameters, batch {t['batch_per_rank']} "
                  f"per rank, SGD momentum, {t['steps']} steps per window", "",
                  "| optimizer | samples/s | % of no all-reduce | vs Horovod |",
                  "|---|---|---|---|"]
        for m, v in rates.items():
            vs = f"{v / rates['horovod']:.2f}x" if "horovod" in rates else "-"
            lines.append(f"| {m} | {v:.0f} | {100 * v / rates['none']:.0f}% | {vs} |")
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", default="8,1K,64K,1M,16M,64M",
                   help="comma-separated bytes, K/M suffixes; empty: none")
    p.add_argument("--reps", type=int, default=5, help="repetitions per column (median reported)")
    p.add_argument("--train", action="store_true", help="also the training throughput")
    p.add_argument("--steps", type=int, default=20, help="timed training steps per window")
    p.add_argument("--warmup", type=int, default=5, help="untimed steps before each window")
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    p.add_argument("--no-horovod", action="store_true", help="leave Horovod out (no init)")
    p.add_argument("--json", metavar="FILE", help="write every figure as JSON (rank 0)")
    args = p.parse_args()

    torch.set_num_threads(args.threads)
    mpidp.init()  # first: mpi4py starts MPI at THREAD_MULTIPLE, Horovod then takes it as is
    hvd2.init()  # the same group (mpidp.init is idempotent)
    hvd = None
    if not args.no_horovod:
        import horovod  # only where asked for: --no-horovod keeps its thread out
        import horovod.torch as hvd
        hvd.init()
        assert hvd.size() == hvd2.size() and hvd.rank() == hvd2.rank()
    from mpi4py import MPI  # started by mpidp.init()
    comm = MPI.COMM_WORLD
    seed = comm.bcast(time.time_ns() % (1 << 32), root=0)
    out = {"ranks": comm.Get_size(), "argv": sys.argv, "reps": args.reps, "threads": args.threads,
           "mpi": " ".join(MPI.Get_library_version().splitlines()[0].split()[:3]),
           "horovod": hvd and horovod.__version__,
           "cycle_time": os.environ.get("HOROVOD_CYCLE_TIME"), "latency": []}
    for nbytes in [parse_size(s) for s in args.sizes.split(",") if s.strip()]:
        out["latency"].append(latency(comm, hvd, nbytes, args.reps, seed))
    if args.train:
        out["train"] = training(comm, hvd, args.steps, args.warmup, args.reps)
    if comm.Get_rank() == 0:
        print(report(out), flush=True)
        if args.json:
            os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
            files.write_json(args.json, out, what="benchmark results")
    wrong = sum(r["wrong"] for r in out["latency"])
    if hvd:
        hvd.shutdown()  # leaves MPI to mpi4py: Horovod did not start it
    mpidp.shutdown()
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main())
