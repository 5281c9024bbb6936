"""Run under mpiexec at any world size: a script written for Horovod (``import ... as hvd``,
``hvd.init()``, Horovod's calls and DistributedOptimizer), on mpidp.horovod. Collectives
exact on small integers for every op, factor, form (new, in place, grouped, async) and for
autograd as Horovod defines it; DistributedOptimizer training on each rank's share of a
global batch ending as one process does on the whole batch (with backward_passes_per_step,
gradient_predivide_factor and fp16 compression); the broadcasts a script makes at start-up;
alltoall with and without splits; process sets added and removed while running; the timeline
started and stopped while running (HOROVOD_TIMELINE=DYNAMIC); and what is refused, refused on
every rank."""
import contextlib
import json
import math
import os
import shutil
import tempfile
import warnings

import torch

import mpidp.horovod as hvd
from mpidp import runtime
from mpidp.errors import MismatchError
from mpidp.runtime import timeline as rt_timeline
from bodykit import expect, finish

hvd.init()
n, r = hvd.size(), hvd.rank()
expect(hvd.is_initialized() and 0 <= hvd.local_rank() < hvd.local_size() <= n, "basics")
per_node = hvd.local_size()  # ranks placed on nodes of equal size in blocks (-ppn)
expect((hvd.cross_size(), hvd.cross_rank(), hvd.is_homogeneous()) ==
       (n // per_node, r // per_node, True), "cross_size, cross_rank, is_homogeneous: "
       f"{hvd.cross_size(), hvd.cross_rank(), hvd.is_homogeneous()}")
expect(hvd.mpi_built() and hvd.mpi_enabled() and not hvd.gloo_enabled(), "build queries")

# ---- collectives: rank r holds r + 1 -------------------------------------------------------
x = torch.full((5,), float(r + 1))
expected = {hvd.Sum: n * (n + 1) / 2, hvd.Average: (n + 1) / 2, hvd.Min: 1.0, hvd.Max: float(n),
            hvd.Product: float(math.factorial(n))}
for op, value in expected.items():
    got = hvd.allreduce(x, op=op)
    expect(torch.equal(got, torch.full((5,), value)), f"allreduce op {op}: {got}")
expect(torch.equal(x, torch.full((5,), float(r + 1))), "allreduce left its input alone")
expect(torch.equal(hvd.allreduce(x), torch.full((5,), (n + 1) / 2)), "Average by default")
expect(torch.equal(hvd.allreduce(x, average=False), torch.full((5,), n * (n + 1) / 2)),
       "average=False is Sum")
got = hvd.allreduce(x, op=hvd.Sum, prescale_factor=2.0, postscale_factor=0.5)
expect(torch.equal(got, torch.full((5,), n * (n + 1) / 2)), f"pre/postscale: {got}")
ints = torch.arange(4, dtype=torch.int64) + r
expect(torch.equal(hvd.allreduce(ints, op=hvd.Sum), n * torch.arange(4) + n * (n - 1) // 2),
       "int64 Sum")
# integers as Horovod scales them: in double, truncated toward zero (an Average is a Sum
# whose postscale is divided by n); the narrow dtypes come back in their own dtype
base = torch.tensor([7, -7, 5])
odd = (base * (r + 1)).to(torch.int32)
for op, pre, post in ((hvd.Average, 1.0, 1.0), (hvd.Sum, 0.5, 1.0), (hvd.Sum, 1.0, 0.3),
                      (hvd.Average, 1.0, 3.0)):
    summed = sum((base * (q + 1)).double().mul(pre).to(torch.int32) for q in range(n))
    want = (summed.double() * (post / n if op == hvd.Average else post)).to(torch.int32)
    for form in (hvd.allreduce, hvd.allreduce_):
        got = form(odd.clone(), op=op, prescale_factor=pre, postscale_factor=post)
        expect(got.dtype == torch.int32 and torch.equal(got, want),
               f"int32 {form.__name__} op {op} x{pre} x{post}: {got} != {want}")
for dtype in (torch.uint8, torch.int8, torch.int16, torch.bool):
    small = (torch.arange(6) % 2 == 1) if dtype is torch.bool else torch.arange(6) + r
    small = small.to(dtype)
    summed = hvd.allreduce(small, op=hvd.Sum)
    want = (sum(((torch.arange(6) % 2 == 1).to(torch.int32) if dtype is torch.bool
                 else torch.arange(6) + q) for q in range(n))).to(dtype)
    expect(summed.dtype == dtype and torch.equal(summed, want), f"{dtype} Sum: {summed}")
    every = hvd.allgather(small.reshape(2, 3))
    expect(every.dtype == dtype and every.shape == (2 * n, 3), f"{dtype} allgather")
    top = hvd.broadcast(small, n - 1)
    expect(top.dtype == dtype and torch.equal(hvd.broadcast_(small.clone(), n - 1), top),
           f"{dtype} broadcast")
# a narrow dtype is summed in it, wrapping, before its postscale, as Horovod's: uint8 200 on
# every rank averaged is (200 n mod 256) / n, truncated (72 at n = 2)
wrapped = hvd.allreduce(torch.full((3,), 200, dtype=torch.uint8), op=hvd.Average)
expect(wrapped.dtype == torch.uint8 and torch.equal(wrapped, torch.full((3,), 200 * n % 256 // n,
                                                                        dtype=torch.uint8)),
       f"uint8 Average wraps before it scales: {wrapped}")
y = x.clone()
expect(hvd.allreduce_(y, op=hvd.Sum) is y and torch.equal(y, torch.full((5,), n * (n + 1) / 2)),
       "allreduce_ in place")
# Note [Pending operations]: an async operation is pending until its poll or synchronize,
# or the next operation but barrier; a name pending twice is refused on its rank alone
h = hvd.allreduce_async(x, op=hvd.Max)
expect(not hvd.poll(h) and hvd.poll(h) and
       torch.equal(hvd.synchronize(h), torch.full((5,), float(n))), "async: poll")
if r == 0:
    first = hvd.allgather_async(x, name="twice")
    try:
        hvd.allgather_async(x, name="twice")
        expect(False, "a name pending twice should be refused")
    except ValueError as exc:
        expect("already in flight" in str(exc), str(exc))
hvd.barrier()  # rank 0's allgather stays pending across it, as in Horovod
if r != 0:
    first = hvd.allgather_async(x, name="twice")
hvd.barrier()
ahead = hvd.broadcast_async(x, root_rank=0)
expect(torch.equal(hvd.allreduce(x, op=hvd.Sum), torch.full((5,), n * (n + 1) / 2)) and
       torch.equal(hvd.synchronize(first), torch.cat([torch.full((5,), q + 1.0) for q in
                                                      range(n)])) and
       torch.equal(hvd.synchronize(ahead), torch.ones(5)) and hvd.synchronize(ahead) is None,
       "pending operations run before the next one, in order")
pair = [x.clone(), torch.arange(3, dtype=torch.float64) * (r + 1)]
out = hvd.grouped_allreduce(pair, op=hvd.Sum)
expect(torch.equal(out[0], torch.full((5,), n * (n + 1) / 2)) and
       torch.equal(out[1], torch.arange(3, dtype=torch.float64) * n * (n + 1) / 2), "grouped")
hvd.grouped_allreduce_(pair, op=hvd.Average)
expect(torch.equal(pair[0], torch.full((5,), (n + 1) / 2)), "grouped in place")
half = hvd.allreduce(x, op=hvd.Sum, compression=hvd.Compression.fp16)
expect(half.dtype == torch.float32 and torch.equal(half, torch.full((5,), n * (n + 1) / 2)),
       "fp16 compression: back to float32, exact on small integers")

rows = torch.full((r + 1, 2), float(r))  # first dimensions differ
gathered = hvd.allgather(rows)
expect(torch.equal(gathered, torch.cat([torch.full((q + 1, 2), float(q)) for q in range(n)])),
       f"allgather: {gathered}")
root = n - 1
b = torch.full((3,), float(r))
expect(torch.equal(hvd.broadcast(b, root), torch.full((3,), float(root))) and
       torch.equal(b, torch.full((3,), float(r))), "broadcast")
expect(hvd.broadcast_(b, root) is b and torch.equal(b, torch.full((3,), float(root))),
       "broadcast_")
whole = torch.arange(2 * n + 1, dtype=torch.float32).repeat_interleave(2).reshape(-1, 2)
mine = hvd.reducescatter(whole * (r + 1), op=hvd.Sum)
block = torch.tensor_split(whole, n)[r] * (n * (n + 1) / 2)
expect(torch.equal(mine, block), f"reducescatter: {mine} != {block}")
hvd.barrier()

# ---- autograd, as Horovod defines it --------------------------------------------------------
a = torch.full((4,), float(r + 1), requires_grad=True)
hvd.allreduce(a, op=hvd.Sum).sum().backward()
expect(torch.equal(a.grad, torch.full((4,), float(n))), f"allreduce's gradient: {a.grad}")
g_in = torch.full((r + 1, 2), 1.0, requires_grad=True)
weights = torch.arange(n * (n + 1) // 2 * 2, dtype=torch.float32).reshape(-1, 2)
(hvd.allgather(g_in) * weights).sum().backward()
start = r * (r + 1) // 2
expect(torch.equal(g_in.grad, weights[start:start + r + 1]), "allgather's gradient: averaged")
c = torch.ones(3, requires_grad=True)
hvd.broadcast(c, 0).sum().backward()
expect(torch.equal(c.grad, torch.full((3,), 1.0 if r == 0 else 0.0)),
       "broadcast's gradient: averaged on the root")

# reducescatter's gradient, Horovod's: every rank's gathered, times n for Sum, times the
# factors, an Average's not divided
rs_in = torch.ones(2 * n, 2, requires_grad=True)
(hvd.reducescatter(rs_in, op=hvd.Sum, postscale_factor=0.5) * (r + 1)).sum().backward()
want = torch.cat([torch.full((2, 2), (q + 1) * n * 0.5) for q in range(n)])
expect(torch.equal(rs_in.grad, want), f"reducescatter's gradient (Sum): {rs_in.grad}")
rs_in.grad = None
(hvd.reducescatter(rs_in) * (r + 1)).sum().backward()
want = torch.cat([torch.full((2, 2), q + 1.0) for q in range(n)])
expect(torch.equal(rs_in.grad, want), f"reducescatter's gradient (Average): {rs_in.grad}")
pieces = hvd.grouped_reducescatter([torch.ones(n, 1) * (r + 1), torch.arange(2.0 * n) * (r + 1)],
                                   op=hvd.Sum)
expect(torch.equal(pieces[0], torch.full((1, 1), n * (n + 1) / 2)) and
       torch.equal(pieces[1], torch.arange(2.0 * r, 2.0 * r + 2) * n * (n + 1) / 2),
       f"grouped_reducescatter: {pieces}")
h = hvd.grouped_reducescatter_async([torch.ones(n, 3)], op=hvd.Sum)
expect(torch.equal(hvd.synchronize(h)[0], torch.full((1, 3), float(n))), "its _async form")
sparse = torch.zeros(4, 2)
sparse[r % 4] = r + 1.0
gathered = hvd.sparse_allreduce_async(sparse.to_sparse(), name="sparse", op=hvd.Average)()
expect(torch.equal(gathered.to_dense(), sum(torch.zeros(4, 2).index_fill(0, torch.tensor(
    [q % 4]), q + 1.0) for q in range(n)) / n), f"sparse_allreduce_async: {gathered}")
expect(issubclass(hvd.HorovodInternalError, RuntimeError), "HorovodInternalError")

# ---- the broadcasts a script starts with -----------------------------------------------------
torch.manual_seed(100 + r)  # every rank starts elsewhere
model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))
hvd.broadcast_parameters(model.state_dict(), root_rank=0)
first = [p.detach().clone() for p in model.parameters()]
every = hvd.allgather(torch.cat([p.reshape(-1) for p in first]).reshape(1, -1))
expect(all(torch.equal(every[0], every[q]) for q in range(n)), "broadcast_parameters")
expect(hvd.broadcast_object({"epoch": 3 + r, "lr": [0.1]}, root_rank=root) ==
       {"epoch": 3 + root, "lr": [0.1]}, "broadcast_object")
expect(hvd.allgather_object(("rank", r)) == [("rank", q) for q in range(n)], "allgather_object")

# ---- DistributedOptimizer: n ranks, each its rows of a global batch == one process --------
g = torch.Generator().manual_seed(7)
inputs = torch.randn(4 * n * 6, 6, generator=g)
labels = torch.randint(0, 3, (4 * n * 6,), generator=g)


def loss_of(m, xs, ys):
    return torch.nn.functional.cross_entropy(m(xs), ys)


# broadcast_optimizer_state on an optimizer without state, Horovod's: each parameter that
# requires a gradient gets a zero one (kept), the optimizer's own step runs once, and an
# optimizer built without names names its parameters allreduce.noname.<group>.<index>
fresh = torch.nn.Linear(3, 2)
fresh.bias.requires_grad_(False)
fresh_opt = hvd.DistributedOptimizer(torch.optim.SGD(
    [{"params": [fresh.weight]}, {"params": [fresh.bias]}], lr=0.1, momentum=0.9))
expect(sorted(fresh_opt._parameter_names.values()) ==
       ["allreduce.noname.0.0", "allreduce.noname.1.0"], f"{fresh_opt._parameter_names}")
hvd.broadcast_optimizer_state(fresh_opt, root_rank=0)
expect(torch.equal(fresh.weight.grad, torch.zeros(2, 3)) and fresh.bias.grad is None and
       len(fresh_opt.state_dict()["state"]) == 1, "broadcast_optimizer_state of a new optimizer")


def train(distributed: bool, passes: int = 1, **options):
    m = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))
    with torch.no_grad():
        for p, p0 in zip(m.parameters(), first):
            p.copy_(p0)
    opt = torch.optim.SGD(m.parameters(), lr=0.5, momentum=0.9)
    if distributed:
        opt = hvd.DistributedOptimizer(opt, named_parameters=m.named_parameters(),
                                       backward_passes_per_step=passes, **options)
        hvd.broadcast_optimizer_state(opt, root_rank=0)
    per_step = 4 * n
    for step in range(6):
        rows = slice(step * per_step, (step + 1) * per_step)
        xs, ys = inputs[rows], labels[rows]
        opt.zero_grad()
        for k in range(passes):  # the batch in `passes` parts, gradients summed
            part = slice(k * per_step // passes, (k + 1) * per_step // passes)
            px, py = xs[part], ys[part]
            if distributed:  # this rank's share of the part: every n-th row
                px, py = px[r::n], py[r::n]
            loss_of(m, px, py).backward()
        opt.step()
    return [p.detach() for p in m.parameters()]


reference = train(False)
for options, passes, tol in (({}, 1, 1e-6), ({}, 2, 1e-6),
                             ({"gradient_predivide_factor": 2.0}, 1, 1e-6),
                             ({"compression": hvd.Compression.fp16}, 1, 2e-3)):
    got = train(True, passes, **options)
    ref = reference if passes == 1 else train(False, passes)
    close = all(torch.allclose(p, q, rtol=tol, atol=tol) for p, q in zip(got, ref))
    expect(close, f"DistributedOptimizer {options} passes={passes}: not one process's result")

# ---- gradients all-reduced during backward (Note [Gradients during backward]) ---------------
# buckets of one parameter each (groups=), so that each launches from its hook: with a
# SyncBatchNorm layer and a differentiable hvd.allreduce between the layers (their backward's
# all-reduces come between the buckets), a metric all-reduced between backward and step, and
# the model's two halves under two DistributedOptimizers at once; every rank ends as one
# process with BatchNorm on the whole batch.
class Touch(torch.nn.Module):
    """x plus the all-reduced sum of zeros: x itself, with an hvd all-reduce in backward."""

    def __init__(self, distributed: bool):
        super().__init__()
        self.distributed = distributed

    def forward(self, h):
        return h + hvd.allreduce(h * 0, op=hvd.Sum) if self.distributed else h


def train_busy(distributed: bool, two: bool, **options):
    torch.manual_seed(3)
    norm = hvd.SyncBatchNorm(8) if distributed else torch.nn.BatchNorm1d(8)
    m = torch.nn.Sequential(torch.nn.Linear(6, 8), norm, torch.nn.Tanh(), Touch(distributed),
                            torch.nn.Linear(8, 3))
    halves = [list(m[0].parameters()) + list(m[1].parameters()), list(m[4].parameters())]
    opts = [torch.optim.SGD(h, lr=0.5, momentum=0.9) for h in (halves if two else [halves[0]
                                                                               + halves[1]])]
    if distributed:
        opts = [hvd.DistributedOptimizer(o, **options) for o in opts]
    for step in range(4):
        rows = slice(step * 4 * n, (step + 1) * 4 * n)
        xs, ys = inputs[rows], labels[rows]
        if distributed:
            xs, ys = xs[r::n], ys[r::n]
        for o in opts:
            o.zero_grad()
        loss = torch.nn.functional.cross_entropy(m(xs), ys)
        loss.backward()
        if distributed:
            metric = hvd.allreduce(loss.detach(), op=hvd.Sum)
            expect(torch.isfinite(metric).all(), f"a metric between backward and step: {metric}")
        for o in opts:
            o.step()
    stats = [o._hvd_buckets.stats for o in opts] if distributed else []
    return [p.detach() for p in m.parameters()], \
        [(s["launched_in_backward"], s["buckets"]) for s in stats]


busy_ref, _ = train_busy(False, False)
# per optimizer and step: 6 parameters in 6 groups; 4 in 3 groups and 2 in 2 (of 3, one
# empty); mpidp's buckets: the 6 in one (under 1 MiB)
for two, options, per_step in ((False, {"groups": 6}, [6]), (True, {"num_groups": 3}, [3, 2]),
                               (False, {}, [1])):
    got, launched = train_busy(True, two, **options)
    close = all(torch.allclose(p, q, rtol=1e-5, atol=1e-6) for p, q in zip(got, busy_ref))
    expect(close, f"gradients during backward, two optimizers={two}, {options}: not one "
           "process's result")
    expect(launched == [(4 * k, 4 * k) for k in per_step],
           f"every bucket launched from the hooks, {options}: {launched}")

# a parameter with a gradient on rank 0 only: elsewhere its bucket (the last: the parameter
# comes first) is held back, and the metric between backward and step launches it with zeros
# first, so that every rank pairs its calls alike; the average is rank 0's gradient over n
extra, body_layer = torch.nn.Linear(6, 3, bias=False), torch.nn.Linear(6, 3)
hvd.broadcast_parameters(list(extra.parameters()) + list(body_layer.parameters()), root_rank=0)
uneven = hvd.DistributedOptimizer(torch.optim.SGD([extra.weight, *body_layer.parameters()],
                                                  lr=0.0), groups=3)
xs = inputs[:4 * n][r::n]
loss = body_layer(xs).sum() + (extra(xs).sum() if r == 0 else 0.0)
loss.backward()
metric = hvd.allreduce(torch.tensor([float(r)]), op=hvd.Sum)
expect(torch.equal(metric, torch.tensor([n * (n - 1) / 2])), f"metric with a bucket held back: "
       f"{metric}")
uneven.step()
rows_of_0 = inputs[:4 * n][0::n].sum(0)
expect(torch.allclose(extra.weight.grad, rows_of_0.expand(3, 6) / n, atol=1e-6),
       f"a gradient of rank 0 only, averaged: {extra.weight.grad}")
held = uneven._hvd_buckets.stats
expect((held["launched_in_backward"], held["buckets"]) == ((3, 3) if r == 0 else (2, 3)),
       f"the bucket held back where the gradient is missing: {held}")
if n > 1:  # two optimizers, the second's parameter used on rank 0 only (and last, so its
    # bucket is queued there first): the buckets would pair across optimizers; their names
    # in the headers make it an error on every rank, not a wrong average
    pa, pb = torch.nn.Parameter(torch.ones(4)), torch.nn.Parameter(torch.ones(4))
    first_opt, second_opt = (hvd.DistributedOptimizer(torch.optim.SGD([p], lr=0.0))
                             for p in (pa, pb))
    crossing = (pa * (1.0 + r)).sum()
    if r == 0:
        crossing = crossing + (pb * 100.0).sum()
    crossing.backward()
    said = []
    for o in (first_opt, second_opt):
        try:
            o.step()
        except MismatchError as exc:
            said.append(str(exc))
    expect(len(said) == 2 and all("at DistributedOptimizer bucket 1 of 1 (allreduce.noname."
                                  in e for e in said), f"crossed buckets: {said}")
net = torch.nn.Linear(2, 2)
again = hvd.DistributedOptimizer(torch.optim.SGD(net.parameters(), lr=0.1))
net(torch.ones(1, 2)).sum().backward()
again.synchronize()
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    again.step()  # a second all-reduce: Horovod warns
expect(any("skip_synchronize" in str(w.message) for w in caught), "step after synchronize "
       "should warn")

mixed = torch.nn.Linear(2, 2)
frozen = torch.nn.Parameter(torch.zeros(2), requires_grad=False)
hvd.DistributedOptimizer(torch.optim.SGD([*mixed.parameters(), frozen], lr=0.1),
                         groups=[[mixed.weight, frozen], []])  # as Horovod takes them
for groups, why in ((-1, "positive integer"), ([[mixed.weight], [mixed.weight]], "groups[0]"),
                    ([[torch.zeros(1, requires_grad=True)]], "not one of")):
    try:
        hvd.DistributedOptimizer(torch.optim.SGD(mixed.parameters(), lr=0.1), groups=groups)
        expect(False, f"groups={groups!r} should be refused")
    except ValueError as exc:
        expect(why in str(exc), f"groups={groups!r}: {exc}")
opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
expect(isinstance(opt, torch.optim.SGD), "the optimizer is still an SGD")
loss_of(model, inputs[:4], labels[:4]).backward()
try:
    opt.zero_grad()
    expect(False, "zero_grad between backward and step should raise, as Horovod's does")
except AssertionError as exc:
    expect("before optimizer.step() or optimizer.synchronize()" in str(exc), str(exc))
opt.synchronize()
with opt.skip_synchronize():
    opt.step()

# ---- sparse gradients (Note [Sparse gradients] in mpidp/horovod/sparse.py) -------------------
# an nn.Embedding(sparse=True) and a Linear after it, in one bucket; rank q looks up q + 2 rows
# (some repeated within and across ranks) with integer weights: n ranks == one process on
# every rank's lookups, exactly (integers throughout; Average's loss is n times the rank's,
# so its 1/n leaves integers)
def lookups(step: int, q: int) -> tuple:
    ids = torch.tensor([(3 * q + 2 * j + step) % 7 for j in range(q + 2)])
    return ids, torch.arange(1.0, q + 3).reshape(-1, 1) + step


def sparse_model() -> tuple:
    emb, lin = torch.nn.Embedding(7, 3, sparse=True), torch.nn.Linear(3, 1)
    with torch.no_grad():
        emb.weight.copy_(torch.arange(21.0).reshape(7, 3) % 5 - 2)
        lin.weight.copy_(torch.tensor([[1.0, -1.0, 2.0]]))
        lin.bias.fill_(1.0)
    return emb, lin


def train_sparse(distributed: bool, op=hvd.Average, passes: int = 1, **options) -> tuple:
    emb, lin = sparse_model()
    opt = torch.optim.SGD([*emb.parameters(), *lin.parameters()], lr=1.0)
    if distributed:
        opt = hvd.DistributedOptimizer(opt, op=op, backward_passes_per_step=passes, **options)
    grads = []
    for step in range(2):
        opt.zero_grad()
        for k in range(passes):
            for q in ([r] if distributed else range(n)):
                ids, w = lookups(2 * step + k, q)
                scale = n if distributed and op == hvd.Average else 1
                (scale * lin(emb(ids)) * w).sum().backward()
        if distributed:
            opt.synchronize()
        grads.append(emb.weight.grad)
        with opt.skip_synchronize() if distributed else contextlib.nullcontext():
            opt.step()
    return [emb.weight.detach(), *lin.parameters()], grads


for passes in (1, 2):
    want, want_grads = train_sparse(False, passes=passes)
    for op, as_dense in ((hvd.Average, False), (hvd.Sum, False), (hvd.Average, True),
                         (hvd.Sum, True)):
        got, grads = train_sparse(True, op, passes, sparse_as_dense=as_dense)
        what = f"sparse gradients, op={op} sparse_as_dense={as_dense} passes={passes}"
        expect(all(torch.equal(a, b) for a, b in zip(got, want)), f"{what}: {got} != {want}")
        # Horovod's form: gathered, sparse in the rows; as dense, sparse in every dimension
        # (alone, as it was: Horovod reduces nothing at size 1)
        expect(all(g.is_sparse and g.sparse_dim() == (2 if as_dense and n > 1 else 1) and
                   torch.equal(g.to_dense(), h.to_dense()) for g, h in zip(grads, want_grads)),
               f"{what}: gradients {grads}")
# torch.optim.SparseAdam takes the sparse result: one step equal to one process's
for as_dense in (False, True):
    adams = []
    for distributed in (False, True):
        emb, _ = sparse_model()
        adam = torch.optim.SparseAdam(list(emb.parameters()), lr=0.5)
        if distributed:
            adam = hvd.DistributedOptimizer(adam, sparse_as_dense=as_dense)
        for q in ([r] if distributed else range(n)):
            ids, w = lookups(0, q)
            ((n if distributed else 1) * emb(ids) * w).sum().backward()
        adam.step()
        adams.append(emb.weight.detach())
    expect(torch.equal(adams[0], adams[1]) and not torch.equal(adams[0], sparse_model()[0].weight),
           f"SparseAdam, sparse_as_dense={as_dense}: {adams}")

# ---- SyncBatchNorm: each rank its rows == BatchNorm on the whole batch ----------------------
whole_x = torch.arange(2 * n * 4, dtype=torch.float32).reshape(2 * n, 4) % 7
sync_bn, plain = hvd.SyncBatchNorm(4), torch.nn.BatchNorm1d(4)
mine_x = whole_x[r::n].clone().requires_grad_()
ref_x = whole_x.clone().requires_grad_()
(sync_bn(mine_x) * torch.arange(4.0)).sum().backward()
(plain(ref_x) * torch.arange(4.0)).sum().backward()
expect(torch.allclose(sync_bn.running_mean, plain.running_mean, atol=1e-6) and
       torch.allclose(sync_bn.running_var, plain.running_var, atol=1e-6) and
       torch.allclose(mine_x.grad, ref_x.grad[r::n], atol=1e-5), "SyncBatchNorm")

# ---- alltoall: rank r sends rank j j + 1 rows of 10 r + j ------------------------------------
sent = torch.cat([torch.full((j + 1, 2), 10.0 * r + j) for j in range(n)]).requires_grad_()
got, received = hvd.alltoall(sent, splits=torch.arange(1, n + 1, dtype=torch.int32))
expect(torch.equal(got, torch.cat([torch.full((r + 1, 2), 10.0 * j + r) for j in range(n)]))
       and received.tolist() == [r + 1] * n, f"alltoall with splits: {got} {received}")
(got * (r + 1)).sum().backward()  # rows that went to rank j come back with j + 1
expect(torch.equal(sent.grad, torch.cat([torch.full((j + 1, 2), j + 1.0) for j in range(n)])),
       f"alltoall's gradient: {sent.grad}")
even = torch.arange(2 * n, dtype=torch.int64).reshape(-1, 1) + 100 * r  # 2 rows to each rank
out, counts = hvd.synchronize(hvd.alltoall_async(even))
expect(torch.equal(hvd.alltoall(even), out) and counts.tolist() == [2] * n and
       torch.equal(out.flatten(), torch.tensor([100 * j + 2 * r + k for j in range(n)
                                                for k in (0, 1)])), f"alltoall even: {out}")

# ---- process sets, added and removed while running ------------------------------------------
evens = list(range(0, n, 2))
if n == 1:  # the one rank's set is the global one's
    try:
        hvd.add_process_set(evens)
        expect(False, "a duplicate of the global set should be refused")
    except ValueError as exc:
        expect("duplicate process set" in str(exc), str(exc))
else:
    ps = hvd.add_process_set(evens)
    expect(ps.process_set_id == 1 and ps.size() == len(evens) and ps.included() == (r % 2 == 0),
           f"process set: {ps}")
    if ps.included():
        expect(ps.rank() == r // 2, "rank in the set")
        total = hvd.allreduce(x, op=hvd.Sum, process_set=ps)
        expect(torch.equal(total, torch.full((5,), float(sum(q + 1 for q in evens)))),
               f"allreduce on a set: {total}")
        expect(torch.equal(hvd.broadcast(b * 0 + r, evens[-1], process_set=ps),
                           torch.full((3,), float(evens[-1]))), "broadcast on a set, global root")
        expect(torch.equal(hvd.allgather(torch.tensor([r]), process_set=ps), torch.tensor(evens)),
               "allgather on a set")
        model = torch.nn.Linear(2, 1, bias=False)
        torch.nn.init.constant_(model.weight, float(r))
        hvd.broadcast_parameters(model.state_dict(), root_rank=evens[-1], process_set=ps)
        set_opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=1.0),
                                           process_set=ps)
        model(torch.full((1, 2), float(r + 1))).sum().backward()
        set_opt.step()  # the gradient averaged over the set: mean of (q + 1) over evens
        mean = sum(q + 1 for q in evens) / len(evens)
        expect(torch.equal(model.weight.detach(), torch.full((1, 2), evens[-1] - mean)),
               f"DistributedOptimizer on a set: {model.weight}")
        k, total = len(evens), sum(q + 1 for q in evens)
        rows = torch.arange(2.0 * k).reshape(k, 2)
        expect(torch.equal(hvd.reducescatter(rows * (r + 1), op=hvd.Sum, process_set=ps),
                           (rows * total)[ps.rank():ps.rank() + 1]), "reducescatter on a set")
        y2 = torch.full((3,), float(r))
        hvd.allreduce_(y2, op=hvd.Max, process_set=ps)
        expect(torch.equal(y2, torch.full((3,), float(evens[-1]))), "allreduce_ on a set")
        pair2 = hvd.grouped_allreduce([torch.ones(2), torch.ones(3, dtype=torch.float64)],
                                      op=hvd.Sum, process_set=ps)
        expect(torch.equal(pair2[1], torch.full((3,), float(k), dtype=torch.float64)),
               "grouped_allreduce on a set")
        expect(hvd.broadcast_object({"r": r}, root_rank=evens[-1], process_set=ps) ==
               {"r": evens[-1]} and hvd.allgather_object(r, process_set=ps) == evens,
               "object calls on a set")
        expect(torch.equal(hvd.alltoall(torch.full((k, 1), float(r)), process_set=ps),
                           torch.tensor(evens, dtype=torch.float32).reshape(k, 1)),
               "alltoall on a set")
        hvd.barrier(process_set=ps)
        leaf = torch.ones(2, requires_grad=True)
        pending = hvd.allreduce(leaf, op=hvd.Sum, process_set=ps)  # its backward comes later
    else:
        try:
            hvd.allreduce(x, process_set=ps)
            expect(False, "a rank outside the set should be refused")
        except ValueError as exc:
            expect(f"rank {r} is not in" in str(exc), str(exc))
        # Horovod's: a DistributedOptimizer on a set without this rank reduces nothing here
        alone = torch.nn.Linear(2, 1, bias=False)
        torch.nn.init.constant_(alone.weight, 1.0)
        alone_opt = hvd.DistributedOptimizer(torch.optim.SGD(alone.parameters(), lr=1.0),
                                             process_set=ps)
        alone(torch.full((1, 2), float(r))).sum().backward()
        alone_opt.step()
        expect(torch.equal(alone.weight.detach(), torch.full((1, 2), 1.0 - r)),
               f"DistributedOptimizer outside its set: a plain step: {alone.weight}")
    expect(hvd.remove_process_set(ps) and ps.process_set_id is None, "remove_process_set")
    if r % 2 == 0:  # Note [Process sets in autograd]: the removed set is named, on every member
        try:
            pending.sum().backward()
            expect(False, "backward through a removed set should raise")
        except ValueError as exc:
            expect("has not been added" in str(exc), f"backward after removal: {exc}")

