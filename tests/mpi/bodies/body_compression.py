"""Run under mpiexec at any world size, without torch.distributed: mpidp's own compression
hooks on mpidp's DistributedDataParallel (Note [Compressed buckets] in mpidp/ddp/compression.py,
Note [PowerSGD] in mpidp/ddp/powersgd.py).
- fp16 and bf16 exact against their definition: every rank's gradient is n*u*(1+eps), u a
  small multiple of 1/4 and eps tiny, so rounding leaves n*u (bf16) or u (fp16, divided
  first) and every sum is exact: the average must be sum(u) bit for bit — not the float32
  average, which eps moves. The fused C path, the hook function (on the generic hook path)
  and gradient_as_bucket_view all give it.
- PowerSGD: plain averaging before start_powerSGD_iter; a rank-1 gradient reproduced; error
  feedback telescopes (the sum of what was applied plus the ranks' mean error is the sum of
  the true averages); every rank ends with the same bits; state_dict resumes bit for bit.
- at n >= 2, another hook or PowerSGD setting on one rank is refused on every rank at the first
  backward, naming it, and training goes on.
Prints 'ok <rank>'."""
import torch
from torch import nn

import mpidp
from bodykit import expect, finish
from mpidp.ddp.compression import bf16_compress_hook, fp16_compress_hook
from mpidp.ddp.powersgd import PowerSGDState, powerSGD_hook

torch.set_num_threads(1)
mpidp.init()
rank, n = mpidp.rank(), mpidp.size()
SHAPES = [(5, 7), (13,), (40, 30), (3, 2, 4)]


class Probe(nn.Module):
    """Parameters of SHAPES; the gradient of each is the input given for it."""

    def __init__(self):
        super().__init__()
        self.ps = nn.ParameterList([nn.Parameter(torch.zeros(s)) for s in SHAPES])

    def forward(self, xs):
        return sum((p * x).sum() for p, x in zip(self.ps, xs))


def u_of(r, step):
    g = torch.Generator().manual_seed(1000 * step + r)
    return [(torch.randint(1, 17, s, generator=g) * (2 * torch.randint(0, 2, s, generator=g) - 1))
            .float() / 4 for s in SHAPES]


def g_of(r, step):
    g = torch.Generator().manual_seed(5000 + 1000 * step + r)
    eps = [(torch.rand(s, generator=g) - 0.5) * 2 ** -14 for s in SHAPES]
    eps = [torch.where(e == 0, torch.full_like(e, 2 ** -15), e) for e in eps]
    return [n * u * (1 + e) for u, e in zip(u_of(r, step), eps)]


def grads_after(ddp, step):
    ddp.zero_grad()
    ddp(g_of(rank, step)).backward()
    return [p.grad.clone() for p in ddp.module.ps]


def hidden(hook):
    """The same hook function without its fused-path mark: the generic hook path."""
    return lambda state, bucket: hook(state, bucket)


for name, hook in (("fp16", fp16_compress_hook), ("bf16", bf16_compress_hook)):
    for how, h in (("fused", hook), ("hook function", hidden(hook))):
        for view in (False, True):
            ddp = mpidp.DistributedDataParallel(Probe(), gradient_as_bucket_view=view,
                                                bucket_cap_mb=0.002)
            ddp.register_comm_hook(None, h)
            for step in range(2):
                got = grads_after(ddp, step)
                want = [sum(us) for us in zip(*[u_of(r, step) for r in range(n)])]
                fp32 = [sum(gs) / n for gs in zip(*[g_of(r, step) for r in range(n)])]
                for k, (a, b, c) in enumerate(zip(got, want, fp32)):
                    expect(torch.equal(a, b), f"{name} {how} view={view} step {step} tensor "
                           f"{k}: {(a - b).abs().max().item():.3e} from its definition")
                    expect(not torch.equal(a, c), f"{name} {how}: equals the float32 average")

# random inputs (sums round, so the order of addition shows): the fused path and the hook
# function still give the same bits with DDP's default algorithm
for hook in (fp16_compress_hook, bf16_compress_hook):
    got = []
    for h in (hook, hidden(hook)):
        ddp = mpidp.DistributedDataParallel(Probe(), bucket_cap_mb=0.002)
        ddp.register_comm_hook(None, h)
        gen = torch.Generator().manual_seed(77 + rank)
        ddp([torch.randn(s, generator=gen) * 3 for s in SHAPES]).backward()
        got.append([p.grad.clone() for p in ddp.module.ps])
    expect(all(torch.equal(a, b) for a, b in zip(*got)),
           f"{hook.__name__}: the fused path and the hook function differ on random inputs")

