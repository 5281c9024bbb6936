"""Run under mpiexec at any world size: mpidp.ZeroRedundancyOptimizer (Note [ZeRO] in
mpidp/ddp/zero.py) against the unsharded optimizer, with SGD-momentum and Adam:
- beside mpidp's DDP (gradients all-reduced) the parameters after 5 steps equal the unsharded
  optimizer's bit for bit at any n; attached to it (reduce_scatter_hook: each bucket
  reduce-scattered to its owners) bit for bit at n = 1, 2 — at n >= 3 the reduce-scatter adds
  the ranks in the ring's order, the all-reduce in the node's: within float rounding;
- consolidate_state_dict + state_dict give the unsharded optimizer's state_dict; a state_dict
  of either loads into the other and training continues as if uninterrupted;
- each rank holds about 1/n of the optimizer state; errors at the public boundary;
- at n >= 2 the parameters and groups are compared across ranks (at construction and at
  add_param_group): reversed parameters, other groups, another lr (float or tensor) on one
  rank, or an input one rank refuses, raise on every rank naming the difference, and the
  next collective (ZeRO's step) works; a Join one rank refuses is refused on every rank.
Prints 'ok <rank>'."""
import math

import torch
from torch import nn

import mpidp
from bodykit import expect, finish
from mpidp.errors import MismatchError
from mpidp.ddp.zero import ZeroRedundancyOptimizer, reduce_scatter_hook

torch.set_num_threads(1)
mpidp.init()
rank, n = mpidp.rank(), mpidp.size()


def net():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(7, 16), nn.Tanh(), nn.Linear(16, 9), nn.Tanh(),
                         nn.Linear(9, 3))


gen = torch.Generator().manual_seed(1)
data = [(torch.randn(4 * n, 7, generator=gen), torch.randint(0, 3, (4 * n,), generator=gen))
        for _ in range(8)]
local = [(x[rank * 4:(rank + 1) * 4], y[rank * 4:(rank + 1) * 4]) for x, y in data]
OPTIMIZERS = {"momentum": (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9}),
              "adam": (torch.optim.Adam, {"lr": 0.01})}


def run(opt_name, mode, steps=range(5), model=None, opt=None):
    """(model, optimizer) after ``steps``: mode plain (the unsharded optimizer), zero (ZeRO
    beside DDP's all-reduce) or attached (ZeRO with reduce_scatter_hook)."""
    cls, kw = OPTIMIZERS[opt_name]
    if model is None:
        model = mpidp.DistributedDataParallel(net(), bucket_cap_mb=0.001)
        opt = cls(model.parameters(), **kw) if mode == "plain" else \
            ZeroRedundancyOptimizer(model.parameters(), cls, **kw)
        if mode == "attached":
            model.register_comm_hook(opt, reduce_scatter_hook)
    for k in steps:
        x, y = local[k]
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    return model, opt


def same(a, b, what, exact):
    for (name, p), q in zip(a.module.named_parameters(), b.module.parameters()):
        ok = torch.equal(p, q) if exact else torch.allclose(p, q, rtol=1e-5, atol=1e-6)
        expect(ok, f"{what}: {name} differs by {(p - q).abs().max().item():.3e}")


