"""Tier 1: the tree is the architecture (issue 27) — the package root holds only the public
surface, each tool runs as ``python -m``, and the names users were given keep working."""
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parent.parent.parent
PACKAGE = ROOT / "mpidp"


def _passes(code: str) -> None:
    """``code`` runs in a fresh interpreter, its asserts holding."""
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]


def test_the_root_holds_only_the_public_surface():
    assert sorted(p.name for p in PACKAGE.glob("*.py")) == [
        "__init__.py", "algorithms.py", "config.py", "dist.py", "errors.py", "lazy.py"]


def test_every_package_is_a_layer_of_the_contract():
    """Each subpackage is named in pyproject.toml's layer contract (Note [Layers])."""
    contract = (ROOT / "pyproject.toml").read_text().split("[tool.importlinter]")[1]
    packages = sorted(p.name for p in PACKAGE.iterdir() if (p / "__init__.py").exists())
    assert packages == ["backend", "bench", "comm", "ddp", "doctor", "engine", "files", "horovod",
                        "modes", "report", "run", "runtime", "train", "workloads"]
    for name in packages:
        assert f'"mpidp.{name}' in contract or f"| mpidp.{name}" in contract, name


@pytest.mark.parametrize("tool", ["train", "bench", "doctor", "report", "run"])
def test_every_tool_runs_as_a_module(tool):
    proc = subprocess.run([sys.executable, "-m", f"mpidp.{tool}", "--help"], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.startswith(f"usage: python -m mpidp.{tool}"), proc.stdout[:200]


def test_import_starts_nothing_and_public_names_resolve():
    code = ("import sys, mpidp\n"
            "assert 'torch' not in sys.modules and 'mpi4py.MPI' not in sys.modules\n"
            "for name in mpidp.__all__: getattr(mpidp, name)\n"
            "from mpidp.ddp import compression, powersgd, zero, audit\n"
            "assert mpidp.compression.fp16_compress_hook is compression.fp16_compress_hook\n"
            "assert mpidp.powersgd.PowerSGDState is powersgd.PowerSGDState\n"
            "assert mpidp.zero.reduce_scatter_hook is zero.reduce_scatter_hook\n"
            "assert mpidp.audit.ReplicaDivergenceError is audit.ReplicaDivergenceError\n"
            "assert 'mpi4py.MPI' not in sys.modules\n")
    _passes(code)


def test_the_supervisor_loads_nothing_of_the_engine():
    """Note [The runtime's front]: ``python -m mpidp.run`` imports runtime.hostlist, launcher
    and exit, and with them neither the engine, nor its C extension, nor MPI, nor torch."""
    code = ("import sys, mpidp.run.cli, mpidp.run.supervisor\n"
            "loaded = [m for m in sys.modules if m.startswith(('mpidp.engine', 'mpidp._ext',\n"
            "          'mpidp.runtime.world', 'mpi4py', 'torch'))]\n"
            "assert loaded == [], loaded\n"
            "from mpidp import runtime\n"
            "assert runtime.group is sys.modules['mpidp.runtime.world'].group\n")
    _passes(code)


def test_the_backends_old_name_is_the_backend():
    """Note [The backend's old name]: ``import mpidp.dist`` and its submodules are the very
    modules of ``mpidp.backend`` (no second copy), and the entry point of an install made
    before the move, ``mpidp.dist:autoload``, registers the backend."""
    code = ("import sys, mpidp.dist, mpidp.backend\n"
            "assert mpidp.dist is mpidp.backend\n"
            "import mpidp.dist.group, mpidp.backend.group\n"
            "from mpidp.dist import ops\n"
            "assert mpidp.dist.group is mpidp.backend.group\n"
            "assert sys.modules['mpidp.dist.group'] is mpidp.backend.group\n"
            "assert mpidp.backend.group.__spec__.name == 'mpidp.backend.group'\n"
            "assert ops is sys.modules['mpidp.backend.ops']\n"
            "from importlib.metadata import EntryPoint\n"
            "EntryPoint('mpidp', 'mpidp.dist:autoload', 'torch.backends').load()()\n"
            "import torch.distributed as d\n"
            "assert 'MPIDP' in d.Backend._plugins\n")
    _passes(code)


def test_no_module_imports_itself_back():
    """0 import cycles between mpidp's modules (the layer contract forbids them between
    packages; this covers the modules inside one package too)."""
    import grimp
    graph = grimp.build_graph("mpidp", cache_dir=None)
    cycles = sorted({tuple(sorted((a, b))) for a in graph.modules
                     for b in graph.find_modules_directly_imported_by(a)
                     if graph.find_shortest_chain(importer=b, imported=a)})
    assert cycles == [], cycles
