"""Run under mpiexec at any world size: ``hvd.join`` as Horovod defines it (Note [Joined ranks]
in mpidp/engine/header.py). While some ranks have joined, the others' all-reduces — every
form: new, in place (also of a transposed tensor), async, grouped and fused, and
DistributedOptimizer's gradients — get zeros from the joined ranks, an average staying over
every rank; their allgather and broadcast raise on them while the joined ranks go on waiting,
and a joined rank that cannot make its zeros makes them raise rather than wait;
``join`` returns the same last-joined rank everywhere (Horovod's own test_torch.py checks,
adapted: exact sums on small integers). Training with uneven batches per rank, the ranks out
of data joining, ends as one process on the rows that were there, after Horovod's advice:
broadcast the parameters from the rank that joined last."""
import torch

import mpidp
import mpidp.horovod as hvd
from bodykit import expect, finish

hvd.init()
n, r = hvd.size(), hvd.rank()
active = n - 1 if n > 1 else 1  # ranks that add their data while one has joined

# ---- Horovod's test_horovod_join_allreduce, exact: every rank joins first once ------------
for first in range(n):
    for dtype in (torch.float32, torch.float64, torch.int32, torch.int64, torch.bfloat16):
        for dim in (1, 3):  # 3: the second try on a flat view (Note [Joined ranks])
            g = torch.Generator().manual_seed(1234 + dim)
            a = torch.randint(-100, 100, (5,) * dim, generator=g).to(dtype)
            b = torch.randint(-100, 100, (17,) * dim, generator=g).to(dtype)
            if r == first and n > 1:
                ret = hvd.join()
                continue
            ha = hvd.allreduce_async(a, op=hvd.Sum, name="tensor_a")
            hb = hvd.allreduce_async(b, op=hvd.Sum, name="tensor_b")
            sa, sb = hvd.synchronize(ha), hvd.synchronize(hb)
            expect(torch.equal(sa, a * active) and torch.equal(sb, b * active),
                   f"join {first}: allreduce {dtype} dim {dim}")
            if dtype.is_floating_point:
                avg = hvd.allreduce(b * n, op=hvd.Average)  # over every rank, joined ones too
                expect(torch.allclose(avg, b * active, rtol=1e-2 if dtype == torch.bfloat16
                                      else 1e-6), f"join {first}: Average {dtype} dim {dim}")
            ret = hvd.join()
        expect(n == 1 or ret != first, f"join returned {ret}, the rank that joined first")
        every = hvd.allgather_object(ret)
        expect(every == [ret] * n, f"join's return differs between ranks: {every}")

# ---- in place, strided, grouped and fused, Min/Max: rank n - 1 joins ----------------------
if r == n - 1 and n > 1:
    ret = hvd.join()
else:
    t = torch.arange(12, dtype=torch.float32).reshape(3, 4) + r
    expect(hvd.allreduce_(t, op=hvd.Sum) is t and
           torch.equal(t, active * torch.arange(12.0).reshape(3, 4) + sum(range(active))),
           f"allreduce_ while a rank has joined: {t}")
    u = torch.arange(6, dtype=torch.float32).reshape(2, 3) + r  # named: its stamp in the one
    expect(hvd.allreduce_(u, op=hvd.Sum, name="u") is u and       # call, then the second try's
           torch.equal(u, active * torch.arange(6.0).reshape(2, 3) + sum(range(active))),
           f"named allreduce_ while a rank has joined: {u}")
    s = (torch.arange(12, dtype=torch.float64).reshape(4, 3) + 1).t()  # not contiguous
    hvd.allreduce_(s, op=hvd.Sum)
    expect(torch.equal(s, active * (torch.arange(12.0, dtype=torch.float64).reshape(4, 3)
                                    + 1).t()), f"allreduce_ of a transposed tensor: {s}")
    st = (torch.arange(12, dtype=torch.float32).reshape(4, 3) + 1).t()  # mpidp's own call:
    mpidp.allreduce_(st, "sum")                                         # written back
    expect(torch.equal(st, active * (torch.arange(12.0).reshape(4, 3) + 1).t()),
           f"mpidp.allreduce_ of a transposed tensor while a rank has joined: {st}")
    seg = [torch.ones(3000), torch.full((2000,), 2.0)]  # above the inline size, in place:
    hvd.grouped_allreduce_(seg, op=hvd.Sum)             # reduced where they lie (zero-copy)
    expect(torch.equal(seg[0], torch.full((3000,), float(active))) and
           torch.equal(seg[1], torch.full((2000,), 2.0 * active)), "grouped in place, large")
    pair = [torch.ones(3, 2), torch.full((4,), 2.0, dtype=torch.float64)]
    hvd.grouped_allreduce_(pair, op=hvd.Sum)
    expect(torch.equal(pair[0], torch.full((3, 2), float(active))) and
           torch.equal(pair[1], torch.full((4,), 2.0 * active, dtype=torch.float64)),
           f"grouped_allreduce_ while a rank has joined: {pair}")
    big = [torch.ones(70_000), torch.ones(50, 50)]  # above the inline size: the sliced path
    out = hvd.grouped_allreduce(big, op=hvd.Sum)
    expect(torch.equal(out[0], torch.full((70_000,), float(active))) and
           torch.equal(out[1], torch.full((50, 50), float(active))), "grouped, large")
    expect(torch.equal(hvd.allreduce(torch.full((3,), r + 1.0), op=hvd.Min),
                       torch.zeros(3) if n > 1 else torch.ones(3)),
           "Min: the joined rank's zeros count, as in Horovod")
    if n > 1:  # Horovod: "not supported with Join"; raised here, the joined rank waits on
        for what, call in (("allgather", lambda: hvd.allgather(torch.ones(2, 1))),
                           ("broadcast", lambda: hvd.broadcast(torch.ones(2), 0)),
                           ("broadcast_optimizer_state", lambda: hvd.broadcast_optimizer_state(
                               torch.optim.SGD(torch.nn.Linear(2, 1).parameters(), lr=0.1), 0)),
                           ("Product", lambda: hvd.allreduce(torch.ones(2), op=hvd.Product))):
            try:
                call()
                expect(False, f"{what} while a rank has joined should raise")
            except RuntimeError as exc:
                expect("have joined" in str(exc), f"{what}: {exc}")
    hvd.barrier()
    ret = hvd.join()
