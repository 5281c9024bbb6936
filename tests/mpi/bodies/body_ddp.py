"""Run under mpiexec at any world size: DistributedDataParallel against single-process training
on the concatenated batch (SGD with momentum and Adam, with and without gradients as bucket
views, no_sync accumulation, unused parameters), bucket rebuild, construction-time broadcast
and model check, the Horovod-style helpers, and every error path. Prints 'ok <rank>'."""
import re
import sys

import numpy as np
import torch
from torch import nn

import mpidp
from mpidp.comm.fingerprint import check_same_buckets
from mpidp.comm.fusion import plan
from mpidp.errors import MismatchError, MpidpError

torch.set_num_threads(1)
g = mpidp.init()
rank, n = mpidp.rank(), mpidp.size()
failures = []
LOCAL = 4  # samples per rank
TINY_MB = 256 / (1 << 20)  # 256-byte buckets: many buckets even on a tiny model


def expect(cond, what):
    if not cond:
        failures.append(what)


def same_everywhere(tensors, what):
    raw = b"".join(t.detach().contiguous().view(-1).view(torch.uint8).numpy().tobytes()
                   for t in tensors)
    everyone = g.comm.allgather(raw)
    expect(all(e == everyone[0] for e in everyone), f"{what}: differs between ranks")


def close(a, b, what, rtol=1e-6):
    for x, y in zip(a, b):
        err = (x.detach() - y.detach()).norm().item()
        scale = max(y.detach().norm().item(), 1e-12)
        expect(err <= rtol * scale, f"{what}: relative error {err / scale:.2e}")


def net(seed=0, hidden=8):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, hidden), nn.Tanh(), nn.Linear(hidden, 7), nn.Tanh(),
                         nn.Linear(7, 5))


def batches(steps, seed):
    gen = torch.Generator().manual_seed(seed)
    return [(torch.randn(LOCAL * n, 6, generator=gen),
             torch.randint(0, 5, (LOCAL * n,), generator=gen)) for _ in range(steps)]


def mine(x):
    return x[rank * LOCAL:(rank + 1) * LOCAL]


def optimizer(kind, params):
    return torch.optim.SGD(params, lr=0.1, momentum=0.9) if kind == "momentum" else \
        torch.optim.Adam(params, lr=0.01)


loss_fn = nn.functional.cross_entropy

# ---- equivalence: k steps on n ranks == k steps of one process on the whole batch ----------
for kind in ("momentum", "adam"):
    for as_view in (False, True):
        for algorithm in (("auto", "mpi") if kind == "momentum" and not as_view else ("auto",)):
            what = f"equivalence {kind} view={as_view} {algorithm}"
            model = mpidp.DistributedDataParallel(net(seed=rank), bucket_cap_mb=TINY_MB,
                                                  gradient_as_bucket_view=as_view,
                                                  algorithm=algorithm)
            ref = net(seed=0)
            opt, ref_opt = optimizer(kind, model.parameters()), optimizer(kind, ref.parameters())
            for step, (x, y) in enumerate(batches(4, seed=7)):
                opt.zero_grad(set_to_none=step % 2 == 0)
                loss_fn(model(mine(x)), mine(y)).backward()
                opt.step()
                ref_opt.zero_grad()
                loss_fn(ref(x), y).backward()
                ref_opt.step()
            close(list(model.module.parameters()), list(ref.parameters()), what)
            same_everywhere(list(model.module.parameters()), what)
            expect(len(model.bucket_indices) > 1, f"{what}: expected several buckets")

# big enough buckets for the zero-copy path (Note [Zero-copy buckets]), default bucket sizes
model = mpidp.DistributedDataParallel(net(seed=rank, hidden=300))
ref = net(seed=0, hidden=300)
opt, ref_opt = optimizer("adam", model.parameters()), optimizer("adam", ref.parameters())
for x, y in batches(3, seed=9):
    opt.zero_grad()
    loss_fn(model(mine(x)), mine(y)).backward()
    opt.step()
    ref_opt.zero_grad()
    loss_fn(ref(x), y).backward()
    ref_opt.step()
