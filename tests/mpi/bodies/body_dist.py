"""Run under mpiexec at any world size, without MASTER_ADDR: torch.distributed on the "mpidp"
backend — the store over MPI, every collective with torch's semantics (exact: small integers),
async work and futures, point-to-point, sub-groups, cross-rank errors — and torch's own clients
on it: DistributedDataParallel against one process on the concatenated batch,
ZeroRedundancyOptimizer against the unsharded optimizer, torch.distributed.checkpoint.
Prints 'ok <rank>'."""
import os
import shutil
import sys
import tempfile
import time
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn

from mpidp.errors import MismatchError

assert "MASTER_ADDR" not in os.environ, "this body tests the rendezvous without MASTER_ADDR"
torch.set_num_threads(1)
dist.init_process_group("mpidp")
rank, n = dist.get_rank(), dist.get_world_size()
R = dist.ReduceOp
failures = []


def expect(cond, what):
    if not cond:
        failures.append(what)


def equal(a, b, what):
    expect(a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b),
           f"{what}: got {a.tolist()} ({a.dtype}), expected {b.tolist()} ({b.dtype})")


def raises(kind, fn, what, text=""):
    try:
        fn()
    except kind as exc:
        expect(text in str(exc), f"{what}: message {exc!s} lacks {text!r}")
        return exc
    except Exception as exc:  # noqa: BLE001
        failures.append(f"{what}: raised {type(exc).__name__}: {exc}")
        return exc
    failures.append(f"{what}: did not raise")


def values(r, dtype=torch.int64, count=5):
    """Rank r's input: small integers, different on every rank."""
    return (torch.arange(count) % 3 + r + 1).to(dtype)


expect(dist.get_backend() == "mpidp", f"backend {dist.get_backend()}")

