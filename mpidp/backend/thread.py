"""The communication thread of a torch.distributed group of the mpidp backend and the Work it
completes (Note [One communication thread per group], Note [Synchronous calls on the caller's
thread]).

Note [One communication thread per group]
Every asynchronous collective of a group is queued to the group's one thread, which runs them
in the order they were called — the order every rank calls them in — under the group's
watchdog; its Work completes (its future is set, its wait returns or raises) when the
operation has. The caller's tensors must stay untouched until then, as with any torch
backend. An operation that raises on the thread raises from ``wait`` and from the future; the
thread goes on with the next one (a disagreement raises on every rank alike, so the ranks
stay in step). A future's callbacks run on the thread that completes it, this one: an
operation such a callback submits (torch's PowerSGD and quantisation hooks submit and wait
there) runs at once, in its place in the order, where queueing it behind the callback would
wait forever. A synchronous call runs on the caller's thread instead where nothing of the
group is queued or running (Note [Synchronous calls on the caller's thread]).

Note [Synchronous calls on the caller's thread]
torch's front passes ``async_op`` down in the operation's options (``opts.asyncOp``, False
for ``dist.all_reduce(t)``, True by default: torch 2.1-2.6 have no such field, and torch's
C++ — DDP's reducer, the functional collectives — leaves the default) and, for a synchronous
call, waits on the Work at once. Queueing such a call to the thread and waiting for it costs
two wake-ups (~100 µs on a loaded machine, 40x the all-reduce of 8 bytes), so a call with
``asyncOp`` False runs on the caller's thread where the group is idle: nothing queued and
nothing running (``finished == queued``, read under the ``running`` lock that the thread
holds for each operation it runs and a caller holds for one it runs itself, so that no two
run at once). Where asynchronous work is queued or running, the call queues behind it and
waits, which keeps the group's order (the order the ranks agree on) and the thread's
callbacks before it. An asynchronous call always takes the thread: running it inline
"because the queue is empty" would make torch's DDP, whose reducer all-reduces each bucket
asynchronously from inside backward, wait for every bucket in backward instead of
overlapping them. A call run here raises its error itself (the front would raise it from
``wait``) and returns None: every front function of torch that passes ``asyncOp`` waits only
on a Work that is not None ("the backend has synced at C++ level", as NCCL's synchronous calls
do), and making a completed Work would cost as much as the all-reduce of 8 bytes."""
from __future__ import annotations

import functools
import queue
import threading
import time
from datetime import timedelta
from typing import Callable, Optional

import torch
import torch.distributed as dist

from .. import runtime

POLL_S = 0.001  # a wait with a timeout polls the future this often
STOPPED = "mpidp was shut down (or the group destroyed) before this operation ran"


class Work(dist.Work):
    """A collective's Work: complete when its future is; ``wait`` raises what the
    operation raised (torch's future-wrapping Work would only log it)."""

    def __init__(self, future: torch.futures.Future):
        super().__init__()
        self.future = future

    def wait(self, timeout: Optional[timedelta] = None) -> bool:
        if timeout is not None and timeout.total_seconds() > 0:
            deadline = time.monotonic() + timeout.total_seconds()
            while not self.future.done():
                if time.monotonic() > deadline:
                    raise RuntimeError(f"mpidp: the operation did not complete within "
                                       f"{timeout.total_seconds():g} s")
                time.sleep(POLL_S)
        self.future.wait()
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
        return self.future

    def result(self):
        return self.future.value()


def run_now(fn: Callable[[], None], result) -> Work:
    """``fn`` run here; its Work, completed (or failed)."""
    f = torch.futures.Future()
    _complete(f, fn, result)
    return Work(f)


def _complete(f: torch.futures.Future, fn: Callable[[], None], result,
              ran: Callable[[], None] = lambda: None) -> None:
    """Runs ``fn``, then ``ran()``, then completes ``f`` (whose waiters and callbacks see
    what ``ran`` did)."""
    try:
        fn()
    except BaseException as exc:  # noqa: BLE001 - handed to whoever waits
        ran()
        f.set_exception(exc)
    else:
        ran()
        f.set_result(result)


class CommThread:
    """One group's thread (Note [One communication thread per group]); stopped by mpidp's
    shutdown, which then runs ``after_stop`` (Note [Stopping the users first] in
    mpidp/runtime/resources.py)."""

    def __init__(self, g, name: str, after_stop: Callable[[], None]):
        self.g = g
        self.after_stop = after_stop
        self.tasks: queue.SimpleQueue = queue.SimpleQueue()
        self.stopped = False  # by stop: nothing queued after it would ever run
        self.lock = threading.Lock()  # a submit queues before stop or fails after it
        # Note [Synchronous calls on the caller's thread]: the group is idle while
        # finished == queued; whoever runs an operation holds ``running``
        self.queued = self.finished = 0
        self.running = threading.Lock()
        self.thread = threading.Thread(target=self._run, name=f"mpidp-dist-{name}", daemon=True)
        self.thread.start()
        g.resources.add_user(self.stop)

    def call(self, run: Callable, fn: Callable[[], None], result, sync: bool) -> Optional[Work]:
        """Runs operation ``fn`` as ``run(fn)``: here, where ``sync`` and the group is idle
        (Note [Synchronous calls on the caller's thread]: its error raised, None returned),
        else on the thread (``submit``: its Work)."""
        if sync and self.finished == self.queued and \
                threading.current_thread() is not self.thread:  # a callback's: run_now, below
            with self.running:
                if self.finished == self.queued and not self.stopped:
                    run(fn)
                    return None
        return self.submit(functools.partial(run, fn), result)

    def submit(self, fn: Callable[[], None], result) -> Work:
        if threading.current_thread() is self.thread:  # from a future's callback
            return run_now(fn, result)
        f = torch.futures.Future()
        fn = self.g.board.carry_site(fn)  # in debug mode, the caller's line (Note [Debug
        with self.lock:                   # fingerprints] in mpidp/engine/header.py)
            if not self.stopped:
                self.queued += 1
                self.tasks.put((fn, f, result))
                return Work(f)
        f.set_exception(RuntimeError(STOPPED))
        return Work(f)

    def drain(self) -> None:
        """Returns once every operation queued so far has run (at once if the thread has
        stopped)."""
        if threading.current_thread() is not self.thread:
            f = self.submit(lambda: None, None).future
            while not f.done():  # fails at once (STOPPED) where the thread has stopped
                time.sleep(POLL_S)

    def _run(self) -> None:
        with runtime.using(self.g):
            while True:
                task = self.tasks.get()
                if task is None:
                    return
                fn, f, result = task
                with self.running:  # counted done before its waiter wakes: a synchronous
                    _complete(f, fn, result, self._count)  # call after wait() finds it idle

    def _count(self) -> None:
        self.finished += 1

    def stop(self, timeout_s: float) -> bool:
        """Ends the thread after the operation it is in; operations still queued fail
        (nobody can run them now). True once it has ended."""
        with self.lock:
            self.stopped = True
        while True:
            try:
                task = self.tasks.get_nowait()
            except queue.Empty:
                break
            if task is not None:
                task[1].set_exception(RuntimeError(STOPPED))
        self.tasks.put(None)
        self.thread.join(timeout_s)
        if self.thread.is_alive():
            return False
        self.after_stop()
        return True