close(list(model.module.parameters()), list(ref.parameters()), "equivalence, large buckets")
same_everywhere(list(model.module.parameters()), "equivalence, large buckets")

# ---- zero-copy bucket all-reduce: exact, odd segment sizes, mixed with packing ranks ----------
from mpidp.comm import collectives  # noqa: E402
from mpidp.comm.buckets import Bucket  # noqa: E402
from mpidp.engine.planner import plan_bucket  # noqa: E402
from mpidp.engine.dtypes import F32, as_host_array  # noqa: E402

for trial, sizes in enumerate(([5000], [1, 7, 3001, 2], [1024] * 10 + [3], [2] * 300,
                                 [40] * 200 + [1, 3])):  # > 64 pieces: several batches
    for op in ("sum", "avg", "max"):
        every = [[torch.randint(-8, 9, (s,), generator=torch.Generator().manual_seed(
            1000 * trial + 10 * q + k)).float() for k, s in enumerate(sizes)] for q in range(n)]
        stacks = [torch.stack([every[q][k] for q in range(n)]) for k in range(len(sizes))]
        want = [{"sum": st.sum(0), "avg": st.sum(0) / n, "max": st.max(0).values}[op]
                for st in stacks]
        # every rank's tensors where they lie
        got = [t.clone() for t in every[rank]]
        took = plan_bucket("host", "auto", collectives.facts(g, False), 4 * sum(sizes),
                           len(sizes), True, op).zero_copy
        # zero-copy is shm's, on one node; across nodes (hier, ring) every bucket is packed
        expect(took == (n > 1 and g.single_node and len(sizes) <= 256),
               f"zero-copy {sizes[:3]}: took={took}")
        if took:
            collectives.allreduce_segments_(g, [as_host_array(t).flat for t in got], F32, op)
        else:
            Bucket(range(len(sizes)), sizes, F32).reduce_(got, got, op, "auto", g)
        expect(all(torch.equal(a, w) for a, w in zip(got, want)), f"zero-copy {sizes[:3]} {op}")
        # odd ranks hold non-contiguous tensors and must pack while their neighbours do not
        if rank % 2:
            got = [torch.zeros(len(t), 2)[:, 1].copy_(t) for t in every[rank]]
        else:
            got = [t.clone() for t in every[rank]]
        Bucket(range(len(sizes)), sizes, F32).reduce_(got, got, op, "auto", g)
        expect(all(torch.equal(a, w) for a, w in zip(got, want)), f"mixed {sizes[:3]} {op}")

# ---- no_sync: accumulation over micro-batches == one big batch ------------------------------
for as_view in (False, True):
    model = mpidp.DistributedDataParallel(net(), bucket_cap_mb=TINY_MB,
                                          gradient_as_bucket_view=as_view)
    ref = net()
    opt, ref_opt = optimizer("momentum", model.parameters()), optimizer("momentum", ref.parameters())
    micro = batches(6, seed=11)
    for step in range(2):
        opt.zero_grad()
        ref_opt.zero_grad()
        for j in range(3):
            x, y = micro[3 * step + j]
            if j < 2:
                with model.no_sync():
                    loss_fn(model(mine(x)), mine(y)).backward()
            else:
                loss_fn(model(mine(x)), mine(y)).backward()
            loss_fn(ref(x), y).backward()
        opt.step()
        ref_opt.step()
    close(list(model.module.parameters()), list(ref.parameters()), f"no_sync view={as_view}")


