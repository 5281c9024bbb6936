"""What the launcher (Open MPI, MPICH/Hydra, Slurm) says about this process's place in the job,
read from its environment variables, so the runtime can cross-check MPI's own answer."""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Mapping, NamedTuple, Optional

# launcher -> (rank, size, local rank, local size) variable names, most specific first
_VARIABLES = (
    ("Open MPI", ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE",
                  "OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_SIZE")),
    ("MPICH/Hydra", ("PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS")),
    ("Slurm", ("SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID", None)),
)


class LauncherView(NamedTuple):
    launcher: str
    rank: Optional[int]
    size: Optional[int]
    local_rank: Optional[int]
    local_size: Optional[int]


def _int(env: Mapping[str, str], name: Optional[str]) -> Optional[int]:
    if name is None or name not in env:
        return None
    try:
        return int(env[name])
    except ValueError:
        return None


def launcher_view(env: Mapping[str, str] | None = None) -> Optional[LauncherView]:
    """The first launcher whose rank and size variables are set, or None (a bare singleton)."""
    env = os.environ if env is None else env
    for name, (rank, size, local_rank, local_size) in _VARIABLES:
        r, n = _int(env, rank), _int(env, size)
        if r is not None and n is not None:
            if name == "MPICH/Hydra" and "SLURM_STEP_ID" in env and "HYDI_CONTROL_FD" not in env:
                name = "Slurm (PMI2)"  # srun --mpi=pmi2 sets the PMI variables, not Hydra
            return LauncherView(name, r, n, _int(env, local_rank), _int(env, local_size))
    return None


def disagreements(view: Optional[LauncherView], rank: int, size: int, local_rank: int,
                  local_size: int) -> list[str]:
    """Human-readable differences between the launcher's view and MPI's."""
    if view is None:
        return []
    problems = []
    if view.size is not None and view.size != size:
        hint = (" — the job was started as independent singletons: launch with mpiexec, or "
                "srun --mpi=pmi2 with the mpich wheel") if size == 1 and view.size > 1 else ""
        problems.append(f"{view.launcher} says {view.size} processes, MPI says {size}{hint}")
    elif view.rank is not None and view.rank != rank:
        problems.append(f"{view.launcher} says rank {view.rank}, MPI says {rank}")
    if view.local_rank is not None and view.local_rank != local_rank:
        problems.append(f"{view.launcher} says local rank {view.local_rank}, MPI says {local_rank}")
    if view.local_size is not None and view.local_size != local_size:
        problems.append(f"{view.launcher} says {view.local_size} ranks on this node, "
                        f"MPI says {local_size}")
    return problems


# Note [Independent singletons]: a launcher that starts N processes in a way the MPI library
# mpi4py uses cannot join (srun without an MPI plugin, or with one that library does not
# speak; another MPI's mpirun) gives N worlds of one rank each. Each would train alone on the
# whole data set and write the same checkpoints, so init refuses (LaunchError) instead of
# warning. The batch script of `sbatch -n N` itself sees SLURM_NTASKS=N and SLURM_PROCID=0 but
# is one process, not N: for Slurm only a step's task count (set by srun) counts.
def _fix(launcher: str) -> str:
    mpiexec = Path(sys.executable).parent / "mpiexec"
    if launcher.startswith("Slurm"):
        return ("launch with srun --mpi=pmi2 (the mpich wheel speaks PMI2; or MpiDefault=pmi2 "
                "in slurm.conf), or with mpiexec inside the allocation")
    if launcher == "Open MPI":
        return (f"this is Open MPI's mpirun but mpi4py uses another MPI library: launch with "
                f"that library's mpiexec ({mpiexec} for the mpich wheel)")
    return (f"mpi4py's MPI library does not speak this launcher's PMI: launch with that "
            f"library's own mpiexec ({mpiexec} for the mpich wheel)")


def singleton_launch(size: int, env: Mapping[str, str] | None = None) -> Optional[tuple]:
    """(what happened, the fix) where this process is one of several that a launcher started
    as one job although MPI sees a world of ``size`` == 1 (see Note [Independent
    singletons]); None when it is not."""
    if size != 1:
        return None
    env = os.environ if env is None else env
    view = launcher_view(env)
    if view is None:
        return None
    started = _int(env, "SLURM_STEP_NUM_TASKS") if view.launcher.startswith("Slurm") \
        else view.size
    if started is None or started <= 1:
        return None
    return (f"{view.launcher} started {started} processes but MPI sees a world of 1 in each: "
            f"the job runs as {started} independent singletons, each training alone",
            _fix(view.launcher))


