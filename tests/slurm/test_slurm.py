"""The batch scripts of examples/slurm/ submitted with sbatch to a real single-node Slurm
cluster (tests/harness/slurm_cluster.py, started and stopped by this module), and srun's commonest
mistake (no MPI plugin: N independent singletons) refused by the runtime; then Slurm across
two emulated nodes (tests/harness/multinode_cluster.py): srun -N 2, and a batch job across both
requeued and resumed.

Slurm comes from the distribution's packages (tests/slurm/install.sh, part of the README's
test command). Without it, or without root, these tests are skipped, except in CI (the CI
variable set), where they fail."""
from __future__ import annotations

import json
import os
import re
import shutil
import sys
import tempfile
import time
from pathlib import Path

import pytest

from mpirun import BODIES
from slurm_cluster import SlurmCluster, missing_programs

REPO = Path(__file__).parents[2]
EXAMPLES = REPO / "examples" / "slurm"
JOB_TIMEOUT_S = 240
TRAIN_FLAGS = ["--epochs", "1", "--verbose"]   # one quick epoch, every rank logs

# example script -> (ranks on the one node, strategy)
JOBS = {
    "mirrored.sbatch": (2, "mirrored"),
    "mpiexec.sbatch": (2, "mirrored"),
    "ps.sbatch": (3, "ps"),
}


def _cannot_run() -> str | None:
    missing = missing_programs()
    if missing:
        return (f"Slurm is not installed (missing {', '.join(missing)}): run "
                f"bash tests/slurm/install.sh as root")
    if os.geteuid() != 0:
        return "the test's Slurm daemons run as root (SlurmUser=root); this is not root"
    return None


def _require(reason: str | None, what: str) -> None:
    """Skips the test for ``reason``, if any; in CI (the CI variable set) fails it instead."""
    if reason is not None:
        if os.environ.get("CI"):
            pytest.fail(f"CI must run {what}: {reason}", pytrace=False)
        pytest.skip(reason)


@pytest.fixture(scope="module")
def cluster():
    _require(_cannot_run(), "the Slurm test")
    root = Path(tempfile.mkdtemp(prefix="mpidp-slurm-"))
    try:
        with SlurmCluster(root) as c:
            yield c
    finally:
        shutil.rmtree(root, ignore_errors=True)


def _job_env() -> dict:
    """Jobs run this Python (and the mpich wheel's mpiexec beside it) first on PATH, as
    they would for a user who submits from a shell with the virtual environment active."""
    return {"PATH": str(Path(sys.executable).parent) + os.pathsep + os.environ.get("PATH", ""),
            "PYTHONUNBUFFERED": "1"}


def _tail(path: Path, chars: int = 4000) -> str:
    """The end of a job's output file, for a failure message."""
    try:
        return f"--- {path.name}\n" + path.read_text(errors="replace")[-chars:]
    except OSError as exc:
        return f"--- {path.name}: {exc}"


def _job_state(c: SlurmCluster, job_id: str) -> dict:
    out = c.run(["scontrol", "show", "job", "-o", job_id]).stdout
    return dict(w.split("=", 1) for w in out.split() if "=" in w)


def _submit_and_wait(c: SlurmCluster, jobs: dict) -> dict:
    """Submits every job of ``jobs`` (name -> sbatch's arguments) at once from the cluster's
    directory (the jobs' working directory), waits for all, and returns name -> (scontrol's
    job record, the job's output)."""
    ids = {name: c.run(["sbatch", "--parsable", f"--output={c.root / name}.out", *args],
                       env=_job_env(), cwd=c.root).stdout.strip()
           for name, args in jobs.items()}
    deadline = time.monotonic() + JOB_TIMEOUT_S
    records = {}
    while len(records) < len(ids):
        for name, job_id in ids.items():
            if name not in records:
                record = _job_state(c, job_id)
                if record["JobState"] not in ("PENDING", "CONFIGURING", "RUNNING",
                                              "COMPLETING"):
                    records[name] = record
        if time.monotonic() > deadline:
            pending = {n: _job_state(c, i)["JobState"] for n, i in ids.items()
                       if n not in records}
            tails = "\n".join(_tail(c.root / f"{n}.out") for n in pending)
            pytest.fail(f"jobs not done in {JOB_TIMEOUT_S} s: {pending}\n{tails}\n{c.logs()}")
        time.sleep(0.25)
    return {n: (records[n], (c.root / f"{n}.out").read_text(errors="replace")) for n in ids}


@pytest.fixture(scope="module")
def jobs(cluster):
    """Every example script at once (each small: one node, 1 epoch): script -> (record,
    output). Options on the command line override the scripts' #SBATCH lines."""
    return _submit_and_wait(cluster, {
        script: ["--nodes=1", f"--ntasks-per-node={ranks}", "--time=5", EXAMPLES / script,
                 *TRAIN_FLAGS] for script, (ranks, _) in JOBS.items()})


