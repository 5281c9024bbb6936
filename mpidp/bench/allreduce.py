"""``python -m mpidp.bench allreduce``: an nccl-tests-style all-reduce sweep of mpidp's
algorithms against MPI_Allreduce and torch.distributed (gloo), out of place and in place."""
from __future__ import annotations

import argparse
import socket
import sys

import numpy as np

from .. import files
from ..algorithms import DEVICE, HOST, NAMES
from .harness import (
    Gloo,
    device_ceiling,
    link_ceiling,
    memory_ceiling,
    parse_size,
    rotation,
    stats,
    sweep,
    time_per_call)

ALGORITHMS = tuple(dict.fromkeys(  # mpidp's own (one table) and gloo, the baseline we measure
    NAMES[HOST] + ("gloo",) + NAMES[DEVICE]))
OURS = tuple(n for n in NAMES[HOST] + NAMES[DEVICE] if n != "mpi")  # mpi: MPI_Allreduce direct
DEFAULT_ALGORITHMS = {"cpu": "auto,shm,ring,mpi,gloo", "gpu": "ring,nccl,staged"}
DTYPES = {"float16": np.float16, "float32": np.float32, "float64": np.float64,
          "int32": np.int32, "int64": np.int64, "bfloat16": None}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("-b", "--minbytes", default="8", help="smallest size (default 8)")
    p.add_argument("-e", "--maxbytes", default="64M", help="largest size (default 64M)")
    p.add_argument("-f", "--stepfactor", type=int, default=4, help="size multiplier (default 4)")
    p.add_argument("-n", "--iters", type=int, default=20, help="timed iterations (default 20)")
    p.add_argument("-w", "--warmup_iters", type=int, default=5, help="warm-up iterations (default 5)")
    p.add_argument("-r", "--repeats", type=int, default=1,
                   help="repeat each measurement and keep the median (default 1)")
    p.add_argument("--dtype", default="float32", choices=sorted(DTYPES), help="default float32")
    p.add_argument("--op", default="sum", choices=("sum", "avg", "min", "max"), help="default sum")
    p.add_argument("--device", default="cpu", choices=("cpu", "gpu"),
                   help="where the buffers live (gpu: CuPy arrays, one GPU per rank)")
    p.add_argument("--algorithms", default=None,
                   help=f"comma-separated, from {','.join(ALGORITHMS)} (default "
                        f"{DEFAULT_ALGORITHMS['cpu']} on cpu, {DEFAULT_ALGORITHMS['gpu']} on gpu); "
                        "mpi is MPI_Allreduce itself, gloo torch.distributed over loopback, "
                        "nccl ncclAllReduce, staged the host path of a device buffer")
    p.add_argument("--buffers", type=_sets, default=None, metavar="N",
                   help="buffer sets each size rotates through, each a source and a "
                        "destination per rank (default: enough to fill 64 MiB, at most 64: "
                        "data from memory above a few hundred KiB; 3: data in cache up to "
                        "the cache's size, as a loop over a few tensors runs)")
    p.add_argument("--memory", default="ordinary", choices=("ordinary", "node"),
                   help="cpu buffers: ordinary arrays (default), or node: from mpidp.alloc, "
                        "which the node's ranks reach directly (Note [Node heap])")
    p.add_argument("--json", metavar="FILE", help="write every row and the ceiling as JSON")
    p.add_argument("--plot", metavar="FILE.png", help="plot busbw against size (needs matplotlib)")


def _sets(text: str) -> int:
    n = int(text)
    if n < 1:
        raise argparse.ArgumentTypeError(f"{text}: expected 1 or more buffer sets")
    return n


def _make(dtype: str, count: int, fill):
    """Host buffer of ``count`` elements (a torch tensor for bfloat16)."""
    if dtype == "bfloat16":
        import torch
        return torch.from_numpy(np.asarray(fill(count), dtype=np.float32)).to(torch.bfloat16)
    return np.asarray(fill(count), dtype=DTYPES[dtype])


def _in_node_memory(x):
    """``x`` copied into an array of mpidp.alloc's (``--memory node``)."""
    import mpidp
    out = mpidp.alloc(x.shape, x.dtype)
    out[...] = x
    return out


def _as_numpy(x):
    if isinstance(x, np.ndarray):
        return x
    if hasattr(x, "get"):  # CuPy
        return x.get()
    return x.float().cpu().numpy()


def _to_device(x):
    """The host buffer ``x`` on this rank's GPU (CuPy; bfloat16 as a torch CUDA tensor)."""
    if isinstance(x, np.ndarray):
        from mpidp.engine.gpu.device import cupy
        return cupy().asarray(x)
    return x.cuda()


