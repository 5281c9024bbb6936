"""Tier 1: configuration parsing, the launcher cross-check, and import side effects (a bad
setting raised by mpidp.init under mpiexec: tests/mpi/test_config_runs.py)."""
import re
import subprocess
import sys
from pathlib import Path

import pytest

from mpidp import config
from mpidp.runtime import launcher
from mpidp.errors import ConfigError


def test_defaults_and_overrides():
    c = config.from_env({})
    assert c.algorithm == "auto" and c.shm_peers == "auto" and not c.require_extension
    c = config.from_env({"MPIDP_ALGORITHM": "ring", "MPIDP_RING_PIECE_BYTES": "4096",
                         "MPIDP_SHM_PEERS": "window", "MPIDP_TIMEOUT_S": "2.5", "CI": "true"})
    assert (c.algorithm, c.ring_piece_bytes, c.shm_peers, c.timeout_s) == ("ring", 4096, "window", 2.5)
    assert c.require_extension
    assert not config.from_env({"CI": "1", "MPIDP_REQUIRE_EXTENSION": "0"}).require_extension


@pytest.mark.parametrize("env,match", [
    ({"MPIDP_ALGORITHM": "tree"}, "MPIDP_ALGORITHM='tree': expected one of auto, shm"),
    ({"MPIDP_RING_PIECE_BYTES": "big"}, "expected an integer"),
    ({"MPIDP_SHM_CHUNK_BYTES": "8"}, ">= 64"),
    ({"MPIDP_TIMEOUT_S": "-1"}, "must be > 0"),
    ({"MPIDP_ABORT_ON_EXCEPTION": "maybe"}, "expected one of 1, 0"),
])
def test_bad_values_name_the_variable(env, match):
    with pytest.raises(ValueError, match=match):
        config.from_env(env)


# a garbage value of every documented variable but MPIDP_TIMELINE (any path names a file; one
# that cannot be written is refused by mpidp.init) and what the one line says is accepted
GARBAGE = {
    "MPIDP_ALGORITHM": ("tree", "expected one of auto, "),
    "MPIDP_SHM_PEERS": ("shared", "expected one of auto, cma, window"),
    "MPIDP_SHM_CHUNK_BYTES": ("1e6", "expected an integer >= 64"),
    "MPIDP_SHM_INLINE_BYTES": ("99999", "must be from 0 to 4096"),
    "MPIDP_RING_PIECE_BYTES": ("32", "must be >= 64"),
    "MPIDP_DOUBLING_MAX_BYTES": ("-1", "must be >= 0"),
    "MPIDP_HIER_MIN_BYTES": ("64k", "expected an integer >= 0"),
    "MPIDP_EMULATE_NODE_SIZE": ("two", "expected an integer >= 0"),
    "MPIDP_TIMEOUT_S": ("0", "must be > 0 and finite"),
    "MPIDP_DEBUG": ("verbose", "expected one of 1, 0, true, false, yes, no, on, off"),
    "MPIDP_ABORT_ON_EXCEPTION": ("maybe", "expected one of 1, 0, true, false, yes, no, on, off"),
    "MPIDP_REQUIRE_EXTENSION": ("2", "expected one of 1, 0, true, false, yes, no, on, off"),
    "MPIDP_EXTENSION": ("c", "expected one of 1, 0, true, false, yes, no, on, off"),
    "MPIDP_AUDIT_EVERY": ("often", "expected an integer >= 0"),
    "MPIDP_AUDIT_ACTION": ("stop", "expected one of raise, warn"),
    "MPIDP_HOROVOD_FUSION_BYTES": ("64M", "expected an integer >= 1"),
    "MPIDP_RECOVERY": ("restart", "expected one of auto, respawn, shrink, off"),
    "MPIDP_PS_MEMORY": ("shared", "expected one of auto, window"),
}
DOCS = Path(__file__).parents[2] / "docs" / "configuration.md"


def documented_variables() -> list:
    return re.findall(r"^\| `(MPIDP_[A-Z_]+)` \|", DOCS.read_text(), re.M)


