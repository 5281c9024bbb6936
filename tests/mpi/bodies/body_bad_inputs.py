"""Run under mpiexec at 2 ranks or more: no silent wrong answer. Bad input on some ranks — a
read-only array, counts that differ, a sparse tensor, a wrong dtype or type, a bad op, root or
algorithm — raises on every rank (its own error where it is bad, MismatchError elsewhere) and
the next collective is exact; a randomized round of such calls with a seeded generator; NaN
through min and max on every algorithm; an in-place collective on a tensor autograd saved is
refused by backward; through Horovod's API and the torch.distributed backend, arguments,
layouts, names and process sets that differ on some rank raise on every rank (Note [Agreement
before refusal] in mpidp/comm/agreement.py).
Prints 'ok <rank>' at the end."""
import os
import sys

import numpy as np
import torch

import mpidp
from mpidp.errors import MismatchError

g = mpidp.init()
rank, n = mpidp.rank(), mpidp.size()
failures = []
ALGOS = [a for a in os.environ.get("BODY_ALGORITHMS", "auto,shm,ring,hier,mpi,doubling").split(",")
         if a != "shm" or g.single_node]


def expect(cond, what):
    if not cond:
        failures.append(what)


def outcome(call):
    try:
        call()
    except Exception as exc:  # noqa: BLE001 - the test looks at what each rank raised
        return exc
    return None


def check_everyone_raised(exc, bad_here, what):
    if bad_here:
        expect(exc is not None and not isinstance(exc, MismatchError),
               f"{what}: the bad rank raised {exc!r}, not its own error")
    else:
        expect(isinstance(exc, MismatchError), f"{what}: a good rank got {exc!r}, not a "
                                                "MismatchError")


def check_next_is_exact(what, count=1000):
    x = np.arange(count, dtype=np.float32) % 7 + rank
    mpidp.allreduce_(x)
    want = (np.arange(count, dtype=np.float32) % 7) * n + n * (n - 1) / 2
    expect(np.array_equal(x, want), f"{what}: the next all-reduce is wrong")


# ---- the read-only array of the report, small and large, on rank 0 or on every rank --------
for count in (4, 300_000):
    for bad_ranks in ({0}, set(range(n))):
        if rank in bad_ranks:
            x = np.frombuffer(np.full(count, rank + 1, np.float32).tobytes(), np.float32)
        else:
            x = np.full(count, rank + 1, np.float32)
        keep = np.full(count, 2.0, np.float32)  # a live array nobody may write into
        exc = outcome(lambda: mpidp.allreduce_(x))
        check_everyone_raised(exc, rank in bad_ranks, f"read-only[{count}] on {bad_ranks}")
        expect(np.all(keep == 2.0), f"read-only[{count}]: an unrelated array was written")
        check_next_is_exact(f"after read-only[{count}]")

# ---- counts that differ across ranks, small and large (across nodes the large ones travel
# after their records: Note [Chunks after the record] in csrc/exchange.c). In floats: 12_000
# against 24_000 is 48 KiB in the records against 96 KiB in chunks, 16_384 against 32_768 two
# chunks posted ahead against four, 150_000 against 300_000 a full window on both -------------
for count in (1000, 12_000, 16_384, 150_000):
    x = np.ones(count * (2 if rank == n - 1 else 1), np.float32)
    exc = outcome(lambda: mpidp.allreduce_(x))
    expect(isinstance(exc, MismatchError), f"counts differ [{count}]: {exc!r}")
    expect(np.all(x == 1), f"counts differ [{count}]: the refused array was written")
    check_next_is_exact(f"after counts that differ [{count}]", 150_000)

# ---- a sparse tensor on the last rank ---------------------------------------------------------
dense = torch.arange(6, dtype=torch.float32) + rank
x = dense.to_sparse() if rank == n - 1 else dense.clone()
check_everyone_raised(outcome(lambda: mpidp.allreduce_(x)), rank == n - 1, "sparse tensor")
check_next_is_exact("after a sparse tensor")

