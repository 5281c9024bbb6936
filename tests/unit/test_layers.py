"""Tier 1: the import layers of pyproject.toml (Note [Layers]) hold — checked by import-linter,
which sees every import, inside functions too, so no cycle can land hidden in a late import."""
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).parents[2]


def test_the_import_contract_is_kept():
    lint = Path(sys.executable).parent / "lint-imports"
    proc = subprocess.run([str(lint), "--no-cache"], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert "2 kept, 0 broken" in proc.stdout, proc.stdout[-2000:]


def test_the_contract_catches_an_upward_import(tmp_path):
    """The same contract on a copy of the package where the device backend imports the front
    (the cycle this layering removed): broken."""
    import shutil
    pkg = tmp_path / "mpidp"
    shutil.copytree(ROOT / "mpidp", pkg, ignore=shutil.ignore_patterns("*.so", "__pycache__"))
    backend = pkg / "engine" / "gpu" / "executor.py"
    backend.write_text(backend.read_text() + "\nfrom ...comm import collectives  # upward\n")
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    lint = Path(sys.executable).parent / "lint-imports"
    proc = subprocess.run([str(lint), "--no-cache"], cwd=tmp_path, capture_output=True,
                          text=True, timeout=120, env={"PYTHONPATH": str(tmp_path),
                                                      "PATH": "/usr/bin:/bin"})
    assert proc.returncode != 0, proc.stdout[-2000:]
    assert "mpidp.engine.gpu.executor -> mpidp.comm.collectives" in proc.stdout, proc.stdout[-3000:]
