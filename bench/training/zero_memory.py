"""ZeRO's optimizer memory and step time (bench/RESULTS.md, "ZeRO"): under
``mpiexec -n N python bench/training/zero_memory.py``, the training benchmark's MLP 784-2048-2048-10
(23 MB of float32 parameters) in mpidp's DistributedDataParallel with Adam, unsharded and as
mpidp.ZeroRedundancyOptimizer attached with reduce_scatter_hook: each rank's bytes of
optimizer state (exact, from the tensors) and the median step time of 5 x 10 steps (modes
interleaved). Rank 0 prints one JSON line."""
import json
import statistics
import time

import torch

import mpidp
from mpidp.workloads import models
from mpidp.ddp.zero import ZeroRedundancyOptimizer, reduce_scatter_hook

torch.set_num_threads(1)
g = mpidp.init()


def build(mode):
    torch.manual_seed(0)
    model = mpidp.DistributedDataParallel(models.BUILTIN["mlp"](hidden=(2048, 2048)))
    if mode == "adam":
        return model, torch.optim.Adam(model.parameters(), lr=1e-3)
    opt = ZeroRedundancyOptimizer(model.parameters(), torch.optim.Adam, lr=1e-3)
    model.register_comm_hook(opt, reduce_scatter_hook)
    return model, opt


def step(model, opt, x, y):
    opt.zero_grad()
    torch.nn.functional.cross_entropy(model(x), y).backward()
    opt.step()


gen = torch.Generator().manual_seed(g.rank)
x, y = torch.randn(64, 784, generator=gen), torch.randint(0, 10, (64,), generator=gen)
runs = {mode: build(mode) for mode in ("adam", "zero")}
times = {mode: [] for mode in runs}
for rep in range(5):
    for mode, (model, opt) in runs.items():
        step(model, opt, x, y)
        g.comm.Barrier()
        t0 = time.perf_counter()
        for _ in range(10):
            step(model, opt, x, y)
        times[mode].append(max(g.comm.allgather(time.perf_counter() - t0)) / 10)
plain = runs["adam"][1]
unsharded = sum(v.numel() * v.element_size() for s in plain.state.values() for v in s.values())
held = g.comm.gather(runs["zero"][1].local_state_bytes(), root=0)
if g.rank == 0:
    print(json.dumps({"ranks": g.size, "unsharded_state_bytes": unsharded,
                      "zero_state_bytes_per_rank": held,
                      "adam_step_ms": 1e3 * statistics.median(times["adam"]),
                      "zero_step_ms": 1e3 * statistics.median(times["zero"])}))
