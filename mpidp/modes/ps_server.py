"""The parameter server's server side (mpidp.modes.ps): drain the pushes, apply the optimizer,
publish, until every worker has finished the epoch. On one node through shared memory alone;
otherwise through its MPI window, with the slots of its own node's workers drained beside it
(Note [Node-local shards] in ps_shared.py, Note [Publishing a shard] in ps.py)."""
from __future__ import annotations

import threading
import time
from typing import Callable, Optional

import numpy as np

from ..runtime import timeline
from .ps import CONTROL_WORDS, FINISHED, IDLE_SLEEP_S, VERSION, ParameterServer

# Note [A server across nodes]
# With memory "mixed" a server meets its own node's workers in shared memory and the others
# through its window. Its window drains and publishes take an exclusive lock, which waits
# until every remote worker's shared epoch ends; at 1 Gbit/s a push or a pull of the
# digits' MLP (340 kB) holds one for about 3 ms, and a remote worker is inside one most of
# the time. Done in the serving loop, that wait also held up the node's own workers, whose
# pulls wait for their last push to be applied (Note [Node-local shards]): across 2
# emulated nodes such a pull took 2.4 ms. So, where MPI offers THREAD_MULTIPLE, a thread of
# the server does the window's side (WindowSide): it drains remote pushes into a sum that
# the loop takes, and writes the newest version the loop hands it, with the applied counts
# that version holds. The loop itself makes no MPI call. The window's version then counts
# the versions written there, which may skip some of the loop's; a remote worker's
# staleness is measured in those.


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
        self.applied = np.zeros(ps.num_workers, np.int64)  # node-local shards: APPLIED

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
            elif self.ps.shared is not None:  # across nodes, with THREAD_MULTIPLE
                self._serve_mixed(apply, board)  # Note [A server across nodes]
            else:
                self._serve_window(apply, board)

    def _serve_shared(self, apply, board) -> None:
        """One node (Note [Node-local shards]): drain the slots, apply, publish; no MPI call."""
        shared, k = self.ps.shared, self.ps.index
        grads = np.empty(self.lay.count, np.float32)
        params = self.params()
        while True:
            taken = shared.drain(k, grads)
            if not taken.any():
                if shared.finished(k):
                    return
                time.sleep(IDLE_SLEEP_S)
                continue
            self._applied_now(apply, params, grads, int(taken.sum()), board)
            shared.publish(k, params, taken, self.applied)

    def _serve_window(self, apply, board) -> None:
        """Note [Publishing a shard]: the window alone."""
        ps, win, lay = self.ps, self.ps.window, self.lay
        me = ps.rank
        applied = win.local(lay.control)[lay.applied(0):lay.applied(0) + lay.workers]
        grads = np.empty(lay.count, np.float32)
        params = self.params()  # the server is its shard's one writer
        while True:
            with win.locked(me, exclusive=True):  # Note [Publishing a shard]: drain
                pending, finished = _drain(win, lay, grads)
            if not pending.any():
                if finished >= lay.workers:
                    return
                time.sleep(IDLE_SLEEP_S)
                continue
            self._applied_now(apply, params, grads, int(pending.sum()), board)
            with win.locked(me, exclusive=True):  # publish
                _publish(win, lay, params, applied + pending)

    def _serve_mixed(self, apply, board) -> None:
        """Note [A server across nodes]: shared memory here, the window in ``WindowSide``."""
        shared, k = self.ps.shared, self.ps.index
        grads = np.empty(self.lay.count, np.float32)
        side = WindowSide(self.ps, self.lay, self.params())
        params = side.params
        side.start()
        try:
            while True:
                remote, finished = side.take(grads)  # before the slots: a finished worker's
                taken = shared.drain(k, side.near)  # last push is in one
                pushes = remote + taken
                if pushes.any():
                    if taken.any():
                        grads += side.near
                    self._applied_now(apply, params, grads, int(pushes.sum()), board)
                    shared.publish(k, params, pushes, self.applied)
                    side.offer(params, self.applied)
                elif finished >= self.lay.workers:
                    return
                else:
                    time.sleep(IDLE_SLEEP_S)
        finally:
            side.finish()

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


