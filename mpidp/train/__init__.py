"""Training as a tool: the loop (``Trainer``, ``fit``), its settings, checkpoints, reports and
the ``python -m mpidp.train`` command line. Its names load on first access, so that
``python -m mpidp.train`` imports torch only once its signal handling is armed (__main__)."""
from __future__ import annotations

from ..lazy import exports

_EXPORTS = {"Trainer": "loop", "fit": "loop", "SetupError": "setup",
            "TrainSettings": "settings"}

__all__ = sorted(_EXPORTS)


__getattr__, __dir__ = exports(__name__, _EXPORTS)
