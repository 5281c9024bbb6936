"""Issue 32, item 3: what each way of moving bytes costs on this node, every rank at once, in
one launch: numpy's copy (reads the destination before writing it), the non-temporal copy
(Note [Streaming copy] in csrc/kernels.c), and the kernel's cross-memory-attach copy into a
peer's buffer (process_vm_writev, what the shm all-reduce writes its results with) and out of
it (process_vm_readv, how it reads the peer's input), each into a destination written before
(no page faults); the all-reduce's own read pattern (the peer's 256 KiB chunks into one
cache-resident scratch) by CMA and by a user-space copy; and the in-place shm all-reduce of the
same size beside them, of an ordinary buffer and of one from mpidp.alloc (Note [Node heap] in
csrc/heap.c: the peer's stores land in it directly). Which copy the all-reduce runs at says
where its time goes.

    mpiexec -n 2 python bench/collectives/copy_kinds.py [--size 32M] [--repeats 5]
"""
import argparse
import ctypes
import os

import numpy as np

import mpidp
from mpidp.bench.harness import parse_size, time_per_call
from mpidp.engine import host_ops


class IoVec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--size", default="32M")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--chunk", default="256K", help="the chunked kinds' unit (the sliced "
                   "protocol's MPIDP_SHM_CHUNK_BYTES, 256K by default)")
    args = p.parse_args()
    g = mpidp.init()
    comm, rank, n = g.comm, g.rank, g.size
    assert n == 2, "two ranks: each copies into the other"
    nbytes = parse_size(args.size)
    ext = host_ops.extension()
    libc = ctypes.CDLL(None, use_errno=True)
    for f in (libc.process_vm_writev, libc.process_vm_readv):
        f.restype = ctypes.c_ssize_t
        f.argtypes = [ctypes.c_int, ctypes.POINTER(IoVec), ctypes.c_ulong,
                      ctypes.POINTER(IoVec), ctypes.c_ulong, ctypes.c_ulong]
    src = np.ones(nbytes, np.uint8)
    dst = np.zeros(nbytes, np.uint8)  # written once: its pages exist
    target = np.zeros(nbytes, np.uint8)  # what the peer writes into and reads from
    peer = 1 - rank
    peer_pid, peer_addr = comm.sendrecv((os.getpid(), target.ctypes.data), peer)
    ext.set_ptracer(peer_pid)
    comm.Barrier()
    local = IoVec(src.ctypes.data, nbytes)
    into = IoVec(dst.ctypes.data, nbytes)
    remote = IoVec(peer_addr, nbytes)

    def cma(fn, mine):
        def call(i):
            got = fn(peer_pid, ctypes.byref(mine), 1, ctypes.byref(remote), 1, 0)
            if got != nbytes:
                raise OSError(ctypes.get_errno(), f"{fn.__name__}: {got}")
        return call

    chunk = parse_size(args.chunk)
    scratch = np.zeros(chunk, np.uint8)
    pieces = [(IoVec(scratch.ctypes.data, chunk), IoVec(peer_addr + at, chunk))
              for at in range(0, nbytes - chunk + 1, chunk)]

    def cma_chunks(i):  # the all-reduce's reads: the peer's chunks into one hot scratch
        for mine, theirs in pieces:
            if libc.process_vm_readv(peer_pid, ctypes.byref(mine), 1, ctypes.byref(theirs), 1,
                                     0) != chunk:
                raise OSError(ctypes.get_errno(), "process_vm_readv")

    def copy_chunks(i):  # the same pattern as a user-space copy of one's own buffer
        for at in range(0, nbytes - chunk + 1, chunk):
            np.copyto(scratch, src[at:at + chunk])

    buf = np.ones(nbytes // 4, np.float32)
    node_buf = mpidp.alloc(nbytes // 4, np.float32)  # Note [Node heap]: peers store into it
    node_buf[:] = 1
    kinds = {"numpy copy": lambda i: np.copyto(dst, src),
             "non-temporal copy": lambda i: ext.stream_copy(dst, src),
             "CMA write into the peer": cma(libc.process_vm_writev, local),
             "CMA read from the peer": cma(libc.process_vm_readv, into),
             f"numpy copy, {args.chunk} chunks into one hot scratch": copy_chunks,
             f"CMA read, {args.chunk} chunks into one hot scratch": cma_chunks,
             "shm all-reduce, in place": lambda i: mpidp.allreduce_(buf, "sum",
                                                                    algorithm="shm"),
             "shm all-reduce, in place, buffer from mpidp.alloc":
                 lambda i: mpidp.allreduce_(node_buf, "sum", algorithm="shm")}
    rates = {k: [] for k in kinds}
    for _ in range(args.repeats):
        for name, call in kinds.items():  # the kinds take turns: drift is shared
            seconds = time_per_call(comm, call, args.iters, 2).max()
            rates[name].append(nbytes / seconds / 1e9)
    if rank == 0:
        best = np.median(rates["non-temporal copy"])
        print(f"{n} ranks at once, {nbytes >> 20} MiB each, medians of {args.repeats} x "
              f"{args.iters} calls (GB/s of bytes moved per rank, each byte counted once)")
        print("| kind | GB/s | of the non-temporal copy |\n|---|---|---|")
        for name, r in rates.items():
            print(f"| {name} | {np.median(r):.2f} ({min(r):.2f}-{max(r):.2f}) | "
                  f"{np.median(r) / best:.0%} |")
    mpidp.shutdown()


if __name__ == "__main__":
    main()