# ---- randomized: random bad inputs on random ranks, random collectives ------------------------
BAD = {
    "read-only": lambda c: np.frombuffer(np.ones(c, np.float32).tobytes(), np.float32),
    "complex dtype": lambda c: np.ones(c, np.complex64),
    "a list": lambda c: [1.0] * c,
    "sparse": lambda c: torch.ones(c).to_sparse(),
    "bool tensor": lambda c: torch.ones(c, dtype=torch.bool),
}
CALLS = {
    "allreduce_": lambda x, bad: mpidp.allreduce_(x, "sum"),
    "allreduce": lambda x, bad: mpidp.allreduce(x, "avg"),
    "broadcast_": lambda x, bad: mpidp.broadcast_(x, 0),
    "reduce_": lambda x, bad: mpidp.reduce_(x, 0, "max"),
    "allgather": lambda x, bad: mpidp.allgather(x),
    "reduce_scatter": lambda x, bad: mpidp.reduce_scatter(x),
    "bad op": lambda x, bad: mpidp.allreduce_(x, "prod" if bad else "sum"),
    "bad algorithm": lambda x, bad: mpidp.allreduce_(x, "sum", "fastest" if bad else "auto"),
    "bad root": lambda x, bad: mpidp.broadcast_(x, n if bad else 0),
    "grouped_allreduce_": lambda x, bad: mpidp.grouped_allreduce_([x, np.ones(3, np.float32)],
                                                                  "sum"),
    "grouped avg of integers": lambda x, bad: mpidp.grouped_allreduce(
        [np.ones(4, np.int64 if bad else np.float64)], "avg"),
}
rng = np.random.default_rng(20261122)  # the same plan on every rank
for trial in range(int(os.environ.get("BODY_TRIALS", "40"))):
    call = list(CALLS)[rng.integers(len(CALLS))]
    kind = list(BAD)[rng.integers(len(BAD))]
    if kind == "read-only" and call not in ("allreduce_", "broadcast_", "grouped_allreduce_"):
        kind = "complex dtype"  # read-only input is fine where nothing is written into it
    count = int(rng.choice([1, 5, 1000, 20_000]))
    bad_ranks = {int(r) for r in rng.choice(n, size=rng.integers(1, n + 1), replace=False)}
    bad_here = rank in bad_ranks
    needs_bad_value = call not in ("bad op", "bad algorithm", "bad root",
                                   "grouped avg of integers")
    x = BAD[kind](count) if bad_here and needs_bad_value else np.ones(count, np.float32)
    what = f"trial {trial}: {call} with {kind if needs_bad_value else 'bad argument'} on " \
           f"ranks {sorted(bad_ranks)}"
    check_everyone_raised(outcome(lambda: CALLS[call](x, bad_here)), bad_here, what)
    check_next_is_exact(what)

# ---- NaN through min and max: every algorithm, every floating dtype -------------------------
count = 300_000
spots = {q: [12345 + q, 250_000 - q, 7 * q] for q in range(n)}  # where rank q holds a NaN
nan_at = sorted({i for q in range(n) for i in spots[q]})
for algo in ALGOS:
    for op in ("min", "max"):
        for dtype in (np.float16, np.float32, np.float64, torch.bfloat16):
            base = (np.arange(count) % 11).astype(np.float32) + rank
            base[spots[rank]] = np.nan
            want = (np.arange(count) % 11).astype(np.float32) + (0 if op == "min" else n - 1)
            want[nan_at] = np.nan
            if dtype is torch.bfloat16:
                x = torch.from_numpy(base).to(torch.bfloat16)
                got = mpidp.allreduce(x, op, algo).float().numpy()
            else:
                got = mpidp.allreduce(base.astype(dtype), op, algo).astype(np.float32)
            expect(np.array_equal(got, want, equal_nan=True),
                   f"NaN {op} {algo} {dtype}: NaN at {np.flatnonzero(np.isnan(got))[:6]}, "
                   f"want {nan_at[:6]}; others equal: "
                   f"{np.array_equal(np.nan_to_num(got), np.nan_to_num(want))}")

