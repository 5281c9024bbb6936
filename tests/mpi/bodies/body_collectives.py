"""Run under mpiexec at any world size: every collective, algorithm, dtype, op and edge count,
checked exactly against numpy, bitwise equal across ranks; then bad inputs on one rank or all,
each reported on every rank, with the runtime usable afterwards. Prints 'ok <rank>' at the end.
BODY_EXPECT_C_EXCHANGE=1 (each rank a node): the one C call across nodes must have been made."""
import os
import sys

import numpy as np
import torch

import mpidp
from mpidp.errors import MismatchError

g = mpidp.init()
rank, n = mpidp.rank(), mpidp.size()
failures = []
ALGOS = os.environ.get("BODY_ALGORITHMS", "auto,shm,ring,hier,mpi,doubling").split(",")
if not g.single_node:
    ALGOS = [a for a in ALGOS if a != "shm"]
BIG = int(os.environ.get("BODY_BIG_COUNT", str(3 << 20)))  # 12 MiB of float32 by default


def expect(cond, what):
    if not cond:
        failures.append(what)


if os.environ.get("BODY_EXPECT_C_EXCHANGE"):  # each rank a node: the one C call was made
    expect(g.resources.c_exchange is not None, "no C exchange across nodes (csrc/exchange.c)")


def inputs(count, q, dtype, seed):
    """Small integers, fresh per call, different on every rank, exact in any order."""
    rng = np.random.default_rng(seed * 1000 + q)
    return rng.integers(-8, 9, size=count).astype(dtype)


def bitwise_same_everywhere(arr, what):
    raw = np.ascontiguousarray(arr).view(np.uint8).reshape(-1)
    everyone = g.comm.allgather(raw.tobytes())
    expect(all(e == everyone[0] for e in everyone), f"{what}: differs between ranks")


NP_DTYPES = [np.float16, np.float32, np.float64, np.int32, np.int64]
COUNTS = sorted({0, 1, n - 1 if n > 1 else 1, n + 1, 7 * n + 3, 1000, 5000, 70001})
seed = 0
for algo in ALGOS:
    for dtype in NP_DTYPES:
        for count in COUNTS:
            for op in ("sum", "avg", "min", "max"):
                if op == "avg" and np.dtype(dtype).kind == "i":
                    continue
                seed += 1
                every = [inputs(count, q, dtype, seed) for q in range(n)]
                stack = np.stack(every).astype(np.float64)
                want = {"sum": stack.sum(0), "avg": stack.sum(0) / n, "min": stack.min(0),
                        "max": stack.max(0)}[op].astype(dtype)
                x = every[rank].copy()
                got = mpidp.allreduce(x, op=op, algorithm=algo)
                what = f"{algo} {np.dtype(dtype).name}[{count}] {op}"
                expect(np.array_equal(x, every[rank]), f"{what}: input modified")
                expect(type(got) is np.ndarray and got.dtype == dtype and got.shape == x.shape,
                       f"{what}: wrong type/shape")
                expect(np.array_equal(got, want), f"{what}: wrong values")
                y = every[rank].copy()
                ret = mpidp.allreduce_(y, op=op, algorithm=algo)
                expect(ret is y and np.array_equal(y, want), f"{what} in place: wrong values")
                bitwise_same_everywhere(got, what)
    # tens of MiB, in place, float32 sum (a random shape: counts agree, shape too)
    seed += 1
    every = [inputs(BIG, q, np.float32, seed) for q in range(n)]
    want = np.sum(np.stack(every), axis=0, dtype=np.float32)
    big = every[rank].copy()
    mpidp.allreduce_(big, algorithm=algo)
    expect(np.array_equal(big, want), f"{algo} float32[{BIG}] in place: wrong values")
    bitwise_same_everywhere(big, f"{algo} big")

# torch tensors, bfloat16 included, and multi-dimensional shapes
for algo in ALGOS:
    for tdtype in (torch.bfloat16, torch.float16, torch.float32, torch.int64):
        seed += 1
        every = [torch.from_numpy(inputs(3 * 5 * 7, q, np.float32, seed)).reshape(3, 5, 7)
                 .to(tdtype) for q in range(n)]
        want = torch.stack(every).to(torch.float64).sum(0).to(tdtype)
        got = mpidp.allreduce(every[rank].clone(), algorithm=algo)
        expect(isinstance(got, torch.Tensor) and got.dtype == tdtype and got.shape == (3, 5, 7),
               f"torch {tdtype} {algo}: wrong type/shape")
        expect(torch.equal(got, want), f"torch {tdtype} {algo}: wrong values")
        t = every[rank].clone().requires_grad_(tdtype.is_floating_point)
        with torch.no_grad():
            mpidp.allreduce_(t, algorithm=algo)
        expect(torch.equal(t.detach(), want), f"torch {tdtype} {algo} in place: wrong values")

