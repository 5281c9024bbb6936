"""A Hugging Face Accelerate script on the mpidp backend. Accelerate picks its backend itself and,
on CPU, keeps only gloo or mpi (``Accelerator(kwargs_handlers=[InitProcessGroupKwargs(
backend="mpidp")])`` is refused: "Your assigned backend mpidp is not available"); it makes no
group where torch.distributed already has one. So the mpidp line is the first below: the
default group made on mpidp before the Accelerator, which then prepares model, optimiser and
data on it (torch's DDP over mpidp's collectives). Launch it with an MPI launcher:

    mpiexec -n 2 python examples/accelerate_cpu.py

``--backend gloo`` makes the group on gloo instead, for comparison; ``--out FILE``: rank 0
saves the final weights and the last epoch's loss."""
import argparse

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", default="mpidp")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()

    dist.init_process_group(args.backend)  # before the Accelerator, which then uses it
    from accelerate import Accelerator  # after: Accelerate reads the launcher's variables
    accelerator = Accelerator(cpu=True)

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(256, 8, generator=gen)
    y = (x[:, :3] * torch.tensor([1.0, -1.0, 0.5])).argmax(1)
    loader = DataLoader(TensorDataset(x, y), batch_size=16, shuffle=True,
                        generator=torch.Generator().manual_seed(2))
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    for epoch in range(args.epochs):
        losses = []
        for xb, yb in loader:
            optimizer.zero_grad()
            loss = nn.functional.cross_entropy(model(xb), yb)
            accelerator.backward(loss)
            optimizer.step()
            losses.append(loss.detach())
        mean = accelerator.gather(torch.stack(losses)).mean().item()
        accelerator.print(f"epoch {epoch + 1}/{args.epochs}: {accelerator.num_processes} "
                          f"processes on {dist.get_backend()}, "
                          f"{accelerator.distributed_type}, loss {mean:.4f}")
    if accelerator.is_main_process and args.out:
        torch.save({"weights": accelerator.unwrap_model(model).state_dict(), "loss": mean},
                   args.out)
    accelerator.end_training()
    if dist.is_initialized():
        dist.destroy_process_group()  # as torch asks, before the interpreter ends


if __name__ == "__main__":
    main()