# ---- an in-place collective on a tensor autograd saved is refused by backward ----------------
w = torch.ones(4, requires_grad=True)
saved = torch.arange(4, dtype=torch.float32) + 1
loss = (w * saved).sum()  # mul saves `saved` for w's gradient
version = saved._version
mpidp.allreduce_(saved)
expect(saved._version > version, "allreduce_ did not bump the tensor's version counter")
expect(isinstance(outcome(loss.backward), RuntimeError),
       "backward used a tensor an in-place collective had changed, without complaint")
for name, inplace, bumps in (("broadcast_", lambda t: mpidp.broadcast_(t, 0), True),
                             ("reduce_", lambda t: mpidp.reduce_(t, 0, "sum"), rank == 0)):
    t = torch.ones(3)
    before = t._version
    inplace(t)
    expect((t._version > before) == bumps, f"{name} and the version counter: {before} -> "
                                           f"{t._version}")

t = torch.ones(3)
before = t._version
mpidp.grouped_allreduce_([t], "sum")
expect(t._version > before, "grouped_allreduce_ left the version counter alone")

# ---- agreement before refusal (Note [Agreement before refusal] in mpidp/comm/agreement.py):
# through Horovod's API and the torch.distributed backend, an argument refused on rank 0 only
# raises on every rank — rank 0 its own error (as Horovod's front raises it), every other rank
# a MismatchError naming rank 0 and the value — as do layouts, names and process sets that
# differ; the next all-reduce, all-gather and broadcast are exact. Waits in this section end
# after 30 s with WaitTimeoutError (set_wait_timeout), which fails the checks, rather than
# after the watchdog's 180 s -----------------------------------------------------------------
import torch.distributed as dist  # noqa: E402 - the sections above need neither

import mpidp.backend  # noqa: E402,F401 - registers the backend
import mpidp.horovod as hvd  # noqa: E402

hvd.init()
g.resources.set_wait_timeout(30.0)
last = n - 1


def returned(call):
    """What ``call`` returned, or the exception it raised."""
    try:
        return call()
    except Exception as exc:  # noqa: BLE001 - the test looks at what each rank raised
        return exc


def raised_everywhere(call, bad_here, own, what, *shown):
    """``call`` raised ``own`` here if this rank is bad, else a MismatchError whose text holds
    every string of ``shown``."""
    exc = outcome(call)
    if bad_here:
        expect(type(exc) is own, f"{what}: the bad rank raised {exc!r}, not {own.__name__}")
    else:
        expect(isinstance(exc, MismatchError) and all(t in str(exc) for t in shown),
               f"{what}: a good rank got {exc!r}, not a MismatchError naming {shown}")


def hvd_next_is_exact(what):
    got = [returned(lambda: hvd.allreduce(torch.tensor([rank + 1.0]), op=hvd.Sum)),
           returned(lambda: hvd.allgather(torch.tensor([rank + 1.0]))),
           returned(lambda: hvd.broadcast(torch.tensor([rank + 1.0]), root_rank=last))]
    want = [torch.tensor([n * (n + 1) / 2]), torch.arange(1.0, n + 1), torch.tensor([n * 1.0])]
    expect(all(isinstance(a, torch.Tensor) and torch.equal(a, b) for a, b in zip(got, want)),
           f"after {what}: the next all-reduce, all-gather, broadcast gave {got}")


