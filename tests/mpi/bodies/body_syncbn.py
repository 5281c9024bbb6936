"""Run under mpiexec at any world size: SyncBatchNorm on CPU tensors equals BatchNorm on the
concatenated batch — torch.nn.SyncBatchNorm inside mpidp's DistributedDataParallel, a model
converted with mpidp.SyncBatchNorm.convert_sync_batchnorm under torch's DDP on the "mpidp"
backend — weights, running statistics and outputs; a layer bound to its own process group is
refused by name. Prints 'ok <rank>'."""

import torch
import torch.distributed as dist
from torch import nn

import mpidp
from bodykit import expect, failures, finish

torch.set_num_threads(1)
mpidp.init()
rank, n = mpidp.rank(), mpidp.size()
LOCAL = 3


def close(a, b, what):
    expect(torch.allclose(a, b, rtol=1e-4, atol=1e-5),
           f"{what}: max difference {(a - b).abs().max().item():.2e}")


def net(norm2d, norm1d):
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(2, 4, 3), norm2d(4), nn.ReLU(), nn.Flatten(),
                         nn.Linear(4 * 4 * 4, 6), norm1d(6), nn.Tanh(), nn.Linear(6, 3))


gen = torch.Generator().manual_seed(1)
data = [(torch.randint(-3, 4, (LOCAL * n, 2, 6, 6), generator=gen).float(),
         torch.randint(0, 3, (LOCAL * n,), generator=gen)) for _ in range(3)]


def mine(t):
    return t[rank * LOCAL:(rank + 1) * LOCAL]


def train(model, wrapped, local):
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    outputs = []
    for x, y in data:
        opt.zero_grad()
        xs, ys = (mine(x), mine(y)) if local else (x, y)
        out = wrapped(xs)
        outputs.append(out.detach())
        nn.functional.cross_entropy(out, ys).backward()
        opt.step()
    return outputs


def compare(model, reference, outs, ref_outs, what):
    for (name, a), b in zip(model.state_dict().items(), reference.state_dict().values()):
        if a.is_floating_point():
            close(a, b, f"{what}: {name}")
        else:
            expect(torch.equal(a, b), f"{what}: {name} {a} != {b}")
    for k, (o, r) in enumerate(zip(outs, ref_outs)):
        close(o, mine(r), f"{what}: output of step {k}")
    model.eval()
    reference.eval()
    x = data[0][0]
    close(model(mine(x)), reference(x)[rank * LOCAL:(rank + 1) * LOCAL], f"{what}: eval output")


reference = net(nn.BatchNorm2d, nn.BatchNorm1d)
ref_outs = train(reference, reference, local=False)

# torch.nn.SyncBatchNorm inside mpidp's DDP
model = net(nn.SyncBatchNorm, nn.SyncBatchNorm)
ddp = mpidp.DistributedDataParallel(model, bucket_cap_mb=0.0005)
expect(ddp.sync_batchnorm_layers == ["1", "5"], f"adopted {ddp.sync_batchnorm_layers}")
outs = train(model, ddp, local=True)
compare(model, reference, outs, ref_outs, "torch.nn.SyncBatchNorm in mpidp DDP")

# a layer bound to its own process group is refused by name
try:
    mpidp.DistributedDataParallel(nn.Sequential(nn.Linear(2, 2),
                                                nn.SyncBatchNorm(2, process_group="mine")))
    failures.append("a SyncBatchNorm with its own process group was accepted")
except ValueError as exc:
    expect("'1'" in str(exc) and "process_group" in str(exc), f"refusal says {exc}")

# mpidp.SyncBatchNorm under torch's own DDP on the mpidp backend
dist.init_process_group("mpidp")
model = mpidp.SyncBatchNorm.convert_sync_batchnorm(net(nn.BatchNorm2d, nn.BatchNorm1d))
expect(sum(isinstance(m, mpidp.SyncBatchNorm) for m in model.modules()) == 2, "converted")
torch_ddp = nn.parallel.DistributedDataParallel(model)
outs = train(model, torch_ddp, local=True)
compare(model, reference, outs, ref_outs, "mpidp.SyncBatchNorm in torch DDP on mpidp")
dist.destroy_process_group()

finish(rank)
