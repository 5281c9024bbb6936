"""``python -m mpidp.doctor``: its pure verdicts and report (single process), the scan for files
of dead jobs against a stand-in directory, and a job launched as independent singletons (each a
plain process, no mpiexec); the doctor itself under mpiexec: tests/mpi/test_doctor_runs.py."""
import mmap
import os
import subprocess
import sys
from pathlib import Path

from mpidp.doctor import leftovers, verdicts
from mpidp.doctor.findings import (
    FAIL,
    INFO,
    OK,
    SKIP,
    WARN,
    Finding,
    Raised,
    Skipped,
    exit_code,
    format_report,
    judge,
    rank_list)

ROOT = Path(__file__).parents[2]


# ---- pure: findings and report --------------------------------------------------------------

def test_rank_list_joins_runs():
    assert rank_list([3]) == "rank 3"
    assert rank_list([5, 0, 1, 2, 7, 8]) == "ranks 0-2, 5, 7-8"


def test_judge_reports_raised_and_skipped_and_a_broken_verdict():
    found = judge(lambda vs: [Finding(OK, "fine")], [1, Raised("OSError: x"), Raised("OSError: x")])
    assert [(f.status, f.text) for f in found] == [(FAIL, "ranks 1-2: OSError: x")]
    assert judge(lambda vs: [], [Skipped("needs init"), Skipped("needs init")]) == \
        [Finding(SKIP, "needs init")]
    found = judge(lambda vs: [Finding(OK, vs[0]["missing"])], [{}])
    assert found[0].status == FAIL and "KeyError" in found[0].text


def test_report_puts_each_fix_on_the_next_line_and_counts():
    sections = [("MPI", [Finding(INFO, "MPICH"), Finding(OK, "thread level MULTIPLE")]),
                ("GPU", [Finding(WARN, "no device", "check nvidia-smi")]),
                ("Slurm", [Finding(FAIL, "singletons", "srun --mpi=pmi2")])]
    text = format_report("mpidp doctor", sections).splitlines()
    assert text[0] == "mpidp doctor" and text[1] == "MPI"
    assert text[text.index("  WARN  no device") + 1] == "        fix: check nvidia-smi"
    assert text[-1] == "problems found: 1 OK, 1 WARN, 1 FAIL, 0 SKIP"
    assert exit_code(sections) == 1 and exit_code(sections[:2]) == 0


# ---- pure: diagnoses ------------------------------------------------------------------------

