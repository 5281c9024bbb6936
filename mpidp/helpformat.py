"""The help format of mpidp's command lines (``python -m mpidp.train``, ``mpidp.bench``)."""
from __future__ import annotations

import argparse


class DefaultsHelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """argparse's help with each flag's default appended, except where the help text already
    says it (it mentions "default") or there is none to show (None, a switch that is off)."""

    def _get_help_string(self, action):
        text = action.help or ""
        if action.default is None or action.default is False or \
                action.default is argparse.SUPPRESS or "default" in text:
            return text
        return super()._get_help_string(action)