# ---- the timeline started and stopped while running (Note [A timeline started while running])
# every rank calls start/stop, each naming its own file (Horovod's test: a temporary file per
# rank); rank 0's is written. The body runs without HOROVOD_TIMELINE: set here, as a script
# sets it before hvd.init, and read by start_timeline when called
folder = tempfile.mkdtemp(prefix=f"hvd-timeline-{r}-")
files = {k: os.path.join(folder, f"{k}.json") for k in ("first", "second", "third")}


def trace_of(path):
    """The events of rank 0's trace at ``path``, by name: {name: set of ranks}."""
    with open(path) as f:
        events = json.load(f)["traceEvents"]
    seen = {}
    for e in events:
        key = e["args"]["name"] if e["name"] == "process_name" else e["name"]
        seen.setdefault(key, set()).add(e["pid"])
    return seen


static = bool(os.environ.get("MPIDP_TIMELINE"))  # a timeline from init: nothing to refuse
saved_timeline = os.environ.pop("HOROVOD_TIMELINE", None)
res = runtime.init_group().resources
one_call = res.fast_allreduce
if not static:
    try:
        hvd.start_timeline(files["first"])
        expect(False, "start_timeline without HOROVOD_TIMELINE should raise")
    except ValueError as exc:
        expect("Set HOROVOD_TIMELINE=DYNAMIC" in str(exc) and not rt_timeline.ON, str(exc))
    expect(torch.equal(hvd.allreduce(x, op=hvd.Sum), torch.full((5,), n * (n + 1) / 2)),
           "usable after start_timeline refused")
