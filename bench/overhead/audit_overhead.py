"""The replica audit's cost (Note [Replica audit] in mpidp/ddp/audit.py): step time of the training
benchmark's MLP (784-2048-2048-10, 23 MB of parameters, batch 64 per rank, SGD) under mpidp's
DistributedDataParallel with audit_every 0 (off), 1 and 100, medians of 5 repetitions of 20
steps, modes interleaved; and one checksum pass over the parameters.

    mpiexec -n 2 python bench/overhead/audit_overhead.py"""
import statistics
import time

import torch

import mpidp
from mpidp.workloads import models
from mpidp.ddp.audit import checksums

EVERY = (0, 1, 100)


def step_s(every: int) -> float:
    torch.manual_seed(0)
    model = mpidp.DistributedDataParallel(models.mlp(hidden=(2048, 2048)), audit_every=every)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y = torch.randn(64, 784), torch.randint(0, 10, (64,))

    def step():
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    for _ in range(3):
        step()
    t0 = time.perf_counter()
    for _ in range(20):
        step()
    return (time.perf_counter() - t0) / 20


def main() -> None:
    torch.set_num_threads(1)
    mpidp.init()
    times = {k: [] for k in EVERY}
    for _ in range(5):
        for k in EVERY:
            times[k].append(step_s(k))
    params = list(models.mlp(hidden=(2048, 2048)).parameters())
    t0 = time.perf_counter()
    for _ in range(10):
        checksums(params)
    one = (time.perf_counter() - t0) / 10
    if mpidp.rank() == 0:
        base = statistics.median(times[0])
        for k in EVERY:
            med = statistics.median(times[k])
            print(f"audit_every={k:<4} {med * 1e3:7.2f} ms/step  ({med / base:.2f}x off)")
        print(f"one checksum pass over {sum(p.numel() for p in params) * 4 / 1e6:.0f} MB: "
              f"{one * 1e3:.2f} ms")


if __name__ == "__main__":
    main()
