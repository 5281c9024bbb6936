"""The MPI library as Python sees it: ``mpi()``, mpi4py's ``MPI`` module, the one place in
mpidp that imports it (Note [MPI imported once]).

Note [MPI imported once]
Importing ``mpi4py.MPI`` starts MPI (MPI_Init_thread), so no module of mpidp imports it at
the top: ``import mpidp``, the tools' ``--help`` and the supervisor start no MPI, and unit
tests of the engine's pure parts run without a launcher. Every MPI call of mpidp sits in
mpidp.engine or mpidp.runtime (Note [MPI below one line] in mpidp/runtime/__init__.py), and
each one reaches the module through ``mpi()`` when it runs — a dictionary lookup once MPI is
loaded, cheaper than the ``from mpi4py import MPI`` statement it replaces in those functions
— so the decision when MPI starts is made here and nowhere else."""
from __future__ import annotations

import ctypes
import os
import sys


def mpi():
    """mpi4py's MPI module, imported (MPI started) at the first call."""
    module = sys.modules.get("mpi4py.MPI")
    if module is None:
        from mpi4py import MPI as module  # deferred for cost: Note [MPI imported once]
    return module


def loaded_libmpi() -> list:
    """ctypes handles of the MPI libraries (``libmpi.so*``) this process has loaded, found
    in /proc/self/maps (mpi4py loads the library of the environment it runs in: MPICH's
    libmpi.so.12, Open MPI's libmpi.so.40), in the order of their paths; none before MPI
    is loaded. Loads nothing."""
    with open("/proc/self/maps") as maps:
        paths = sorted({line.split()[-1] for line in maps
                        if os.path.basename(line.split()[-1]).startswith("libmpi.so")})
    found = []
    for path in paths:
        try:
            found.append(ctypes.CDLL(path, mode=os.RTLD_NOLOAD))
        except OSError:  # unmapped since
            continue
    return found


def wait_all(requests: list) -> None:
    """MPI_Waitall on ``requests``; where one of them failed, its own error is raised (an
    ``MPI.Exception`` of its class, from MPI's), not MPI_ERR_IN_STATUS, which names none: a
    lost peer's MPI_ERR_PROC_FAILED in a wait on a send and a receive reaches in-job
    recovery as a lost process (mpidp.runtime.recovery.is_process_failure)."""
    MPI = mpi()
    statuses = [MPI.Status() for _ in requests]
    try:
        MPI.Request.Waitall(requests, statuses)
    except MPI.Exception as exc:
        if exc.Get_error_class() != MPI.ERR_IN_STATUS:
            raise
        for status in statuses:
            code = status.Get_error()
            if code not in (MPI.SUCCESS, MPI.ERR_PENDING):
                raise MPI.Exception(code) from exc
        raise