def _mpi_spec(x):
    """What a user of mpi4py passes for ``x``: the array itself, or for 16-bit floats (no
    portable MPI type) a uint16 view, reduced by mpidp's kernel as an MPI user op."""
    from mpidp.engine.host_executor import mpi_buffer
    from mpidp.engine.dtypes import F16, BF16, as_host_array
    a = as_host_array(x)
    return mpi_buffer(a.flat, a.dtype) if a.dtype in (F16, BF16) else a.flat


def _runner(algo: str, comm, op: str, dtype: str, gloo):
    """(out_of_place(i), in_place(i)) for one algorithm over rotated buffer set i; None where
    the algorithm has no such mode."""
    import mpidp
    if algo in OURS:
        return (lambda s, d, sm, dm: mpidp.allreduce(s, op=op, algorithm=algo),
                lambda b, bm: mpidp.allreduce_(b, op=op, algorithm=algo))
    if algo == "mpi":
        from mpidp.runtime import mpi
        from mpidp.engine.host_executor import mpi_op
        from mpidp.engine.dtypes import DTYPE_NAMES, OP_CODES
        code = DTYPE_NAMES.index(dtype)
        mop = mpi_op(code, OP_CODES[op][0])
        n = comm.Get_size()

        out_of_place, in_place = (mpi.allreduce_bound(comm, mop, p) for p in (False, True))

        def finish(b):
            if op == "avg":
                b /= n
        def oop(s, d, sm, dm):
            out_of_place(sm, dm)
            finish(d)
        def ip(b, bm):
            in_place(bm)
            finish(b)
        return oop, ip
    if algo == "gloo":
        import torch
        def ip(b, bm):
            gloo.allreduce_(b if isinstance(b, torch.Tensor) else torch.from_numpy(b), op)
        return None, ip
    raise ValueError(f"unknown algorithm {algo!r}; accepted: {', '.join(ALGORITHMS)}")


def _expected(count: int, nranks: int, op: str, dtype: str):
    """Inputs rank r uses for the #wrong check, and the exact reduction of all of them."""
    base = np.arange(count, dtype=np.int64) % 13
    inputs = [(base + r) % 13 - 6 for r in range(nranks)]
    stack = np.stack(inputs) if count else np.zeros((nranks, 0))
    exact = {"sum": stack.sum(0), "min": stack.min(0), "max": stack.max(0),
             "avg": stack.sum(0) / nranks}[op]
    return inputs, exact


def _count_wrong(result, exact) -> int:
    got = _as_numpy(result).astype(np.float64)
    want = exact.astype(np.float64)
    tol = 1e-2 if got.dtype != want.dtype else 0
    return int(np.count_nonzero(np.abs(got - want) > tol * np.maximum(1, np.abs(want))))


def measure(comm, args, gloo) -> list:
    """Every (size, algorithm) row: out-of-place and in-place times across ranks, bandwidths,
    and #wrong from a separate exact check."""
    rank, n = comm.Get_rank(), comm.Get_size()
    itemsize = 2 if args.dtype == "bfloat16" else np.dtype(DTYPES[args.dtype]).itemsize
    sizes = sweep(parse_size(args.minbytes), parse_size(args.maxbytes), args.stepfactor, itemsize)
    algos = _algorithms(args)
    gpu = args.device == "gpu"
    place = _to_device if gpu else _in_node_memory if args.memory == "node" else (lambda x: x)
    sync = _device_sync() if gpu else None
    rows = []
    progress = _progress(len(sizes) * len(algos), rank)
    for nbytes in sizes:
        count = nbytes // itemsize
        sets = args.buffers or rotation(nbytes)  # --buffers is 1 or more where given
        rng = np.random.default_rng(rank)
        fill = lambda k: rng.integers(-4, 5, size=k)
        srcs = [place(_make(args.dtype, count, fill)) for _ in range(sets)]
        dsts = [place(_make(args.dtype, count, fill)) for _ in range(sets)]
        spec = _mpi_spec if "mpi" in algos else (lambda x: None)
        smpi, dmpi = [spec(x) for x in srcs], [spec(x) for x in dsts]
        inputs, exact = _expected(count, n, args.op, args.dtype)
        for algo in algos:
            oop, ip = _runner(algo, comm, args.op, args.dtype, gloo)
            row = {"size": nbytes, "count": count, "type": args.dtype, "redop": args.op,
                   "algorithm": algo, "nranks": n}
            for mode, fn in (("out_of_place", oop), ("in_place", ip)):
                if fn is None:
                    row[mode] = None
                    continue
                call = (lambda i: fn(srcs[i % sets], dsts[i % sets], smpi[i % sets], dmpi[i % sets])) \
                    if mode == "out_of_place" else (lambda i: fn(dsts[i % sets], dmpi[i % sets]))
                reps = [time_per_call(comm, call, args.iters, args.warmup_iters, sync)
                        for _ in range(args.repeats)]
                per_rank = np.median(np.stack(reps), axis=0)
                t = stats(per_rank)
                algbw = nbytes / t["avg"] / 1e9
                row_wrong = comm.allreduce(_count_wrong(
                    _check(fn, mode, args.dtype, inputs[rank], place, spec), exact))
                row[mode] = {"time_us": {k: v * 1e6 for k, v in t.items()}, "algbw_GBps": algbw,
                             "busbw_GBps": algbw * (2 * (n - 1) / n if n > 1 else 1.0),
                             "wrong": row_wrong}
            rows.append(row)
            progress.update(1)
    progress.close()
    return rows


