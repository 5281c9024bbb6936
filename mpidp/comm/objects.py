"""Object collectives: small Python objects of mpidp's own (settings, fingerprints, shapes, RNG
states, resume positions, metadata) moved over a group's communicator, and the barrier, each a
collective under the watchdog (Note [The collective frame] in mpidp/runtime/frame.py)."""
from __future__ import annotations

from typing import Any, Optional, Sequence

from ..runtime import mpi
from ..runtime.frame import collective

# Note [Object collectives]
# These pickle, as mpi4py's lower-case methods do: they carry mpidp's own descriptions and
# bookkeeping, never a user's tensors or data (those travel as bytes through the buffer
# collectives). Each is named, so the watchdog's report and debug mode's check (Note [Debug
# fingerprints] in mpidp/engine/header.py) say which one a rank is in; alone, a group
# exchanges nothing. Every rank of the group calls each, in the same order. ``comm``: the
# communicator where it is not ``g``'s own (the parameter server's, whose ``g`` may be None:
# unwatched); then MPI is called whatever its size.


def _on(g, comm):
    """The communicator to call MPI on, or None where the group is alone."""
    if comm is not None:
        return comm
    return g.comm if g.size > 1 else None


def allgather(g, mine: Any, name: str, comm=None) -> list:
    """Every rank's ``mine`` in rank order."""
    with collective(g, name):
        c = _on(g, comm)
        return mpi.allgather_objects(c, mine) if c is not None else [mine]


def bcast(g, value: Any, name: str, root: int = 0, comm=None) -> Any:
    """``root``'s ``value`` on every rank."""
    with collective(g, name):
        c = _on(g, comm)
        return mpi.bcast_object(c, value, root) if c is not None else value


def gather(g, mine: Any, name: str, root: int = 0, comm=None) -> Optional[list]:
    """Every rank's ``mine`` in rank order at ``root``; None elsewhere."""
    with collective(g, name):
        c = _on(g, comm)
        return mpi.gather_objects(c, mine, root) if c is not None else [mine]


def scatter(g, values: Optional[Sequence], name: str, root: int = 0, comm=None) -> Any:
    """``values[r]`` of ``root``'s ``values`` (one per rank; None elsewhere) on rank r."""
    with collective(g, name):
        c = _on(g, comm)
        return mpi.scatter_objects(c, values, root) if c is not None else \
            (values[0] if values is not None else None)


def barrier(g, name: str, comm=None) -> None:
    """Returns once every rank has called it."""
    with collective(g, name):
        c = _on(g, comm)
        if c is not None:
            mpi.barrier(c)
