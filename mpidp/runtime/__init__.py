"""The process group mpidp runs on — ``init``, ``shutdown``, ``group()``, ``using(g)``, the rank
queries — and what the launcher and the job's failures need (hostlist, launcher, exit).

Note [The runtime's front]
The group's functions live in mpidp.runtime.world, which loads the engine and its C extension;
this package's names for them are looked up on first use (PEP 562), so that the supervisor
(mpidp.run), which imports ``runtime.hostlist``, ``runtime.launcher`` and ``runtime.exit`` and
never makes a group, loads nothing of the engine (tests/unit/test_tree.py checks it). A name,
once looked up, is a plain attribute of this package: ``runtime.group()`` costs what it cost
when the functions were defined here.

Note [MPI below one line]
MPI is called in mpidp.engine and mpidp.runtime only; every package above reaches it through
them: mpidp.comm's collectives (which frame MPI's own calls: Note [The collective frame]), the
group's functions here, ``runtime.mpi`` (each MPI call the layers above need, on a
communicator handed in) and ``runtime.windows`` (one-sided windows). An import-linter
contract in pyproject.toml forbids ``mpi4py`` above this line (tests/unit/test_layers.py),
and below it everywhere but mpidp.engine.library, whose ``mpi()`` every call below the line
takes the module from (Note [MPI imported once] there: importing it starts MPI, and ``import
mpidp`` starts none)."""
from __future__ import annotations

import importlib

_WORLD = ("Group", "init", "shutdown", "start_timeline", "stop_timeline", "subgroup",
          "free_subgroup", "using", "group", "init_group", "is_initialized", "rank", "size",
          "local_rank", "local_size", "node_count", "thread_level", "THREAD_LEVELS")
__all__ = list(_WORLD)


def __getattr__(name: str):
    if name in _WORLD:
        world = importlib.import_module(__name__ + ".world")
        for each in _WORLD:
            globals().setdefault(each, getattr(world, each))
        return globals()[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