# ---- unused parameters ------------------------------------------------------------------------
class Branchy(nn.Module):
    """Head b is used on even ranks only; head never is used nowhere."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(3)
        self.trunk, self.a, self.b, self.never = (nn.Linear(6, 8), nn.Linear(8, 5),
                                                  nn.Linear(8, 5), nn.Linear(8, 5))

    def forward(self, x, use_b):
        h = torch.tanh(self.trunk(x))
        return self.a(h) + self.b(h) if use_b else self.a(h)


for as_view in (False, True):
    model = mpidp.DistributedDataParallel(Branchy(), bucket_cap_mb=TINY_MB,
                                          find_unused_parameters=True,
                                          gradient_as_bucket_view=as_view)
    ref = Branchy()
    opt, ref_opt = optimizer("momentum", model.parameters()), optimizer("momentum", ref.parameters())
    for x, y in batches(3, seed=5):
        opt.zero_grad()
        loss_fn(model(mine(x), rank % 2 == 0), mine(y)).backward()
        opt.step()
        ref_opt.zero_grad()
        sum(loss_fn(ref(x[q * LOCAL:(q + 1) * LOCAL], q % 2 == 0), y[q * LOCAL:(q + 1) * LOCAL])
            for q in range(n)).div(n).backward()
        ref_opt.step()
    close(list(model.module.parameters()), list(ref.parameters()), f"find_unused view={as_view}")
    expect(model.module.never.weight.grad is None, "unused everywhere: grad should stay None")

model = mpidp.DistributedDataParallel(Branchy(), bucket_cap_mb=TINY_MB)
x, y = batches(1, seed=6)[0]
try:
    loss_fn(model(mine(x), rank % 2 == 0), mine(y)).backward()
    failures.append("unused parameters without find_unused_parameters: no error")
except MpidpError as exc:
    text = str(exc)
    expect("never.weight (on" in text and "find_unused_parameters=True" in text,
           f"unused error should name never.weight: {text}")
    expect(n == 1 or f"b.weight (on {n // 2} of {n} ranks)" in text,
           f"unused error should name b.weight and its rank count: {text}")


# ---- bucket rebuild in the order gradients became ready ---------------------------------------
class Reversed(nn.Module):
    """Registered last layer first, so registration order is not the ready order."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(4)
        self.last, self.first = nn.Linear(5, 3), nn.Linear(6, 5)

    def forward(self, x):
        return self.last(torch.tanh(self.first(x)))


model = mpidp.DistributedDataParallel(Reversed(), bucket_cap_mb=1e-6)  # one tensor per bucket
expect(model.bucket_indices == ((3,), (2,), (1,), (0,)), f"initial {model.bucket_indices}")
x, y = batches(1, seed=8)[0]
loss_fn(model(mine(x))[:, :3], mine(y) % 3).backward()
rebuilt = model.bucket_indices
expect(sorted(i for b in rebuilt for i in b) == [0, 1, 2, 3], f"rebuilt {rebuilt}")
expect({rebuilt[0][0], rebuilt[1][0]} == {0, 1}, f"last layer should come first: {rebuilt}")
expect(all(b == rebuilt for b in g.comm.allgather(rebuilt)), "rebuilt buckets differ")
loss_fn(model(mine(x))[:, :3], mine(y) % 3).backward()
expect(model.bucket_indices == rebuilt, "buckets are rebuilt only once")

