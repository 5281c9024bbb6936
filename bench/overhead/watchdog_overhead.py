"""What the watchdog costs (Note [Watchdog] in mpidp/runtime/watchdog.py), in two parts:

1. the board, on every collective's path: ``publish`` plus ``done``, ns per collective, in
   one process without MPI, with MPIDP_DEBUG off and on (on: the call site is looked up);
2. the watching thread: small all-reduce latency under ``mpiexec -n RANKS`` with the
   thread running (as always) and stopped, in alternated blocks within each launch (the
   launches themselves differ by ±50% here with where the ranks land).

``python bench/overhead/watchdog_overhead.py [--ranks 2] [--launches 3] [--sizes 8,65536]``."""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path


def board_ns(debug: bool, calls: int, repeats: int) -> float:
    """ns per collective spent on the board (an empty loop subtracted)."""
    from mpidp.runtime.watchdog import Board
    b = Board(debug)
    hdr = (1, 3, 4, 2, 650, 12345, 0, 0)

    def run(n, touch):
        t0 = time.perf_counter_ns()
        for _ in range(n):
            if touch:
                b.publish(hdr)
                b.done = b.seq
        return (time.perf_counter_ns() - t0) / n

    runs = [run(calls, True) - run(calls, False) for _ in range(repeats)]
    return statistics.median(runs)


def rank_main(a) -> None:
    """One launch: blocks of all-reduces with the thread running and stopped, alternated (so
    both see the same core placement); prints, per size, each mode's median block median."""
    import numpy as np
    import mpidp
    from mpidp import config
    from mpidp.runtime.watchdog import Watchdog
    g = mpidp.init()
    blocks = {True: {s: [] for s in a.sizes}, False: {s: [] for s in a.sizes}}
    xs = {s: np.ones(max(1, s // 4), np.float32) for s in a.sizes}
    for s in a.sizes:
        for _ in range(a.warmup):
            mpidp.allreduce_(xs[s])
    for block in range(a.blocks):
        for running in ((True, False) if block % 2 == 0 else (False, True)):
            if running and g.watchdog is None:
                g.watchdog = Watchdog(g, config.get().timeout_s)
            elif not running and g.watchdog is not None:
                g.watchdog.stop()
                g.watchdog = None
            for s in a.sizes:
                times = []
                for _ in range(a.iters):
                    t0 = time.perf_counter_ns()
                    mpidp.allreduce_(xs[s])
                    times.append(time.perf_counter_ns() - t0)
                blocks[running][s].append(statistics.median(times) / 1000)
    if g.rank == 0:
        print(json.dumps({str(running): {s: statistics.median(v) for s, v in sizes.items()}
                          for running, sizes in blocks.items()}), flush=True)


def launch(ranks: int, a) -> dict:
    mpiexec = str(Path(sys.executable).parent / "mpiexec")
    cmd = [mpiexec, "-n", str(ranks), sys.executable, __file__, "--rank-main",
           "--sizes", ",".join(map(str, a.sizes)), "--iters", str(a.iters),
           "--warmup", str(a.warmup), "--blocks", str(a.blocks)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600,
                          env=dict(os.environ, PYTHONUNBUFFERED="1"))
    if proc.returncode != 0:
        raise SystemExit(f"launch failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    line = [l for l in proc.stdout.splitlines() if l.startswith("{")][-1]
    return {k == "True": {int(s): v for s, v in d.items()} for k, d in json.loads(line).items()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--launches", type=int, default=3)
    p.add_argument("--sizes", default="8,65536", help="bytes per all-reduce, comma-separated")
    p.add_argument("--iters", type=int, default=5000, help="calls per block")
    p.add_argument("--blocks", type=int, default=8, help="blocks per mode in each launch")
    p.add_argument("--warmup", type=int, default=2000)
    p.add_argument("--calls", type=int, default=200_000, help="board part: calls per run")
    p.add_argument("--rank-main", action="store_true", help=argparse.SUPPRESS)
    a = p.parse_args()
    a.sizes = [int(s) for s in a.sizes.split(",")]
    if a.rank_main:
        return rank_main(a)

    print(f"# board cost per collective, ns (median of 7 x {a.calls:,}, empty loop subtracted)")
    for debug in (False, True):
        print(f"MPIDP_DEBUG={int(debug)}  {board_ns(debug, a.calls, 7):8.0f} ns")

    on_off = []  # per launch: {running: {size: µs}}
    for i in range(a.launches):
        on_off.append(launch(a.ranks, a))
        print(f"  launch {i + 1}/{a.launches}: " + ", ".join(
            f"{s} B on {on_off[-1][True][s]:.2f} / off {on_off[-1][False][s]:.2f} µs"
            for s in a.sizes), file=sys.stderr, flush=True)
    print(f"# all-reduce latency, µs, mpiexec -n {a.ranks}: {a.launches} launches, each "
          f"alternating {a.blocks} blocks of {a.iters:,} calls per mode; medians of block "
          "medians, then over launches; on/off is the median of each launch's ratio")
    print(f"{'bytes':>8} {'thread on':>10} {'thread off':>11} {'on/off':>7}")
    for s in a.sizes:
        on = statistics.median(r[True][s] for r in on_off)
        off = statistics.median(r[False][s] for r in on_off)
        ratio = statistics.median(r[True][s] / r[False][s] for r in on_off)
        print(f"{s:>8} {on:10.2f} {off:11.2f} {ratio:7.3f}")

if __name__ == "__main__":
    main()