expect(ret == (0 if n == 1 else n - 2), f"the last to join was rank {n - 2}, join said {ret}")

# ---- a joined rank that cannot make its zeros refuses: the others raise, none waits ---------
if n > 1:
    from mpidp.comm import joined as joined_module
    if r == n - 1:
        real = joined_module._zeros

        def broken(*args):
            joined_module._zeros = real
            raise MemoryError("no memory for the zeros (this test)")
        joined_module._zeros = broken
        try:
            hvd.join()
            expect(False, "join should raise where its zeros cannot be made")
        except MemoryError as exc:
            expect("this test" in str(exc), f"join: {exc}")
    else:
        try:
            hvd.allreduce(torch.ones(3), op=hvd.Sum)
            expect(False, "an all-reduce the joined rank refused should raise")
        except RuntimeError as exc:
            expect("rejected" in str(exc), f"the joined rank's refusal: {exc}")
    expect(torch.equal(hvd.allreduce(torch.ones(2), op=hvd.Sum), torch.full((2,), float(n))),
           "every rank in step after the refusal")

# ---- uneven batches: rank q has 6 - q steps, then joins --------------------------------------
gen = torch.Generator().manual_seed(7)
inputs, labels = torch.randn(6 * n * 4, 6, generator=gen), torch.randint(0, 3, (6 * n * 4,),
                                                                         generator=gen)
torch.manual_seed(3)
start = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))


def rows(step, q):  # rank q's 4 rows of the step
    return slice((step * n + q) * 4, (step * n + q + 1) * 4)


def model_and_optimizer(distributed):
    m = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))
    m.load_state_dict(start.state_dict())
    opt = torch.optim.SGD(m.parameters(), lr=0.5, momentum=0.9)
    if distributed:
        opt = hvd.DistributedOptimizer(opt, named_parameters=m.named_parameters())
    return m, opt


m, opt = model_and_optimizer(True)
for step in range(6 - r):
    opt.zero_grad()
    torch.nn.functional.cross_entropy(m(inputs[rows(step, r)]), labels[rows(step, r)]).backward()
    opt.step()
last = hvd.join()
expect(last == 0, f"rank 0 has the most batches and joins last; join said {last}")
hvd.broadcast_parameters(m.state_dict(), root_rank=last)

ref, ref_opt = model_and_optimizer(False)  # one process: the rows there were, averaged over n
for step in range(6):
    ref_opt.zero_grad()
    there = [q for q in range(n) if step < 6 - q]
    xs = torch.cat([inputs[rows(step, q)] for q in there])
    ys = torch.cat([labels[rows(step, q)] for q in there])
    (torch.nn.functional.cross_entropy(ref(xs), ys, reduction="sum") / (4 * n)).backward()
    ref_opt.step()
close = all(torch.allclose(p, q, atol=1e-6) for p, q in zip(m.parameters(), ref.parameters()))
expect(close, "uneven batches with join: not one process's result")
expect(torch.equal(hvd.allreduce(torch.ones(2), op=hvd.Sum), torch.full((2,), float(n))),
       "every rank back after the last join")
finish(r)
