"""Point-to-point for the torch.distributed backend — send, receive (also from any source) and
the monitored barrier — on a communicator of the group's own, apart from mpidp's collective
messages; waits are watched by the watchdog's one-sided lane."""
from __future__ import annotations

import threading
import time
from datetime import timedelta
from typing import Optional

import numpy as np
import torch
import torch.distributed as dist

from ..comm import collectives
from ..runtime import mpi
from ..errors import CommunicationError
from . import ops

POLL_S = 0.001
ANY = None  # the peer of a receive from any source


class P2PWork(dist.Work):
    """A send or receive: MPI's request, completed by ``wait`` under the watchdog's
    one-sided lane; ``finish(source, nbytes)`` runs after it (a receive's copy and size
    check)."""

    def __init__(self, g, request, what: tuple, finish=None):
        super().__init__()
        self.g, self.request, self.what, self.finish = g, request, what, finish
        self.source = -1
        self._error: Optional[BaseException] = None  # what the finish raised, for wait
        self._lock = threading.Lock()

    def _completed(self, source: int, nbytes: int) -> None:
        self.request, self.source = None, source
        if self.finish is not None:
            try:
                self.finish(source, nbytes)
            except BaseException as exc:  # noqa: BLE001 - raised by wait, as torch's Work
                self._error = exc

    def _complete(self) -> None:
        with self._lock:
            if self.request is not None:
                with self.g.board.waiting(self.what):
                    done = mpi.wait(self.request)
                self._completed(*done)
        if self._error is not None:
            raise self._error

    def wait(self, timeout: Optional[timedelta] = None) -> bool:
        self._complete()
        return True

    def is_completed(self) -> bool:
        """True once the message has gone or come (a receive's copy done, or its error kept
        for ``wait``): a ``wait`` after it returns at once."""
        with self._lock:
            if self.request is None:
                return True
            done = mpi.test_status(self.request)
            if done is not None:
                self._completed(*done)
            return done is not None

    def is_success(self) -> bool:
        return self.is_completed() and self._error is None

    def _source_rank(self) -> int:  # torch's recv from any source asks it
        self._complete()
        return self.source

    def get_future(self) -> torch.futures.Future:
        f = torch.futures.Future()

        def complete():
            try:
                self._complete()
            except BaseException as exc:  # noqa: BLE001 - handed to the future
                f.set_exception(exc)
            else:
                f.set_result(None)
        threading.Thread(target=complete, daemon=True).start()
        return f


def tag_limit() -> int:
    """Tags 0 .. tag_limit() - 1 are the user's; the highest MPI tag is the monitored
    barrier's."""
    return mpi.tag_limit()


def post(g, comm, tensors, peer: int, tag: int, send: bool) -> P2PWork:
    """A send of ``tensors[0]`` to ``peer`` (or a receive into it from ``peer``, any source
    with ``ANY``) with ``tag`` on ``comm``; ValueError for a bad call. This rank only: the
    peer posts the matching call."""
    if len(tensors) != 1:
        raise ValueError(f"the mpidp backend sends one tensor per call, got {len(tensors)}")
    if not 0 <= tag < tag_limit():
        raise ValueError(f"tag {tag} is out of the backend's range 0..{tag_limit() - 1}")
    if peer is not ANY:
        collectives.check_root(peer, g.size)
    staged = ops.Staged(tensors[0], read=send)
    if send:
        request = mpi.isend_bytes(comm, staged.bytes, peer, tag)
        return P2PWork(g, request, ("send to rank {} (tag {})", peer, tag),
                       lambda *_: staged)  # keeps the staged bytes alive until sent
    request = mpi.irecv_bytes(comm, staged.bytes, peer, tag)  # ANY: through a matched probe

    def finish(source, got):
        if got != staged.bytes.nbytes:
            raise CommunicationError(g.rank, "recv", f"rank {source} sent {got} "
                                     f"bytes, the tensor holds {staged.bytes.nbytes}")
        staged.done()
    return P2PWork(g, request, ("receive from {} (tag {})",
                                "any rank" if peer is ANY else f"rank {peer}", tag), finish)


def monitored_barrier(g, comm, timeout_s: float, wait_all_ranks: bool) -> None:
    """gloo's monitored barrier: rank 0 waits for the ranks in order, each within what is left
    of ``timeout_s``, and raises a RuntimeError naming the first rank that did not come
    ("Rank R failed to pass monitoredBarrier in T ms"; with ``wait_all_ranks`` it waits the
    whole timeout and names every such rank, "Ranks R, S failed ..."; "Rank 0 timed out in
    monitoredBarrier" where the time ran out between two ranks). The others raise, in gloo's
    words, when rank 0 does not release them within twice the timeout."""
    if g.size == 1:
        return
    tag = tag_limit()
    token = np.zeros(1, np.uint8)
    ms = f"{timeout_s * 1000:.0f} ms"
    if g.rank != 0:
        mpi.wait(mpi.isend_bytes(comm, token, 0, tag))
        release = mpi.irecv_bytes(comm, token, 0, tag)
        if not _poll([release], 2 * timeout_s):
            mpi.cancel([release])
            raise RuntimeError(f"Rank {g.rank} successfully reached monitoredBarrier, but "
                               "received errors while waiting for send/recv from rank 0: it "
                               f"did not release this rank within twice the timeout of {ms}; "
                               "rank 0's error names the rank that did not come")
        return
    buffers = [np.zeros(1, np.uint8) for _ in range(g.size)]
    arrivals = [mpi.irecv_bytes(comm, buffers[r], r, tag) for r in range(1, g.size)]
    deadline = time.monotonic() + timeout_s
    for r, arrival in enumerate(arrivals if not wait_all_ranks else [], 1):
        left = deadline - time.monotonic()
        if left < 0:
            mpi.cancel(arrivals)
            raise RuntimeError(f"Rank 0 timed out in monitoredBarrier after {ms}: ranks "
                               f"{', '.join(map(str, range(1, r))) or 'none'} had come, "
                               f"rank {r} and after not checked")
        if not _poll([arrival], left):
            mpi.cancel(arrivals)
            raise RuntimeError(f"Rank {r} failed to pass monitoredBarrier in {ms}")
    if not _poll(arrivals, max(0.0, deadline - time.monotonic())):
        missing = [r for r, a in enumerate(arrivals, 1) if not mpi.test(a)]
        mpi.cancel(arrivals)
        raise RuntimeError(f"Ranks {', '.join(map(str, missing))} failed to pass "
                           f"monitoredBarrier in {ms}")
    for r in range(1, g.size):
        mpi.wait(mpi.isend_bytes(comm, token, r, tag))


def _poll(requests: list, timeout_s: float) -> bool:
    """True once every request of ``requests`` completed (each then MPI.REQUEST_NULL), False
    after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while not mpi.test_all(requests):
        if time.monotonic() > deadline:
            return False
        time.sleep(POLL_S)
    return True