def test_every_documented_variable_refuses_garbage_in_one_line_naming_what_is_accepted():
    assert sorted(documented_variables()) == sorted([*GARBAGE, "MPIDP_TIMELINE"])
    for name, (value, accepted) in GARBAGE.items():
        with pytest.raises(ConfigError) as caught:
            config.from_env({name: value})
        e = caught.value
        assert isinstance(e, ValueError) and (e.variable, e.value) == (name, value)
        assert str(e).startswith(f"{name}={value!r}: ") and accepted in str(e), str(e)
        assert "\n" not in str(e)


def test_shm_inline_bytes_maximum_is_the_control_blocks():
    assert config.from_env({"MPIDP_SHM_INLINE_BYTES": "4096"}).shm_inline_bytes == 4096
    ext = pytest.importorskip("mpidp._ext")
    assert config.SHM_INLINE_MAX_BYTES == ext.SHM_INLINE_BYTES


def test_switch_spellings_are_accepted_and_documented():
    for text in ("yes", "On", " TRUE ", "1"):
        assert config.from_env({"MPIDP_DEBUG": text}).debug is True
    for text in ("no", "Off", "false", "0", ""):
        assert config.from_env({"MPIDP_DEBUG": text}).debug is False
    docs = DOCS.read_text()
    assert all(f"`{spelling}`" in docs for spelling in config.BOOL_SPELLINGS)


def test_a_config_error_pickles_whole_for_another_rank():
    """_agreed_settings sends a bad rank's error to the others: a round trip keeps its fields
    and its message, "rank r: " included."""
    import pickle
    e = ConfigError("MPIDP_DEBUG", "maybe", "expected one of on, off", where="rank 1: ")
    back = pickle.loads(pickle.dumps(e))
    assert type(back) is ConfigError and str(back) == str(e) == \
        "rank 1: MPIDP_DEBUG='maybe': expected one of on, off"
    assert (back.variable, back.value, back.expected, back.where) == \
        ("MPIDP_DEBUG", "maybe", "expected one of on, off", "rank 1: ")


def test_emulated_node_larger_than_the_group_is_refused():
    for k, size in ((0, 2), (1, 2), (2, 2), (2, 3)):  # 2 on 3 ranks: nodes of 2 and 1
        config.check_group_size(config.from_env({"MPIDP_EMULATE_NODE_SIZE": str(k)}), size)
    with pytest.raises(ConfigError, match=r"^MPIDP_EMULATE_NODE_SIZE='7': more than the 2 "
                                          r"rank\(s\) of the group: expected 0 \(off\) or 1 to 2$"):
        config.check_group_size(config.from_env({"MPIDP_EMULATE_NODE_SIZE": "7"}), 2)


def test_launcher_views():
    assert launcher.launcher_view({}) is None
    v = launcher.launcher_view({"PMI_RANK": "1", "PMI_SIZE": "4", "MPI_LOCALRANKID": "1",
                                "MPI_LOCALNRANKS": "2"})
    assert v == launcher.LauncherView("MPICH/Hydra", 1, 4, 1, 2)
    v = launcher.launcher_view({"OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "2",
                                "SLURM_PROCID": "5", "SLURM_NTASKS": "8"})
    assert v.launcher == "Open MPI"
    assert launcher.launcher_view({"SLURM_PROCID": "3", "SLURM_NTASKS": "4",
                                   "SLURM_LOCALID": "1"}).local_rank == 1
    # srun --mpi=pmi2 sets the PMI variables too; mpiexec inside an allocation is Hydra's
    pmi2 = {"PMI_RANK": "1", "PMI_SIZE": "2", "SLURM_STEP_ID": "0", "SLURM_PROCID": "1",
            "SLURM_NTASKS": "2"}
    assert launcher.launcher_view(pmi2) == launcher.LauncherView("Slurm (PMI2)", 1, 2, None, None)
    assert launcher.launcher_view({**pmi2, "HYDI_CONTROL_FD": "7"}).launcher == "MPICH/Hydra"


