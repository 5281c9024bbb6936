"""What the launcher (Open MPI, MPICH/Hydra, Slurm) says about this process's place in the job,
read from its environment variables, so the runtime can cross-check MPI's own answer."""
from __future__ import annotations

import os
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
