"""Run under mpiexec on a machine with a GPU (ranks may share it): every collective with CuPy
arrays and torch CUDA tensors equals the host result bit for bit (staged at any world size;
ring and nccl where each rank has a GPU of its own, and nccl with one rank), and
DistributedDataParallel with its buckets on the GPU ends with the parameters of CPU training;
a rank that joined adds zeros to the others' CUDA all-reduces; Horovod's DistributedOptimizer
on CUDA, and a grouped all-reduce on a side stream. Prints 'ok <rank>'."""
import contextlib
import sys

import cupy as cp
import numpy as np
import torch
from torch import nn

import mpidp
from mpidp.engine.gpu.device import nccl_available

torch.set_num_threads(1)
g = mpidp.init()
rank, n = g.rank, g.size
failures = []
own_gpu = cp.cuda.runtime.getDeviceCount() >= g.local_size  # NCCL needs a GPU per rank
algorithms = ["staged"] + (["ring", "nccl"] if nccl_available() and (own_gpu or n == 1) else [])


def expect(cond, what):
    if not cond:
        failures.append(what)


def host(x):
    return x.get() if isinstance(x, cp.ndarray) else x.cpu()


for algo in algorithms:
    for dtype in (np.float32, np.float16, np.float64, np.int32, np.int64):
        for count in (0, 1, 7, 1000, 70_001):
            base = (np.arange(count) % 11 - 5 + rank).astype(dtype)
            ops = ("sum", "min", "max") + (("avg",) if dtype in (np.float16, np.float32,
                                                                np.float64) else ())
            for op in ops:
                want = mpidp.allreduce(base, op)  # the host collective
                got = mpidp.allreduce(cp.asarray(base), op, algorithm=algo)
                expect(isinstance(got, cp.ndarray) and np.array_equal(host(got), want),
                       f"{algo} cupy {dtype.__name__} x{count} {op}")
                t = torch.from_numpy(base).cuda()
                mpidp.allreduce_(t, op, algorithm=algo)
                expect(np.array_equal(host(t).numpy(), want), f"{algo} torch {dtype} {op}")
    b = (torch.arange(999) % 7 - 3 + rank).to(torch.bfloat16)
    want = mpidp.allreduce(b, "avg")
    got = mpidp.allreduce(b.cuda(), "avg", algorithm=algo)
    expect(got.is_cuda and torch.equal(got.cpu(), want), f"{algo} bfloat16 avg")
    nc = torch.arange(12.0).reshape(3, 4).cuda().t()  # not contiguous
    mpidp.allreduce_(nc, "sum", algorithm=algo)
    expect(torch.equal(nc.cpu(), torch.arange(12.0).reshape(3, 4).t() * n), f"{algo} strided")
    # an in-place collective on a tensor autograd saved: backward refuses it
    w = torch.ones(4, device="cuda", requires_grad=True)
    saved = torch.arange(4.0, device="cuda")
    loss = (w * saved).sum()
    mpidp.allreduce_(saved, "sum", algorithm=algo)
    try:
        loss.backward()
        expect(False, f"{algo}: backward used a tensor allreduce_ had changed")
    except RuntimeError:
        pass

# the collectives without a device algorithm of their own go through the host
x = cp.arange(6, dtype=cp.float32) + rank
expect(np.array_equal(host(mpidp.broadcast(x, 0)), np.arange(6, dtype=np.float32)), "broadcast")
expect(host(mpidp.allgather(x)).shape == (6 * n,), "allgather")
rs = mpidp.reduce_scatter(cp.ones((n * 2, 3), cp.float32))
expect(rs.shape == (2, 3) and float(rs.sum().get()) == 6 * n, "reduce_scatter")

# DDP with buckets on the GPU against the same training on the CPU
torch.manual_seed(0)
cpu_model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
gpu_model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4)).cuda()
gpu_model.load_state_dict(cpu_model.state_dict())
models = {"cpu": mpidp.DistributedDataParallel(cpu_model, bucket_cap_mb=0.001),
          "gpu": mpidp.DistributedDataParallel(gpu_model, device_ids=[g.local_rank %
                                                                     cp.cuda.runtime.getDeviceCount()],
                                               bucket_cap_mb=0.001)}
expect(type(models["gpu"]._buckets[0]).__name__ == "DeviceBucket", "DDP buckets on the GPU")
opts = {k: torch.optim.SGD(m.parameters(), lr=0.125) for k, m in models.items()}
gen = torch.Generator().manual_seed(rank)
for step in range(3):
    xb = torch.randint(-3, 4, (8, 16), generator=gen).float()
    yb = torch.randint(0, 4, (8,), generator=gen)
    for k, m in models.items():
        dev = "cuda" if k == "gpu" else "cpu"
        opts[k].zero_grad()
        nn.functional.cross_entropy(m(xb.to(dev)), yb.to(dev)).backward()
        opts[k].step()
for (name, p), q in zip(cpu_model.named_parameters(), gpu_model.parameters()):
    expect(torch.allclose(p, q.cpu(), atol=1e-5), f"DDP on GPU differs at {name}")

