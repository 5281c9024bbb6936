"""Tier 2: Horovod's own PyTorch examples on mpidp, with only their import lines changed.

The project carries no copy of them (Horovod's code is read, never copied into mpidp), and no
package index ships them, so these tests run where a Horovod checkout is named:
``pytest tests/mpi/test_horovod_examples.py --horovod-examples=<horovod>/examples/pytorch``,
and skip, saying so, where none is. Each script is copied to a temporary folder with
``import horovod.torch as hvd`` made ``import mpidp.horovod as hvd`` (pytorch_mnist.py also
drops its ``import horovod``, used only by its ``--num-proc`` mode, Horovod's own launcher);
torchvision, and the download, are replaced by tests/harness/stand_in (a synthetic MNIST and
small models). What Horovod documents for them:

- pytorch_mnist.py at n ranks (learning rate scaled by n, each rank its sampler's share)
  ends where the same script ends on one process with the n-times batch and learning rate:
  the test set learnt (dropout draws differ, so the figures agree closely, not bit for bit);
- pytorch_synthetic_benchmark.py reports its per-rank and total rates."""
import re
from pathlib import Path

import pytest

from mpirun import ROOT, named_checkout, run

STAND_IN = ROOT / "tests" / "harness" / "stand_in"
IMPORTS = {"import horovod.torch as hvd\n": "import mpidp.horovod as hvd\n",
           "import horovod\n": ""}


@pytest.fixture(scope="module")
def examples(request, tmp_path_factory) -> Path:
    """The examples with their import lines changed, in a temporary folder."""
    where = named_checkout(request, "--horovod-examples", "Horovod's examples are",
                           "<a Horovod checkout>/examples/pytorch")
    folder = tmp_path_factory.mktemp("horovod_examples")
    for name in ("pytorch_mnist.py", "pytorch_synthetic_benchmark.py"):
        text = (Path(where) / name).read_text()
        assert "import horovod.torch as hvd\n" in text, f"{name}: no Horovod import to change"
        for line, ours in IMPORTS.items():
            text = re.sub(f"^{re.escape(line)}", ours, text, flags=re.M)
        (folder / name).write_text(text)
    return folder


def example(examples, n, name, *args):
    proc = run(n, [examples / name, *args], env={"PYTHONPATH": str(STAND_IN)}, timeout_s=180)
    assert proc.returncode == 0, f"exit {proc.returncode}:\n{(proc.stdout + proc.stderr)[-6000:]}"
    return proc.stdout


def accuracy(out: str) -> float:
    found = re.findall(r"Test set: Average loss: [\d.]+, Accuracy: ([\d.]+)%", out)
    assert found, out[-3000:]
    return float(found[-1])


@pytest.mark.parametrize("n", [2, 3])
def test_mnist_on_n_ranks_ends_as_on_one_process_with_the_whole_batch(examples, n):
    common = ["--epochs", "3", "--log-interval", "100"]
    ours = accuracy(example(examples, n, "pytorch_mnist.py", *common, "--lr", "0.05"))
    alone = accuracy(example(examples, 1, "pytorch_mnist.py", *common, "--lr", str(0.05 * n),
                             "--batch-size", str(64 * n)))
    assert ours >= 95 and alone >= 95 and abs(ours - alone) <= 3, (ours, alone)


def test_mnist_with_fp16_compression_learns(examples):
    assert accuracy(example(examples, 2, "pytorch_mnist.py", "--epochs", "3", "--lr", "0.05",
                            "--log-interval", "100", "--fp16-allreduce")) >= 95


def test_synthetic_benchmark_reports_its_rates(examples):
    out = example(examples, 2, "pytorch_synthetic_benchmark.py", "--model", "small_cnn",
                  "--batch-size", "4", "--num-warmup-batches", "2",
                  "--num-batches-per-iter", "2", "--num-iters", "3")
    assert "Number of CPUs: 2" in out, out
    assert len(re.findall(r"^Iter #\d: [\d.]+ img/sec per CPU$", out, re.M)) == 3, out
    assert re.search(r"^Total img/sec on 2 CPU\(s\): [\d.]+ \+-[\d.]+$", out, re.M), out