# non-contiguous in-place views are reduced and written back
seed += 1
base = inputs(6 * 8, rank, np.float32, seed).reshape(6, 8)
everyone = g.comm.allgather(base)
view = base[:, ::2]
mpidp.allreduce_(view)
want = np.sum([e[:, ::2] for e in everyone], axis=0)
expect(np.array_equal(base[:, ::2], want), "non-contiguous numpy view: wrong values")
expect(np.array_equal(base[:, 1::2], everyone[rank][:, 1::2]), "non-contiguous: touched others")
tb = torch.arange(24, dtype=torch.float32).reshape(4, 6) + rank
tv = tb.t()
mpidp.allreduce_(tv)
expect(torch.equal(tb, sum(torch.arange(24, dtype=torch.float32).reshape(4, 6) + q
                           for q in range(n))), "non-contiguous torch view: wrong values")

# Note [Summation order] (csrc/shm.c): on one node the sum is added in rank order whoever
# owns the slice, so it does not depend on how a buffer is split (bucket layout)
if g.single_node and "shm" in ALGOS:
    rng = np.random.default_rng(100 + rank)
    x = rng.standard_normal(100_003).astype(np.float32)  # not small integers: order shows
    whole = mpidp.allreduce(x, algorithm="shm")
    parts = [mpidp.allreduce(x[lo:hi].copy(), algorithm="shm")
             for lo, hi in ((0, 37_001), (37_001, 99_000), (99_000, 100_003))]
    expect(np.array_equal(whole, np.concatenate(parts)), "shm sum depends on the split")
    everyone = mpidp.allgather(x.reshape(1, -1))
    in_order = everyone[0].copy()
    for q in range(1, n):
        in_order += everyone[q]
    expect(np.array_equal(whole, in_order), "shm sum is not in rank order")

# buffers from mpidp.alloc (Note [Node heap] in csrc/heap.c): the same bits as ordinary arrays,
# on every rank or some; where peers reach each other by cross-memory attach, shm's sliced calls
# load and store a peer's node memory directly: one of its mappings used per peer per call
from mpidp.engine import host_ops  # noqa: E402
from mpidp.engine.shm import PEERS_CMA  # noqa: E402
ext = host_ops.EXTENSION
shm_ctx = g.resources.shm() if ext is not None else None
from mpidp.comm import node_memory  # noqa: E402
# peers reached by cross-memory attach, and node memory offered (Note [Node heap])
direct = (shm_ctx is not None and shm_ctx.size > 1 and shm_ctx.peers == PEERS_CMA and
          node_memory.offered())
stats = ext.heap_stats if ext is not None else (lambda: (0, 0))
for algo in ALGOS:
    for dtype, count in ((np.float32, 70001), (np.float64, 5000), (np.int32, 1 << 20)):
        for owners in ("every rank", "rank 0"):
            seed += 1
            every = [inputs(count, q, dtype, seed) for q in range(n)]
            want = np.sum(np.stack(every), axis=0, dtype=dtype)
            mine = owners == "every rank" or rank == 0
            x = mpidp.alloc((count,), dtype) if mine else np.zeros(count, dtype)
            expect(type(x) is np.ndarray and x.dtype == dtype and not x.any(),
                   "mpidp.alloc: a zeroed numpy array")
            x[:] = every[rank]
            before = stats()
            got = mpidp.allreduce(x, algorithm=algo)
            mpidp.allreduce_(x, algorithm=algo)
            used = stats()[1] - before[1]
            what = f"node memory on {owners}, {algo} {np.dtype(dtype).name}[{count}]"
            expect(np.array_equal(got, want) and np.array_equal(x, want), f"{what}: wrong values")
            bitwise_same_everywhere(x, what)
            # out of place the peers' inputs, in place their buffers: once per peer each
            peers_in_node_memory = (n - 1 if owners == "every rank" else 0 if rank == 0 else 1)
            if algo == "shm" or not direct:  # (auto and hier may or may not go through shm)
                expected = 2 * peers_in_node_memory if direct else 0
                expect(used == expected, f"{what}: {used} direct uses of peers' memory, "
                                         f"expected {expected}")
