"""``python -m mpidp.bench kernels``: bandwidth of mpidp's GPU kernels (mpidp/engine/gpu/kernels/*.cu)
against a device-to-device copy of the same buffer, timed with CUDA events (one GPU, one
process). A reduction moves 3 bytes (read two, write one) per byte of buffer and a copy 2:
both are reported as bytes moved per second, and "of copy" is the ratio."""
from __future__ import annotations

import argparse

import numpy as np

from .. import files
from ..engine.dtypes import BF16, DTYPE_NAMES, FLOATING, OP_SUM, OPS, OP_CODES
from .harness import parse_size

KERNELS = ("reduce", "reduce+avg", "divide", "pack", "unpack+avg")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--sizes", default="1M,16M,64M,256M", help="buffer sizes (bytes)")
    p.add_argument("--dtypes", default="float32,float16,bfloat16,float64")
    p.add_argument("--ops", default="sum,min,max", help=f"reduce ops, from {','.join(OPS)}")
    p.add_argument("-n", "--iters", type=int, default=20, help="timed launches per row")
    p.add_argument("--tensors", type=int, default=64, help="tensors per bucket for pack/unpack")
    p.add_argument("--json", metavar="FILE", help="write the rows as JSON")


def _time_ms(cp, fn, iters: int) -> float:
    fn()  # warm-up (and compilation)
    start, stop = cp.cuda.Event(), cp.cuda.Event()
    start.record()
    for _ in range(iters):
        fn()
    stop.record()
    stop.synchronize()
    return cp.cuda.get_elapsed_time(start, stop) / iters


def measure(args) -> list:
    from ..engine.gpu.device import bind, cupy
    from ..engine.gpu.ops import DeviceOps
    cp = cupy()
    bind(0)
    stream = cp.cuda.get_current_stream()
    ops = DeviceOps(stream)
    rows = []
    for size_text in args.sizes.split(","):
        nbytes = parse_size(size_text)
        for name in args.dtypes.split(","):
            dtype = DTYPE_NAMES.index(name)
            storage = np.uint16 if dtype == BF16 else np.dtype(name)
            count = nbytes // np.dtype(storage).itemsize
            one = cp.full(count, 0x3F80, cp.uint16) if dtype == BF16 else cp.ones(count, storage)
            a, b = one, one.copy()  # 1.0 (bfloat16's bits for 1.0 are 0x3F80)
            copy_ms = _time_ms(cp, lambda: cp.copyto(a, b), args.iters)
            copy_gbps = 2 * nbytes / copy_ms / 1e6
            cases = [(f"reduce {op}", 3, lambda op=op: ops.reduce_into(a, b, dtype, OP_CODES[op][0]))
                     for op in args.ops.split(",") if op != "avg"]
            if dtype in FLOATING:
                cases += [("reduce sum+avg", 3, lambda: ops.reduce_into(a, b, dtype, OP_SUM, 3)),
                          ("divide", 2, lambda: ops.divide(a, dtype, 3))]
            parts = [b[i::args.tensors][: count // args.tensors].copy()
                     for i in range(args.tensors)]
            bucket = cp.empty(sum(len(p) for p in parts), storage)
            cases.append(("pack", 2, lambda: ops.pack(bucket, parts)))
            if dtype in FLOATING:
                cases.append(("unpack+avg", 2, lambda: ops.unpack(bucket, parts, dtype, 3)))
            for label, passes, fn in cases:
                ms = _time_ms(cp, fn, args.iters)
                gbps = passes * nbytes / ms / 1e6
                rows.append({"size": nbytes, "type": name, "kernel": label, "time_ms": ms,
                             "GBps": gbps, "copy_GBps": copy_gbps, "of_copy": gbps / copy_gbps})
    return rows


def table(rows: list) -> str:
    lines = [f"{'size':>10} {'type':>9} {'kernel':>15} {'time_ms':>9} {'GB/s':>8} "
             f"{'copy GB/s':>9} {'of copy':>7}"]
    for r in rows:
        lines.append(f"{r['size']:>10} {r['type']:>9} {r['kernel']:>15} {r['time_ms']:9.3f} "
                     f"{r['GBps']:8.1f} {r['copy_GBps']:9.1f} {r['of_copy']:7.0%}")
    return "\n".join(lines)


def main(args) -> int:
    from ..engine.gpu.device import cupy
    cp = cupy()
    rows = measure(args)
    props = cp.cuda.runtime.getDeviceProperties(cp.cuda.Device().id)
    print(f"# mpidp GPU kernel benchmark: {props['name'].decode()}, iters {args.iters}")
    print(table(rows))
    if args.json:
        files.write_json(args.json, {"device": props["name"].decode(), "rows": rows},
                         what="benchmark results")
    return 0
