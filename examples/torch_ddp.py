"""A plain torch.distributed script — torch's DistributedDataParallel and DistributedSampler,
with SyncBatchNorm — on the mpidp backend: its mpidp lines are the backend's name and the
SyncBatchNorm conversion (torch's own SyncBatchNorm runs on GPUs only). Launch it with an MPI
launcher; rank and world size come from MPI, no MASTER_ADDR is needed:

    mpiexec -n 2 python examples/torch_ddp.py
    srun --mpi=pmi2 -n 4 python examples/torch_ddp.py     (or sbatch examples/slurm/torch_ddp.sbatch)

``--backend gloo`` runs it on torch's gloo instead (under an MPI launcher its rendezvous, too,
goes through mpidp's store over MPI); ``--out FILE``: rank 0 saves the final weights."""
import argparse

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", default="mpidp")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()

    dist.init_process_group(args.backend)
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 3))
    if args.backend == "mpidp":  # torch's own SyncBatchNorm runs on GPUs only; mpidp's anywhere
        import mpidp
        model = mpidp.SyncBatchNorm.convert_sync_batchnorm(model)
    ddp = nn.parallel.DistributedDataParallel(model)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.1, momentum=0.9)

    gen = torch.Generator().manual_seed(1)
    x = torch.randn(512, 8, generator=gen)
    y = (x[:, :3] * torch.tensor([1.0, -1.0, 0.5])).argmax(1)
    sampler = DistributedSampler(TensorDataset(x, y), shuffle=True, seed=0)
    loader = DataLoader(TensorDataset(x, y), batch_size=16, sampler=sampler)
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        total, correct, loss_sum = torch.zeros(1), torch.zeros(1), torch.zeros(1)
        for xb, yb in loader:
            optimizer.zero_grad()
            logits = ddp(xb)
            loss = nn.functional.cross_entropy(logits, yb)
            loss.backward()
            optimizer.step()
            loss_sum += loss.detach() * len(yb)
            correct += (logits.argmax(1) == yb).sum()
            total += len(yb)
        stats = torch.cat([loss_sum, correct, total])
        dist.all_reduce(stats)
        if rank == 0:
            print(f"epoch {epoch + 1}/{args.epochs}: {world} ranks, loss "
                  f"{stats[0].item() / stats[2].item():.4f}, accuracy "
                  f"{stats[1].item() / stats[2].item():.4f}", flush=True)
    if rank == 0 and args.out:
        torch.save(model.state_dict(), args.out)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