for opt_name in OPTIMIZERS:
    plain, plain_opt = run(opt_name, "plain")
    for mode in ("zero", "attached"):
        exact = mode == "zero" or n <= 2
        model, zero = run(opt_name, mode)
        same(plain, model, f"{opt_name} {mode}", exact)
        # the consolidated state is the unsharded optimizer's
        zero.consolidate_state_dict(to=0)
        if rank == 0:
            mine, theirs = zero.state_dict(), plain_opt.state_dict()
            expect(mine["param_groups"] == theirs["param_groups"],
                   f"{opt_name} {mode}: param_groups {mine['param_groups']}")
            expect(sorted(mine["state"]) == sorted(theirs["state"]), f"{opt_name} state keys")
            for k in theirs["state"]:
                for key, v in theirs["state"][k].items():
                    w = mine["state"][k][key]
                    ok = torch.equal(v, w) if exact else torch.allclose(v, w, rtol=1e-4,
                                                                        atol=1e-6)
                    expect(ok and v.shape == w.shape, f"{opt_name} {mode}: state {k} {key}")
        else:
            try:
                zero.state_dict()
                expect(False, "state_dict on a rank it was not consolidated to")
            except RuntimeError as exc:
                expect("consolidate_state_dict" in str(exc), f"state_dict says {exc}")
        # memory: about 1/n of the unsharded state
        total = sum(v.numel() * v.element_size() for s in plain_opt.state.values()
                    for v in s.values() if v.dim() > 0)
        held = zero.local_state_bytes()
        expect(abs(held - total / n) <= 64 * 8 + total / n * 0.01 + 16 * 4,
               f"{opt_name} {mode}: this rank holds {held} bytes of {total}")
        # the unsharded state loaded into ZeRO (before its first step) continues exactly
        fresh_model, fresh = run(opt_name, mode, steps=())
        fresh_model.module.load_state_dict(plain.module.state_dict())
        fresh.load_state_dict(plain_opt.state_dict())
        run(opt_name, mode, steps=range(5, 8), model=fresh_model, opt=fresh)
        cont, _ = run(opt_name, "plain", steps=range(5, 8), model=plain, opt=plain_opt)
        same(cont, fresh_model, f"{opt_name} {mode} resumed from the unsharded state", exact)
        plain, plain_opt = run(opt_name, "plain")  # back to 5 steps for the next mode

# a parameter unused on every rank is skipped as the unsharded optimizer skips it (its .grad
# stays None), one unused on some ranks only is averaged
class Partly(nn.Module):
    def __init__(self):
        super().__init__()
        self.net, self.never, self.sometimes = net(), nn.Linear(7, 3), nn.Linear(7, 3)

    def forward(self, x):
        return self.net(x) + (self.sometimes(x) if rank == 0 else 0)


results = []
for mode in ("plain", "attached"):
    torch.manual_seed(0)
    model = mpidp.DistributedDataParallel(Partly(), find_unused_parameters=True,
                                          bucket_cap_mb=0.001)
    opt = torch.optim.Adam(model.parameters(), lr=0.01) if mode == "plain" else \
        ZeroRedundancyOptimizer(model.parameters(), torch.optim.Adam, lr=0.01)
    if mode == "attached":
        model.register_comm_hook(opt, reduce_scatter_hook)
    run("adam", mode, model=model, opt=opt)
    results.append(model)
same(results[0], results[1], "Adam with unused parameters, attached", n <= 2)

# two groups (one without momentum), a scheduler, and .grad halved between backward and step:
# as the unsharded optimizer; its consolidated state (a scheduler adds initial_lr) too
def grouped(mode):
    torch.manual_seed(0)
    model = mpidp.DistributedDataParallel(net(), bucket_cap_mb=0.001)
    params = list(model.parameters())
    groups = [{"params": params[:2], "momentum": 0.0}, {"params": params[2:], "lr": 0.05}]
    opt = torch.optim.SGD(groups, lr=0.1, momentum=0.9) if mode == "plain" else \
        ZeroRedundancyOptimizer(groups, torch.optim.SGD, lr=0.1, momentum=0.9)
    if mode == "attached":
        model.register_comm_hook(opt, reduce_scatter_hook)
    schedule = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    for k in range(5):
        x, y = local[k]
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        for p in model.parameters():
            p.grad.mul_(0.5)
        opt.step()
        schedule.step()
    return model, opt


