"""Object collectives: small Python objects of mpidp's own (settings, fingerprints, shapes, RNG
states, resume positions, metadata) moved over a group's communicator, each a collective under
the watchdog (Note [The collective frame] in mpidp/runtime/frame.py)."""
from __future__ import annotations

from typing import Any, Optional

from ..runtime.frame import collective

# Note [Object collectives]
# These pickle, as mpi4py's lower-case methods do: they carry mpidp's own descriptions and
# bookkeeping, never a user's tensors or data (those travel as bytes through the buffer
# collectives). Each is named, so the watchdog's report and debug mode's check (Note [Debug
# fingerprints] in mpidp/engine/header.py) say which one a rank is in; alone, a group
# exchanges nothing. Every rank of the group calls each, in the same order.


def allgather(g, mine: Any, name: str) -> list:
    """Every rank's ``mine`` in rank order."""
    with collective(g, name):
        return g.comm.allgather(mine) if g.size > 1 else [mine]


def bcast(g, value: Any, name: str, root: int = 0) -> Any:
    """``root``'s ``value`` on every rank."""
    with collective(g, name):
        return g.comm.bcast(value, root=root) if g.size > 1 else value


def gather(g, mine: Any, name: str, root: int = 0) -> Optional[list]:
    """Every rank's ``mine`` in rank order at ``root``; None elsewhere."""
    with collective(g, name):
        return g.comm.gather(mine, root=root) if g.size > 1 else [mine]