# the compression hooks on device buckets (fp16 and bf16 fused, PowerSGD) against the host's
from mpidp.ddp.compression import bf16_compress_hook, fp16_compress_hook  # noqa: E402
from mpidp.ddp.powersgd import PowerSGDState, powerSGD_hook  # noqa: E402
for name, make in (("fp16", lambda: (None, fp16_compress_hook)),
                   ("bf16", lambda: (None, bf16_compress_hook)),
                   ("powerSGD", lambda: (PowerSGDState(start_powerSGD_iter=0), powerSGD_hook))):
    pair = {}
    for dev in ("cpu", "cuda"):
        torch.manual_seed(0)
        net = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4)).to(dev)
        ddp = mpidp.DistributedDataParallel(net, bucket_cap_mb=0.001)
        ddp.register_comm_hook(*make())
        for step in range(2):
            x = torch.randint(-3, 4, (8, 16),
                              generator=torch.Generator().manual_seed(rank + 10 * step)).float()
            ddp.zero_grad()
            ddp(x.to(dev)).sum().backward()
        pair[dev] = [p.grad.cpu() for p in net.parameters()]
    expect(all(torch.allclose(a, b, rtol=1e-2, atol=1e-2)
               for a, b in zip(pair["cpu"], pair["cuda"])),
           f"{name} compression on device buckets differs from the host's")

# a grouped all-reduce of tensors a side stream is still writing: the pack, the all-reduce and
# the unpack follow that stream (torch's side streams are not ordered against CuPy's default)
side = torch.cuda.Stream()
with torch.cuda.stream(side):
    late = [torch.empty(k, device="cuda") for k in (3, 70_001, 5)]
    torch.cuda._sleep(20_000_000)  # ~10 ms of the GPU before the values are written
    for k, t in enumerate(late):
        t.fill_(rank + k)
    mpidp.grouped_allreduce_(late, "sum")
torch.cuda.synchronize()
expect(all(torch.equal(t.cpu(), torch.full((t.numel(),), float(n * k + n * (n - 1) // 2)))
           for k, t in enumerate(late)), "grouped_allreduce_ on a side stream")

# ---- Horovod's DistributedOptimizer on CUDA: a bucket per parameter, each all-reduced during
# backward on the stream its gradients came from (Note [Gradients during backward]) ---------
import mpidp.horovod as hvd  # noqa: E402
hvd.init()


def hvd_training(dev, with_hvd):
    """Three steps of SGD on rank-dependent batches: through hvd.DistributedOptimizer, or
    (``with_hvd=False``) a plain optimizer after a synchronous all-reduce of each gradient."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(256, 512), nn.ReLU(), nn.Linear(512, 4)).to(dev)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    if with_hvd:
        opt = hvd.DistributedOptimizer(opt, groups=4)
    for step in range(3):
        x = torch.randint(-3, 4, (64, 256),
                          generator=torch.Generator().manual_seed(rank + 10 * step)).float()
        with torch.cuda.stream(side) if dev == "cuda" else contextlib.nullcontext():
            opt.zero_grad()
            net(x.to(dev)).sum().backward()
            if not with_hvd:
                for p in net.parameters():
                    mpidp.allreduce_(p.grad, "avg")
            elif dev == "cuda":
                expect(opt._hvd_buckets._streams and
                       all(st == side for st in opt._hvd_buckets._streams),
                       f"hvd buckets on the gradients' stream: {opt._hvd_buckets._streams}")
            opt.step()
    if with_hvd:
        expect(opt._hvd_buckets.stats["launched_in_backward"] == 12,
               f"hvd buckets on {dev} launched from the hooks: {opt._hvd_buckets.stats}")
    torch.cuda.synchronize()
    return [p.detach().cpu() for p in net.parameters()]


# the same kernels on the same stream give the same bits; the host's matmuls sum in another order
trained = {"cpu": hvd_training("cpu", True), "cuda": hvd_training("cuda", True),
           "cuda, all-reduced after backward": hvd_training("cuda", False)}
for other, same in (("cuda, all-reduced after backward", True), ("cpu", False)):
    diff = max(float((a - b).abs().max()) for a, b in zip(trained["cuda"], trained[other]))
    scale = max(float(a.abs().max()) for a in trained[other])
    expect(diff == 0 if same else diff <= 1e-5 * scale,
           f"hvd.DistributedOptimizer on CUDA differs from {other} by {diff:g} "
           f"(largest parameter {scale:g})")

# ---- a rank that joined adds zeros to the others' CUDA all-reduces (Note [Joined ranks]) ---
from mpidp.comm import joined  # noqa: E402
if n > 1:
    if rank == n - 1:
        last = joined.join(g)
    else:
        t = torch.arange(12, dtype=torch.float32, device="cuda").reshape(3, 4) + rank
        mpidp.allreduce_(t)
        expect(torch.equal(t.cpu(), (n - 1) * torch.arange(12.0).reshape(3, 4) +
                           sum(range(n - 1))), f"CUDA all-reduce while a rank joined: {t}")
        s = (torch.arange(12.0, device="cuda").reshape(4, 3) + 1).t()  # not contiguous
        avg = mpidp.allreduce(s * n, "avg")
        mpidp.allreduce_(s)
        expect(torch.equal(s.cpu(), (n - 1) * (torch.arange(12.0).reshape(4, 3) + 1).t()) and
               torch.equal(avg.cpu(), s.cpu()), f"strided CUDA all-reduce while joined: {s}")
        last = joined.join(g)
    expect(last == max(n - 2, 0), f"join: the last to join was {n - 2}, said {last}")

g.comm.Barrier()
if failures:
    print(f"rank {rank} FAILED:\n  " + "\n  ".join(failures[:20]), flush=True)
    sys.exit(1)
print(f"ok {rank} algorithms={','.join(algorithms)}", flush=True)