os.environ["HOROVOD_TIMELINE"] = "DYNAMIC"
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    hvd.start_timeline(files["first"])
    hvd.start_timeline(files["first"], mark_cycles=True)  # the file being recorded: nothing
    recording = rt_timeline.ON and res.fast_allreduce is None
    got = hvd.allreduce(x, op=hvd.Sum, name="test_allreduce")
    hvd.stop_timeline()
late = [w for w in caught if "HOROVOD_TIMELINE was set after" in str(w.message)]
expect(len(late) == (0 if rt_timeline._WRAP else 1), f"the late-variable warning: {late}")
expect(recording and not rt_timeline.ON and res.fast_allreduce == one_call,
       "recording holds the one-call path off, and stop gives it back")
expect(torch.equal(got, torch.full((5,), n * (n + 1) / 2)), f"named allreduce recorded: {got}")
if r == 0:
    seen = trace_of(files["first"])
    expect({f"rank {q}" for q in range(n)} <= set(seen), f"every rank's track: {seen}")
    expect(seen.get("allreduce.test_allreduce") == set(range(n)), f"the named op: {seen}")
hvd.start_timeline(files["second"])
hvd.allreduce(x, name="in_second")
hvd.start_timeline(files["third"])  # another file: the second is written first
hvd.allreduce(x, name="in_third")
hvd.stop_timeline()
hvd.stop_timeline()  # none records: nothing
if r == 0:
    second, third = trace_of(files["second"]), trace_of(files["third"])
    expect("allreduce.in_second" in second and "allreduce.in_third" not in second and
           "allreduce.in_third" in third and "allreduce.in_second" not in third,
           f"start with another file: {sorted(second)} then {sorted(third)}")
