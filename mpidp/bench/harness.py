"""Timing across ranks for mpidp's benchmarks: size sweeps with nccl-tests' flags, rotated
buffers, per-rank times reduced to min/avg/max, and the machine's memory-bandwidth ceiling."""
from __future__ import annotations

import re
import time
from typing import Optional, Callable, List, Sequence

import numpy as np

from ..runtime import mpi

_UNITS = {"": 1, "B": 1, "K": 1 << 10, "KB": 1 << 10, "KIB": 1 << 10, "M": 1 << 20,
          "MB": 1 << 20, "MIB": 1 << 20, "G": 1 << 30, "GB": 1 << 30, "GIB": 1 << 30}


def parse_size(text: str) -> int:
    """'8', '4K', '64M', '1G' (binary units, as nccl-tests) -> bytes."""
    m = re.fullmatch(r"\s*(\d+)\s*([A-Za-z]*)\s*", str(text))
    if not m or m.group(2).upper() not in _UNITS:
        raise ValueError(f"size {text!r}: expected a number with an optional K, M or G suffix")
    return int(m.group(1)) * _UNITS[m.group(2).upper()]


def format_size(nbytes: int) -> str:
    for unit, scale in (("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
        if nbytes >= scale and nbytes % scale == 0:
            return f"{nbytes // scale}{unit}"
    return f"{nbytes}B" if nbytes < 1024 else f"{nbytes}"


def sweep(minbytes: int, maxbytes: int, factor: int, itemsize: int) -> List[int]:
    """Sizes from minbytes to maxbytes multiplying by factor, rounded down to whole elements
    (at least one)."""
    if minbytes <= 0 or maxbytes < minbytes or factor < 2:
        raise ValueError(f"need 0 < -b ({minbytes}) <= -e ({maxbytes}) and -f ({factor}) >= 2")
    sizes, s = [], minbytes
    while s <= maxbytes:
        sizes.append(max(itemsize, s // itemsize * itemsize))
        s *= factor
    return sizes


def rotation(nbytes: int, budget_bytes: int = 64 << 20, cap: int = 64) -> int:
    """How many buffer sets to rotate through so that small sizes do not run from cache."""
    return max(1, min(cap, budget_bytes // max(nbytes, 1)))


def time_per_call(comm, call: Callable[[int], None], iters: int, warmup: int,
                  sync: Optional[Callable[[], None]] = None) -> np.ndarray:
    """Runs call(i) warmup + iters times between barriers; returns every rank's seconds per
    call (an array of comm size, the same on every rank). ``sync`` (a device's synchronize)
    runs after the warm-up and after the timed calls, inside the timing (as nccl-tests)."""
    for i in range(warmup):
        call(i)
    if sync is not None:
        sync()
    comm.Barrier()
    t0 = time.perf_counter()
    for i in range(iters):
        call(i)
    if sync is not None:
        sync()
    local = (time.perf_counter() - t0) / max(iters, 1)
    return np.array(comm.allgather(local))


def stats(values: Sequence[float]) -> dict:
    v = np.asarray(values, dtype=float)
    return {"min": float(v.min()), "avg": float(v.mean()), "max": float(v.max())}


def device_ceiling(comm, nbytes: int = 256 << 20, iters: int = 5) -> dict:
    """memory_ceiling's figures for each rank's GPU (CuPy copy and add, every rank at once)."""
    from mpidp.engine.gpu.device import cupy
    cp = cupy()
    n = nbytes // 4
    a, b, c = cp.ones(n, cp.float32), cp.ones(n, cp.float32), cp.empty(n, cp.float32)
    sync = cp.cuda.Device().synchronize
    copy_s = time_per_call(comm, lambda i: cp.copyto(c, a), iters, 1, sync)
    add_s = time_per_call(comm, lambda i: cp.add(a, b, out=c), iters, 1, sync)
    return {"bytes": nbytes, "copy_GBps": nbytes / copy_s.max() / 1e9,
            "add_GBps": nbytes / add_s.max() / 1e9}


def memory_ceiling(comm, nbytes: int = 256 << 20, iters: int = 5) -> dict:
    """Copy and add bandwidth (GB/s of bytes produced per rank) with every rank working at
    once, as ranks share the memory bus. An all-reduce must read each input once and write
    each output once — a copy's traffic — so the best copy rate bounds its algbw: numpy's
    copy, or a copy with non-temporal stores, which skips reading the destination first
    (Note [Streaming copy] in csrc/kernels.c; where the C extension is built)."""
    from ..engine import host_ops
    n = nbytes // 4
    a = np.ones(n, np.float32)
    b = np.ones(n, np.float32)
    c = np.empty(n, np.float32)
    copy_s = time_per_call(comm, lambda i: np.copyto(c, a), iters, 1)
    add_s = time_per_call(comm, lambda i: np.add(a, b, out=c), iters, 1)
    found = {"bytes": nbytes,
             "copy_GBps": nbytes / copy_s.max() / 1e9,
             "add_GBps": nbytes / add_s.max() / 1e9}
    ext = host_ops.EXTENSION
    if ext is not None:
        stream_s = time_per_call(comm, lambda i: ext.stream_copy(c, a), iters, 1)
        found["stream_copy_GBps"] = nbytes / stream_s.max() / 1e9
    found["bound_algbw_GBps"] = max(found["copy_GBps"], found.get("stream_copy_GBps", 0))
    return found


def link_ceiling(g, nbytes: int = 16 << 20, iters: int = 5, piece: int = 32 << 10) -> dict:
    """The network's bandwidth between nodes, GB/s each way: node 0's and node 1's first
    ranks swap ``nbytes`` both directions at once, the others wait; the better of one
    MPI_Sendrecv and a stream of ``piece``-byte messages posted together (over TCP, UCX moves
    many eager pieces faster than one large message: the link is at least the faster).
    Across nodes the link, not memory, bounds an all-reduce: nccl-tests' busbw is then at
    most this. Collective."""
    comm = g.comm
    leaders = [g.node_of.index(k) for k in (0, 1)]
    peer = {leaders[0]: leaders[1], leaders[1]: leaders[0]}.get(g.rank)
    a, b = np.ones(nbytes, np.uint8), np.empty(nbytes, np.uint8)

    def stream(i):
        reqs = []
        for at in range(0, nbytes, piece):
            reqs.append(mpi.irecv_bytes(comm, b[at:at + piece], peer, 78))
            reqs.append(mpi.isend_bytes(comm, a[at:at + piece], peer, 78))
        mpi.wait_all(reqs)

    rates = []
    for call in (lambda i: mpi.sendrecv_bytes(comm, a, peer, b, peer, 77), stream):
        t = time_per_call(comm, call if peer is not None else (lambda i: None), iters, 1)
        rates.append(nbytes / max(t[leaders[0]], t[leaders[1]]) / 1e9)
    link = max(rates)
    nodes = g.node_count
    return {"link_bytes": nbytes, "link_GBps": link, "link_one_message_GBps": rates[0],
            "link_piece_bytes": piece, "link_pieces_GBps": rates[1],
            "bound_algbw_GBps": link * nodes / (2 * (nodes - 1))}


class Gloo:
    """torch.distributed on gloo (over loopback on one node; across nodes to ``host``, rank
    0's host name): a reference column only. With ``backend_group``, ``mpidp_group`` is a
    group of every rank on the mpidp torch.distributed backend (mpidp.backend)."""

    def __init__(self, comm, host: str = "127.0.0.1", backend_group: bool = False):
        import torch.distributed as dist
        port = comm.bcast(free_port() if comm.Get_rank() == 0 else None, root=0)
        dist.init_process_group("gloo", init_method=f"tcp://{host}:{port}",
                                rank=comm.Get_rank(), world_size=comm.Get_size())
        self.dist = dist
        self.mpidp_group = dist.new_group(backend="mpidp") if backend_group else None

    def allreduce_(self, tensor, op: str):
        d = self.dist
        red = {"sum": d.ReduceOp.SUM, "min": d.ReduceOp.MIN, "max": d.ReduceOp.MAX,
               "avg": d.ReduceOp.SUM}[op]
        d.all_reduce(tensor, op=red)
        if op == "avg":
            tensor /= d.get_world_size()

    def close(self):
        self.dist.destroy_process_group()


def free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