t3 = torch.full((3,), rank + 1.0)
ONE_RANK = [  # (what, call, rank 0's error, what the others' message names)
    ("op=hvd.Adasum", lambda b: hvd.allreduce(t3, op=hvd.Adasum if b else hvd.Sum),
     NotImplementedError, "rank 0: allreduce float32[3] op=adasum, refused there"),
    ("root_rank=99", lambda b: hvd.broadcast(t3, root_rank=99 if b else 0), ValueError,
     "rank 0: broadcast float32[3] root=99, refused there"),
    ("broadcast_ root_rank=99", lambda b: hvd.broadcast_(t3.clone(), 99 if b else 0),
     ValueError, "root=99, refused there"),
    # an Average of integers is Horovod's (a Sum, scaled and truncated): against floats
    # elsewhere, dtypes that differ
    ("Average of integers", lambda b: hvd.allreduce(t3.long() if b else t3, op=hvd.Average),
     MismatchError, "rank 0: allreduce int64[3]"),
    ("allreduce_ Average of integers",
     lambda b: hvd.allreduce_(t3.long() if b else t3.clone(), op=hvd.Average), MismatchError,
     "rank 0: allreduce int64[3]"),
    ("a list to allreduce", lambda b: hvd.allreduce([1.0] * 3 if b else t3, op=hvd.Sum),
     TypeError, "rank 0: allreduce op=sum, refused there (TypeError)"),
    ("a list to allgather", lambda b: hvd.allgather([1.0] if b else t3), TypeError,
     "rank 0: allgather, refused there (TypeError)"),
    ("reducescatter Average of integers",
     lambda b: hvd.reducescatter(t3.long() if b else t3, op=hvd.Average), MismatchError,
     "int64[3]"),
    ("grouped with Adasum", lambda b: hvd.grouped_allreduce([t3], op=hvd.Adasum if b else
                                                            hvd.Sum), NotImplementedError,
     "op=adasum, refused there"),
    ("Max against Sum", lambda b: hvd.allreduce(t3, op=hvd.Max if b else hvd.Sum),
     MismatchError, "op=max"),
    # Horovod's own test_horovod_alltoall_type_error: int32 against float32, bytes alike
    ("alltoall of int32 against float32",
     lambda b: hvd.alltoall(torch.ones(2 * n, dtype=torch.int32 if b else torch.float32)),
     MismatchError, "rank 0: alltoall int32"),
]
for what, call, own, shown in ONE_RANK:
    raised_everywhere(lambda: call(rank == 0), rank == 0, own, what, shown)
    hvd_next_is_exact(what)

# a group whose layout differs on the last rank: its buckets would add one tensor into another.
# Before each, every rank makes rank 0's call, so that rank 0's layout is unchanged and only
# the last rank's changes (Note [A group's layout] in mpidp/comm/fusion.py): every rank's
# MismatchError names its own layout (a named one every rank's, after exchanging the names)
agreed_layout = [torch.full((4,), rank + 1.0), torch.full((2,), rank + 1.0)]
layout = [t.clone() for t in agreed_layout]
if rank == last:
    layout.reverse()
for what, call in (("grouped_allreduce_", lambda: hvd.grouped_allreduce_(layout, op=hvd.Sum)),
                   ("grouped_allreduce", lambda: hvd.grouped_allreduce(layout, op=hvd.Sum)),
                   ("named grouped_allreduce",
                    lambda: hvd.grouped_allreduce(layout, op=hvd.Sum, name="g")),
                   ("mpidp.grouped_allreduce_",
                    lambda: mpidp.grouped_allreduce_([x.numpy() for x in layout], "sum"))):
    same = returned(lambda: hvd.grouped_allreduce(agreed_layout, op=hvd.Sum))
    expect(isinstance(same, list) and all(torch.equal(t, torch.full(t.shape, n * (n + 1) / 2))
                                          for t in same), f"layouts that agree: {same}")
    raised_everywhere(call, False, None, f"layouts that differ: {what}", f"rank {last}:",
                      "float32[2], float32[4]]" if rank == last or "named" in what else
                      "float32[4], float32[2]]")
    expect(all(torch.equal(x, torch.full(x.shape, rank + 1.0)) for x in layout),
           f"layouts that differ: {what} wrote into the tensors")
    hvd_next_is_exact(f"layouts that differ: {what}")

# a grouped call refused on rank 0 before it reached the fused all-reduce, or a non-tensor
# there, between grouped calls of one layout: the next call of that layout works on every
# rank (Note [A group's layout]: every rank forgets the layout after a collective raised)
for what, bad, own in (("Adasum", lambda: hvd.grouped_allreduce(agreed_layout, op=hvd.Adasum),
                        NotImplementedError),
                       ("a non-tensor", lambda: hvd.grouped_allreduce(
                           [agreed_layout[0], [1.0, 2.0]], op=hvd.Sum), TypeError)):
    for step in ("before", "after"):
        same = returned(lambda: hvd.grouped_allreduce(agreed_layout, op=hvd.Sum))
        expect(isinstance(same, list) and all(
            torch.equal(t, torch.full(t.shape, n * (n + 1) / 2)) for t in same),
            f"one layout {step} a grouped call refused on rank 0 ({what}): {same}")
        if step == "before":
            raised_everywhere(lambda: bad() if rank == 0 else hvd.grouped_allreduce(
                agreed_layout, op=hvd.Sum), rank == 0, own,
                f"a grouped call refused on rank 0 ({what})", "rank 0:")

