"""The pure parts of in-job recovery (mpidp/runtime/recovery.py, mpidp/train/in_job.py): the
replacement's command line, MPIDP_RECOVERY's values, the errors that mean a lost process,
and the snapshots the run goes on from."""
import os
import sys
import types

import pytest
import torch

from mpidp import config
from mpidp.errors import ConfigError
from mpidp.runtime import recovery
from mpidp.train import in_job


def test_the_replacement_runs_this_command_marked_once(monkeypatch):
    monkeypatch.setattr(sys, "orig_argv", ["python", "-X", recovery.REPLACEMENT, "-m",
                                           "mpidp.train", "--epochs", "3"])
    assert recovery.command() == [sys.executable, "-X", recovery.REPLACEMENT, "-m",
                                  "mpidp.train", "--epochs", "3"]


def test_mpidp_recovery_values():
    assert config.from_env({}).recovery == "auto"
    for mode in ("respawn", "shrink", "off", "auto"):
        assert config.from_env({"MPIDP_RECOVERY": mode}).recovery == mode
    with pytest.raises(ConfigError, match="MPIDP_RECOVERY='later': expected one of auto, "
                                          "respawn, shrink, off"):
        config.from_env({"MPIDP_RECOVERY": "later"})
    assert "recovery" in config.AGREED


def test_a_lost_process_is_recognised_through_the_chain(monkeypatch):
    class FakeMPIException(Exception):
        def __init__(self, cls):
            self.cls = cls

        def Get_error_class(self):
            return self.cls

    fake = types.SimpleNamespace(Exception=FakeMPIException, ERR_PROC_FAILED=75,
                                 ERR_PROC_FAILED_PENDING=76, ERR_REVOKED=77)
    monkeypatch.setitem(sys.modules, "mpi4py.MPI", fake)
    for cls in (75, 76, 77):
        try:
            try:
                raise FakeMPIException(cls)
            except FakeMPIException as inner:
                raise RuntimeError("bucket failed") from inner
        except RuntimeError as exc:
            assert recovery.is_process_failure(exc)
    assert not recovery.is_process_failure(FakeMPIException(15))  # MPI_ERR_TRUNCATE
    assert not recovery.is_process_failure(ValueError("bad input"))


def test_two_snapshots_kept_and_found_by_step():
    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    run = types.SimpleNamespace(model=model, strategy=types.SimpleNamespace(
        optimizer=optimizer), global_step=0, samples_total=0)
    snapshots = in_job.Snapshots()
    assert snapshots.newest() == -1
    for step in (1, 2, 3):
        model(torch.ones(1, 3)).sum().backward()
        optimizer.step()
        run.global_step, run.samples_total = step, 32 * step
        snapshots.take(run, (0, step, 32 * step))
    assert [s["global_step"] for s in snapshots.kept] == [2, 3] and snapshots.newest() == 3
    kept = snapshots.at(3)["model"]["weight"]
    assert torch.equal(kept, model.weight.detach()) and kept is not model.weight
    with torch.no_grad():
        model.weight.add_(1.0)  # a snapshot is a copy: training on does not change it
    assert not torch.equal(snapshots.at(3)["model"]["weight"], model.weight.detach())
    with pytest.raises(AssertionError, match="no snapshot of step 1"):
        snapshots.at(1)


ENDING = """
import atexit, sys, time, types
import mpidp
from mpidp.engine.library import mpi
from mpidp.runtime import exit, recovery, world
mpidp.init()
MPI = mpi()
atexit.register(lambda: print("finalized at exit:", MPI.Is_finalized(), flush=True))
recovery._lost = sys.argv[1] != "none"
if sys.argv[1] == "hangs":  # an MPI_Finalize that never returns (Open MPI's, now and then)
    world.mpi = lambda: types.SimpleNamespace(Is_finalized=lambda: False,
                                                 Finalize=lambda: time.sleep(60))
recovery.FINALIZE_AFTER_LOSS_S = 1.0
exit.exit_now(3)
"""


@pytest.mark.parametrize("case", ["none", "lost", "hangs"])
def test_a_process_of_a_job_that_lost_one_finalizes_last_and_within_its_time(case):
    """Note [Ending a job that lost a process]: MPI finalised by exit_now itself (before the
    atexit handlers), and a finalize that hangs ends the process with exit code 1."""
    import subprocess
    proc = subprocess.run([sys.executable, "-c", ENDING, case], capture_output=True,
                          text=True, timeout=120)
    if case == "hangs":
        assert proc.returncode == 1 and "Timeout (0:00:01)!" in proc.stderr, proc.stderr
        assert "in finalize_within" in proc.stderr and "finalized at exit" not in proc.stdout
        return
    assert proc.returncode == 3, proc.stderr
    assert proc.stdout.strip() == f"finalized at exit: {case == 'lost'}", proc.stdout


JOINING = """
import sys, time
from mpidp.runtime import recovery
with recovery.joined_within(True):
    time.sleep(float(sys.argv[1]))
print("joined", flush=True)
"""


@pytest.mark.parametrize("replacement", [True, False], ids=["replacement", "first-start"])
def test_a_replacement_that_cannot_join_ends_itself_after_the_timeout(replacement):
    """Note [A replacement that cannot join]: a replacement's join (here a sleep of 30 s) under
    MPIDP_TIMEOUT_S=1 ends the process with exit code 1 and its stacks on stderr; a process
    that is no replacement waits as long as its block takes (a 2 s sleep)."""
    import subprocess
    mark = ["-X", recovery.REPLACEMENT] if replacement else []
    proc = subprocess.run([sys.executable, *mark, "-c", JOINING, "30" if replacement else "2"],
                          capture_output=True, text=True, timeout=60,
                          env={**os.environ, "MPIDP_TIMEOUT_S": "1"})
    if replacement:
        assert proc.returncode == 1 and "Timeout (0:00:01)!" in proc.stderr, proc.stderr
        assert 'File "<string>", line 5 in <module>' in proc.stderr, proc.stderr
        assert "joined" not in proc.stdout
    else:
        assert proc.returncode == 0 and proc.stdout == "joined\n", proc.stderr