def test_mpich_under_srun_pmi2_gets_the_ofi_netmod():
    """Note [PMI-1 lines under srun]: only an srun step served by Slurm's pmi2 plugin, and only
    where the user chose no netmod."""
    step = {"PMI_RANK": "0", "PMI_SIZE": "2", "PMI_FD": "11", "SLURM_STEP_ID": "0",
            "SLURM_PROCID": "0", "SLURM_NTASKS": "2"}
    assert launcher.mpi_start_settings(step, True) == {"MPIR_CVAR_CH4_NETMOD": "ofi"}
    assert launcher.mpi_start_settings(step, False) == {}  # a site's MPICH may lack ofi
    for chosen in launcher.NETMOD_VARIABLES:
        assert launcher.mpi_start_settings({**step, chosen: "ucx"}, True) == {}
    assert launcher.mpi_start_settings({**step, "HYDI_CONTROL_FD": "7"}, True) == {}  # mpiexec
    no_fd = {k: v for k, v in step.items() if k != "PMI_FD"}
    assert launcher.mpi_start_settings(no_fd, True) == {}
    assert launcher.mpi_start_settings({}, True) == {}


def test_open_mpi_with_fault_tolerance_finalizes_without_the_fence_and_sends_without_put():
    """Note [Ending a job that lost a process] and Note [A peer lost mid-transfer] in
    mpidp/runtime/recovery.py: each unless the user chose."""
    ft = {"OMPI_MCA_mpi_ft_enable": "1", "OMPI_COMM_WORLD_RANK": "0"}
    no_put = {"OMPI_MCA_btl_tcp_flags": "send,inplace,need-ack,need-csum"}
    assert launcher.mpi_start_settings(ft, False) == {"OMPI_MCA_async_mpi_finalize": "1",
                                                      **no_put}
    assert launcher.mpi_start_settings({**ft, "OMPI_MCA_async_mpi_finalize": "0"}, False) == \
        no_put
    assert launcher.mpi_start_settings({**ft, "OMPI_MCA_btl_tcp_flags": "send,put"}, False) == \
        {"OMPI_MCA_async_mpi_finalize": "1"}
    assert launcher.mpi_start_settings({**ft, **no_put, "OMPI_MCA_async_mpi_finalize": "1"},
                                       True) == {}
    assert launcher.mpi_start_settings({**ft, "OMPI_MCA_mpi_ft_enable": "0"}, False) == {}


def test_disagreements_name_singletons():
    v = launcher.LauncherView("Slurm", 3, 4, 1, None)
    problems = launcher.disagreements(v, rank=0, size=1, local_rank=0, local_size=1)
    assert any("singletons" in p for p in problems)
    assert launcher.disagreements(v, rank=3, size=4, local_rank=1, local_size=2) == []
    assert launcher.disagreements(None, 0, 1, 0, 1) == []


def test_import_starts_neither_mpi_nor_torch_nor_cuda():
    code = ("import sys, mpidp; mpidp.__dir__(); "
            "bad = [m for m in ('mpi4py.MPI', 'torch', 'cupy') if m in sys.modules]; "
            "assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_collective_before_init_is_a_clear_error():
    code = ("import mpidp, numpy as np\n"
            "try:\n    mpidp.allreduce(np.ones(2))\nexcept mpidp.NotInitializedError as e:\n"
            "    assert 'mpidp.init()' in str(e); print('ok')\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "ok", out.stderr


def test_independent_singletons_are_named_with_the_fix():
    # srun without an MPI plugin: every task is a world of 1
    step = {"SLURM_PROCID": "1", "SLURM_NTASKS": "2", "SLURM_STEP_NUM_TASKS": "2"}
    reason = launcher.independent_singletons(1, step)
    assert "2 independent singletons" in reason and "srun --mpi=pmi2" in reason
    assert launcher.independent_singletons(2, step) is None
    # the batch script of sbatch -n 2 is one process, not two singletons
    assert launcher.independent_singletons(1, {"SLURM_PROCID": "0", "SLURM_NTASKS": "2"}) is None
    assert launcher.independent_singletons(1, dict(step, SLURM_STEP_NUM_TASKS="1")) is None
    # another MPI's launcher
    ompi = {"OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "3"}
    assert "Open MPI's mpirun" in launcher.independent_singletons(1, ompi)
    assert "PMI" in launcher.independent_singletons(1, {"PMI_RANK": "0", "PMI_SIZE": "2"})
    assert launcher.independent_singletons(1, {"PMI_RANK": "0", "PMI_SIZE": "1"}) is None
    assert launcher.independent_singletons(1, {}) is None
