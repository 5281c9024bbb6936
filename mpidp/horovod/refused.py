"""Horovod names this module does not serve yet: each raises, in one line, what to use
instead (docs/horovod.md). Every rank of a script calls them at the same point, so every
rank raises there; none waits in a collective."""
from __future__ import annotations


def _not_yet(name: str, instead: str):
    def refused(*args, **kwargs):
        raise NotImplementedError(f"mpidp.horovod: hvd.{name} is not supported yet; {instead}")
    refused.__name__ = refused.__qualname__ = name
    refused.__doc__ = f"Refused: {instead}."
    return refused


start_timeline = _not_yet("start_timeline", "set HOROVOD_TIMELINE=file.json (or "
                          "MPIDP_TIMELINE) before the job starts")
stop_timeline = _not_yet("stop_timeline", "set HOROVOD_TIMELINE=file.json (or MPIDP_TIMELINE) "
                         "before the job starts")