# an async operation pending on every rank, then allreduce_ that takes the one-call path on
# the other ranks and not on rank 0 (a narrow dtype): the pending one runs first on every
# rank (Note [Pending operations]), then the two calls raise on every rank
pending = hvd.allreduce_async(torch.full((3,), rank + 1.0), op=hvd.Sum)
raised_everywhere(lambda: hvd.allreduce_(torch.full((3,), rank + 1.0).to(
    torch.int16 if rank == 0 else torch.float32), op=hvd.Sum), rank == 0, MismatchError,
    "allreduce_ of another dtype behind a pending operation", "int32[3]")
got = returned(lambda: hvd.synchronize(pending))
expect(isinstance(got, torch.Tensor) and torch.equal(got, torch.full((3,), n * (n + 1) / 2)),
       f"a pending operation ahead of allreduce_'s one-call path: {got}")
hvd_next_is_exact("a pending operation ahead of allreduce_'s one-call path")

# an empty group on the last rank meets the others' first bucket (it sends a header of no
# elements, where its layout changed), then empty groups on every rank, twice: nothing to do
raised_everywhere(lambda: hvd.grouped_allreduce([] if rank == last else agreed_layout,
                                                op=hvd.Sum), False, None,
                  "an empty group on one rank", f"rank {last}:")
hvd_next_is_exact("an empty group on one rank")
expect(returned(lambda: hvd.grouped_allreduce([], op=hvd.Sum)) == [] and
       returned(lambda: mpidp.grouped_allreduce_([], "sum")) == [],
       "empty groups on every rank")
hvd_next_is_exact("empty groups on every rank")
# an empty group that did not change on rank 0 still meets another rank's refusal
raised_everywhere(lambda: hvd.grouped_allreduce([], op=hvd.Adasum if rank == last else hvd.Sum),
                  rank == last, NotImplementedError, "an empty group refused on one rank",
                  f"rank {last}:")
hvd_next_is_exact("an empty group refused on one rank")

# named asynchronous all-reduces submitted in another order on the last rank (Note [Names] in
# mpidp/horovod/ops.py: refused on every rank, naming both names), then in the same order


def submit(order):
    values = {"a": rank + 1.0, "b": 100.0 + rank}
    handles = {k: hvd.allreduce_async(torch.tensor([values[k]]), name=k, op=hvd.Sum)
               for k in order}
    return {k: hvd.synchronize(h) for k, h in handles.items()}


raised_everywhere(lambda: submit("ba" if rank == last else "ab"), False, None,
                  "names in another order", "name 'a'", "name 'b'", f"rank {last}:")
hvd_next_is_exact("names in another order")
got = returned(lambda: submit("ab"))
expect(isinstance(got, dict) and torch.equal(got["a"], torch.tensor([n * (n + 1) / 2])) and
       torch.equal(got["b"], torch.tensor([100.0 * n + n * (n - 1) / 2])),
       f"named all-reduces in the same order: {got}")

# named all-reduces in place (the name rides the one C call's header: Note [Names] in
# mpidp/horovod/arguments.py): another name on the last rank, no name there, then one name on
# every rank, in place on some ranks and not on others
raised_everywhere(lambda: hvd.allreduce_(torch.ones(2), op=hvd.Sum,
                                         name="b" if rank == last else "a"), False, None,
                  "another name on one rank", "name 'a'", "name 'b'", f"rank {last}:")
hvd_next_is_exact("another name on one rank")
raised_everywhere(lambda: hvd.allreduce_(torch.ones(2), op=hvd.Sum,
                                         name=None if rank == last else "a"), False, None,
                  "no name on one rank", f"rank {last}:")
