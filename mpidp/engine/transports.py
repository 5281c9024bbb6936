"""Point-to-point transports the ring runs over: MPI on host buffers, and an in-process
loopback for testing n virtual ranks in one process. They know no algorithm."""
from __future__ import annotations

import collections
import threading
import time

import numpy as np

from ..errors import WaitTimeoutError
from .library import mpi, wait_all

RING_TAG = 0x6D70   # "mp": keeps the ring's messages apart from a user's own traffic
CHECK_TAG = 0x6D63  # "mc": the records of the checked exchange (mpidp.engine.doubling)


class MPITransport:
    """Non-blocking send/receive pairs on an mpi4py communicator (host buffers).
    ``timeout_s``: how long a record's receive waits for its sender (None: as long as it
    takes; the watchdog ends a stall) before raising WaitTimeoutError naming it."""

    def __init__(self, comm):
        self.comm = comm
        self.rank, self.size = comm.Get_rank(), comm.Get_size()
        self.timeout_s = None

    def start(self, send, dst: int, recv, src: int):
        # raw bytes: MPI has no portable float16/bfloat16 type, and moving bytes is all we ask
        reqs = []
        if recv is not None:
            reqs.append(self.comm.Irecv(recv.view(np.uint8), src, RING_TAG))
        if send is not None:
            reqs.append(self.comm.Isend(send.view(np.uint8), dst, RING_TAG))
        return reqs

    def wait(self, handle) -> None:
        wait_all(handle)

    # records of any length (mpidp.engine.doubling): the receiver learns the length from the message
    def swap(self, msg: np.ndarray, peer: int) -> np.ndarray:
        req = self.comm.Isend(msg, peer, CHECK_TAG)
        got = self.take(peer)
        req.Wait()
        return got

    def put(self, msg: np.ndarray, peer: int) -> None:
        self.comm.Send(msg, peer, CHECK_TAG)

    def take(self, peer: int) -> np.ndarray:
        MPI = mpi()
        status = MPI.Status()
        if self.timeout_s is None:
            message = self.comm.Mprobe(peer, CHECK_TAG, status)
        else:
            message = self._probe_until(peer, status)
        got = np.empty(status.Get_count(MPI.BYTE), np.uint8)
        message.Recv(got)
        return got

    def _probe_until(self, peer: int, status):
        """The next record from ``peer``, waited for at most ``timeout_s`` (polled: an MPI
        wait cannot be interrupted), else WaitTimeoutError naming ``peer``."""
        deadline = time.monotonic() + self.timeout_s
        pause = 0.0
        while True:
            message = self.comm.Improbe(peer, CHECK_TAG, status)
            if message is not None:
                return message
            if time.monotonic() > deadline:
                raise WaitTimeoutError(
                    self.rank, "", self.timeout_s, (peer,), f"timed out after "
                    f"{self.timeout_s:g} s waiting for rank {peer} across nodes (the group's "
                    "timeout); it, or a rank it waits for, had not reached this collective",
                    across=True)
            time.sleep(pause)
            pause = min(2 * pause + 1e-6, 1e-3)  # polled at once, then backing off to 1 ms


class LoopbackNetwork:
    """Mailboxes for ``size`` virtual ranks in one process; ``transport(r)`` is rank r's end.
    Messages between a pair are delivered in order, so any thread schedule gives the same
    result."""

    def __init__(self, size: int):
        self.size = size
        self._boxes = collections.defaultdict(collections.deque)
        self._cv = threading.Condition()

    def transport(self, rank: int) -> "LoopbackTransport":
        return LoopbackTransport(self, rank)


class LoopbackTransport:
    def __init__(self, net: LoopbackNetwork, rank: int):
        self.net, self.rank, self.size = net, rank, net.size

    def start(self, send, dst: int, recv, src: int):
        if send is not None:
            with self.net._cv:
                self.net._boxes[(self.rank, dst)].append(send.copy())
                self.net._cv.notify_all()
        return (recv, src)

    def wait(self, handle, timeout_s: float = 60.0) -> None:
        recv, src = handle
        if recv is None:
            return
        box = self.net._boxes[(src, self.rank)]
        with self.net._cv:
            if not self.net._cv.wait_for(lambda: len(box) > 0, timeout=timeout_s):
                raise TimeoutError(f"loopback rank {self.rank}: nothing from rank {src}")
            msg = box.popleft()
        if msg.shape != recv.shape:
            raise ValueError(f"loopback rank {self.rank}: {msg.shape} sent by rank {src}, "
                             f"{recv.shape} expected")
        recv[...] = msg

    def swap(self, msg, peer: int):
        self.put(msg, peer)
        return self.take(peer)

    def put(self, msg, peer: int) -> None:
        self.start(msg, peer, None, peer)

    def take(self, peer: int, timeout_s: float = 60.0):
        box = self.net._boxes[(peer, self.rank)]
        with self.net._cv:
            if not self.net._cv.wait_for(lambda: len(box) > 0, timeout=timeout_s):
                raise TimeoutError(f"loopback rank {self.rank}: nothing from rank {peer}")
            return box.popleft()