# ---- construction: broadcast from rank 0, model check -----------------------------------------
model = mpidp.DistributedDataParallel(net(seed=100 + rank))
close(list(model.module.parameters()), list(net(seed=100).parameters()), "broadcast", 0)
if n > 1:
    try:
        mpidp.DistributedDataParallel(net(hidden=9 if rank == n - 1 else 8))
        failures.append("model mismatch: no error")
    except MismatchError as exc:
        expect(f"rank {n - 1}: parameter 0.weight torch.float32[9, 6] where rank 0 has "
               "parameter 0.weight torch.float32[8, 6]" in str(exc), f"mismatch text: {exc}")
    try:  # the same model, bucketed differently on one rank: caught with DDP's arguments,
        # before any bucket is built
        mpidp.DistributedDataParallel(net(), bucket_cap_mb=TINY_MB if rank == n - 1 else 25)
        failures.append("bucket_cap_mb mismatch: no error")
    except MismatchError as exc:
        expect("its arguments differ between ranks" in str(exc) and
               f"rank {n - 1}: bucket_cap_mb = {TINY_MB!r} where rank 0 has 25" in str(exc),
               f"bucket_cap_mb mismatch text: {exc}")
    # the layout check behind it, on the buckets DDP would plan with those caps
    params = [p.detach() for p in net().parameters()]
    cap = 256 if rank == n - 1 else 25 << 20
    try:
        check_same_buckets(g, plan(params, cap, min(1 << 20, cap),
                                   tuple(reversed(range(len(params))))), "DistributedDataParallel")
        failures.append("bucket layout mismatch: no error")
    except MismatchError as exc:
        expect("gradient buckets differ between ranks" in str(exc) and
               re.search(rf"rank {n - 1}: bucket 1 of \d+: 4 tensors, float32\[103\] where "
                         r"rank 0 has bucket 1 of 1: 6 tensors, float32\[159\]", str(exc)),
               f"bucket mismatch text: {exc}")
    # DDP's own arguments, compared at construction: a setting on one rank only, or a bad
    # argument there, raises on every rank and none waits (the drop-in below then trains)
    last = rank == n - 1
    try:
        mpidp.DistributedDataParallel(net(), find_unused_parameters=last)
        failures.append("find_unused_parameters on the last rank only: no error")
    except MismatchError as exc:
        expect(f"rank {n - 1}: find_unused_parameters = True where rank 0 has False"
               in str(exc), f"find_unused_parameters mismatch text: {exc}")
    try:
        mpidp.DistributedDataParallel(net(), bucket_cap_mb=-1 if last else 25)
        failures.append("bucket_cap_mb=-1 on the last rank only: no error")
    except MismatchError as exc:
        expect(not last and f"rank {n - 1}: ValueError: bucket_cap_mb must be a positive "
               "number, got -1" in str(exc), f"bad argument elsewhere: {exc!r}")
    except ValueError as exc:
        expect(last and "bucket_cap_mb must be a positive number, got -1" in str(exc),
               f"bad argument here: {exc!r}")

# ---- drop-in: a torch DDP tutorial loop with only the import and init lines changed -----------
from mpidp import DistributedDataParallel as DDP  # noqa: E402  (was torch.nn.parallel)


class ToyModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.net1 = nn.Linear(10, 10)
        self.relu = nn.ReLU()
        self.net2 = nn.Linear(10, 5)

    def forward(self, x):
        return self.net2(self.relu(self.net1(x)))


ddp_model = DDP(ToyModel(), device_ids=None)
loss_mse = nn.MSELoss()
sgd = torch.optim.SGD(ddp_model.parameters(), lr=0.001)
sgd.zero_grad()
outputs = ddp_model(torch.randn(20, 10))
labels = torch.randn(20, 5)
loss_mse(outputs, labels).backward()
sgd.step()
expect(sorted(ddp_model.state_dict()) == ["module.net1.bias", "module.net1.weight",
                                          "module.net2.bias", "module.net2.weight"],
       f"state_dict keys {sorted(ddp_model.state_dict())}")
same_everywhere(list(ddp_model.module.parameters()), "drop-in")

# ---- Horovod-style helpers ----------------------------------------------------------------------
root = n - 1
m = net(seed=200 + rank)
mpidp.broadcast_parameters(m.state_dict(), root=root)
close(list(m.parameters()), list(net(seed=200 + root).parameters()), "broadcast_parameters", 0)
mpidp.broadcast_parameters(m.named_parameters(), root=0)
same_everywhere(list(m.parameters()), "broadcast_parameters(named_parameters)")

# any dtype, non-contiguous tensors and arrays: written back into the caller's objects
odd = [torch.full((4, 3), float(rank)).t(), np.full((3, 4), rank, np.int32)[:, ::2],
       torch.tensor([rank % 2 == 0, True, False]), torch.full((5,), rank, dtype=torch.uint8)]
mpidp.broadcast_parameters(odd, root=root)
expect(torch.equal(odd[0], torch.full((3, 4), float(root))) and
       np.array_equal(odd[1], np.full((3, 2), root)) and
       torch.equal(odd[2], torch.tensor([root % 2 == 0, True, False])) and
       torch.equal(odd[3], torch.full((5,), root, dtype=torch.uint8)),
       f"broadcast_parameters of odd tensors: {odd}")

opt = torch.optim.Adam(m.parameters(), lr=0.5)
if rank == root:
    for p in m.parameters():
        p.grad = torch.full_like(p, 0.25)
    opt.step()
    opt.param_groups[0]["lr"] = 0.123
