"""The communication thread of a DistributedDataParallel (mpidp.ddp.distributed) and of
Horovod's DistributedOptimizer (mpidp.horovod.backward): the buckets' all-reduces in launch
order, and other collectives put in that order (a SyncBatchNorm layer's during backward)."""
from __future__ import annotations

import contextlib
import queue
import threading
import time
from typing import Any, Callable, Optional, Sequence

from ..errors import MpidpError

# Note [Communication thread]
# One thread per DistributedDataParallel reduces the buckets one after another — on one node
# a zero-copy all-reduce of the gradients where they lie (Note [Zero-copy buckets] in
# mpidp/comm/buckets.py), elsewhere pack -> all-reduce (sum) -> unpack with the division by the number of
# ranks fused into the unpack — while autograd goes on computing gradients in the main
# thread; the C calls release the GIL. While backward runs only that thread calls MPI, but for
# a collective the main thread makes in its place in the order with that thread parked
# (``parked``), and the main thread waits for it before it calls MPI again, so
# MPI_THREAD_SERIALIZED suffices (checked at construction; mpidp.init asks for MULTIPLE).


def reduce_bucket(bucket, sources: Sequence[Any], destinations: Optional[Sequence[Any]],
                  algorithm: str) -> None:
    """Averages ``bucket`` over the ranks: ``sources`` packed (None: zeros) and the results
    unpacked into ``destinations``, or with ``destinations`` None (gradients are bucket
    views: Note [Gradients as bucket views] in mpidp/ddp/distributed.py) in place in the bucket.
    Collective."""
    if destinations is None:
        bucket.pack(sources, skip_own_slots=True)
        bucket.allreduce_("avg", algorithm)
    else:
        bucket.reduce_(sources, destinations, "avg", algorithm)


def communicate(tasks: queue.SimpleQueue, board) -> None:
    """The communication thread's loop. A task is (context, fn, results): ``fn()`` runs with
    the watchdog's ``board`` naming ``context`` (a format and its arguments), and its outcome
    (None, or the exception) and seconds go to ``results``; or a callable, run as it is (a
    gate: ``parked``). None ends the loop."""
    while True:
        task = tasks.get()
        if task is None:
            return
        if callable(task):
            task()
            continue
        context, fn, results = task
        board.context = context
        t0, error = time.perf_counter(), None
        try:
            fn()
        except BaseException as exc:  # reported by the thread that waits for the results
            error = exc
        board.context = None
        results.put((error, time.perf_counter() - t0))


def stop(tasks: queue.SimpleQueue, thread: threading.Thread, timeout_s: float) -> bool:
    """Ends the communication thread after the task it is in (shutdown closed the context
    its waits are in first: Note [Stopping the users first] in mpidp/runtime/resources.py) and joins
    it; True once it has ended. Buckets still queued are dropped: nobody waits for them."""
    while not tasks.empty():
        try:
            tasks.get_nowait()
        except queue.Empty:
            break
    tasks.put(None)
    thread.join(timeout_s)
    return not thread.is_alive()


@contextlib.contextmanager
def parked(tasks: queue.SimpleQueue, alive: Optional[Callable[[], bool]] = None):
    """Runs the block once the communication thread has finished the tasks queued before it,
    with that thread waiting until the block ends: the block's collectives come in their
    place in the order, and only one thread calls MPI at a time. ``alive()`` false while
    waiting (the thread stopped: shutdown) raises instead of waiting for ever."""
    reached, released = threading.Event(), threading.Event()

    def gate():
        reached.set()
        released.wait()
    tasks.put(gate)
    try:
        while not reached.wait(1.0):
            if alive is not None and not alive():
                raise MpidpError("mpidp: the communication thread stopped (shutdown?) "
                                 "before this collective's turn")
        yield
    finally:
        released.set()


def call_in_order(tasks: queue.SimpleQueue, fn: Callable[[], None]) -> None:
    """Runs ``fn`` after the tasks queued before it (``parked``) and raises what it raised."""
    with parked(tasks):
        fn()


def check_thread_level() -> None:
    """Note [Communication thread]: SERIALIZED or better."""
    from mpi4py import MPI
    level = MPI.Query_thread()
    if level < MPI.THREAD_SERIALIZED:
        raise MpidpError(f"DistributedDataParallel needs MPI_THREAD_SERIALIZED or better; "
                         f"MPI was initialised with level {level} (let mpidp.init() start MPI,"
                         " or call MPI.Init_thread(MPI.THREAD_MULTIPLE) yourself)")
