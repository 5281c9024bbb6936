"""The torch Work of an operation of the mpidp backend: completed when its task on the group's
scheduler has run (Note [One communication thread per group] and Note [Synchronous calls on
the caller's thread] in mpidp/comm/scheduler.py)."""
from __future__ import annotations

import functools
import time
from datetime import timedelta
from typing import Callable, Optional

import torch
import torch.distributed as dist

from ..comm import scheduler
from ..comm.scheduler import Scheduler

POLL_S = 0.001  # a wait with a timeout polls the future this often


class Work(dist.Work):
    """A collective's Work: complete when its future is; ``wait`` raises what the
    operation raised (torch's future-wrapping Work would only log it)."""

    def __init__(self, future: torch.futures.Future):
        super().__init__()
        self.future = future
        self._chained: Optional[torch.futures.Future] = None

    def wait(self, timeout: Optional[timedelta] = None) -> bool:
        if timeout is not None and timeout.total_seconds() > 0:
            deadline = time.monotonic() + timeout.total_seconds()
            while not self.future.done():
                if time.monotonic() > deadline:
                    raise RuntimeError(f"mpidp: the operation did not complete within "
                                       f"{timeout.total_seconds():g} s")
                time.sleep(POLL_S)
        self.future.wait()
        if self._chained is not None:  # its callback runs on the thread that completed it
            self._chained.wait()
        return True

    def is_completed(self) -> bool:
        return self.future.done()

    def is_success(self) -> bool:
        return self.future.done() and self.exception() is None

    def exception(self):
        try:
            self.future.value()
        except Exception as exc:  # noqa: BLE001 - returned, as torch's Work returns it
            return exc
        return None

    def get_future(self) -> torch.futures.Future:
        """The future torch's C++ side waits on (DDP's reducer, a comm hook): one whose
        failure C++ sees. Python's ``Future.set_exception`` completes the future with the
        exception as its value, raised only when Python unwraps it; C++ would take that value
        for the result (the reducer read it as a tensor and the process crashed), so the
        future given out is chained, and a chained future's callback that raises fails it in
        C++ too."""
        if self._chained is None:
            self._chained = self.future.then(_unwrapped)
        return self._chained

    def result(self):
        return self.future.value()


def _unwrapped(f: torch.futures.Future):
    return f.value()  # raises what the operation raised


def run_now(fn: Callable[[], None], result) -> Work:
    """``fn`` run here; its Work, completed (or failed)."""
    f = torch.futures.Future()
    _settle(f, result, scheduler.outcome(fn))
    return Work(f)


def submit(s: Scheduler, board, fn: Callable[[], None], result) -> Work:
    """``fn`` queued to scheduler ``s`` (run at once where this is its thread: a future's
    callback); its Work, which completes with ``result`` or fails with what ``fn`` raised. In
    debug mode ``fn``'s collectives carry this caller's line (Note [Debug fingerprints] in
    mpidp/engine/header.py)."""
    f = torch.futures.Future()
    s.submit(None, board.carry_site(fn), functools.partial(_settle, f, result))
    return Work(f)


def _settle(f: torch.futures.Future, result, outcome: tuple) -> None:
    """Completes ``f`` with the task's ``outcome`` (its error, or None: ``result``); its
    callbacks run here."""
    if outcome[0] is None:
        f.set_result(result)
    else:
        f.set_exception(outcome[0])