mpidp.broadcast_optimizer_state(opt, root=root)
expect(opt.param_groups[0]["lr"] == 0.123, "broadcast_optimizer_state: lr")
state = [opt.state[p][k] for p in m.parameters() for k in ("exp_avg", "exp_avg_sq", "step")]
expect(len(state) == 3 * len(list(m.parameters())), "broadcast_optimizer_state: state missing")
same_everywhere(state, "broadcast_optimizer_state")


def ints(shape, dtype, q, seed):
    gen = torch.Generator().manual_seed(seed * 100 + q)
    return torch.randint(-8, 9, shape, generator=gen).to(dtype)


DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.float16, torch.float32]
shapes = [(3, 4), (5,), (0,), (2, 3, 2), (70001,)]
for op in ("sum", "avg", "max"):
    every = [[ints(s, d, q, k) for k, (s, d) in enumerate(zip(shapes, DTYPES))]
             for q in range(n)]
    want = []
    for k in range(len(shapes)):
        stack = torch.stack([every[q][k].double() for q in range(n)])
        want.append({"sum": stack.sum(0), "avg": stack.sum(0), "max": stack.max(0).values}[op]
                    .to(DTYPES[k]))
        if op == "avg":
            want[-1] = want[-1] / n
    mine_ = [t.clone() for t in every[rank]]
    got = mpidp.grouped_allreduce(mine_, op=op, bucket_cap_mb=0.01)
    expect(all(torch.equal(a, b) for a, b in zip(mine_, every[rank])), f"grouped {op}: input")
    expect(all(torch.equal(a, b) for a, b in zip(got, want)), f"grouped {op}: values")
    mpidp.grouped_allreduce_(mine_, op=op)
    expect(all(torch.equal(a, b) for a, b in zip(mine_, want)), f"grouped_ {op}: values")
arrays = [np.full(5, rank + 1, np.int64), np.arange(3, dtype=np.int32) * (rank + 1)]
mpidp.grouped_allreduce_(arrays, op="sum")
tri = n * (n + 1) // 2
expect(np.array_equal(arrays[0], np.full(5, tri)) and np.array_equal(arrays[1], np.arange(3) * tri),
       "grouped_allreduce_ on numpy integers")

# ---- errors at the boundary (raised on every rank alike, before any communication) -----------
for call, exc_type, text in (
        (lambda: DDP("not a module"), TypeError, "torch.nn.Module"),
        (lambda: DDP(net(), bucket_cap_mb=0), ValueError, "bucket_cap_mb"),
        (lambda: DDP(net(), device_ids=["cuda:0"]), ValueError, "device_ids"),
        (lambda: DDP(net(), algorithm="fastest"), ValueError, "unknown algorithm"),
        (lambda: DDP(net(), dim=1), ValueError, "dim=1"),
        (lambda: mpidp.grouped_allreduce([torch.ones(2)], op="prod"), ValueError, "unknown op"),
        (lambda: mpidp.grouped_allreduce([torch.ones(2, dtype=torch.int64)]), ValueError,
         "floating"),
        (lambda: mpidp.grouped_allreduce([torch.ones(2)], bucket_cap_mb=-1), ValueError,
         "bucket_cap_mb"),
        (lambda: mpidp.grouped_allreduce("abc"), TypeError, "list of tensors"),
        (lambda: mpidp.broadcast_parameters(m.state_dict(), root=n), ValueError, "root"),
        (lambda: mpidp.broadcast_parameters([3.0]), TypeError, "numpy.ndarray or a CPU"),
        (lambda: mpidp.broadcast_optimizer_state("adam"), TypeError, "Optimizer")):
    try:
        call()
        failures.append(f"expected {exc_type.__name__} ({text})")
    except exc_type as exc:
        expect(text in str(exc), f"{exc_type.__name__} should mention {text!r}: {exc}")

g.comm.Barrier()
if failures:
    print(f"rank {rank} FAILED:\n  " + "\n  ".join(failures), flush=True)
    sys.exit(1)
print(f"ok {rank}", flush=True)
