"""PyTorch Lightning on the mpidp torch.distributed backend: a plain Lightning script whose only
mpidp line is the strategy's backend. Launch it with an MPI launcher (Lightning's MPI or Slurm
environment takes rank and world size from it):

    mpiexec -n 2 python examples/lightning_ddp.py
    srun --mpi=pmi2 -n 4 python examples/lightning_ddp.py     (or sbatch examples/slurm/lightning.sbatch)

``--backend gloo`` runs the same job on torch's gloo, for comparison; ``--out FILE`` makes rank 0
save the final weights and metrics there."""
import argparse
import os

import lightning as L
import torch
import torchmetrics
from lightning.pytorch.strategies import DDPStrategy
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


class Classifier(L.LightningModule):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3))
        self.accuracy = torchmetrics.classification.MulticlassAccuracy(num_classes=3)

    def training_step(self, batch, _):
        x, y = batch
        logits = self.net(x)
        loss = nn.functional.cross_entropy(logits, y)
        self.accuracy(logits, y)
        self.log("train_loss", loss, sync_dist=True, on_epoch=True, on_step=False)
        self.log("train_accuracy", self.accuracy, on_epoch=True, on_step=False)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)


def data(samples=256):
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(samples, 8, generator=gen)
    y = (x[:, :3] * torch.tensor([1.0, -1.0, 0.5])).argmax(1)
    return DataLoader(TensorDataset(x, y), batch_size=16, shuffle=False)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", default="mpidp")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    ranks_here = int(os.environ.get("MPI_LOCALNRANKS", os.environ.get(
        "OMPI_COMM_WORLD_LOCAL_SIZE", os.environ.get("SLURM_NTASKS_PER_NODE", "1"))))
    trainer = L.Trainer(accelerator="cpu", devices=ranks_here,
                        num_nodes=int(os.environ.get("SLURM_NNODES", "1")),
                        strategy=DDPStrategy(process_group_backend=args.backend),
                        max_epochs=args.epochs, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False)
    model = Classifier()
    trainer.fit(model, data())
    metrics = {k: float(v) for k, v in trainer.callback_metrics.items()}
    if trainer.global_rank == 0:
        print(f"backend {torch.distributed.get_backend()}: {trainer.world_size} ranks, "
              + ", ".join(f"{k} {v:.4f}" for k, v in sorted(metrics.items())), flush=True)
        if args.out:
            torch.save({"weights": model.state_dict(), "metrics": metrics}, args.out)
    torch.distributed.destroy_process_group()  # as torch asks, before the interpreter ends


if __name__ == "__main__":
    main()