for hook, state, says in ((fp16_compress_hook, "group", "takes no state"),
                          (bf16_compress_hook, object(), "takes no state"),
                          (powerSGD_hook, None, "takes mpidp.ddp.powersgd.PowerSGDState")):
    try:  # refused when registered, before any backward
        mpidp.DistributedDataParallel(Probe()).register_comm_hook(state, hook)
        expect(False, f"{hook.__name__} accepted the state {state!r}")
    except TypeError as exc:
        expect(says in str(exc), f"{hook.__name__}'s state error says: {exc}")


# every rank must register the same hook with the same state (Note [Communication hooks])
last = rank == n - 1
for hook, state, says in (
        (bf16_compress_hook if last else fp16_compress_hook, None,
         f"rank {n - 1}: communication hook = mpidp.ddp.compression.bf16_compress_hook where rank "
         "0 has mpidp.ddp.compression.fp16_compress_hook"),
        (powerSGD_hook, PowerSGDState(matrix_approximation_rank=1 + last),
         f"rank {n - 1}: communication hook state: matrix_approximation_rank = 2 where rank 0 "
         "has 1"),
        (powerSGD_hook, PowerSGDState(random_seed=7 if last else 0),
         f"rank {n - 1}: communication hook state: random_seed = 7 where rank 0 has 0"),
        (powerSGD_hook, PowerSGDState(orthogonalization_epsilon=1e-8 if last else 0),
         f"rank {n - 1}: communication hook state: orthogonalization_epsilon = 1e-08 where "
         "rank 0 has 0.0")):
    if n == 1:
        break
    ddp = mpidp.DistributedDataParallel(Probe())
    ddp.register_comm_hook(state, hook)
    try:
        ddp(g_of(rank, 0)).backward()
        expect(False, f"{says}: accepted")
    except mpidp.MismatchError as exc:
        expect(says in str(exc) and "every rank raises" in str(exc), f"hooks differ: {exc}")


# ---- PowerSGD ---------------------------------------------------------------------------

def powersgd_run(steps, state, low_rank=False, start=None, load=None):
    """Gradients after each step with mpidp's PowerSGD (one bucket; two with ``start``, so
    the resumed layout differs), ``load`` a state_dict loaded first."""
    ddp = mpidp.DistributedDataParallel(Probe(), bucket_cap_mb=0.002 if start else 25)
    if load is not None:
        state.load_state_dict(load, ddp.module.parameters())
    ddp.register_comm_hook(state, powerSGD_hook)
    runs.append(ddp)
    out = []
    for step in range(start or 0, steps):
        xs = g_of(rank, step)
        if low_rank:  # the 40x30 gradient: one outer product, the same on every rank
            g = torch.Generator().manual_seed(step)
            xs[2] = torch.outer(torch.randint(-3, 4, (40,), generator=g).float(),
                                torch.randint(-3, 4, (30,), generator=g).float())
        ddp.zero_grad()
        ddp(xs).backward()
        out.append([p.grad.clone() for p in ddp.module.ps])
    return out


runs = []
state = PowerSGDState(matrix_approximation_rank=2, start_powerSGD_iter=2, random_seed=3)
run = powersgd_run(6, state)
for step in range(2):  # plain averaging first: exact with these inputs
    exact = [sum(gs) / n for gs in zip(*[g_of(r, step) for r in range(n)])]
    expect(all(torch.allclose(a, b, rtol=0, atol=1e-6) for a, b in zip(run[step], exact)),
           f"PowerSGD step {step} (before start_powerSGD_iter) is not the plain average")
expect(state.iter == 6, f"PowerSGDState.iter is {state.iter} after 6 steps")
true_sum = sum(sum(gs) / n for gs in zip(*[[g_of(r, s)[2] for r in range(n)]
                                           for s in range(6)]))
applied = sum(grads[2] for grads in run)
e40 = next(e for p, e in state.error_dict.items() if p.shape == (40, 30)).clone()
mpidp.allreduce_(e40, "avg")
expect(torch.allclose(applied + e40, true_sum, atol=1e-3),
       f"error feedback does not telescope: {(applied + e40 - true_sum).abs().max():.3e}")
expect(not torch.allclose(run[5][2], sum(g_of(r, 5)[2] for r in range(n)) / n, atol=1e-2),
       "the 40x30 gradient was not compressed")
