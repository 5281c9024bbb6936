"""Training as a tool: the loop (``Trainer``, ``fit``), its settings, checkpoints, reports and
the ``python -m mpidp.train`` command line."""
from .loop import Trainer, fit
from .setup import SetupError
from .settings import TrainSettings

__all__ = ["SetupError", "Trainer", "TrainSettings", "fit"]
