"""Tier 2: real clients of the torch.distributed backend under mpiexec: torchmetrics
(tests/mpi/bodies/body_metrics.py, at n = 1, 2, 3: test_together.py), and the examples as
they are — PyTorch Lightning's Trainer with DDPStrategy(process_group_backend="mpidp")
(examples/lightning_ddp.py) ending with the same weights and metrics as the same job on gloo,
the plain torch-DDP script (examples/torch_ddp.py), and Hugging Face Accelerate
(examples/accelerate_cpu.py) ending with gloo's weights. Their batch scripts run in
tests/slurm/test_slurm.py."""
from pathlib import Path

import pytest
import torch

from mpirun import run

EXAMPLES = Path(__file__).parents[2] / "examples"
NO_MASTER = {"MASTER_ADDR": None, "MASTER_PORT": None}


def _ran(proc) -> str:
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-6000:]
    return proc.stdout


def test_lightning_on_mpidp_ends_as_on_gloo(tmp_path):
    got = {}
    for backend in ("mpidp", "gloo"):
        out = tmp_path / f"{backend}.pt"
        stdout = _ran(run(2, [EXAMPLES / "lightning_ddp.py", "--backend", backend,
                              "--epochs", "2", "--out", out], env=NO_MASTER))
        assert f"backend {backend}: 2 ranks" in stdout, stdout
        got[backend] = torch.load(out, weights_only=True)
    ours, gloo = got["mpidp"], got["gloo"]
    assert ours["metrics"].keys() == gloo["metrics"].keys() == {"train_loss", "train_accuracy"}
    for k, v in gloo["metrics"].items():
        assert ours["metrics"][k] == pytest.approx(v, rel=1e-5), (k, ours["metrics"], v)
    for k, v in gloo["weights"].items():
        assert torch.allclose(ours["weights"][k], v, rtol=1e-5, atol=1e-6), k


def test_torch_ddp_example_runs_as_it_is(tmp_path):
    stdout = _ran(run(2, [EXAMPLES / "torch_ddp.py", "--epochs", "2",
                          "--out", tmp_path / "w.pt"], env=NO_MASTER))
    assert "epoch 2/2: 2 ranks, loss" in stdout, stdout
    weights = torch.load(tmp_path / "w.pt", weights_only=True)
    assert "1.running_mean" in weights  # the SyncBatchNorm layer's statistics


def test_gloo_under_mpiexec_rendezvous_over_mpi_without_master_addr():
    """Under an MPI launcher env:// falls back to mpidp's store over MPI for any backend."""
    stdout = _ran(run(2, [EXAMPLES / "torch_ddp.py", "--backend", "gloo", "--epochs", "1"],
                      env=NO_MASTER))
    assert "epoch 1/1: 2 ranks, loss" in stdout, stdout


def test_accelerate_on_mpidp_ends_as_on_gloo(tmp_path):
    """Hugging Face Accelerate on CPU on a default group made on mpidp first
    (examples/accelerate_cpu.py): the same weights, bit for bit, as on gloo."""
    got = {}
    for backend in ("mpidp", "gloo"):
        out = tmp_path / f"{backend}.pt"
        stdout = _ran(run(2, [EXAMPLES / "accelerate_cpu.py", "--backend", backend,
                              "--out", out], env=NO_MASTER))
        assert f"epoch 2/2: 2 processes on {backend}, DistributedType.MULTI_CPU" in stdout, \
            stdout
        got[backend] = torch.load(out, weights_only=True)
    assert got["mpidp"]["loss"] == got["gloo"]["loss"]
    for k, v in got["gloo"]["weights"].items():
        assert torch.equal(got["mpidp"]["weights"][k], v), k