plain, plain_opt = grouped("plain")
for mode in ("zero", "attached"):
    model, zero = grouped(mode)
    same(plain, model, f"two groups, a scheduler, halved .grad ({mode})", mode == "zero" or n <= 2)
    zero.consolidate_state_dict(to=0)
    if rank == 0:
        mine, theirs = zero.state_dict(), plain_opt.state_dict()
        expect(mine["param_groups"] == theirs["param_groups"], f"groups {mine['param_groups']}")
        expect(all(mine["state"][k]["momentum_buffer"].shape == v["momentum_buffer"].shape
                   for k, v in theirs["state"].items() if v.get("momentum_buffer") is not None),
               "momentum buffers of two groups consolidated")
    try:
        zero.add_param_group({"params": [nn.Parameter(torch.ones(3))]})
        expect(False, "add_param_group after the first step")
    except RuntimeError as exc:
        expect("add_param_group after the first step" in str(exc), f"says {exc}")

# loaded before the first step: consolidated as loaded; a float32 state into a float64 model
plain, plain_opt = run("adam", "plain")
wide = mpidp.DistributedDataParallel(net().double(), bucket_cap_mb=0.001)
zero = ZeroRedundancyOptimizer(wide.parameters(), torch.optim.Adam, lr=0.01)
zero.load_state_dict(plain_opt.state_dict())
zero.consolidate_state_dict(to=0)
if rank == 0:
    expect(len(zero.state_dict()["state"]) == len(plain_opt.state_dict()["state"]),
           "a state loaded before the first step is consolidated as loaded")
x, y = local[0]
nn.functional.cross_entropy(wide(x.double()), y).backward()
zero.step()
expect(all(s["exp_avg"].dtype == torch.float64 for s in zero._local.state.values()),
       "the loaded state takes the parameters' dtype")

# refused under Join (a joined rank would not all-gather)
model, zero = run("momentum", "attached", steps=())
try:
    with model.join():
        pass
    expect(False, "Join with a ZeroRedundancyOptimizer attached")
except ValueError as exc:
    expect("ZeroRedundancyOptimizer all-gathers at every step" in str(exc), f"Join says {exc}")

# errors at the public boundary
for args, kw, says in (((net().parameters(), "adam"), {}, "optimizer_class must be"),
                       ((net().parameters(), torch.optim.SGD), {"process_group": 1, "lr": 1},
                        "process_group must be None")):
    try:
        ZeroRedundancyOptimizer(*args, **kw)
        expect(False, f"ZeroRedundancyOptimizer{args} accepted")
    except (TypeError, ValueError) as exc:
        expect(says in str(exc), f"the error says {exc}")
ddp = mpidp.DistributedDataParallel(net())
try:
    ddp.register_comm_hook(object(), reduce_scatter_hook)
    expect(False, "reduce_scatter_hook accepted a state that is no ZeroRedundancyOptimizer")
except TypeError as exc:
    expect("ZeroRedundancyOptimizer" in str(exc), f"the hook's state error says {exc}")
try:
    ddp.register_comm_hook(ZeroRedundancyOptimizer(net().parameters(), torch.optim.SGD, lr=1),
                           reduce_scatter_hook)
    expect(False, "a ZeroRedundancyOptimizer of other parameters was attached")
except ValueError as exc:
    expect("must hold the DistributedDataParallel's parameters" in str(exc), f"says {exc}")
zero = ZeroRedundancyOptimizer(ddp.parameters(), torch.optim.SGD, lr=1)
ddp.register_comm_hook(zero, reduce_scatter_hook)
try:
    zero.step()
    expect(False, "step before the first backward of the attached DDP")
except RuntimeError as exc:
    expect("before the first backward" in str(exc), f"says {exc}")


# ---- every rank's parameters and groups compared: refused on every rank, the job goes on -----
def refused(build, says, what, own=None):
    """``build()`` raises on every rank: a MismatchError whose text has ``says`` — on a rank
    whose own input was refused, its own exception of type ``own`` — and then a collective
    (an all-reduce) still pairs across the ranks."""
    try:
        build()
        expect(False, f"{what}: accepted")
    except MismatchError as exc:
        expect(own is None and says in str(exc) and "every rank raises" in str(exc),
               f"{what}: says {exc}")
    except Exception as exc:  # noqa: BLE001 (the refusing rank's own error)
        expect(own is not None and isinstance(exc, own), f"{what}: raised {exc!r}")
    total = mpidp.allreduce(torch.full((3,), float(rank + 1)))
    expect(torch.equal(total, torch.full((3,), n * (n + 1) / 2)), f"{what}: then {total}")


