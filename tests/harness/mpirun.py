"""Launching test bodies under mpiexec in a subprocess, with a timeout (the outer pytest
process never imports mpi4py.MPI)."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from mpidp.runtime.launcher import mpiexec  # the mpich wheel's, beside this Python

ROOT = Path(__file__).parents[2]          # the repository: the jobs' working directory
BODIES = ROOT / "tests" / "mpi" / "bodies"  # the MPI test bodies
RUN_BODY = Path(__file__).parent / "run_body.py"  # how body() starts them


def command(n: int, args: list, cluster=None, per_node=1, supervised=None) -> list:
    """``mpiexec -n n python args...``; on an emulated cluster (tests/harness/multinode_cluster.py),
    run from its head with ``per_node`` ranks on each of its first n / per_node nodes, or
    with ``per_node`` a Hydra host list ("node0:2,node1:1": nodes of unequal sizes).
    ``supervised``: the supervisor's options; it launches the job (``python -m mpidp.run``)."""
    if supervised is not None:
        hosts = [] if cluster is None else ["--hosts", per_node if isinstance(per_node, str)
                                            else cluster.hosts(per_node, n // per_node)]
        line = [sys.executable, "-m", "mpidp.run", "-n", str(n), *hosts,
                *map(str, supervised), "--", sys.executable, *map(str, args)]
        return line if cluster is None else cluster.head_command(line)
    if cluster is None:
        return [mpiexec(), "-n", str(n), sys.executable, *map(str, args)]
    place = ["-hosts", per_node] if isinstance(per_node, str) else \
        ["-ppn", str(per_node), "-hosts", ",".join(cluster.names[:n // per_node])]
    return cluster.head_command([mpiexec(), "-n", str(n), *place, sys.executable,
                                 *map(str, args)])


def run(n: int, args: list, env: dict | None = None, timeout_s: float = 240, cluster=None,
        per_node: int = 1, supervised=None) -> subprocess.CompletedProcess:
    """Runs ``python args...`` on n ranks (``command``; under the supervisor with its options
    ``supervised``) with ``env`` over this process's environment (a value None unsets the
    variable); a hang fails the test at timeout_s instead of CI."""
    full_env = dict(os.environ)
    full_env.update(cluster.env() if cluster is not None else {})
    full_env.update(env or {})
    full_env = {k: v for k, v in full_env.items() if v is not None}  # None: unset it
    full_env.setdefault("PYTHONUNBUFFERED", "1")
    return finished(command(n, args, cluster, per_node, supervised), full_env, timeout_s)


def finished(cmd: list, env: dict, timeout_s: float) -> subprocess.CompletedProcess:
    """``subprocess.run(cmd)`` in ROOT with ``env``, its output captured as text; where it
    has not finished in ``timeout_s``, every process of the job is killed (the launcher's
    ranks too, which run in sessions of their own and would spin on in the rest of the
    run) and the test fails with the output so far."""
    tag = uuid.uuid4().hex
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            errors="replace", env={**env, "MPIDP_TEST_TAG": tag}, cwd=ROOT,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        kill_job(proc, tag)
        out, err = proc.communicate()
        raise AssertionError(f"{' '.join(map(str, cmd))} did not finish in {timeout_s} s:\n"
                             f"{out[-6000:]}\n{err[-6000:]}") from None
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def tagged(tag: str) -> dict:
    """{pid: the MPI rank, or None for a launcher process} of the live processes started
    with MPIDP_TEST_TAG=tag in their environment."""
    found = {}
    needle = f"MPIDP_TEST_TAG={tag}".encode()
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                env = (entry / "environ").read_bytes().split(b"\0")
            except OSError:
                continue
            if needle in env:
                rank = [v for v in env if v.startswith((b"PMI_RANK=", b"OMPI_COMM_WORLD_RANK="))]
                found[int(entry.name)] = int(rank[0].split(b"=")[1]) if rank else None
    return found


def kill_job(proc: subprocess.Popen, tag: str) -> None:
    """SIGKILL to the launcher's process group and to every process tagged ``tag``."""
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    for pid in tagged(tag):  # ranks run in sessions of their own
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass


def body(n: int, name: str, env: dict | None = None, timeout_s: float = 240, extra=(),
         cluster=None, per_node: int = 1):
    """``run`` of ``tests/mpi/bodies/<name> extra...``, through run_body.py (it ends as mpidp's
    tools end, without the interpreter's teardown)."""
    return run(n, [RUN_BODY, BODIES / name, *extra], env, timeout_s, cluster, per_node)


def assert_ok(proc: subprocess.CompletedProcess, n: int) -> None:
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"exit {proc.returncode}:\n{out[-6000:]}"
    for r in range(n):
        assert f"ok {r}" in proc.stdout, f"rank {r} did not finish:\n{out[-6000:]}"


def together(n: int, names, env: dict | None = None, timeout_s: float = 600, cluster=None,
             per_node: int = 1) -> subprocess.CompletedProcess:
    """The bodies ``names`` one after another in one launch (tests/mpi/bodies/body_together.py:
    one start-up for all), checked: every rank started and ended each (lines of different
    ranks may interleave: counted, not parsed)."""
    proc = body(n, "body_together.py", env, timeout_s, list(names), cluster, per_node)
    assert_ok(proc, n)
    out = proc.stdout
    for name in names:
        assert out.count(f"body_together: {name}") == n, (name, out[-6000:])
    for r in range(n):
        assert out.count(f"ok {r}") == len(names), (r, out[-6000:])
    return proc


class Job:
    """``mpiexec -n n python args...`` started in the background, in a session of its own, its
    output to ``log`` and a tag in every process's environment (so that the test finds the
    ranks and anything left behind). A context manager: leaving it kills whatever still runs."""

    def __init__(self, n: int, args: list, log: Path, env: dict | None = None, cluster=None,
                 per_node: int = 1, supervised=None):
        self.tag = uuid.uuid4().hex
        self.log = Path(log)
        full_env = dict(os.environ, PYTHONUNBUFFERED="1", MPIDP_TEST_TAG=self.tag)
        full_env.update(cluster.env() if cluster is not None else {})
        full_env.update(env or {})
        with open(self.log, "w") as out:
            self.proc = subprocess.Popen(command(n, args, cluster, per_node, supervised),
                                         stdout=out,
                                         stderr=subprocess.STDOUT, env=full_env,
                                         cwd=ROOT,
                                         start_new_session=True)

    @property
    def text(self) -> str:
        return self.log.read_text()

    def wait_for(self, ready, timeout_s: float) -> None:
        """Returns once ``ready()`` is true; fails if the job ends or ``timeout_s`` passes
        first."""
        t0 = time.monotonic()
        while not ready():
            assert self.proc.poll() is None, f"the job ended early:\n{self.text[-4000:]}"
            assert time.monotonic() - t0 < timeout_s, \
                f"not ready in {timeout_s} s:\n{self.text[-4000:]}"
            time.sleep(0.02)

    def processes(self) -> dict:
        """{pid: the MPI rank, or None for a launcher process} of this job's live processes."""
        return tagged(self.tag)

    def rank_pid(self, rank: int) -> int:
        pids = [p for p, r in self.processes().items() if r == rank]
        assert len(pids) == 1, f"rank {rank}: processes {pids}"
        return pids[0]

    def wait(self, timeout_s: float) -> int:
        """The job's exit code; fails if it still runs after ``timeout_s``."""
        try:
            return self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"still running {timeout_s} s later:\n{self.text[-4000:]}") \
                from None

    def left_behind(self, within_s: float = 2.0) -> dict:
        """The job's processes still alive ``within_s`` after it ended (should be none)."""
        t0 = time.monotonic()
        while (left := self.processes()) and time.monotonic() - t0 < within_s:
            time.sleep(0.05)
        return left

    def __enter__(self) -> "Job":
        return self

    def __exit__(self, *exc) -> None:
        kill_job(self.proc, self.tag)


def named_checkout(request, option: str, what: str, example: str) -> Path:
    """The folder pytest option ``option`` names (a checkout of a peer project, which the
    project carries no copy of); without it the test skips, saying that ``what`` is not part
    of mpidp and what to pass (``example``)."""
    where = request.config.getoption(option)
    if where is None:
        pytest.skip(f"{what} not part of mpidp: pass {option}={example}")
    return Path(where)