def independent_singletons(size: int, env: Mapping[str, str] | None = None) -> Optional[str]:
    """singleton_launch's finding as one sentence with its fix, or None."""
    found = singleton_launch(size, env)
    return None if found is None else f"{found[0]}; {found[1]}"


# Note [PMI-1 lines under srun]: the mpich wheel speaks PMI-1 to Slurm's pmi2 plugin (its
# PMI-2 client does not start here, even under its own mpiexec). That plugin reads a PMI-1
# request with a single 1024-byte read, while MPICH cuts its network address into values of up
# to 1022 characters, sent as `cmd=put kvsname=... key=...-seg-i/n value=...` lines longer than
# that read whenever a segment has few runs of zeros. The rest of the line is then parsed as a
# request of its own ("mpi/pmi2: request not begin with 'cmd='" in slurmd's log) and the job
# hangs in MPI_Init — at random, the more ranks the likelier (twice in some dozens of
# two-node jobs here, once in CI). UCX's address takes about nine such segments a rank;
# libfabric's (MPICH's ofi netmod) fits a line of under a hundred characters. So under an srun
# PMI step, with the mpich wheel (built with both netmods; a site's MPICH may lack ofi) and no
# netmod chosen, mpidp chooses ofi before MPI starts (mpidp.init, the doctor);
# MPIR_CVAR_CH4_NETMOD=ucx set by the user wins. On InfiniBand, UCX may be the faster of the
# two: a site that launches with srun there should use an MPI built for its Slurm.
NETMOD_VARIABLES = ("MPIR_CVAR_CH4_NETMOD", "MPICH_CH4_NETMOD", "MPIR_PARAM_CH4_NETMOD")
FINALIZE_WITHOUT_FENCE = "OMPI_MCA_async_mpi_finalize"  # Open MPI's; set by --with-ft ulfm
# Open MPI's tcp transport without its RDMA put (its default flags less put and hetero-rdma):
# Note [A peer lost mid-transfer] in mpidp/runtime/recovery.py
TCP_FLAGS = "OMPI_MCA_btl_tcp_flags"
TCP_FLAGS_WITHOUT_PUT = "send,inplace,need-ack,need-csum"


def fault_tolerance_asked(env: Mapping[str, str]) -> bool:
    """Whether Open MPI's launcher started this process with fault tolerance on (``mpiexec
    --with-ft ulfm`` sets OMPI_MCA_mpi_ft_enable in every process it starts)."""
    return env.get("OMPI_MCA_mpi_ft_enable", "") not in ("", "0", "false")


def mpi_start_settings(env: Mapping[str, str], mpich_wheel: bool) -> dict:
    """The variables to set in ``env`` before MPI starts (Note [PMI-1 lines under srun]):
    MPICH's ofi netmod under an srun step whose PMI is Slurm's pmi2 plugin, with the mpich
    wheel and no netmod chosen; under Open MPI with fault tolerance on, no process-manager
    fence in MPI_Finalize and no RDMA put over tcp, each unless the user chose (Note [Ending a
    job that lost a process], Note [A peer lost mid-transfer] in mpidp/runtime/recovery.py);
    nothing elsewhere."""
    if fault_tolerance_asked(env):
        return {name: value for name, value in ((FINALIZE_WITHOUT_FENCE, "1"),
                                                (TCP_FLAGS, TCP_FLAGS_WITHOUT_PUT))
                if name not in env}
    view = launcher_view(env)
    if not mpich_wheel or view is None or view.launcher != "Slurm (PMI2)" \
            or "PMI_FD" not in env or any(name in env for name in NETMOD_VARIABLES):
        return {}
    return {"MPIR_CVAR_CH4_NETMOD": "ofi"}


def _mpich_wheel() -> bool:
    from importlib import metadata
    try:
        metadata.version("mpich")
    except metadata.PackageNotFoundError:
        return False
    return True


def prepare_mpi_start() -> None:
    """Sets mpi_start_settings in this process's environment; call before the first ``from
    mpi4py import MPI``. Later, MPI has read its environment: a warning says what was not
    set."""
    settings = mpi_start_settings(os.environ, _mpich_wheel())
    if settings and "mpi4py.MPI" in sys.modules:
        import warnings
        warnings.warn(f"mpidp: MPI started before mpidp.init(), so {settings} was not set "
                      "(mpi_start_settings in mpidp/runtime/launcher.py): import mpidp and "
                      "call mpidp.init() before importing mpi4py.MPI, or set it yourself",
                      RuntimeWarning, stacklevel=3)
    elif settings:
        os.environ.update(settings)


