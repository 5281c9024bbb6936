"""Tier 1: the import contracts of pyproject.toml (Note [Layers], Note [MPI below one line])
hold — checked by import-linter, which sees every import, inside functions too, so no cycle
can land hidden in a late import, nor an MPI call above the line."""
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).parents[2]
LINT = Path(sys.executable).parent / "lint-imports"


def test_the_import_contract_is_kept():
    proc = subprocess.run([str(LINT), "--no-cache"], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert "3 kept, 0 broken" in proc.stdout, proc.stdout[-2000:]
    assert "MPI below one line" in proc.stdout, proc.stdout[-2000:]


def _lint_a_copy(tmp_path, module: str, line: str) -> subprocess.CompletedProcess:
    """import-linter with this project's contracts on a copy of the package in which
    ``module`` (a path below mpidp/) ends with ``line``."""
    pkg = tmp_path / "mpidp"
    shutil.copytree(ROOT / "mpidp", pkg, ignore=shutil.ignore_patterns("*.so", "__pycache__"))
    changed = pkg / module
    changed.write_text(changed.read_text() + f"\n{line}\n")
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    site = next(p for p in sys.path if p.endswith("site-packages"))  # mpi4py, found by name
    return subprocess.run([str(LINT), "--no-cache"], cwd=tmp_path, capture_output=True,
                          text=True, timeout=120,
                          env={"PYTHONPATH": f"{tmp_path}:{site}", "PATH": "/usr/bin:/bin"})


def test_the_contract_catches_an_upward_import(tmp_path):
    """The layers on a copy of the package where the device backend imports the front (the
    cycle this layering removed): broken."""
    proc = _lint_a_copy(tmp_path, "engine/gpu/executor.py",
                        "from ...comm import collectives  # upward")
    assert proc.returncode != 0, proc.stdout[-2000:]
    assert "mpidp.engine.gpu.executor -> mpidp.comm.collectives" in proc.stdout, proc.stdout[-3000:]


def test_the_contract_catches_mpi_above_the_line(tmp_path):
    """MPI below one line on a copy of the package where mpidp.comm imports mpi4py, as the
    object collectives once did: broken, naming the import."""
    proc = _lint_a_copy(tmp_path, "comm/objects.py", "from mpi4py import MPI  # above the line")
    assert proc.returncode != 0, proc.stdout[-2000:]
    assert "mpidp.comm.objects -> mpi4py" in proc.stdout, proc.stdout[-3000:]