try:  # rank 0's folder cannot be written: every rank raises, nothing records
    hvd.start_timeline(os.path.join(folder, "missing", "t.json"))
    expect(False, "an unwritable timeline should raise")
except ValueError as exc:
    expect("cannot write" in str(exc) and not rt_timeline.ON, str(exc))
if n > 1:  # rank 0 starts (then stops) the timeline while the others all-reduce: every rank raises
    for call in (lambda: hvd.start_timeline(files["first"]), hvd.stop_timeline):
        try:
            if r == 0:
                call()
            else:
                hvd.allreduce_(torch.ones(2), op=hvd.Sum)
            expect(False, "start/stop_timeline on rank 0 alone should raise on every rank")
        except MismatchError:
            pass
        expect(not rt_timeline.ON and torch.equal(hvd.allreduce(x, op=hvd.Sum),
                                                  torch.full((5,), n * (n + 1) / 2)),
               "usable after a timeline call on rank 0 alone")
os.environ.pop("HOROVOD_TIMELINE")
if saved_timeline is not None:
    os.environ["HOROVOD_TIMELINE"] = saved_timeline
shutil.rmtree(folder)

# ---- refused on every rank, at the same call -------------------------------------------------
for call, words in ((lambda: hvd.allreduce(x, op=hvd.Adasum), "Adasum"),
                    (lambda: hvd.alltoall(torch.ones(3), splits=[5] * n), "do not split"),
                    (lambda: hvd.broadcast_object(object(), root_rank=0), "broadcast_object")):
    try:
        call()
        expect(False, f"{words}: should have been refused")
    except (NotImplementedError, ValueError) as exc:
        expect(words in str(exc), f"{words}: {exc}")