def mpiexec() -> str:
    """The mpiexec beside this Python (the mpich wheel's), else the first on PATH;
    FileNotFoundError naming the fix where there is none."""
    here = Path(sys.executable).parent / "mpiexec"
    found = str(here) if here.exists() else shutil.which("mpiexec")
    if not found:
        raise FileNotFoundError("no mpiexec found: pip install mpich (see README)")
    return found


# Open MPI's mpiexec options for a job that outlives a lost rank (Note [In-job recovery] in
# mpidp/runtime/recovery.py): ULFM on; the tcp transport, which reports a lost peer (with the
# shared-memory one, sm, the survivors wait forever: docs/recovery.md); no UCX windows (their
# component is not built for failures, and says so at every start); slots for replacements
OPEN_MPI_FT_ARGS = ("--with-ft", "ulfm", "--mca", "btl", "tcp,self", "--mca", "pml", "ob1",
                    "--mca", "osc", "^ucx", "--oversubscribe")


# Note [Which MPI an mpiexec belongs to]
# The supervisor (python -m mpidp.run) launches through the mpiexec beside its Python, MPICH's
# Hydra or Open MPI's, which differ in three ways it needs: how hosts are named (Hydra
# ``-hosts a:2,b:2``, Open MPI ``--host a:2,b:2``), ranks beyond the cores of a machine
# without a host list (Hydra places them; Open MPI refuses unless ``--oversubscribe``), and a
# lost rank (Open MPI built with ULFM goes on with OPEN_MPI_FT_ARGS; Hydra ends the job).
# ``mpiexec --version`` names the MPI ("mpiexec (Open MPI) 5.0.11"; Hydra's "HYDRA build
# details" with its "Version:"), and Open MPI's ompi_info beside it whether it was built with
# fault tolerance ("FT MPI support: yes"). Both take milliseconds, and start no job.


class Mpiexec(NamedTuple):
    """An mpiexec and the MPI it belongs to (Note [Which MPI an mpiexec belongs to])."""
    path: str
    mpi: str              # "Open MPI 5.0.11", "MPICH (Hydra 5.0.2)", else --version's first line
    open_mpi: bool
    fault_tolerant: bool  # Open MPI built with ULFM: a job outlives a lost rank

    def hosts(self, text: str) -> list:
        """The options that place the job on the hosts ``text`` ("a:2,b:2"), each rank's
        threads free on its node's cores (OPEN_MPI_UNBOUND)."""
        return ["--host", text, *OPEN_MPI_UNBOUND] if self.open_mpi else ["-hosts", text]

    def here(self) -> list:
        """The options for a job on this machine alone, its ranks however many its cores."""
        return ["--oversubscribe", *OPEN_MPI_UNBOUND] if self.open_mpi else []


# Open MPI binds each rank to one core where its ranks fit the slots (a rank's torch threads,
# and mpidp's communication and watchdog threads, then share that core); Hydra binds nothing
# unless asked. So mpidp's launch lines ask Open MPI for no binding and ranks placed slot by
# slot, as horovodrun's do.
OPEN_MPI_UNBOUND = ("--bind-to", "none", "--map-by", "slot")


def parse_mpiexec(path: str, version: str, ompi_info: str = "") -> Mpiexec:
    """The Mpiexec of ``path`` from what ``path --version`` and (Open MPI) ``ompi_info``
    printed."""
    if m := re.search(r"\(Open MPI\)\s+(\S+)", version):
        ft = re.search(r"FT MPI support:\s*yes", ompi_info) is not None
        return Mpiexec(path, f"Open MPI {m.group(1)}", True, ft)
    if "HYDRA" in version:
        m = re.search(r"Version:\s+(\S+)", version)
        return Mpiexec(path, f"MPICH (Hydra {m.group(1) if m else 'unknown'})", False, False)
    first = version.strip().splitlines()[0] if version.strip() else "unknown"
    return Mpiexec(path, first, False, False)


def describe(path: str) -> Mpiexec:
    """Which MPI the mpiexec ``path`` belongs to; OSError or SubprocessError where it does
    not run."""
    def said(command: list) -> str:
        return subprocess.run(command, capture_output=True, text=True, timeout=30,
                              stdin=subprocess.DEVNULL, errors="replace").stdout
    version = said([path, "--version"])
    info = Path(path).with_name("ompi_info")
    return parse_mpiexec(path, version, said([str(info)]) if "(Open MPI)" in version
                         and info.exists() else "")