def _summary(output: str) -> dict:
    lines = [l for l in output.splitlines() if l.startswith('{"') and '"summary"' in l]
    assert len(lines) == 1, f"expected one summary line (rank 0's):\n{output[-4000:]}"
    return json.loads(lines[0])


@pytest.mark.parametrize("script", sorted(JOBS))
def test_example_batch_script_trains(cluster, jobs, script):
    ranks, strategy = JOBS[script]
    record, output = jobs[script]
    assert (record["JobState"], record["ExitCode"]) == ("COMPLETED", "0:0"), output[-4000:]
    summary = _summary(output)
    assert summary["event"] == "summary"
    assert summary["ranks"] == ranks and summary["strategy"] == strategy, summary
    # one MPI world: every task logged with its own rank
    for r in range(ranks):
        assert f"[rank {r}] epoch   1/1" in output, output[-4000:]
    if strategy == "ps":
        assert (summary["workers"], summary["servers"]) == (ranks - 1, 1), summary
    if script == "mirrored.sbatch":   # checkpoints under the job's directory, per job id
        checkpoint = Path(summary["checkpoint"])
        assert checkpoint.parent == cluster.root / "checkpoints" / record["JobId"], summary
        assert checkpoint.is_file() and summary["resumed_from"] is None, summary


def test_torch_distributed_batch_scripts(cluster):
    """examples/slurm/lightning.sbatch and torch_ddp.sbatch: Lightning's Trainer and a plain
    torch-DDP script on the mpidp backend, two srun tasks, as they are."""
    env = dict(_job_env(), EXAMPLES_DIR=str(REPO / "examples"))
    ids = {script: cluster.run(["sbatch", "--parsable", f"--output={cluster.root / script}.out",
                                "--nodes=1", "--ntasks-per-node=2", "--time=5",
                                EXAMPLES / script, "--epochs", "1"],
                               env=env, cwd=cluster.root).stdout.strip()
           for script in ("lightning.sbatch", "torch_ddp.sbatch")}
    expected = {"lightning.sbatch": "backend mpidp: 2 ranks, train_accuracy",
                "torch_ddp.sbatch": "epoch 1/1: 2 ranks, loss"}
    deadline = time.monotonic() + JOB_TIMEOUT_S
    for script, job_id in ids.items():
        while (record := _job_state(cluster, job_id))["JobState"] in (
                "PENDING", "CONFIGURING", "RUNNING", "COMPLETING"):
            assert time.monotonic() < deadline, _tail(cluster.root / f"{script}.out")
            time.sleep(0.25)
        output = (cluster.root / f"{script}.out").read_text(errors="replace")
        assert (record["JobState"], record["ExitCode"]) == ("COMPLETED", "0:0"), output[-4000:]
        assert expected[script] in output, output[-4000:]


def test_srun_without_mpi_plugin_is_refused(cluster):
    """srun without --mpi=pmi2 (MpiDefault=none here) starts 2 worlds of 1 rank: the
    training tool refuses with one line and exit code 2, mpidp.init() raises LaunchError."""
    srun = ["srun", "--nodes=1", "--ntasks=2", "--time=5", sys.executable]
    proc = cluster.run(srun + ["-m", "mpidp.train", "--epochs", "1"], check=False,
                       timeout_s=JOB_TIMEOUT_S, env=_job_env(), cwd=cluster.root)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 2, out
    errors = [l for l in out.splitlines() if l.startswith("mpidp.train: error:")]
    assert len(errors) == 1, out   # one line, from SLURM_PROCID 0
    assert "2 independent singletons" in errors[0] and "srun --mpi=pmi2" in errors[0], out
    assert "summary" not in out, out

    code = ("import mpidp\ntry:\n    mpidp.init()\nexcept mpidp.LaunchError as e:\n"
            "    print('refused:', e)\nelse:\n    print('initialised')\n")
    proc = cluster.run(srun + ["-c", code], check=False, timeout_s=JOB_TIMEOUT_S,
                       env=_job_env(), cwd=cluster.root)
    lines = proc.stdout.splitlines()
    assert proc.returncode == 0 and len(lines) == 2, proc.stdout + proc.stderr
    assert all(l.startswith("refused: mpidp: Slurm started 2 processes") for l in lines), lines


