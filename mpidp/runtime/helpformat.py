"""The command lines' parser and help format (``python -m mpidp.train``, ``mpidp.bench``,
``mpidp.doctor``, ``mpidp.report``)."""
from __future__ import annotations

import argparse

from .launcher import launcher_view


class Parser(argparse.ArgumentParser):
    """argparse, with its messages (--help, usage errors) printed by the launcher's rank 0
    only: under ``mpirun -np 4`` a --help is printed once, not four times."""

    def _print_message(self, message: str, file=None) -> None:
        view = launcher_view()
        if view is None or not view.rank:
            super()._print_message(message, file)


class DefaultsHelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """argparse's help with each flag's default appended, except where the help text already
    says it (it mentions "default") or there is none to show (None, a switch that is off)."""

    def _get_help_string(self, action):
        text = action.help or ""
        if action.default is None or action.default is False or \
                action.default is argparse.SUPPRESS or "(default" in text or \
                "default:" in text or text.startswith("default "):
            return text
        return super()._get_help_string(action)
