"""``python -m mpidp.doctor`` under mpiexec -n 1 and 2, with a check that raises on one rank, a
check that hangs, and a job that aborts and leaves its files behind (its verdicts, report and
the singletons case in one process: tests/unit/test_doctor.py)."""
import contextlib
import importlib.util
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from mpirun import body, run

SECTIONS = ("MPI", "Ranks", "mpidp", "Shared memory", "Leftover files", "One-sided (RMA)",
            "All-reduce", "GPU", "Slurm")
ROOT = Path(__file__).parents[2]


# ---- the doctor itself ----------------------------------------------------------------------

def doctor(n, env=None, extra=(), timeout_s=120):
    return run(n, ["-m", "mpidp.doctor", *extra], env=env, timeout_s=timeout_s)


def assert_healthy(proc, n):
    out = proc.stdout
    assert proc.returncode == 0, f"exit {proc.returncode}:\n{out}\n{proc.stderr[-3000:]}"
    lines = out.splitlines()
    assert lines[0].startswith(f"mpidp doctor: {n} rank(s)")
    for name in SECTIONS:
        assert name in lines, f"section {name} missing:\n{out}"
    for ok in ("thread level MULTIPLE", "Win.Allocate_shared: every rank reads",
               "Fetch_and_op and Accumulate from every rank", "mpidp.init(): group built"):
        assert any(l.startswith("  OK") and ok in l for l in lines), f"{ok!r}:\n{out}"
    for algorithm in ("auto", "shm", "ring", "hier", "mpi"):
        assert any(l.startswith(f"  OK    {algorithm:<5} exact") for l in lines), out
    assert sum(l.startswith("rank ", 8) for l in lines) == n  # the rank map, once
    assert not any(l.startswith("  FAIL") for l in lines) and lines[-1].startswith("ready:")
    assert out.count("mpidp doctor:") == 1  # rank 0 prints


@pytest.mark.parametrize("n", [1, 2])
def test_doctor_under_mpiexec(n):
    t0 = time.monotonic()
    proc = doctor(n)
    assert_healthy(proc, n)
    if n == 2:
        assert "launcher variables agree with MPI on every rank (MPICH/Hydra)" in proc.stdout
        assert "cross-memory attach" in proc.stdout or "staging" in proc.stdout
        # node memory: reached directly where offered (Note [Node heap]), else named so
        from mpidp.comm import node_memory
        assert ("OK    node memory (mpidp.alloc): the node's ranks load and store"
                if node_memory.offered() else "node memory (mpidp.alloc): not offered") \
            in proc.stdout, proc.stdout
    print(f"doctor n={n}: {time.monotonic() - t0:.1f} s")


def test_a_bad_setting_is_one_fail_naming_it_and_nothing_about_the_extension():
    """A garbage MPIDP_* value: the mpidp check FAILs naming it (once, not again for the
    init it stops), and the C extension is judged by whether it is built, not by the error."""
    proc = doctor(1, env={"MPIDP_TIMEOUT_S": "0"})
    out = proc.stdout
    assert proc.returncode == 1, f"exit {proc.returncode}:\n{out}\n{proc.stderr[-3000:]}"
    assert [l for l in out.splitlines() if l.startswith("  FAIL")] == \
        ["  FAIL  rank 0: MPIDP_TIMEOUT_S='0': must be > 0 and finite"], out
    built = importlib.util.find_spec("mpidp._ext") is not None
    assert ("C extension loaded" in out) == built and "Traceback" not in out + proc.stderr


def test_a_check_that_raises_on_one_rank_is_a_fail_and_the_rest_still_runs():
    proc = body(2, "body_doctor.py", env={"BODY_DOCTOR_RAISE_ON": "1"}, timeout_s=120)
    out = proc.stdout
    assert proc.returncode == 1, f"exit {proc.returncode}:\n{out}\n{proc.stderr[-3000:]}"
    lines = out.splitlines()
    slurm = lines.index("Slurm")
    assert lines[slurm + 1] == "  FAIL  rank 1: OSError: deliberate failure in the Slurm probe"
    assert lines[slurm + 2].startswith("        fix: ")
    assert "OK    mpi   exact" in out and lines[-1].startswith("problems found:")


def test_a_check_that_hangs_aborts_the_job_naming_it():
    t0 = time.monotonic()
    proc = body(2, "body_doctor.py", env={"BODY_DOCTOR_HANG_ON": "1"},
                extra=["--timeout-s", "4"], timeout_s=90)
    assert proc.returncode != 0
    assert "the 'One-sided (RMA)' check did not finish within 4 s" in proc.stderr, \
        proc.stderr[-3000:]
    assert "All-reduce" not in proc.stdout  # nothing after the hung check
    assert time.monotonic() - t0 < 80


def test_a_live_jobs_files_are_not_reported_and_an_aborted_jobs_are(tmp_path):
    written = tmp_path / "held"
    proc = body(2, "body_leftovers.py", timeout_s=60,
                env={"BODY_LEFTOVERS_ABORT": "1", "BODY_LEFTOVERS_HELD": str(written)})
    held = written.read_text().split() if written.exists() else []
    try:
        assert proc.returncode != 0 and "FAIL" not in proc.stdout and held, \
            proc.stdout + proc.stderr[-3000:]
        assert any("/dev/shm/mpich_shm_" in p for p in held), held
        listed = subprocess.run([sys.executable, "-m", "mpidp.doctor", "--leftovers"],
                                capture_output=True, text=True, timeout=60, cwd=ROOT)
        assert listed.returncode == 0, listed.stderr
        assert set(held) <= set(listed.stdout.splitlines()), (held, listed.stdout)
    finally:
        for path in held:   # the test's own litter; the doctor never deletes
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
