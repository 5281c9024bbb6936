"""A training script written for torch.distributed — torch's own DistributedDataParallel, SGD
with momentum — that goes on after a lost rank as docs/recovery.md says, on the mpidp backend
under fault tolerance: a step that met a lost process (``mpidp.backend.can_recover()``) goes
back to this rank's copy of the state after its last step, the groups are destroyed and made
again (``dist.init_process_group("mpidp")`` remakes the job: the survivors first, a
replacement per lost rank last, which runs this script anew and joins at its own
``init_process_group``), and rank 0's copy — a survivor's — is broadcast to every rank. Step
k's batch on rank r is drawn from the seed (k, r), so the run respawned to its size sees the
uninterrupted run's batches. The rank DIE_RANK (of the job as started) kills itself with
SIGKILL at step DIE_STEP, after its forward (the others wait in the gradients' all-reduce);
DIE_RANK may list several, each at its DIE_STEP. Rank 0 prints 'torch: ranks <size>
recoveries <n> sha256 <the parameters' digest>'; every rank 'steps <rank> <steps this process
took>' and 'ok <rank>'."""
import hashlib
import os
import signal
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

import mpidp.backend

STEPS, BATCH, LR = 30, 8, 0.05
DIE = dict(zip((int(r) for r in os.environ.get("DIE_RANK", "").split(",") if r),
               (int(s) for s in os.environ.get("DIE_STEP", "").split(",") if s)))
ORIGINAL = "mpidp-replaces" not in sys._xoptions  # not a replacement of a lost rank
dist.init_process_group("mpidp")
started_as = dist.get_rank()
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
params = list(model.parameters())


def state() -> list:
    """The parameters and the momentum buffers, in one list of tensors."""
    for p in params:  # a fresh optimizer has none: zeros step as SGD's first step does
        optimizer.state[p].setdefault("momentum_buffer", torch.zeros_like(p))
    return [*params, *(optimizer.state[p]["momentum_buffer"] for p in params)]


def batch(step: int, rank: int):
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(BATCH, 16, generator=g), torch.randint(0, 4, (BATCH,), generator=g)


copy, done, taken, recoveries = None, 0, 0, 0  # this rank's copy of the state after step done
while True:
    ddp = DDP(model)  # broadcasts rank 0's parameters
    with torch.no_grad():
        if copy is not None:  # back to this rank's last whole step
            for t, saved in zip(state(), copy):
                t.copy_(saved)
        step = torch.tensor([done])
        dist.broadcast(step, 0)  # rank 0's copy, a survivor's, to every rank
        for t in state():
            dist.broadcast(t, 0)
        done = int(step)
    try:
        while done < STEPS:
            x, y = batch(done, dist.get_rank())
            optimizer.zero_grad()
            loss = F.cross_entropy(ddp(x), y)
            if ORIGINAL and DIE.get(started_as) == done:
                os.kill(os.getpid(), signal.SIGKILL)
            loss.backward()
            optimizer.step()
            taken += 1
            done += 1
            with torch.no_grad():
                copy = [t.clone() for t in state()]
        break
    except RuntimeError as exc:  # DistBackendError, or DDP's RuntimeError around it
        if not mpidp.backend.can_recover():
            raise
        recoveries += 1
        dist.destroy_process_group()
        dist.init_process_group("mpidp")

digest = hashlib.sha256(b"".join(p.detach().numpy().tobytes() for p in params)).hexdigest()
if dist.get_rank() == 0:
    print(f"torch: ranks {dist.get_world_size()} recoveries {recoveries} sha256 {digest}",
          flush=True)
print(f"steps {dist.get_rank()} {taken}", flush=True)
print(f"ok {dist.get_rank()}", flush=True)
dist.destroy_process_group()