# ---- the store over MPI ------------------------------------------------------------------
store = dist.distributed_c10d._get_default_store()
store.set(f"key{rank}", f"value{rank}")
expect(store.add("counter", rank + 1) >= rank + 1, "store add")
dist.barrier()
expect(store.get(f"key{(rank + 1) % n}") == f"value{(rank + 1) % n}".encode(), "store get")
expect(int(store.get("counter")) == n * (n + 1) // 2, "store add total")
expect(store.check([f"key{r}" for r in range(n)]), "store check")
if rank == n - 1:
    store.set("late", "here")
store.wait(["late"], timedelta(seconds=60))
expect(store.get("late") == b"here", "store wait")
dist.barrier()
raises(ValueError, lambda: store.add(f"key{rank}", 1), "add to a value that is no number",
       "mpidp store: add")
if rank == 0:
    expect(store.compare_set("cas", "", "first") == b"first", "compare_set on a missing key")
    expect(store.compare_set("cas", "other", "second") == b"first", "compare_set refused")
dist.barrier()

# every method torch's Store has, through the PrefixStore torch puts in front (Note [What torch
# calls on a store written in Python] in mpidp/backend/store.py) and on mpidp's store directly
mine = store
while isinstance(mine, dist.PrefixStore):
    mine = mine.underlying_store
expect(type(mine).__name__ == "MPIStore", f"the store under the prefix: {type(mine).__name__}")
expect(store.timeout == dist.distributed_c10d.default_pg_timeout == mine.timeout,
       f"store timeout {store.timeout}, {mine.timeout}: expected the group's")
store.set(f"del{rank}", "x")
expect(store.delete_key(f"del{rank}") is True, "delete_key of a key")
expect(store.delete_key(f"del{rank}") is False, "delete_key of a deleted key")
expect(not store.check([f"del{rank}"]), "check after delete_key")
expect(mine.delete_key(f"nothing{rank}") is False, "delete_key on mpidp's store directly")
dist.barrier()
before = store.num_keys()
expect(before == mine.num_keys() and before >= n + 3, f"num_keys {before}")
dist.barrier()
if rank == 0:
    store.set("counted1", "1")
    store.set("counted2", "2")
dist.barrier()
expect(store.num_keys() == before + 2, f"num_keys after 2 sets: {store.num_keys()} - {before}")
dist.barrier()
if rank == 0:
    store.delete_key("counted1")
dist.barrier()
expect(store.num_keys() == before + 1, f"num_keys after delete: {store.num_keys()} - {before}")
dist.barrier()  # every rank has counted before any adds the keys below
store.append(f"app{rank}", "ab")
store.append(f"app{rank}", b"cd")
mine.append(f"app{rank}", "e")
expect(mine.get(f"app{rank}") == b"e", "append on mpidp's store directly")
store.multi_set([f"m{rank}a", f"m{rank}b"], ["1", b"22"])
dist.barrier()
peer = (rank + 1) % n
expect(store.get(f"app{peer}") == b"abcd", "append through the prefix")
expect(store.multi_get([f"m{peer}b", f"m{peer}a"]) == [b"22", b"1"], "multi_get")
expect(mine.multi_get([]) == [], "multi_get of no keys")
raises(ValueError, lambda: mine.multi_set(["a"], []), "multi_set of unequal lists", "1 keys")
expect(store.has_extended_api() and mine.has_extended_api(), "has_extended_api")
store.wait([f"key{r}" for r in range(n)])  # no timeout: the store's
expect(mine.clone() is mine, "clone of mpidp's store")
twin = store.clone()
expect(twin.get(f"key{peer}") == f"value{peer}".encode(), "get through a clone")
store.barrier("store-barrier", n, timedelta(seconds=60))
store.barrier("store-barrier-default", n)
for name, call in (("queue_push", lambda s: s.queue_push("q", "1")),
                   ("queue_pop", lambda s: s.queue_pop("q", False)),
                   ("queue_len", lambda s: s.queue_len("q")),
                   ("list_keys", lambda s: s.list_keys())):
    raises(NotImplementedError, lambda: call(store), f"{name} via the prefix", "not implemented")
    raises(NotImplementedError, lambda: call(mine), name, f"mpidp's store does not support {name}")
# the timeout: set_timeout changes what torch reports and what waits use
dist.barrier()
store.set_timeout(timedelta(seconds=1))
expect(store.timeout == mine.timeout == timedelta(seconds=1), f"set_timeout: {store.timeout}")
started = time.monotonic()
exc = raises(dist.DistStoreError, lambda: store.wait([f"missing{rank}"]), "wait past the timeout",
             "within 1 s")
expect(isinstance(exc, TimeoutError), f"a wait past the timeout raised {exc!r}")
raises(dist.DistStoreError, lambda: store.get(f"missing{rank}"), "get past the timeout", "1 s")
expect(time.monotonic() - started < 60, "waits took the old timeout, not the one set")
mine.set_timeout(timedelta(seconds=2))
expect(store.timeout == timedelta(seconds=2), f"set_timeout on the store directly: {store.timeout}")
raises(dist.DistStoreError, lambda: store.wait([f"missing{rank}"], timedelta(seconds=1)),
       "wait with a timeout of its own", "within 1 s")
store.set_timeout(dist.distributed_c10d.default_pg_timeout)
dist.barrier()

# ---- all_reduce: every op that has a meaning for the dtype ---------------------------------
for dtype in (torch.int64, torch.int32, torch.int16, torch.uint8, torch.float32,
              torch.float64, torch.bfloat16, torch.float16):
    everyone = torch.stack([values(r, dtype) for r in range(n)])
    floating = dtype.is_floating_point
    cases = [(R.SUM, everyone.sum(0).to(dtype)), (R.MIN, everyone.min(0).values),
             (R.MAX, everyone.max(0).values), (R.PRODUCT, everyone.prod(0).to(dtype))]
    if floating:
        cases.append((R.AVG, (everyone.double().sum(0) / n).to(dtype)))
    elif dtype != torch.uint8:  # integers: the sum divided with truncation, as NCCL's AVG
        cases.append((R.AVG, torch.div(-everyone.sum(0), n, rounding_mode="trunc").to(dtype)))
    else:
        cases += [(R.BAND, everyone[0].clone()), (R.BOR, everyone[0].clone()),
                  (R.BXOR, everyone[0].clone())]
        for r in range(1, n):
            cases[-3][1].bitwise_and_(everyone[r])
            cases[-2][1].bitwise_or_(everyone[r])
            cases[-1][1].bitwise_xor_(everyone[r])
    for op, expected in cases:
        t = values(rank, dtype)
        if op == R.AVG and not floating:
            t = -t  # negative sums: the division truncates toward zero
        dist.all_reduce(t, op=op)
        if op == R.AVG and floating:
            expect(torch.allclose(t.double(), expected.double(), rtol=1e-2),
                   f"all_reduce AVG {dtype}")
        else:
            equal(t, expected, f"all_reduce {op} {dtype}")
flags = torch.tensor([rank == 0, True, False])
dist.all_reduce(flags, op=R.MAX)
equal(flags, torch.tensor([True, True, False]), "all_reduce MAX bool")
c = torch.tensor([1 + 1j * rank], dtype=torch.complex64)
dist.all_reduce(c)
equal(c, torch.tensor([n + 1j * (n * (n - 1) // 2)], dtype=torch.complex64), "complex SUM")
raises(TypeError, lambda: dist.all_reduce(torch.ones(2), op=R.BAND), "BAND on floats", "BAND")
raises(TypeError, lambda: dist.all_reduce(torch.ones(2, dtype=torch.bool), op=R.AVG),
       "AVG on bool", "AVG")
strided = torch.arange(12, dtype=torch.float32).reshape(3, 4)[:, 1]
dist.all_reduce(strided)
equal(strided, torch.tensor([1.0, 5.0, 9.0]) * n, "all_reduce of a strided view")

# ---- the other collectives -----------------------------------------------------------------
root = n - 1
t = values(rank) if rank == root else torch.zeros(5, dtype=torch.int64)
dist.broadcast(t, src=root)
equal(t, values(root), "broadcast")
f16 = torch.full((3,), float(rank), dtype=torch.float16)
dist.broadcast(f16, src=0)
equal(f16, torch.zeros(3, dtype=torch.float16), "broadcast float16")

outs = [torch.empty(5, dtype=torch.int64) for _ in range(n)]
dist.all_gather(outs, values(rank))
for r in range(n):
    equal(outs[r], values(r), f"all_gather row {r}")
# torch 2.13 names them all_gather_single and reduce_scatter_single; older ones *_tensor
all_gather_single = getattr(dist, "all_gather_single", dist.all_gather_into_tensor)
reduce_scatter_single = getattr(dist, "reduce_scatter_single", dist.reduce_scatter_tensor)
out = torch.empty(n * 5, dtype=torch.int64)
all_gather_single(out, values(rank))
equal(out, torch.cat([values(r) for r in range(n)]), "all_gather_into_tensor")

block = 3
x = torch.arange(n * block, dtype=torch.int64) + rank
out = torch.empty(block, dtype=torch.int64)
reduce_scatter_single(out, x)
total = sum(torch.arange(n * block, dtype=torch.int64) + r for r in range(n))
equal(out, total[rank * block:(rank + 1) * block], "reduce_scatter_tensor SUM")
out = torch.empty(block, dtype=torch.int16)
reduce_scatter_single(out, x.to(torch.int16), op=R.MAX)
equal(out, (x - rank + n - 1)[rank * block:(rank + 1) * block].to(torch.int16),
      "reduce_scatter_tensor MAX int16")
out = torch.empty(2, dtype=torch.float32)
dist.reduce_scatter(out, [torch.full((2,), float(rank + j)) for j in range(n)])
equal(out, torch.full((2,), float(sum(r + rank for r in range(n)))), "reduce_scatter list")

t = values(rank)
dist.reduce(t, dst=0, op=R.SUM)
if rank == 0:
    equal(t, sum(values(r) for r in range(n)), "reduce SUM at root")
else:
    equal(t, values(rank), "reduce leaves the others' tensor")
t = values(rank, torch.int8)
dist.reduce(t, dst=root, op=R.PRODUCT)
if rank == root:
    equal(t, torch.stack([values(r, torch.int8) for r in range(n)]).prod(0).to(torch.int8),
          "reduce PRODUCT int8")

gathered = [torch.empty(5, dtype=torch.int64) for _ in range(n)] if rank == root else None
dist.gather(values(rank), gathered, dst=root)
if rank == root:
    for r in range(n):
        equal(gathered[r], values(r), f"gather row {r}")
got = torch.empty(5, dtype=torch.int64)
dist.scatter(got, [values(10 * r) for r in range(n)] if rank == 0 else None, src=0)
equal(got, values(10 * rank), "scatter")

outs = [torch.empty(2, dtype=torch.int64) for _ in range(n)]
dist.all_to_all(outs, [torch.tensor([rank, j]) for j in range(n)])
for j in range(n):
    equal(outs[j], torch.tensor([j, rank]), f"all_to_all from {j}")
# uneven splits: rank r sends j + 1 rows to rank j
send = torch.cat([torch.full((j + 1, 2), 10 * rank + j) for j in range(n)])
recv = torch.empty((n * (rank + 1), 2), dtype=torch.int64)
dist.all_to_all_single(recv, send, output_split_sizes=[rank + 1] * n,
                       input_split_sizes=[j + 1 for j in range(n)])
equal(recv, torch.cat([torch.full((rank + 1, 2), 10 * j + rank) for j in range(n)]),
      "all_to_all_single with splits")
recv = torch.empty(n, dtype=torch.int64)
dist.all_to_all_single(recv, torch.arange(n) + 100 * rank)
equal(recv, torch.arange(n) * 100 + rank, "all_to_all_single even")

# ---- async work and futures --------------------------------------------------------------
works = []
tensors = [values(rank) + k for k in range(4)]
for t in tensors:
    works.append(dist.all_reduce(t, async_op=True))
futures = [w.get_future() for w in works]
for w in works:
    w.wait()
for k, (t, f) in enumerate(zip(tensors, futures)):
    equal(t, sum(values(r) + k for r in range(n)), f"async all_reduce {k}")
    expect(f.done(), f"future {k} not done after wait")
chained = dist.all_reduce(torch.ones(3), async_op=True).get_future().then(
    lambda fut: fut.value()[0] * 2)
equal(chained.wait(), torch.full((3,), 2.0 * n), "future then")


def reduce_again(fut):  # as torch's PowerSGD hook: a collective waited for in a callback
    t = fut.value()[0] + 1
    dist.all_reduce(t, async_op=True).get_future().wait()
    return t


equal(dist.all_reduce(torch.ones(2), async_op=True).get_future().then(reduce_again).wait(),
      torch.full((2,), float(n * (n + 1))), "a collective waited for inside a callback")

# ---- point-to-point ------------------------------------------------------------------------
if n > 1:
    right, left = (rank + 1) % n, (rank - 1) % n
    got = torch.empty(4, dtype=torch.int64)
    # 300 rounds: receives from any source, many in a row while the scheduler's and the
    # watchdog's threads drive MPI too (Note [A receive from any source] in
    # mpidp/runtime/mpi.py: MPICH over UCX lost such a message across nodes, within 13
    # rounds); every other round the receive is polled with is_completed before its wait.
    # A wrong round is recorded (the first only) and the rounds go on, every rank alike
    wrong = []
    for i in range(300):
        reqs = dist.batch_isend_irecv([dist.P2POp(dist.isend, values(rank + i, count=4), right),
                                       dist.P2POp(dist.irecv, got, left)])
        for q in reqs:
            q.wait()
        if not torch.equal(got, values(left + i, count=4)):
            wrong.append(f"batch_isend_irecv ring, round {i}: got {got.tolist()}")
        if rank == 0:
            dist.send(torch.tensor([7.0, i]), dst=1, tag=3)
            back = torch.empty(2)
            dist.recv(back, src=1, tag=4)
            if not torch.equal(back, torch.tensor([14.0, 2.0 * i])):
                wrong.append(f"send/recv round trip, round {i}: got {back.tolist()}")
        elif rank == 1:
            back = torch.empty(2)
            if i % 2:
                work = dist.irecv(back, tag=3)  # any source
                while not work.is_completed():
                    time.sleep(0.0001)
                if not (work.wait() and work._source_rank() == 0):
                    wrong.append(f"irecv polled, then waited, round {i}: from "
                                 f"{work._source_rank()}")
            else:
                src = dist.recv(back, tag=3)  # any source
                if src != 0:
                    wrong.append(f"recv from any source, round {i}: said {src}")
            dist.send(back * 2, dst=0, tag=4)
    expect(not wrong, f"{len(wrong)} wrong rounds of point-to-point, the first: {wrong[:1]}")
    if rank == 1:
        raises(Exception, lambda: dist.send(torch.ones(1), dst=0, tag=-1), "negative tag")

# ---- sub-groups ----------------------------------------------------------------------------
evens = list(range(0, n, 2))
sub = dist.new_group(evens)
if rank in evens:
    t = torch.tensor([rank + 1])
    dist.all_reduce(t, group=sub)
    equal(t, torch.tensor([sum(r + 1 for r in evens)]), "all_reduce on a sub-group")
    expect(dist.get_world_size(sub) == len(evens), "sub-group size")
    outs = [torch.empty(1, dtype=torch.int64) for _ in evens]
    dist.all_gather(outs, torch.tensor([rank]), group=sub)
    equal(torch.cat(outs), torch.tensor(evens), "all_gather on a sub-group")
dist.barrier()

# ---- errors: raised on every rank, never a hang; the group goes on afterwards ---------------
if n > 1:
    exc = raises(MismatchError, lambda: dist.all_reduce(torch.ones(4 if rank == 0 else 5)),
                 "different sizes", "do not agree")
    exc = raises(MismatchError, lambda: dist.broadcast(torch.ones(3), src=rank % 2),
                 "different roots", "root=")
    bad = torch.empty(4 if rank == 0 else n * 5, dtype=torch.int64)
    kind = ValueError if rank == 0 else MismatchError
    raises(kind, lambda: all_gather_single(bad, values(rank)),
           "a rank with a bad output")
    sparse = torch.ones(3).to_sparse() if rank == 0 else torch.ones(3)
    raises(TypeError if rank == 0 else MismatchError, lambda: dist.broadcast(sparse, src=0),
           "a sparse tensor on rank 0 only", "sparse_coo tensors are not supported" if
           rank == 0 else "")
    # a sparse all_reduce sums as gloo's: rank r holds r + 1 at index r and 1 at index n
    dense = torch.zeros(n + 1, 2, dtype=torch.int64)
    dense[rank] = rank + 1
    dense[n] = 1
    sparse = dense.to_sparse(1)
    dist.all_reduce(sparse)
    want = torch.zeros(n + 1, 2, dtype=torch.int64)
    want[:n] = torch.arange(1, n + 1).unsqueeze(1)
    want[n] = n
    expect(torch.equal(sparse.to_dense(), want) and sparse.is_sparse,
           f"a sparse all_reduce: {sparse.to_dense().tolist()}")
    raises(ValueError, lambda: dist.all_reduce(torch.ones(3).to_sparse(), op=R.MAX),
           "a sparse MAX", "the mpidp backend sums sparse tensors (SUM, as gloo)")
    other = torch.ones(3 + (rank == n - 1)).to_sparse()
    raises(MismatchError, lambda: dist.all_reduce(other),
           "sparse tensors of another size on one rank")
    other = torch.ones(2, 2).to_sparse(1 + (rank == n - 1))
    raises(MismatchError, lambda: dist.all_reduce(other),
           "sparse tensors of another sparse/dense split on one rank",
           "hold another shape, dtype or split")
    op = R.PRODUCT if rank == 0 else R.SUM
    raises(MismatchError, lambda: dist.all_reduce(torch.ones(2, dtype=torch.int64), op=op),
           "different ops")
    raises(ValueError, lambda: dist.all_to_all_single(
        torch.empty(n, dtype=torch.int64), torch.zeros(n, 2, dtype=torch.int64)),
        "all_to_all_single with rows of different sizes", "rows")
    send = torch.zeros(n + (rank == 0), dtype=torch.int64)
    raises(Exception, lambda: dist.all_to_all_single(
        torch.empty(n, dtype=torch.int64), send,
        input_split_sizes=[2] + [1] * (n - 1) if rank == 0 else None), "uneven all_to_all")
t = torch.ones(2)
dist.all_reduce(t)
equal(t, torch.full((2,), float(n)), "all_reduce after the errors")
mpidp_dist = sys.modules["mpidp.backend"]
mpidp_dist.monitored_barrier(timeout=timedelta(seconds=60), wait_all_ranks=True)


# ---- torch's own DistributedDataParallel on the backend ----------------------------------
def net(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 5))


LOCAL = 4
gen = torch.Generator().manual_seed(1)
data = [(torch.randint(-2, 3, (LOCAL * n, 6), generator=gen).float(),
         torch.randint(0, 5, (LOCAL * n,), generator=gen)) for _ in range(4)]
reference, model = net(), net()
ddp = nn.parallel.DistributedDataParallel(model, bucket_cap_mb=0.0001)
opt_ref = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
opt = torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9)
for x, y in data:
    opt_ref.zero_grad()
    nn.functional.cross_entropy(reference(x), y).backward()
    opt_ref.step()
    opt.zero_grad()
    nn.functional.cross_entropy(ddp(x[rank * LOCAL:(rank + 1) * LOCAL]),
                                y[rank * LOCAL:(rank + 1) * LOCAL]).backward()
    opt.step()
for a, b in zip(model.parameters(), reference.parameters()):
    expect(torch.allclose(a, b, rtol=1e-5, atol=1e-6),
           f"torch DDP on mpidp: max difference {(a - b).abs().max().item():.2e}")

# ---- ZeroRedundancyOptimizer against the unsharded optimizer ---------------------------------
from torch.distributed.optim import ZeroRedundancyOptimizer  # noqa: E402

reference, model = net(3), net(3)
opt_ref = torch.optim.Adam(reference.parameters(), lr=0.01)
zero = ZeroRedundancyOptimizer(model.parameters(), optimizer_class=torch.optim.Adam, lr=0.01)
for x, y in data:
    for m, o in ((reference, opt_ref), (model, zero)):
        o.zero_grad()
        nn.functional.cross_entropy(m(x), y).backward()  # the same full batch everywhere
        o.step()
for a, b in zip(model.parameters(), reference.parameters()):
    equal(a.detach(), b.detach(), "ZeroRedundancyOptimizer against Adam")

# ---- torch.distributed.checkpoint ----------------------------------------------------------
import torch.distributed.checkpoint as dcp  # noqa: E402

where = [tempfile.mkdtemp(prefix="mpidp-dcp-") if rank == 0 else None]
dist.broadcast_object_list(where, src=0)
state = {"model": net(5).state_dict(), "step": torch.tensor(rank)}
dcp.save(state, checkpoint_id=where[0])
loaded = {"model": net(6).state_dict(), "step": torch.tensor(-1)}
dcp.load(loaded, checkpoint_id=where[0])
for k, v in state["model"].items():
    equal(loaded["model"][k], v, f"checkpoint {k}")
dist.barrier()  # every rank has read before rank 0 removes it
if rank == 0:
    shutil.rmtree(where[0])

if failures:
    print(f"rank {rank}: " + "\n".join(failures), flush=True)
    sys.exit(1)
dist.destroy_process_group()
print(f"ok {rank}", flush=True)
