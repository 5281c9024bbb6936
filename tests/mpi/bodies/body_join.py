"""Run under mpiexec at any world size, rank r with r + 1 batches (uneven inputs): mpidp's
DistributedDataParallel under ``with model.join():`` and torch's DDP on the "mpidp" backend
under ``with Join([model]):`` end with the same parameters as torch's DDP with Join on gloo
(the reference), on every rank. A Join one rank refuses (divide_by_initial_world_size=False
there), or whose enable or throw_on_early_termination differs there, is refused on every rank,
and the job goes on. Prints 'ok <rank>'."""

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.join import Join

import mpidp
from bodykit import expect, finish, sgd_steps

torch.set_num_threads(1)
mpidp.init()
rank, n = mpidp.rank(), mpidp.size()


def net():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3))


gen = torch.Generator().manual_seed(rank + 10)
batches = [(torch.randint(-2, 3, (4, 5), generator=gen).float(),
            torch.randint(0, 3, (4,), generator=gen)) for _ in range(rank + 1)]


def train(ddp, context, accumulate=False):
    with context:
        sgd_steps(ddp, batches, accumulate)
    return [p.detach().clone() for p in ddp.parameters()]  # after Join's final broadcast


# mpidp's DDP with torch's Join, before torch.distributed is initialised (join() starts it)
model = mpidp.DistributedDataParallel(net(), bucket_cap_mb=0.0001)
ours = train(model, model.join())
expect(dist.is_initialized() and dist.get_backend() == "mpidp", "join() started the backend")
model = mpidp.DistributedDataParallel(net(), bucket_cap_mb=0.0001)
ours_accumulated = train(model, model.join(), accumulate=True)

model = nn.parallel.DistributedDataParallel(net())  # torch's DDP on the mpidp backend
theirs = train(model, Join([model]))

gloo = dist.new_group(backend="gloo")
model = nn.parallel.DistributedDataParallel(net(), process_group=gloo)
reference = train(model, Join([model]))
model = nn.parallel.DistributedDataParallel(net(), process_group=gloo)
reference_accumulated = train(model, Join([model]), accumulate=True)

for what, got, reference in (
        ("mpidp DDP with Join", ours, reference),
        ("mpidp DDP with Join and no_sync", ours_accumulated, reference_accumulated),
        ("torch DDP on mpidp with Join", theirs, reference)):
    for a, b in zip(got, reference):
        expect(torch.allclose(a, b, rtol=1e-5, atol=1e-6),
               f"{what}: differs from gloo's by {(a - b).abs().max().item():.2e}")
    flat = torch.cat([p.reshape(-1) for p in got])
    everyone = [torch.empty_like(flat) for _ in range(n)]
    dist.all_gather(everyone, flat)
    expect(all(torch.equal(e, flat) for e in everyone), f"{what}: ranks differ")

if n > 1:  # refused on the last rank only: every rank raises, none waits in a forward
    model = mpidp.DistributedDataParallel(net())
    try:
        model.join(divide_by_initial_world_size=rank != n - 1)
        expect(False, "a Join refused on the last rank was accepted")
    except mpidp.MismatchError as exc:
        expect(rank != n - 1 and f"rank {n - 1}: ValueError: divide_by_initial_world_size="
               "False is not supported" in str(exc), f"Join refused there says: {exc}")
    except ValueError as exc:
        expect(rank == n - 1 and "divide_by_initial_world_size=False" in str(exc),
               f"Join refused here says: {exc}")
    # enable or throw_on_early_termination on the last rank only: a different number of
    # all-reduces per forward, so refused on every rank before any forward
    for setting, value in (("enable", False), ("throw_on_early_termination", True)):
        try:
            model.join(**{setting: value} if rank == n - 1 else {})
            expect(False, f"a Join with {setting}={value} on the last rank only was accepted")
        except mpidp.MismatchError as exc:
            expect(f"rank {n - 1}: {setting} = {value} where rank 0 has {not value}" in str(exc),
                   f"Join with {setting} differing says: {exc}")
    again = train(model, model.join())
    flat = torch.cat([p.reshape(-1) for p in again])
    everyone = [torch.empty_like(flat) for _ in range(n)]
    dist.all_gather(everyone, flat)
    expect(all(torch.equal(e, flat) for e in everyone), "after a refused Join: ranks differ")

dist.destroy_process_group()
finish(rank)