expect(torch.allclose(run[5][1], sum(g_of(r, 5)[1] for r in range(n)) / n, rtol=1e-6),
       "the vector was not averaged as it is")
bits = torch.cat([g.reshape(-1) for g in run[5]])
everyone = mpidp.allgather(bits.reshape(1, -1))
expect(all(torch.equal(everyone[0], row) for row in everyone), "ranks differ after PowerSGD")

low = powersgd_run(4, PowerSGDState(matrix_approximation_rank=1, start_powerSGD_iter=0,
                                    use_error_feedback=False, warm_start=False), low_rank=True)
for step, grads in enumerate(low):
    g = torch.Generator().manual_seed(step)
    m = torch.outer(torch.randint(-3, 4, (40,), generator=g).float(),
                    torch.randint(-3, 4, (30,), generator=g).float())
    expect(torch.allclose(grads[2], m, rtol=1e-5, atol=1e-4),
           f"rank-1 gradient at step {step} not reproduced: {(grads[2] - m).abs().max():.3e}")

# resume: a state saved after 3 steps continues exactly as the uninterrupted run
first = PowerSGDState(matrix_approximation_rank=2, start_powerSGD_iter=1, random_seed=5)
whole = powersgd_run(6, first)
part = PowerSGDState(matrix_approximation_rank=2, start_powerSGD_iter=1, random_seed=5)
powersgd_run(3, part)
saved = part.state_dict(runs[-1].module.parameters())
resumed = PowerSGDState(matrix_approximation_rank=2, start_powerSGD_iter=1, random_seed=5)
tail = powersgd_run(6, resumed, start=3, load=saved)
for k, (a, b) in enumerate(zip(whole[3:], tail)):
    expect(all(torch.equal(x, y) for x, y in zip(a, b)), f"PowerSGD resume differs at step {k}")
for bad in (dict(matrix_approximation_rank=0), dict(start_powerSGD_iter=-1),
            dict(min_compression_rate=-1), dict(process_group="g"), dict(random_seed=-1)):
    try:
        PowerSGDState(**bad)
        expect(False, f"PowerSGDState({bad}) was accepted")
    except (TypeError, ValueError) as exc:
        expect(f"{next(iter(bad))} must be" in str(exc), f"PowerSGDState({bad}) says: {exc}")
# a large seed (the tool passes --seed) and a parameter with no elements
big = powersgd_run(3, PowerSGDState(start_powerSGD_iter=0, random_seed=2 ** 40))
expect(torch.isfinite(big[-1][2]).all(), "PowerSGD with a large seed")


class WithEmpty(nn.Module):
    def __init__(self):
        super().__init__()
        self.empty, self.full = nn.Parameter(torch.zeros(0, 6)), nn.Parameter(torch.zeros(8, 6))

    def forward(self, x):
        return (self.full * x).sum() + self.empty.sum()


ddp = mpidp.DistributedDataParallel(WithEmpty())
ddp.register_comm_hook(PowerSGDState(start_powerSGD_iter=0), powerSGD_hook)
ddp(torch.ones(8, 6)).backward()
expect(ddp.module.empty.grad.shape == (0, 6) and torch.allclose(ddp.module.full.grad,
                                                                torch.ones(8, 6)),
       "PowerSGD with a parameter of no elements")
shape = list(runs[-1].module.parameters())[2].shape
for bad_state, says in (({"iter": 1}, "'errors'"),
                        ({"iter": 1, "q": {}, "errors": {-1: torch.ones(30)}},
                         "position -1 is not one of the 4 parameters"),
                        ({"iter": 1, "q": {}, "errors": {2: torch.ones(30)}},
                         "the error of parameter 2 is torch.float32 (30,), not"),
                        ({"iter": 1, "q": {1: torch.ones(13, 1)}, "errors": {}},
                         "parameter 1 (shape (13,)) is not compressed")):
    try:
        resumed.load_state_dict(bad_state, runs[-1].module.parameters())
        expect(False, f"the PowerSGD state_dict {bad_state} was accepted")
    except ValueError as exc:
        expect("not a PowerSGDState.state_dict()" in str(exc) and says in str(exc),
               f"bad state_dict says: {exc}")
try:
    resumed.load_state_dict({"iter": 1}, runs[-1].module.parameters())
    expect(False, "a bad PowerSGD state_dict was accepted")
except ValueError as exc:
    expect("not a PowerSGDState.state_dict()" in str(exc), f"bad state_dict says: {exc}")
finish(rank)
