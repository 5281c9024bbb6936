"""Run under mpiexec -n 2: rank r runs r + 1 steps of mpidp's DistributedDataParallel without
Join; rank 0 leaves while rank 1 all-reduces: the job must end at once naming uneven inputs
and Join."""
import torch
from torch import nn

import mpidp

mpidp.init()
r = mpidp.rank()
model = mpidp.DistributedDataParallel(nn.Linear(3, 2))
for _ in range(r + 1):
    model(torch.ones(2, 3)).sum().backward()
print(f"done {r}", flush=True)
