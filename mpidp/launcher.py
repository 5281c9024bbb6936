"""What the launcher (Open MPI, MPICH/Hydra, Slurm) says about this process's place in the job,
read from its environment variables, so the runtime can cross-check MPI's own answer."""
from __future__ import annotations

import os
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