def test_doctor_under_srun(cluster):
    """The doctor inside a real srun step: with --mpi=pmi2 the Slurm check finds one MPI rank
    per task and the launcher's variables agree; without it, the singletons are a FAIL that
    names the fix, and the doctor exits non-zero."""
    srun = ["srun", "--nodes=1", "--ntasks=2", "--time=5"]
    doctor = [sys.executable, "-m", "mpidp.doctor"]
    proc = cluster.run(srun + ["--mpi=pmi2"] + doctor, check=False, timeout_s=JOB_TIMEOUT_S,
                       env=_job_env(), cwd=cluster.root)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert "mpidp doctor: 2 rank(s)" in out and ", 0 FAIL," in out, out
    assert "launcher variables agree with MPI on every rank (Slurm (PMI2))" in out, out
    assert "tasks = MPI ranks, SLURM_PROCID = rank on every rank" in out, out

    proc = cluster.run(srun + doctor, check=False, timeout_s=JOB_TIMEOUT_S,
                       env=_job_env(), cwd=cluster.root)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out
    fails = [l for l in out.splitlines() if l.lstrip().startswith("FAIL")]
    assert len(fails) == 1 and "2 independent singletons" in fails[0], out  # said once
    assert "srun --mpi=pmi2" in out, out


# ---- across nodes: slurmctld on an emulated cluster's head, a slurmd in each of its nodes ----

@pytest.fixture(scope="module")
def nodes_cluster():
    from multinode_cluster import Cluster, unavailable  # tests/harness, on sys.path (conftest)
    _require(_cannot_run() or unavailable(), "the Slurm test across nodes")
    root = Path(tempfile.mkdtemp(prefix="mpidp-slurm-nodes-"))
    try:
        with Cluster(2) as nodes, SlurmCluster(root, nodes=nodes) as c:
            yield c
    finally:
        shutil.rmtree(root, ignore_errors=True)


def test_doctor_under_srun_across_nodes(nodes_cluster):
    """srun --mpi=pmi2 -N 2: one task on each node, one MPI world across them."""
    c = nodes_cluster
    proc = c.run(["srun", "--mpi=pmi2", "--nodes=2", "--ntasks=2", "--time=5", sys.executable,
                  "-m", "mpidp.doctor"], check=False, timeout_s=JOB_TIMEOUT_S, env=_job_env(),
                 cwd=c.root)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0 and ", 0 FAIL," in out, out
    assert "OK    2 rank(s) on 2 node(s): 1, 1 per node" in out, out
    assert "2 task(s) on 2 node(s) (node[0-1])" in out, out
    assert "2 tasks = MPI ranks, SLURM_PROCID = rank on every rank" in out, out
    # Note [PMI-1 lines under srun]: UCX's address would not fit Slurm's PMI-1 reads
    assert "MPICH netmod ofi (MPIR_CVAR_CH4_NETMOD)" in out, out


def _until_its_first_checkpoint(c, script: str, out: Path, *sbatch: str,
                                env: dict | None = None) -> tuple:
    """Submits ``script`` on 2 nodes x 1 task (3 epochs of the slow digits), with ``env`` added
    to its environment, and waits for its first checkpoint; returns (job id, its checkpoint
    directory, the test's deadline)."""
    env = dict(_job_env(), PYTHONPATH=str(BODIES), **(env or {}))  # user_factories
    job_id = c.run(["sbatch", "--parsable", f"--output={out}", *sbatch, "--nodes=2",
                    "--ntasks-per-node=1", "--time=5", EXAMPLES / script, "--epochs", "3",
                    "--dataset", "user_factories:slow_digits", "--threads-per-rank", "1"],
                   env=env, cwd=c.root).stdout.strip()
    checkpoints = c.root / "checkpoints" / job_id
    deadline = time.monotonic() + JOB_TIMEOUT_S
    while not list(checkpoints.glob("ckpt-*.pt")):
        assert time.monotonic() < deadline, \
            f"no checkpoint in {JOB_TIMEOUT_S} s\n{_tail(out)}\n{c.logs()}"
        assert _job_state(c, job_id)["JobState"] in ("PENDING", "CONFIGURING", "RUNNING"), \
            _tail(out)
        time.sleep(0.1)
    return job_id, checkpoints, deadline


