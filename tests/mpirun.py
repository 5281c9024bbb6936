"""Launching test bodies under mpiexec in a subprocess, with a timeout (the outer pytest
process never imports mpi4py.MPI)."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

BODIES = Path(__file__).parent / "mpi"


def mpiexec() -> str:
    """The mpiexec beside this Python (the mpich wheel's), else the first on PATH."""
    here = Path(sys.executable).parent / "mpiexec"
    found = str(here) if here.exists() else shutil.which("mpiexec")
    if not found:
        raise RuntimeError("no mpiexec found: pip install mpich (see README)")
    return found


def run(n: int, args: list, env: dict | None = None, timeout_s: float = 240) \
        -> subprocess.CompletedProcess:
    """Runs ``python args...`` on n ranks; a hang fails the test at timeout_s instead of CI."""
    full_env = dict(os.environ)
    full_env.update(env or {})
    full_env.setdefault("PYTHONUNBUFFERED", "1")
    cmd = [mpiexec(), "-n", str(n), sys.executable, *map(str, args)]
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s,
                              env=full_env, cwd=Path(__file__).parent.parent)
    except subprocess.TimeoutExpired as exc:
        raise AssertionError(f"{' '.join(cmd)} did not finish in {timeout_s} s:\n"
                             f"{exc.stdout}\n{exc.stderr}") from None


def body(n: int, name: str, env: dict | None = None, timeout_s: float = 240, extra=()):
    return run(n, [BODIES / name, *extra], env, timeout_s)


def assert_ok(proc: subprocess.CompletedProcess, n: int) -> None:
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"exit {proc.returncode}:\n{out[-6000:]}"
    for r in range(n):
        assert f"ok {r}" in proc.stdout, f"rank {r} did not finish:\n{out[-6000:]}"
