"""Run under mpiexec on a machine with a GPU (ranks may share it): torch's newer layers on the
"mpidp" backend with CUDA tensors, each scenario run on a CUDA mesh and on a CPU mesh in this
launch and compared — the CPU results being those tests/mpi/bodies/body_modern.py holds equal
to gloo's:

- ``init_device_mesh("cuda", ...)`` (1-D, and 2-D with ``mesh["dp"]``) and the functional
  collectives on it: exact (small integers);
- DTensor ``redistribute`` Shard(0) -> Replicate() and Partial() -> Replicate(): exact;
- FSDP2 ``fully_shard`` per layer + Adam on CUDA, with and without ``reshard_after_forward``:
  within rtol 1e-4 of the same training on the CPU mesh (the GPU's matrix products round
  otherwise than the CPU's).

BODY_DEVICE=cpu runs the CUDA side on the CPU too (a dry run of the scenario where no GPU is
lent). Prints 'ok <rank>'."""
import os
import warnings

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor

import mpidp
from bodykit import expect, finish

warnings.filterwarnings("ignore", category=FutureWarning)
warnings.filterwarnings("ignore", category=UserWarning)
torch.set_num_threads(1)
dist.init_process_group("mpidp")
rank, n = dist.get_rank(), dist.get_world_size()
GPU = os.environ.get("BODY_DEVICE", "cuda")
if GPU == "cuda":
    torch.cuda.set_device(mpidp.local_rank() % torch.cuda.device_count())
meshes = {"cuda": init_device_mesh(GPU, (n,)), "cpu": init_device_mesh("cpu", (n,))}


def ints(r: int, count: int = 6) -> torch.Tensor:
    return torch.arange(count, dtype=torch.float32) % 5 + r + 1


# functional collectives and DTensor on each mesh: the CUDA results equal the CPU ones
got = {}
for side, mesh in meshes.items():
    d = GPU if side == "cuda" else "cpu"
    x = ints(rank).to(d)
    summed = funcol.wait_tensor(funcol.all_reduce(x, "sum", mesh))
    gathered = funcol.wait_tensor(funcol.all_gather_tensor(x, 0, mesh))
    full = torch.stack([ints(r) for r in range(n)]).to(d)
    replicated = distribute_tensor(full, mesh, [Shard(0)]).redistribute(
        mesh, [Replicate()]).to_local()
    partial = DTensor.from_local(
        ints(rank).to(d), mesh, [Partial()]).redistribute(mesh, [Replicate()]).to_local()
    got[side] = [t.cpu() for t in (summed, gathered, replicated, partial)]
    expect(all(t.device.type == d for t in (summed, replicated, partial)),
           f"results on {d}: {[t.device for t in (summed, replicated, partial)]}")
for k, (a, b) in enumerate(zip(got["cuda"], got["cpu"])):
    expect(torch.equal(a, b),
           f"collective {k} on cuda {a.tolist()} != cpu {b.tolist()}")
expect(torch.equal(got["cpu"][0], sum(ints(r) for r in range(n))), "all_reduce sum exact")

if n % 2 == 0 and n >= 2:  # a 2-D mesh, its "dp" sub-mesh
    mesh2 = init_device_mesh(GPU, (n // 2, 2), mesh_dim_names=("dp", "tp"))
    y = ints(rank).to(GPU)
    out = funcol.wait_tensor(funcol.all_reduce(y, "sum", mesh2["dp"]))
    dp = [r for r in range(n) if r % 2 == rank % 2]
    expect(torch.equal(out.cpu(), sum(ints(r) for r in dp)), "all_reduce on mesh['dp']")


# FSDP2 on CUDA against the same training on the CPU mesh
def train(side: str, reshard: bool) -> list:
    d = GPU if side == "cuda" else "cpu"
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4)).to(d)
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=meshes[side], reshard_after_forward=reshard)
    fully_shard(model, mesh=meshes[side], reshard_after_forward=reshard)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    gen = torch.Generator().manual_seed(rank)
    for _ in range(3):
        x = torch.randn(4, 8, generator=gen).to(d)
        loss = model(x).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
    return [p.full_tensor().detach().cpu() for p in model.parameters()]


for reshard in (True, False):
    on_gpu, on_cpu = train("cuda", reshard), train("cpu", reshard)
    for a, b in zip(on_gpu, on_cpu):
        expect(torch.allclose(a, b, rtol=1e-4, atol=1e-5),
               f"FSDP2 (reshard_after_forward={reshard}) on cuda differs from cpu by "
               f"{(a - b).abs().max().item():.3g}")

dist.destroy_process_group()
finish(rank)