def test_batch_script_across_nodes_is_requeued_and_resumes(nodes_cluster):
    """examples/slurm/mirrored.sbatch with --nodes=2: requeued once its first checkpoint is
    written (as a pre-empted job is), it runs again under the same job id, finds its
    checkpoints and resumes from them on both nodes, and completes."""
    c = nodes_cluster
    out = c.root / "requeued.out"
    job_id, checkpoints, deadline = _until_its_first_checkpoint(c, "mirrored.sbatch", out,
                                                                "--open-mode=append")
    c.run(["scontrol", "requeue", job_id])
    while (record := _job_state(c, job_id))["JobState"] not in ("COMPLETED", "FAILED",
                                                                "CANCELLED", "TIMEOUT"):
        assert time.monotonic() < deadline, \
            f"job {job_id}: {record['JobState']}\n{_tail(out)}\n{c.logs()}"
        if record["JobState"] == "PENDING" and record.get("Reason") == "BeginTime":
            # a requeued job may start again only two minutes later: not in a test
            c.run(["scontrol", "update", f"JobId={job_id}", "StartTime=now"], check=False)
        time.sleep(0.25)
    output = out.read_text(errors="replace")
    assert (record["JobState"], record["ExitCode"]) == ("COMPLETED", "0:0"), output[-4000:]
    assert int(record["Restarts"]) == 1, record
    summary = _summary(output)
    assert summary["ranks"] == 2 and summary["resumed_from"], summary
    assert Path(summary["resumed_from"]).parent == checkpoints, summary
    assert "mpidp.train: mirrored on 2 rank(s), 2 node(s)" in output, output[-4000:]


def test_the_other_batch_scripts_across_nodes(nodes_cluster):
    """ps.sbatch (its server, the last rank, on the second node) and mpiexec.sbatch (Hydra's
    mpiexec inside the allocation, starting its proxies through Slurm) with --nodes=2, one
    task on each node, both at once: each completes as one world across the two nodes."""
    c = nodes_cluster
    done = _submit_and_wait(c, {
        script: ["--nodes=2", "--ntasks-per-node=1", "--time=5", EXAMPLES / script,
                 *TRAIN_FLAGS] for script in ("ps.sbatch", "mpiexec.sbatch")})
    for script, strategy in (("ps.sbatch", "ps"), ("mpiexec.sbatch", "mirrored")):
        record, output = done[script]
        assert (record["JobState"], record["ExitCode"]) == ("COMPLETED", "0:0"), output[-4000:]
        summary = _summary(output)
        assert summary["ranks"] == 2 and summary["strategy"] == strategy, summary
        ranks = "2 ranks (1 worker(s), 1 server(s))" if strategy == "ps" else "2 rank(s)"
        assert f"mpidp.train: {strategy} on {ranks}, 2 node(s)" in output, output[-4000:]
        for r in range(2):
            assert f"[rank {r}] epoch   1/1" in output, output[-4000:]
    ps = _summary(done["ps.sbatch"][1])
    assert (ps["workers"], ps["servers"]) == (1, 1), ps


def test_the_supervisor_inside_an_allocation_outlives_a_lost_node(nodes_cluster):
    """examples/slurm/supervised.sbatch with --nodes=2: python -m mpidp.run takes the
    allocation's nodes as its host list (Note [Inside an allocation] in
    mpidp/run/allocation.py) and launches through Hydra's mpiexec, whose proxies Slurm starts.
    Once the first checkpoint exists, node1 is lost (every process on it SIGKILLed, its slurmd
    too; slurmctld still counts it as up, and the failed job's step holds node0's CPU): the
    probes (steps beside the job's) find node0 alone answering, and the run is relaunched there,
    1 rank, from the newest checkpoint, in a step beside the stale one, and completes inside the
    same allocation (--no-kill). The restart is one line."""
    c = nodes_cluster
    out = c.root / "supervised.out"
    # node1's probe waits out PROBE_TIMEOUT (srun retries a slurmd that is gone)
    job_id, checkpoints, deadline = _until_its_first_checkpoint(c, "supervised.sbatch", out,
                                                                env={"PROBE_TIMEOUT": "4"})
    try:
        c.lose_node(1)
        while (record := _job_state(c, job_id))["JobState"] not in ("COMPLETED", "COMPLETING",
                                                                    "FAILED", "CANCELLED",
                                                                    "TIMEOUT"):
            assert time.monotonic() < deadline, \
                f"job {job_id}: {record['JobState']}\n{_tail(out)}\n{c.logs()}"
            time.sleep(0.25)
        output = out.read_text(errors="replace")
        # the batch script has ended: COMPLETING while slurmctld waits for node1's slurmd
        assert record["JobState"] in ("COMPLETED", "COMPLETING") and \
            record["ExitCode"] == "0:0", (record, output[-4000:])
        restart = re.search(r"^mpidp\.run: the job failed after [\d.]+ s \(exit \d+: .*\); "
                            r"restart 1 of 3: node1 does not answer; on node0:1, 1 rank\(s\), "
                            r"from (ckpt-\d{9}\.pt)$", output, re.M)
        assert restart, output[-4000:]
        summary = _summary(output)
        assert summary["ranks"] == 1 and summary["resumed_from"] == \
            str(checkpoints / restart.group(1)), summary
        assert "mpidp.run: the run finished after 1 restart(s)" in output, output[-4000:]
    finally:
        c.run(["scancel", job_id], check=False)
        c.restore_node(1)