def test_singleton_diagnosis_from_the_environment():
    step = {"SLURM_JOB_ID": "7", "SLURM_PROCID": "0", "SLURM_NTASKS": "4",
            "SLURM_STEP_NUM_TASKS": "4"}
    f = verdicts.singleton_diagnosis(step, mpi_size=1)
    assert f.status == FAIL and "4 independent singletons" in f.text
    assert "srun --mpi=pmi2" in f.fix
    assert verdicts.singleton_diagnosis(step, mpi_size=4) is None
    batch = {k: v for k, v in step.items() if k != "SLURM_STEP_NUM_TASKS"}
    assert verdicts.singleton_diagnosis(batch, 1) is None   # the batch script is one process
    ompi = {"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "2"}
    assert "Open MPI's mpirun" in verdicts.singleton_diagnosis(ompi, 1).fix
    hydra = {"PMI_RANK": "0", "PMI_SIZE": "3"}
    assert "3 processes" in verdicts.singleton_diagnosis(hydra, 1).text
    assert verdicts.singleton_diagnosis({}, 1) is None


def rank_value(rank, host="a", local=(0, 1), nodes=1, problems=(), launcher="MPICH/Hydra"):
    return {"host": host, "pid": 100 + rank, "cpus": 2, "local_rank": local[0],
            "local_size": local[1], "node_count": nodes, "launcher": launcher,
            "problems": list(problems), "singleton": None, "gpus": None}


def test_ranks_verdict_map_and_disagreements():
    values = [rank_value(0, local=(0, 2)), rank_value(1, local=(1, 2))]
    found = verdicts.verdict_ranks(values)
    assert found[0].status == INFO and found[0].text.startswith("rank 0") and "local 0/2" in \
        found[0].text
    assert [f.status for f in found[2:]] == [OK, OK]
    values[1]["problems"] = ["MPICH/Hydra says rank 3, MPI says 1"]
    bad = [f for f in verdicts.verdict_ranks(values) if f.status == FAIL]
    assert bad[0].text == "rank 1: MPICH/Hydra says rank 3, MPI says 1" and bad[0].fix
    two_hosts_one_node = [rank_value(0, "a", (0, 2)), rank_value(1, "b", (1, 2))]
    assert any(f.status == WARN and "2 host names but 1" in f.text
               for f in verdicts.verdict_ranks(two_hosts_one_node))
    big = [rank_value(r, f"h{r // 10}", (r % 10, 10), nodes=4) for r in range(40)]
    lines = verdicts.rank_map(big)
    assert len(lines) == 4 and "ranks 0-9 (10 ranks)" in lines[0].text


def test_mpi_verdict_flags_mixed_libraries_and_low_thread_levels():
    v = {"library": "MPICH Version: 5.0.2", "standard": (5, 0), "thread": 3, "mpi4py": "4.1"}
    assert [f.status for f in verdicts.verdict_mpi([v, v])] == [INFO, OK, OK, INFO]
    assert verdicts.verdict_mpi([v])[-1].text.startswith("no fault tolerance in this MPI: a "
                                                         "lost rank ends the job")
    on = verdicts.verdict_mpi([dict(v, fault_tolerance="on")])[-1]
    assert on.text.startswith("fault tolerance (ULFM) on in this job")
    other = dict(v, library="Open MPI v5.0.3", thread=2)
    found = verdicts.verdict_mpi([v, other])
    assert found[1].status == FAIL and "rank 1: Open MPI" in found[1].text
    assert found[2].status == WARN and "SERIALIZED on rank 1" in found[2].text
    assert verdicts.verdict_mpi([dict(v, thread=0)])[2].status == FAIL


def test_mpidp_verdict_init_failures():
    v = {"version": "0.1.0", "kernels": "c", "settings": [], "config_error": None, "init": None}
    assert verdicts.verdict_mpidp([v, v])[-1] == Finding(OK, "mpidp.init(): group built on "
                                                             "every rank")
    broken = dict(v, init="RuntimeError: no shared memory")
    found = verdicts.verdict_mpidp([v, broken])[-1]
    assert found.status == FAIL and found.text.startswith("mpidp.init() failed on rank 1")
    refused = dict(v, init="LaunchError: mpidp: Slurm started 2 processes ...")
    found = verdicts.verdict_mpidp([refused])[-1]   # the singletons are named under Ranks
    assert found.status == SKIP and "see Ranks" in found.text


def test_shm_verdict_blocked_cma_and_small_dev_shm():
    v = {"host": "a", "local_rank": 0, "local_size": 2, "got": 3, "expected": 3,
         "mode": "window", "forced": False, "dev_shm_free": 64 << 20}
    found = verdicts.verdict_shm([v, dict(v, local_rank=1)])
    assert [f.status for f in found] == [OK, WARN, WARN]
    assert "ptrace_scope" in found[1].fix and "--shm-size" in found[2].fix
    wrong = verdicts.verdict_shm([dict(v, got=1, dev_shm_free=None, mode="cma")])
    assert wrong[0].status == FAIL


def test_node_memory_verdict_says_how_the_peers_reach_it():
    v = {"host": "a", "local_rank": 0, "local_size": 2, "got": 3, "expected": 3,
         "mode": "cma", "forced": False, "dev_shm_free": 1 << 30}

    def finding(*states):
        found = verdicts.verdict_shm([dict(v, local_rank=r, node_memory=s)
                                      for r, s in enumerate(states)])
        return [f for f in found if "node memory" in f.text]

    assert finding("direct", "direct")[0].status == OK
    assert "not offered" in finding("not offered", "not offered")[0].text
    assert finding("direct", "kernel")[0].status == WARN
    bad = finding("direct", "wrong")[0]
    assert bad.status == FAIL and "rank 1" in bad.text
    assert finding("untested", "untested") == []


SHM = "/dev/shm/mpich_shm_*"


def shm_files(*names, size_bytes=2118784):
    return [(f"/dev/shm/mpich_shm_{n}_0", size_bytes, SHM) for n in names]


def test_leftovers_verdict_none():
    assert verdicts.verdict_leftovers([{"host": "a", "files": []}, None]) == [Finding(
        OK, "no files left by dead MPI jobs (/dev/shm/mpich_shm_*, /dev/shm/mpich_shar_tmp*, "
            "/tmp/hydra_hwloc_xmlfile_*, /tmp/mpich_shar_tmp*)")]
    two_nodes = verdicts.verdict_leftovers([{"host": "a", "files": []}, None,
                                            {"host": "b", "files": []}, None])
    assert [f.status for f in two_nodes] == [OK] and "on any of the 2 nodes" in two_nodes[0].text


def test_leftovers_verdict_counts_sizes_and_names_each_file():
    files = shm_files("1a", "2b") + [("/tmp/hydra_hwloc_xmlfile_Ab9", 5564,
                                      "/tmp/hydra_hwloc_xmlfile_*")]
    found = verdicts.verdict_leftovers([{"host": "a", "files": files}, None])
    assert [f.status for f in found] == [WARN]
    assert found[0].text == ("a: 3 file(s) left by dead MPI jobs (an abort or a killed rank), "
                             "4.0 MiB in all: 2 /dev/shm/mpich_shm_*, 1 "
                             "/tmp/hydra_hwloc_xmlfile_*; no process of yours holds them")
    assert found[0].fix == ("rm /dev/shm/mpich_shm_1a_0 /dev/shm/mpich_shm_2b_0 "
                            "/tmp/hydra_hwloc_xmlfile_Ab9")


def test_leftovers_verdict_names_a_few_and_counts_the_rest_per_host():
    n = verdicts.FIX_NAMES + 2
    files = shm_files(*(f"{i:x}" for i in range(n)), size_bytes=1024)
    found = verdicts.verdict_leftovers([{"host": "a", "files": []}, None,
                                        {"host": "b", "files": files}, None])
    assert [f.status for f in found] == [WARN] and found[0].text.startswith(
        f"b: {n} file(s) left") and f"{n} KiB in all: {n} /dev/shm/mpich_shm_*" in found[0].text
    named = " ".join(p for p, _, _ in files[:verdicts.FIX_NAMES])
    assert found[0].fix == (f"on b: rm {named}; the other 2: python -m mpidp.doctor "
                            "--leftovers | xargs rm")
    assert files[verdicts.FIX_NAMES][0] not in found[0].fix
    odd = [("/dev/shm/mpich_shm_a b", 1, SHM)]   # quoted so that the command is exact
    assert verdicts.verdict_leftovers([{"host": "a", "files": odd}])[0].fix == \
        "rm '/dev/shm/mpich_shm_a b'"


def test_leftovers_scan_reports_only_files_no_live_process_holds(tmp_path):
    d = tmp_path.resolve()
    for name in ("mpich_shm_fd_0", "mpich_shm_mapped_0", "mpich_shm_dead_0", "other_0"):
        (d / name).write_bytes(b"x" * 4096)
    (d / "mpich_shm_link_0").symlink_to(d / "mpich_shm_dead_0")   # never a symlink
    (d / "mpich_shm_dir_0").mkdir()
    patterns = ((str(tmp_path), "mpich_shm_"),)
    with open(d / "mpich_shm_mapped_0", "r+b") as f:
        mapped = mmap.mmap(f.fileno(), 4096)   # held by this mapping alone once f is closed
    try:
        with open(d / "mpich_shm_fd_0", "rb"):   # held by an open file alone
            found = leftovers.dead_files(patterns)
            assert found == [leftovers.Leftover(str(d / "mpich_shm_dead_0"), 4096,
                                                f"{d}/mpich_shm_*")]
            assert leftovers.held([str(d / "mpich_shm_mapped_0")]) == \
                {str(d / "mpich_shm_mapped_0")}
    finally:
        mapped.close()
    assert [f.path for f in leftovers.dead_files(patterns)] == \
        [str(d / n) for n in ("mpich_shm_dead_0", "mpich_shm_fd_0", "mpich_shm_mapped_0")]
    assert leftovers.dead_files(patterns, uid=os.geteuid() + 1) == []   # only this user's
    assert leftovers.dead_files(((str(d / "missing"), "mpich_shm_"),)) == []


def test_rma_and_allreduce_verdicts():
    good = {"counter": 3, "vector": [3.0] * 4, "expected": 3}
    assert verdicts.verdict_rma([good, good])[0].status == OK
    assert verdicts.verdict_rma([good, dict(good, counter=2)])[0].text.startswith("rank 1:")
    ok = ("ring", OK, "", [(20, 1e-5), (262144, 2e-4)])
    bad = ("ring", FAIL, "3 of 5 elements wrong at 20 B", [])
    skip = ("shm", SKIP, "needs one node; the group spans 2", [])
    found = verdicts.verdict_allreduce([[ok, skip], [bad, skip]])
    assert found[0].status == FAIL and "rank 1: 3 of 5" in found[0].text and found[0].fix
    assert found[1] == Finding(SKIP, "shm   needs one node; the group spans 2")
    assert verdicts.verdict_allreduce([[ok], [ok]])[0].text == \
        "ring  exact at 20 B and 256 KiB (10 µs, 200 µs)"


def test_gpu_verdicts_never_need_cupy():
    """The first line says what the training tool's --device auto picks (torch's count of
    GPUs, Note [Training device]), with or without CuPy."""
    found = verdicts.verdict_gpu([{"installed": False, "host": "a"}])
    assert found[0] == Finding(INFO, "python -m mpidp.train --device auto: cpu (auto: no GPU "
                               "visible; the parameter server and central train on the CPU)")
    assert found[1].status == SKIP and "pip install 'mpidp[gpu]'" in found[1].fix
    base = {"installed": True, "version": "13.3", "devices": 1, "name": "H100", "nccl": 22005,
            "local_size": 2, "host": "a", "torch_gpus": 1, "torch_gpu_id": "GPU-a"}
    found = verdicts.verdict_gpu([base, base])
    assert [f.status for f in found] == [INFO, INFO, OK, WARN, OK]  # 2 ranks share 1 GPU
    assert "--device auto: cpu (auto: ranks 0 and 1 would share a GPU" in found[0].text
    two = dict(base, devices=2, torch_gpus=2)
    assert "--device auto: cuda (auto: a GPU for every rank" in \
        verdicts.verdict_gpu([two, dict(two, torch_gpu_id="GPU-b")])[0].text
    none = dict(base, devices=0, device_error="cudaErrorNoDevice", nccl=None,
                nccl_error="ImportError: libnccl.so.2", torch_gpus=0, torch_gpu_id=None)
    found = verdicts.verdict_gpu([none])
    assert [f.status for f in found] == [INFO, INFO, WARN, WARN]
    assert "cudaErrorNoDevice" in found[2].text and "nvidia-nccl" in found[3].fix


def test_slurm_verdicts():
    def values(size, **env):
        return [{"rank": r, "size": size, "env": dict(env, SLURM_PROCID=str(r))}
                for r in range(size)]
    assert verdicts.verdict_slurm(values(2))[0].status == SKIP
    job = {"SLURM_JOB_ID": "9", "SLURM_NTASKS": "2", "SLURM_JOB_NUM_NODES": "1"}
    srun = verdicts.verdict_slurm(values(2, SLURM_STEP_NUM_TASKS="2", SLURM_STEP_ID="0", **job))
    assert srun[-1].status == OK and "srun step 9.0" in srun[-1].text
    mpiexec = verdicts.verdict_slurm(values(3, HYDI_CONTROL_FD="7", **job))
    assert [f.status for f in mpiexec] == [INFO, OK, WARN] and "oversubscribed" in \
        mpiexec[2].text
    batch = verdicts.verdict_slurm(values(1, **job))
    assert batch[-1].status == WARN and "batch script" in batch[-1].text
    single = [{"rank": 0, "size": 1, "env": dict(job, SLURM_PROCID="1",
                                                 SLURM_STEP_NUM_TASKS="2")}]
    last = verdicts.verdict_slurm(single)[-1]   # the failure itself is reported under Ranks
    assert last.status == INFO and "singletons named under Ranks" in last.text
    shifted = values(2, SLURM_STEP_NUM_TASKS="2", **job)
    shifted[1]["env"]["SLURM_PROCID"] = "0"
    assert "SLURM_PROCID differs from the MPI rank on rank 1" in \
        verdicts.verdict_slurm(shifted)[-1].text


# ---- the doctor itself, as two plain processes (no mpiexec) ---------------------------------

def test_independent_singletons_fail_and_only_the_launchers_rank_0_prints():
    slurm = {"SLURM_JOB_ID": "42", "SLURM_STEP_ID": "0", "SLURM_STEP_NUM_TASKS": "2",
             "SLURM_NTASKS": "2", "SLURM_LOCALID": "0", "SLURM_JOB_NUM_NODES": "1"}
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("PMI_", "HYDI_", "MPI_LOCAL", "OMPI_", "SLURM_"))}
    outs = []
    for procid in ("0", "1"):
        proc = subprocess.run([sys.executable, "-m", "mpidp.doctor"], capture_output=True,
                              text=True, timeout=120, cwd=ROOT,
                              env=dict(env, **slurm, SLURM_PROCID=procid))
        assert proc.returncode == 1, proc.stdout + proc.stderr[-3000:]
        outs.append(proc.stdout)
    assert "the job runs as 2 independent singletons" in outs[0]
    assert "srun started 2 tasks but MPI sees a world of 1 in each" in outs[0]
    assert "fix: launch with srun --mpi=pmi2" in outs[0]
    assert outs[1] == ""
