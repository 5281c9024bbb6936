"""``python -m mpidp.bench fusion``: bucket pack and unpack GB/s against one memcpy of the
same bytes, and many small all-reduces fused through buckets against one all-reduce each."""
from __future__ import annotations

import argparse
import ctypes
import statistics
import sys

import numpy as np

from .. import files
from .harness import format_size, parse_size, time_per_call


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tensors", default="1000x4K,100x256K,16x4M",
                   help="comma-separated COUNTxSIZE tensor sets for pack/unpack")
    p.add_argument("--count", type=int, default=1000, help="tensors in the all-reduce test")
    p.add_argument("--size", default="4K", help="bytes per tensor in the all-reduce test")
    p.add_argument("--algorithm", default="auto", help="mpidp all-reduce algorithm")
    p.add_argument("-n", "--iters", type=int, default=20, help="timed calls per repetition")
    p.add_argument("-w", "--warmup-iters", type=int, default=3)
    p.add_argument("-r", "--repeats", type=int, default=5, help="the median is reported")
    p.add_argument("--json", default=None, help="write the results to this JSON file")


def _median_s(comm, call, args) -> float:
    """Median over repetitions of the slowest rank's seconds per call."""
    return statistics.median(float(time_per_call(comm, call, args.iters, args.warmup_iters).max())
                             for _ in range(args.repeats))


def _tensor_set(text: str) -> tuple:
    count, _, size = text.lower().partition("x")
    if not count.isdigit() or not size:
        raise SystemExit(f"--tensors item {text!r}: expected COUNTxSIZE such as 1000x4K")
    return int(count), parse_size(size)


def pack_unpack(comm, args) -> list:
    """Rows: pack, unpack, unpack with the average's divide, against memcpy of the bytes."""
    from mpidp.engine import host_ops
    from mpidp.engine.dtypes import F32
    rows = []
    for item in args.tensors.split(","):
        count, size = _tensor_set(item)
        tensors = [np.random.default_rng(i).integers(-8, 9, size // 4).astype(np.float32)
                   for i in range(count)]
        total = sum(t.nbytes for t in tensors)
        bucket = np.empty(total // 4, np.float32)
        src = np.ones_like(bucket)
        memcpy = _median_s(comm, lambda i: ctypes.memmove(bucket.ctypes.data, src.ctypes.data,
                                                          total), args)
        pack = _median_s(comm, lambda i: host_ops.pack(bucket, tensors), args)
        unpack = _median_s(comm, lambda i: host_ops.unpack(bucket, tensors, F32, 1), args)
        avg = _median_s(comm, lambda i: host_ops.unpack(bucket, tensors, F32, 2), args)
        gbps = {k: total / v / 1e9 for k, v in
                (("memcpy", memcpy), ("pack", pack), ("unpack", unpack), ("unpack_avg", avg))}
        rows.append({"tensors": count, "tensor_bytes": size, "bytes": total, "GBps": gbps,
                     "pack_unpack_of_memcpy": (2 * memcpy) / (pack + avg)})
    return rows


def fused_vs_separate(comm, args) -> dict:
    """``count`` float32 tensors of ``size`` bytes averaged: one grouped_allreduce_ (buckets)
    against one allreduce_ per tensor."""
    import mpidp
    size = parse_size(args.size)
    tensors = [np.random.default_rng(i).integers(-8, 9, max(1, size // 4)).astype(np.float32)
               for i in range(args.count)]
    fused = _median_s(comm, lambda i: mpidp.grouped_allreduce_(tensors, "avg", args.algorithm),
                      args)
    separate = _median_s(comm, lambda i: [mpidp.allreduce_(t, "avg", args.algorithm)
                                          for t in tensors], args)
    return {"tensors": args.count, "tensor_bytes": size, "fused_us": fused * 1e6,
            "separate_us": separate * 1e6, "speedup": separate / fused}


def main(args) -> int:
    import mpidp
    from mpidp.engine import host_ops
    g = mpidp.init()
    comm = g.comm
    rows = pack_unpack(comm, args)
    allreduce = fused_vs_separate(comm, args)
    if comm.Get_rank() == 0:
        print(f"# mpidp fusion benchmark: {comm.Get_size()} ranks, float32, host kernels "
              f"{host_ops.IMPLEMENTATION}, median of "
              f"{args.repeats} x {args.iters} calls (every rank copying at once)")
        print(f"{'tensors':>14} {'memcpy':>8} {'pack':>8} {'unpack':>8} {'unpack/n':>8} "
              f"{'pack+unpack/n vs memcpy':>24}   (GB/s)")
        for r in rows:
            b = r["GBps"]
            print(f"{r['tensors']:>7} x {format_size(r['tensor_bytes']):>4} {b['memcpy']:>8.2f} "
                  f"{b['pack']:>8.2f} {b['unpack']:>8.2f} {b['unpack_avg']:>8.2f} "
                  f"{100 * r['pack_unpack_of_memcpy']:>23.0f}%")
        a = allreduce
        print(f"all-reduce avg of {a['tensors']} x {format_size(a['tensor_bytes'])}: fused "
              f"{a['fused_us']:.0f} us, separate {a['separate_us']:.0f} us, "
              f"{a['speedup']:.1f}x")
        if args.json:
            files.write_json(args.json, {"ranks": comm.Get_size(), "pack_unpack": rows,
                                         "allreduce": allreduce, "argv": sys.argv},
                             what="benchmark results")
    return 0
