"""Run under mpiexec on a machine with a GPU (ranks may share it): the "mpidp"
torch.distributed backend with CUDA tensors — collectives exact on small integers, torch's DDP
on the GPU equal to one process on the CPU on the concatenated batch, and SyncBatchNorm on the
GPU inside mpidp's DDP equal to BatchNorm on the whole batch. Prints 'ok <rank>'."""
import sys

import torch
import torch.distributed as dist
from torch import nn

import mpidp

torch.set_num_threads(1)
dist.init_process_group("mpidp")
rank, n = dist.get_rank(), dist.get_world_size()
dev = torch.device("cuda", mpidp.local_rank() % torch.cuda.device_count())
torch.cuda.set_device(dev)
failures = []


def expect(cond, what):
    if not cond:
        failures.append(what)


def values(r, dtype=torch.int64):
    return (torch.arange(6) % 4 + r + 1).to(dtype)


for dtype in (torch.float32, torch.float16, torch.int64, torch.int32):
    for op, fold in ((dist.ReduceOp.SUM, lambda s: s.sum(0)), (dist.ReduceOp.MAX,
                                                              lambda s: s.max(0).values),
                     (dist.ReduceOp.PRODUCT, lambda s: s.prod(0))):
        t = values(rank, dtype).to(dev)
        dist.all_reduce(t, op=op)
        expected = fold(torch.stack([values(r, dtype) for r in range(n)])).to(dtype)
        expect(t.is_cuda and torch.equal(t.cpu(), expected), f"all_reduce {op} {dtype}")
t = values(rank).to(dev) if rank == 0 else torch.zeros(6, dtype=torch.int64, device=dev)
dist.broadcast(t, src=0)
expect(torch.equal(t.cpu(), values(0)), "broadcast")
out = torch.empty(6 * n, dtype=torch.int64, device=dev)
dist.all_gather_into_tensor(out, values(rank).to(dev))
expect(torch.equal(out.cpu(), torch.cat([values(r) for r in range(n)])), "all_gather")
x = (torch.arange(2 * n) + rank).to(dev)
block = torch.empty(2, dtype=torch.int64, device=dev)
dist.reduce_scatter_tensor(block, x)
total = sum(torch.arange(2 * n) + r for r in range(n))
expect(torch.equal(block.cpu(), total[2 * rank:2 * rank + 2]), "reduce_scatter_tensor")
if n > 1:
    got = torch.empty(6, dtype=torch.int64, device=dev)
    reqs = dist.batch_isend_irecv([dist.P2POp(dist.isend, values(rank).to(dev), (rank + 1) % n),
                                   dist.P2POp(dist.irecv, got, (rank - 1) % n)])
    for q in reqs:
        q.wait()
    expect(torch.equal(got.cpu(), values((rank - 1) % n)), "send/recv on the GPU")

LOCAL = 4
gen = torch.Generator().manual_seed(1)
data = [(torch.randint(-2, 3, (LOCAL * n, 6), generator=gen).float(),
         torch.randint(0, 3, (LOCAL * n,), generator=gen)) for _ in range(3)]


def net(norm=None):
    torch.manual_seed(0)
    layers = [nn.Linear(6, 8)] + ([norm(8)] if norm else []) + [nn.Tanh(), nn.Linear(8, 3)]
    return nn.Sequential(*layers)


def train(model, wrapped, device, local):
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for x, y in data:
        if local:
            x, y = x[rank * LOCAL:(rank + 1) * LOCAL], y[rank * LOCAL:(rank + 1) * LOCAL]
        opt.zero_grad()
        nn.functional.cross_entropy(wrapped(x.to(device)), y.to(device)).backward()
        opt.step()
    return [p.detach().cpu() for p in model.parameters()]


for what, norm, make in (
        ("torch DDP on mpidp, GPU", None,
         lambda m: nn.parallel.DistributedDataParallel(m, device_ids=[dev])),
        ("SyncBatchNorm in mpidp DDP, GPU", nn.SyncBatchNorm,
         lambda m: mpidp.DistributedDataParallel(m))):
    reference = net(nn.BatchNorm1d if norm else None)
    expected = train(reference, reference, "cpu", local=False)
    model = net(norm).to(dev)
    got = train(model, make(model), dev, local=True)
    for a, b in zip(got, expected):
        expect(torch.allclose(a, b, rtol=1e-4, atol=1e-5),
               f"{what}: max difference {(a - b).abs().max().item():.2e}")

if failures:
    print(f"rank {rank}: " + "\n".join(failures), flush=True)
    sys.exit(1)
dist.destroy_process_group()
print(f"ok {rank}", flush=True)