# blocks freed and allocated again (a reused descriptor number names a new block, checked by
# its inode), more of them than a rank keeps mapped (128: the oldest evicted), torch dtypes;
# each new block is mapped by every peer once, in its first call
algo = "shm" if "shm" in ALGOS else "auto"
for k in range(130):
    t = mpidp.alloc((3, 40000), torch.bfloat16 if k % 2 else torch.float32)
    t += rank + k % 16  # sums exact in bfloat16 too
    before = stats()
    mpidp.allreduce_(t, algorithm=algo)
    mapped, used = (a - b for a, b in zip(stats(), before))
    expect(isinstance(t, torch.Tensor) and t.shape == (3, 40000) and
           torch.equal(t, torch.full_like(t, n * (k % 16) + n * (n - 1) // 2)),
           f"mpidp.alloc block {k} ({t.dtype}): wrong values")
    if algo == "shm" or not direct:
        want = n - 1 if direct and algo == "shm" else 0
        expect(mapped == used == want, f"mpidp.alloc block {k}: {mapped} peers' blocks mapped "
                                       f"and {used} used, expected {want} of each")
    del t

# broadcast, allgather, reduce_scatter
for root in range(n):
    seed += 1
    every = [inputs(11, q, np.int64, seed).reshape(11) for q in range(n)]
    x = every[rank].copy()
    out = mpidp.broadcast(x, root=root)
    expect(np.array_equal(out, every[root]) and np.array_equal(x, every[rank]),
           f"broadcast root={root}")
    mpidp.broadcast_(x, root=root)
    expect(np.array_equal(x, every[root]), f"broadcast_ root={root}")
for root in range(n):
    for dtype, op in ((np.float32, "sum"), (np.float64, "avg"), (np.int32, "max"),
                      (np.float16, "min")):
        seed += 1
        every = [inputs(13, q, dtype, seed) for q in range(n)]
        stack = np.stack(every).astype(np.float64)
        want = {"sum": stack.sum(0), "avg": stack.sum(0) / n, "max": stack.max(0),
                "min": stack.min(0)}[op].astype(dtype)
        x = every[rank].copy()
        mpidp.reduce_(x, root=root, op=op)
        expect(np.array_equal(x, want if rank == root else every[rank]),
               f"reduce_ root={root} {np.dtype(dtype).name} {op}")
tr = torch.full((3,), float(rank + 1))
mpidp.reduce_(tr, root=0)
expect(rank != 0 or torch.equal(tr, torch.full((3,), n * (n + 1) / 2)), "reduce_ torch")
tb = torch.full((2, 3), float(rank), dtype=torch.bfloat16)
mpidp.broadcast_(tb, root=n - 1)
expect(torch.equal(tb, torch.full((2, 3), float(n - 1), dtype=torch.bfloat16)), "broadcast_ bf16")

seed += 1
rows = [(q % 3) + (1 if q == 0 else 0) for q in range(n)]  # uneven, some ranks empty
every = [inputs(rows[q] * 4, q, np.float64, seed).reshape(rows[q], 4) for q in range(n)]
got = mpidp.allgather(every[rank])
expect(np.array_equal(got, np.concatenate(every)), "allgather uneven rows")
got = mpidp.allgather(torch.tensor([[rank, rank]], dtype=torch.int32))
expect(torch.equal(got, torch.tensor([[q, q] for q in range(n)], dtype=torch.int32)),
       "allgather torch")

for algo in ("auto", "ring", "mpi"):
    for dim0 in sorted({1, max(n - 1, 1), n, 2 * n + 1, 10}):
        for op in ("sum", "avg", "max"):
            seed += 1
            every = [inputs(dim0 * 3, q, np.float32, seed).reshape(dim0, 3) for q in range(n)]
            stack = np.stack(every).astype(np.float64)
            full = {"sum": stack.sum(0), "avg": stack.sum(0) / n, "max": stack.max(0)}[op]
            want = np.array_split(full.astype(np.float32), n)[rank]
            got = mpidp.reduce_scatter(every[rank], op=op, algorithm=algo)
            expect(got.shape == want.shape and np.array_equal(got, want),
                   f"reduce_scatter {algo} dim0={dim0} {op}: got {got.shape} want {want.shape}")


# bad input: reported on every rank, never a hang, runtime usable afterwards
def rejected(call, kinds, what):
    try:
        call()
    except kinds as exc:
        return str(exc)
    except Exception as exc:  # noqa: BLE001 - recorded as a failure below
        failures.append(f"{what}: raised {type(exc).__name__}: {exc}")
        return ""
    failures.append(f"{what}: did not raise")
    return ""


ok = np.ones(4, np.float32)
msg = rejected(lambda: mpidp.allreduce(np.ones(4, np.uint8)), TypeError, "uint8 on all ranks")
expect("uint8" in msg and "float32" in msg, f"dtype message lists accepted: {msg}")
msg = rejected(lambda: mpidp.allreduce(ok, op="prod"), ValueError, "unknown op")
expect("'prod'" in msg and "sum, avg, min, max" in msg, f"op message: {msg}")
msg = rejected(lambda: mpidp.allreduce(ok, algorithm="tree"), ValueError, "unknown algorithm")
expect("'tree'" in msg and "ring" in msg, f"algorithm message: {msg}")
rejected(lambda: mpidp.allreduce(np.ones(3, np.int32), op="avg"), ValueError, "avg on ints")
rejected(lambda: mpidp.allreduce([1, 2, 3]), TypeError, "a list")
rejected(lambda: mpidp.broadcast(ok, root=n), ValueError, "root out of range")
if n > 1:
    for algo in ALGOS:
        # 10 vs 11 floats: MPICH alone gives a wrong sum on one rank and truncation on another
        msg = rejected(lambda: mpidp.allreduce(np.ones(10 + (rank == 1), np.float32),
                                               algorithm=algo), MismatchError, f"count {algo}")
        expect("rank 1" in msg and "[11]" in msg and "[10]" in msg, f"count message: {msg}")
        # in the records on rank 0, a record with data after it on rank 1 (across nodes)
        msg = rejected(lambda: mpidp.allreduce_(np.ones(10 if rank == 0 else 1 << 15,
                                                        np.float32), algorithm=algo),
                       MismatchError, f"inline against chunked {algo}")
        expect("[32768]" in msg and "[10]" in msg, f"inline against chunked: {msg}")
        msg = rejected(lambda: mpidp.allreduce(np.ones(3 << 20, np.float32 if rank else np.float64),
                                               algorithm=algo), MismatchError, f"dtype {algo}")
        expect("float64" in msg and "float32" in msg, f"dtype mismatch message: {msg}")
    rejected(lambda: mpidp.allreduce(np.ones(5, np.float32) if rank else np.ones(5, np.uint8)),
             (TypeError, MismatchError), "bad dtype on rank 0 only")
    rejected(lambda: mpidp.allreduce(ok, op="max" if rank else "sum"), MismatchError, "op differs")
    rejected(lambda: mpidp.allreduce(ok, algorithm="ring" if rank else "mpi"), MismatchError,
             "algorithm differs")
    rejected(lambda: mpidp.allreduce(np.ones((2, 3), np.float32) if rank else
                                     np.ones((3, 2), np.float32)), MismatchError, "shape differs")
    rejected(lambda: (mpidp.broadcast(ok) if rank else mpidp.allreduce(ok)), MismatchError,
             "different collectives")
    rejected(lambda: mpidp.allgather(np.ones((2, 3 + (rank == 1)), np.float32)), MismatchError,
             "allgather row shapes differ")
    rejected(lambda: mpidp.broadcast(np.ones(4 + rank, np.float32)), MismatchError,
             "broadcast sizes differ")
    msg = rejected(lambda: mpidp.reduce_(ok.copy(), root=min(rank, 1)), MismatchError,
                   "reduce roots differ")
    expect("different roots" in msg and "rank 1 root=1" in msg, f"reduce root message: {msg}")
rejected(lambda: mpidp.reduce_(ok.copy(), root=-1), ValueError, "reduce root out of range")
after = mpidp.allreduce(np.full(3, rank + 1, np.float32))
expect(np.array_equal(after, np.full(3, n * (n + 1) / 2, np.float32)), "usable after errors")

# every rank reports after every collective has run
results = g.comm.allgather(failures)
if rank == 0:
    for r, fs in enumerate(results):
        for f in fs[:20]:
            print(f"FAIL rank {r}: {f}", flush=True)
g.comm.Barrier()
print(f"ok {rank}" if not any(results) else f"failed {rank}", flush=True)
sys.exit(1 if any(results) else 0)
