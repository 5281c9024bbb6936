"""The parameter server's server side (mpidp.modes.ps): drain the pushes, apply the optimizer,
publish, until every worker has finished the epoch. On one node through shared memory alone;
otherwise through its MPI window, with the slots of its own node's workers drained beside it
(Note [Node-local shards] in ps_shared.py, Note [Publishing a shard] in ps.py)."""
from __future__ import annotations

import time
from typing import Callable

import numpy as np

from ..runtime import timeline
from .ps import CONTROL_WORDS, FINISHED, IDLE_SLEEP_S, VERSION, ParameterServer


class Server:
    """A server's side: ``serve_epoch`` drains pushes, calls ``apply(shard_params,
    gradient_sum, pushes)`` (which updates ``shard_params`` in place) and publishes, until
    every worker has finished the epoch and every push is applied."""

    def __init__(self, ps: ParameterServer):
        assert ps.is_server
        self.ps = ps
        self.epoch_pushes = 0
        self.lay = ps.layouts[ps.index]
        self.applies = 0
        self.pushes = 0
        self.busy_s = 0.0
        self.consumed = [0] * ps.num_workers  # node-local shards: CONSUMED, this server's
        self.applied = np.zeros(ps.num_workers, np.int64)  # and APPLIED this epoch

    def params(self) -> np.ndarray:
        """A copy of this server's published shard."""
        if self.ps.window is None:
            out = np.empty(self.lay.count, np.float32)
            self.ps.shared.read(self.ps.index, out)
            return out
        win = self.ps.window
        with win.locked(self.ps.rank, exclusive=True):
            return win.local(self.lay.params).copy()

    def serve_epoch(self, apply: Callable[[np.ndarray, np.ndarray, int], None]) -> None:
        board = self.ps.board
        with board.waiting(("ps server: waiting for a push, or for every worker to finish the "
                            "epoch",)):
            if self.ps.window is None:
                self._serve_shared(apply, board)
            else:
                self._serve_window(apply, board)

    def _serve_shared(self, apply, board) -> None:
        """One node (Note [Node-local shards]): drain the slots, apply, publish; no MPI call."""
        shared, k = self.ps.shared, self.ps.index
        grads = np.empty(self.lay.count, np.float32)
        params = self.params()
        while True:
            taken = shared.drain(k, grads, self.consumed)
            if not taken.any():
                if shared.finished(k, self.consumed):
                    return
                time.sleep(IDLE_SLEEP_S)
                continue
            self._applied_now(apply, params, grads, int(taken.sum()), board)
            shared.publish(k, params, taken, self.applied)

    def _serve_window(self, apply, board) -> None:
        """Note [Publishing a shard]; where this node's shared memory holds the shard too
        (memory "mixed"), its workers' slots are drained after the window's counts are read,
        so that a worker counted as finished has its last push in one or the other."""
        ps, win, lay, shared, k = self.ps, self.ps.window, self.lay, self.ps.shared, \
            self.ps.index
        me = ps.rank
        control_of = win.local(lay.control)
        workers = slice(CONTROL_WORDS, CONTROL_WORDS + lay.workers)
        applied = slice(lay.applied(0), lay.applied(0) + lay.workers)
        grads = np.empty(lay.count, np.float32)
        near = np.empty(lay.count, np.float32) if shared is not None else None
        params = self.params()  # the server is its shard's one writer
        while True:
            with win.locked(me, exclusive=True):  # Note [Publishing a shard]: drain
                pending = control_of[workers].copy()
                finished = int(control_of[FINISHED])
                if pending.any():
                    grads[...] = win.local(lay.grads)
                    win.local(lay.grads)[...] = 0
                    control_of[workers] = 0
            if shared is not None:
                taken = shared.drain(k, near, self.consumed)
                if taken.any():
                    if pending.any():
                        grads += near
                    else:
                        grads[...] = near
                    pending = pending + taken
            if not pending.any():
                if finished >= lay.workers:
                    return
                time.sleep(IDLE_SLEEP_S)
                continue
            self._applied_now(apply, params, grads, int(pending.sum()), board)
            with win.locked(me, exclusive=True):  # publish
                win.local(lay.params)[...] = params
                control_of[applied] += pending
                control_of[VERSION] += 1
            if shared is not None:
                shared.publish(k, params, pending, self.applied)

    def _applied_now(self, apply, params, grads, n: int, board) -> None:
        """``apply`` of ``n`` pushes summed in ``grads`` to ``params``, counted."""
        t0 = time.perf_counter()
        with timeline.span("apply", {"pushes": n}):
            apply(params, grads, n)
        self.applies += 1
        self.pushes += n
        self.epoch_pushes += n
        self.busy_s += time.perf_counter() - t0
        board.progress()

    def reset_epoch(self) -> None:
        """Between epochs, when no worker is active: clocks, flags and the batch counter."""
        win, lay = self.ps.window, self.lay
        self.epoch_pushes = 0
        if self.ps.shared is not None:
            self.applied[...] = 0
            self.ps.shared.reset_epoch(self.ps.index)
        if win is None:
            return
        with self.ps.board.waiting(("ps server: resetting its epoch counters",)):
            with win.locked(self.ps.rank, exclusive=True):
                control = win.local(lay.control)
                version = control[VERSION]
                control[...] = 0
                control[VERSION] = version