def regime(args) -> str:
    """Where the data come from, as every table's header names it."""
    memory = ""
    if args.memory == "node":
        from mpidp.comm import node_memory
        memory = ("; buffers from mpidp.alloc (node memory)" if node_memory.offered() else
                  "; buffers from mpidp.alloc, which offers no node memory here (ordinary "
                  "arrays: Note [Node heap])")
    if args.buffers is None:
        return ("buffers rotated through up to 64 sets filling 64 MiB (data from memory "
                "where that overflows the cache)" + memory)
    return (f"buffers rotated through {args.buffers} set(s) (data in cache up to the cache's "
            f"size){memory}")


def _algorithms(args) -> list:
    algos = [a.strip() for a in (args.algorithms or DEFAULT_ALGORITHMS[args.device]).split(",")
             if a.strip()]
    for a in algos:
        if a not in ALGORITHMS:
            raise ValueError(f"unknown algorithm {a!r}; accepted: {', '.join(ALGORITHMS)}")
        if args.device == "gpu" and a in ("mpi", "gloo"):
            raise ValueError(f"algorithm {a!r} takes host buffers; on gpu use "
                             f"{DEFAULT_ALGORITHMS['gpu']}")
    return algos


def _device_sync():
    from mpidp.engine.gpu.device import cupy
    return cupy().cuda.Device().synchronize


def _check(fn, mode: str, dtype: str, values, place, spec):
    """Runs one call on known inputs and returns its result."""
    src = place(_make(dtype, len(values), lambda k: values))
    if mode == "in_place":
        fn(src, spec(src))
        return src
    dst = place(_make(dtype, len(values), lambda k: values))
    result = fn(src, dst, spec(src), spec(dst))
    return dst if result is None else result


def _progress(total: int, rank: int):
    from tqdm import tqdm
    return tqdm(total=total, desc="allreduce sweep", disable=rank != 0 or not sys.stderr.isatty(),
                leave=False)


def table(rows: list, ceiling: dict, nranks: int) -> str:
    """nccl-tests' columns, one line per (size, algorithm)."""
    head = (f"{'size':>10} {'count':>10} {'type':>8} {'redop':>5} {'algorithm':>9} | "
            f"{'out-of-place':^38} | {'in-place':^38}\n"
            f"{'(B)':>10} {'(elements)':>10} {'':>8} {'':>5} {'':>9} | "
            + f"{'time_us':>9} {'algbw':>7} {'busbw':>7} {'#wrong':>6} {'of max':>6} | " * 2)
    lines = [head.rstrip(" |")]
    bound = ceiling.get("bound_algbw_GBps", ceiling["copy_GBps"])
    for r in rows:
        cells = []
        for mode in ("out_of_place", "in_place"):
            m = r[mode]
            if m is None:
                cells.append(f"{'n/a':>9} {'':>7} {'':>7} {'':>6} {'':>6}")
            else:
                cells.append(f"{m['time_us']['avg']:9.1f} {m['algbw_GBps']:7.2f} "
                             f"{m['busbw_GBps']:7.2f} {m['wrong']:6d} "
                             f"{m['algbw_GBps'] / bound:6.0%}")
        lines.append(f"{r['size']:>10} {r['count']:>10} {r['type']:>8} {r['redop']:>5} "
                     f"{r['algorithm']:>9} | " + " | ".join(cells))
    busbw = bound * (2 * (nranks - 1) / nranks if nranks > 1 else 1)
    link = (f"; link between nodes {ceiling['link_GBps']:.2f} GB/s each way (bounds busbw; "
            f"one message {ceiling.get('link_one_message_GBps', 0):.2f}, "
            f"{ceiling.get('link_piece_bytes', 0) >> 10} KiB pieces "
            f"{ceiling.get('link_pieces_GBps', 0):.2f})" if "link_GBps" in ceiling else "")
    stream = (f" (with non-temporal stores {ceiling['stream_copy_GBps']:.2f})"
              if "stream_copy_GBps" in ceiling else "")
    lines.append(f"# ceiling: copy {ceiling['copy_GBps']:.2f} GB/s{stream}, add "
                 f"{ceiling['add_GBps']:.2f} "
                 f"GB/s per rank with {nranks} ranks at once{link}; all-reduce bound algbw "
                 f"{bound:.2f} GB/s, busbw {busbw:.2f} GB/s ('of max' = algbw / bound)")
    return "\n".join(lines)