hvd_next_is_exact("no name on one rank")
for size in (2, 100_000):  # the one call, and the general path
    x = torch.full((size,), rank + 1.0)
    got = returned(lambda: hvd.allreduce_(x, op=hvd.Sum, name="m") if rank % 2 else
                   hvd.allreduce(x, op=hvd.Sum, name="m"))
    expect(isinstance(got, torch.Tensor) and torch.equal(got, torch.full((size,),
                                                                       n * (n + 1) / 2)),
           f"one name on every rank, {size} elements: {got}")

# process sets: a bad list on rank 0, then lists that differ, then one that every rank agrees on
raised_everywhere(lambda: hvd.add_process_set([0, 99] if rank == 0 else [0]), rank == 0,
                  ValueError, "add_process_set([0, 99]) on rank 0", "rank 0: ValueError",
                  "[0, 99]")
hvd_next_is_exact("add_process_set([0, 99]) on rank 0")
raised_everywhere(lambda: hvd.add_process_set([0] if rank == 0 else [last]), False, None,
                  "process sets' ranks that differ", f"ranks = [{last}] where rank 0 has [0]")
hvd_next_is_exact("process sets' ranks that differ")
# the last rank still in a loop of all-reduces (a check that failed on the other ranks only
# ended theirs) while the others add a process set: every rank raises, none waits, nothing is
# registered (Note [Agreement before refusal] in mpidp/comm/agreement.py)
raised_everywhere(lambda: hvd.allreduce(t3, op=hvd.Sum) if rank == last else
                  hvd.add_process_set([0]), False, None,
                  "an all-reduce on one rank, add_process_set on the others", "allreduce",
                  "hvd.add_process_set")
hvd_next_is_exact("an all-reduce on one rank, add_process_set on the others")
members = [0, last] if n > 2 else [last]
ps = returned(lambda: hvd.add_process_set(members))
if rank in members:
    got = returned(lambda: hvd.allreduce(torch.tensor([rank + 1.0]), op=hvd.Sum,
                                         process_set=ps))
    expect(isinstance(got, torch.Tensor) and
           torch.equal(got, torch.tensor([sum(m + 1.0 for m in members)])),
           f"the process set every rank agreed on: {got}")
expect(isinstance(ps, hvd.ProcessSet) and hvd.remove_process_set(ps), f"process set: {ps}")
hvd_next_is_exact("a process set")
g.resources.set_wait_timeout(None)

# the torch.distributed backend: a root or an op refused on rank 0 only
if not dist.is_initialized():
    dist.init_process_group("mpidp")
pg = dist.distributed_c10d._get_default_group()
pg.g.resources.set_wait_timeout(30.0)
for what, call, own, shown in (
        ("dist.broadcast src=99", lambda b: dist.broadcast(t3.clone(), src=99 if b else 0),
         ValueError, "rank 0: broadcast float32[3] root=99, refused there"),
        ("dist.all_reduce BAND of floats", lambda b: dist.all_reduce(
            t3.clone(), op=dist.ReduceOp.BAND if b else dist.ReduceOp.SUM), TypeError,
         "rank 0: all_reduce BAND float32[3], refused there (TypeError)")):
    raised_everywhere(lambda: call(rank == 0), rank == 0, own, what, shown)
    y, gathered, z = torch.tensor([rank + 1.0]), [torch.zeros(1) for _ in range(n)], \
        torch.tensor([rank + 1.0])
    done = outcome(lambda: (dist.all_reduce(y), dist.all_gather(gathered, y.clone()),
                            dist.broadcast(z, src=last)))
    expect(done is None and torch.equal(y, torch.tensor([n * (n + 1) / 2])) and
           all(torch.equal(v, y) for v in gathered) and torch.equal(z, torch.tensor([n * 1.0])),
           f"after {what}: {done!r}, {y}, {gathered}, {z}")
pg.g.resources.set_wait_timeout(pg.timeout_s)

if failures:
    print(f"rank {rank} FAILED:\n  " + "\n  ".join(failures), file=sys.stderr)
    sys.exit(1)
mpidp.shutdown()
print(f"ok {rank}")