if n > 1:  # shapes that differ between ranks: every rank raises, none waits
    try:
        hvd.allreduce(torch.ones(2 + (r == 0)), op=hvd.Sum)
        expect(False, "mismatched shapes should raise")
    except Exception as exc:  # noqa: BLE001 - mpidp's MismatchError
        expect("shape" in str(exc) or "differ" in str(exc), f"mismatch: {exc}")
    try:  # rows that do not split on rank 0 only
        hvd.alltoall(torch.ones(n + (r == 0)))
        expect(False, "alltoall of rows that do not split should raise on every rank")
    except Exception as exc:  # noqa: BLE001 - rank 0's ValueError, a MismatchError elsewhere
        expect("do not split evenly" in str(exc) or "rank 0" in str(exc), f"alltoall: {exc}")
    emb = torch.nn.Embedding(5, 2, sparse=(r == 0))  # sparse gradients on rank 0 only
    sparse_opt = hvd.DistributedOptimizer(torch.optim.SGD(emb.parameters(), lr=0.1))
    emb(torch.tensor([1, 2])).sum().backward()
    try:  # gathered on rank 0, all-reduced elsewhere: Note [Sparse gradients]
        sparse_opt.step()
        expect(False, "a gradient sparse on rank 0 only should raise on every rank")
    except MismatchError as exc:
        expect("sparse gradients gathered: allreduce.noname." in str(exc), str(exc))
emb = torch.nn.Embedding(5, 2, sparse=True)
hvd.broadcast_parameters(emb.state_dict(), root_rank=0)
start_w = emb.weight.detach().clone()
dense_opt = hvd.DistributedOptimizer(torch.optim.SGD(emb.parameters(), lr=1.0),
                                     sparse_as_dense=True)
emb(torch.tensor([r % 5])).sum().backward()
dense_opt.step()
lookups = torch.zeros(5, 2)
for q in range(n):
    lookups[q % 5] += 1.0 / n  # the averaged gradient of every rank's one lookup
expect(torch.allclose(emb.weight.detach(), start_w - lookups, atol=1e-6), "sparse_as_dense")
expect(torch.equal(hvd.allreduce(x, op=hvd.Sum), torch.full((5,), n * (n + 1) / 2)),
       "usable after the refusals")
finish(r)