def size_label(nbytes: float) -> str:
    """8 B, 4 KiB, 64 MiB: a power-of-two size as a person reads it."""
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= scale:
            return f"{nbytes / scale:g} {unit}"
    return f"{nbytes:g} B"


def plot(rows: list, ceiling: dict, nranks: int, path: str) -> None:
    """busbw (in place) against size, one line per algorithm, the ceiling drawn."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(8, 5))
    for algo in dict.fromkeys(r["algorithm"] for r in rows):
        pts = [(r["size"], r["in_place"]["busbw_GBps"]) for r in rows
               if r["algorithm"] == algo and r["in_place"]]
        if pts:
            ax.plot(*zip(*pts), marker="o", label=algo)
    factor = 2 * (nranks - 1) / nranks if nranks > 1 else 1
    bound = ceiling.get("bound_algbw_GBps", ceiling["copy_GBps"]) * factor
    # across nodes the line is the link as one large message measured it (a reference: the
    # pipelined all-reduce keeps both directions busier and can pass it); within a node, the
    # memory copy every all-reduce must make (a bound)
    label = f"link, one {size_label(ceiling['link_bytes'])} message ({bound:.1f} GB/s)" \
        if "link_GBps" in ceiling else f"memory bound ({bound:.1f} GB/s)"
    ax.axhline(bound, color="k", linestyle="--", label=label)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    from matplotlib.ticker import FuncFormatter, LogLocator
    ax.xaxis.set_major_locator(LogLocator(base=4))
    ax.xaxis.set_major_formatter(FuncFormatter(lambda x, _: size_label(x)))
    ax.set_xlabel("message size")
    ax.set_ylabel("busbw, in place (GB/s)")
    ax.set_title(f"all-reduce, {nranks} ranks, {rows[0]['type'] if rows else ''}")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    files.write_atomically(path, lambda f: fig.savefig(f, format="png", dpi=120), what="plot")
    plt.close(fig)


def main(args) -> int:
    import mpidp
    g = mpidp.init()
    if args.device == "gpu":
        from mpidp.engine.gpu.device import bind
        bind(g.local_rank)  # CuPy was not imported at init: bind now, before any buffer
    comm = g.comm
    rank, n = comm.Get_rank(), comm.Get_size()
    algos = _algorithms(args)
    host = comm.bcast(socket.gethostname(), root=0) if g.node_count > 1 else "127.0.0.1"
    gloo = Gloo(comm, host) if "gloo" in algos else None
    ceiling = memory_ceiling(comm) if args.device == "cpu" else device_ceiling(comm)
    if g.node_count > 1:
        ceiling.update(link_ceiling(g))
    rows = measure(comm, args, gloo)
    if gloo is not None:
        gloo.close()
    ctx = g.resources.shm() if g.single_node else None  # collective: every rank asks
    peers = ctx.mode_name if ctx is not None else "n/a"
    if rank == 0:
        print(f"# mpidp allreduce benchmark: {n} ranks, {g.node_count} node(s), {args.device}, "
              f"shm peers: "
              f"{peers}, dtype {args.dtype}, op {args.op}, "
              f"iters {args.iters}, warmup {args.warmup_iters}, repeats {args.repeats}; "
              f"{regime(args)}")
        print(table(rows, ceiling, n))
        if args.json:
            files.write_json(args.json, {"nranks": n, "nodes": g.node_count, "ceiling": ceiling,
                                         "rows": rows, "argv": sys.argv,
                                         "regime": regime(args)},
                             what="benchmark results")
        if args.plot:
            plot(rows, ceiling, n, args.plot)
    wrong = sum((r[m] or {}).get("wrong", 0) for r in rows for m in ("out_of_place", "in_place"))
    return 1 if wrong else 0