if n > 1:
    params = list(net().parameters())
    one = 1 if rank == 1 else 0  # the rank that differs
    refused(lambda: ZeroRedundancyOptimizer(params[::-1] if one else params, torch.optim.SGD,
                                            lr=0.1),
            "rank 1: param group 0: parameter 0 = torch.float32[3] where rank 0 has "
            "torch.float32[16, 7]", "parameters reversed on rank 1")
    refused(lambda: ZeroRedundancyOptimizer(
        [{"params": params[:2]}, {"params": params[2:]}] if one else params, torch.optim.SGD,
        lr=0.1), "rank 1: param groups = 2 where rank 0 has 1", "two groups on rank 1")
    refused(lambda: ZeroRedundancyOptimizer(
        [{"params": params[:4 if one else 2]}, {"params": params[4 if one else 2:]}],
        torch.optim.SGD, lr=0.1), "rank 1: param group 0: parameters = 4 where rank 0 has 2",
        "groups split differently on rank 1")
    for lr, says in ((0.5 if one else 0.1, "lr = 0.5 where rank 0 has 0.1"),
                     (math.nextafter(0.1, 1) if one else 0.1,
                      "lr = 0.10000000000000002 where rank 0 has 0.1"),
                     (torch.tensor(0.25 if one else 0.5), "lr = tensor(0.25, dtype=torch.float32) "
                      "where rank 0 has tensor(0.5, dtype=torch.float32)")):
        refused(lambda: ZeroRedundancyOptimizer(params, torch.optim.Adam, lr=lr),
                f"rank 1: param group 0: {says}", f"lr {lr} on rank {rank}")
    refused(lambda: ZeroRedundancyOptimizer(params if rank != n - 1 else [], torch.optim.SGD,
                                            lr=0.1),
            f"rank {n - 1}: ValueError: optimizer got an empty parameter list",
            "no parameters on the last rank", own=ValueError if rank == n - 1 else None)
    # add_param_group: a group that differs is added on no rank, the same one on every rank
    model = mpidp.DistributedDataParallel(net(), bucket_cap_mb=0.001)
    head = list(model.parameters())
    zero = ZeroRedundancyOptimizer(head[:4], torch.optim.SGD, lr=0.1, momentum=0.9)
    refused(lambda: zero.add_param_group({"params": head[4:], "lr": 0.5 if one else 0.05}),
            "rank 1: param group 1: lr = 0.5 where rank 0 has 0.05", "add_param_group lr")
    expect(len(zero.param_groups) == 1 and len(zero._all) == 4,
           f"a refused group stays out: {len(zero.param_groups)} groups")
    zero.add_param_group({"params": head[4:], "lr": 0.05})
    mirror = mpidp.DistributedDataParallel(net(), bucket_cap_mb=0.001)
    _, mirror_opt = run("momentum", "plain", model=mirror, opt=torch.optim.SGD(
        [{"params": list(mirror.parameters())[:4]},
         {"params": list(mirror.parameters())[4:], "lr": 0.05}], lr=0.1, momentum=0.9))
    run("momentum", "zero", model=model, opt=zero)
    same(mirror, model, "ZeRO after refused constructions and add_param_group", True)
    # Join refused on one rank (a ZeroRedundancyOptimizer attached there only): on every rank
    model = mpidp.DistributedDataParallel(net())
    if rank == 0:
        model.register_comm_hook(ZeroRedundancyOptimizer(model.parameters(), torch.optim.SGD,
                                                         lr=1), reduce_scatter_hook)
    else:
        ZeroRedundancyOptimizer(model.parameters(), torch.optim.SGD, lr=1)  # collective

    def join():
        with model.join():
            pass
    refused(join, "rank 0: ValueError: Join: a ZeroRedundancyOptimizer all-gathers",
            "Join refused on rank 0", own=ValueError if rank == 0 else None)
finish(rank)