def _drain(win, lay, into: np.ndarray) -> tuple:
    """Inside an exclusive epoch on the server's own window: (pushes pending per worker,
    FINISHED); the pending pushes' sum copied into ``into`` and the accumulator zeroed."""
    control_of = win.local(lay.control)
    workers = slice(CONTROL_WORDS, CONTROL_WORDS + lay.workers)
    pending = control_of[workers].copy()
    finished = int(control_of[FINISHED])
    if pending.any():
        into[...] = win.local(lay.grads)
        win.local(lay.grads)[...] = 0
        control_of[workers] = 0
    return pending, finished


def _publish(win, lay, params: np.ndarray, applied: np.ndarray) -> None:
    """Inside an exclusive epoch on the server's own window: the next version, holding the
    pushes counted in ``applied`` (per worker, this epoch)."""
    control_of = win.local(lay.control)
    win.local(lay.params)[...] = params
    control_of[lay.applied(0):lay.applied(0) + lay.workers] = applied
    control_of[VERSION] += 1


class WindowSide(threading.Thread):
    """Note [A server across nodes]: a server's window drained and written by a thread of its
    own. ``take`` hands the loop the remote pushes summed since the last take, ``offer``
    takes the newest version to write, ``finish`` writes the last one offered and stops;
    an error in the thread is raised by the next ``take`` or by ``finish``."""

    def __init__(self, ps: ParameterServer, lay, params: np.ndarray):
        super().__init__(name="mpidp-ps-window", daemon=True)
        self.ps, self.lay, self.params = ps, lay, params
        self.near = np.empty(lay.count, np.float32)  # the loop's slot sum
        self._sum = np.zeros(lay.count, np.float32)
        self._pending = np.zeros(lay.workers, np.int64)
        self._finished = 0
        self._offered: Optional[tuple] = None
        self._lock = threading.Lock()
        self._ending = threading.Event()
        self.error: Optional[BaseException] = None

    def take(self, grads: np.ndarray) -> tuple:
        """(pushes per worker, FINISHED) since the last take; their sum into ``grads``."""
        if self.error is not None:
            raise self.error
        with self._lock:
            pending, finished = self._pending.copy(), self._finished
            if pending.any():
                grads[...] = self._sum
                self._sum[...] = 0
                self._pending[...] = 0
            else:
                grads[...] = 0
        return pending, finished

    def offer(self, params: np.ndarray, applied: np.ndarray) -> None:
        with self._lock:
            self._offered = (params.copy(), applied.copy())

    def finish(self) -> None:
        self._ending.set()
        self.join()
        if self.error is not None:
            raise self.error
        if self._pending.any():  # FINISHED is read with the pushes it follows: never
            raise RuntimeError(f"ps server: pushes {self._pending.tolist()} drained from the "
                               "window after every worker had finished")

    def run(self) -> None:
        win, lay, me = self.ps.window, self.lay, self.ps.rank
        drained = np.empty(lay.count, np.float32)
        try:
            while True:
                ending = self._ending.is_set()  # read before the last write
                with self._lock:
                    offered, self._offered = self._offered, None
                with win.locked(me, exclusive=True):  # Note [Publishing a shard]
                    pending, finished = _drain(win, lay, drained)
                    if offered is not None:
                        _publish(win, lay, *offered)
                with self._lock:
                    if pending.any():
                        self._sum += drained
                        self._pending += pending
                    self._finished = finished
                if ending:
                    return
                if not pending.any() and offered is None:
                    time.sleep(IDLE_SLEEP_S)
        except BaseException as exc:  # raised in the serving loop
            self.error = exc
