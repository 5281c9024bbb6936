"""The one background communication thread of a group (``Scheduler``: its ordered queue of
tasks, their completion and errors, the gate that runs a collective of another thread in its
place in the order, stopping and draining), and the launch of a model's gradient buckets in
order on it (``BucketLaunch``), which mpidp's DistributedDataParallel, the torch.distributed
backend and Horovod's DistributedOptimizer queue into (Note [One communication thread per
group]).

Note [One communication thread per group]
Each mpidp group (mpidp.runtime.Group) has at most one Scheduler, made on first use by
``of(g, name)`` and hung off the group's resources, whose shutdown stops it (Note [Stopping
the users first] in mpidp/runtime/resources.py): one thread that runs the tasks queued to it
in the order they were queued — the order every rank queues them in — under the group's
watchdog (the task's ``context`` names it on the board). The bindings build the work and
queue it: DistributedDataParallel's gradient buckets (mpidp.ddp.distributed: on one node a
zero-copy all-reduce of the gradients where they lie, elsewhere pack -> all-reduce ->
unpack, Note [Zero-copy buckets] in mpidp/comm/buckets.py) and Horovod's DistributedOptimizer's
(mpidp.horovod.backward), both through ``BucketLaunch``, on the group made by ``init``; every
asynchronous operation of a torch.distributed group of the mpidp backend (mpidp.backend.group,
a sub-group of its own: Note [Sub-groups] in mpidp/runtime/world.py), completed as a torch
Work (mpidp.backend.thread). Autograd goes on computing gradients meanwhile: the C calls
release the GIL.
Every task's outcome — None, or what it raised, and the seconds it ran — is delivered once to
its waiter (``deliver``), and the thread goes on with the next task (a disagreement raises on
every rank alike, so the ranks stay in step). A task queued to a stopped scheduler, or still
queued when it stops, is delivered a SchedulerStoppedError instead: nobody can run it, and no
waiter waits for ever. A task submitted by the thread itself — from inside a task, or from a
callback that a delivery runs (torch's PowerSGD and quantisation hooks submit and wait in a
future's callback) — runs at once, in its place in the order, where queueing it behind the
task would wait for ever.
A collective another thread must make in the order (a SyncBatchNorm layer's during DDP's
backward, hvd's calls while buckets are under way) runs inside ``parked()``: the thread
reaches the gate in the block's place, waits there until the block ends, and only one thread
calls MPI at a time. So MPI_THREAD_SERIALIZED suffices for DDP and Horovod's optimizer
(``check_thread_level``; mpidp.init asks for MULTIPLE, which the backend needs for its
point-to-point). ``stop`` ends the thread after the task it is in; ``drain`` waits for what
was queued; ``of`` makes a new scheduler for a group still open once its previous one stopped.

Note [Synchronous calls on the caller's thread]
torch's front passes ``async_op`` down in the operation's options (``opts.asyncOp``, False
for ``dist.all_reduce(t)``, True by default: torch 2.1-2.6 have no such field, and torch's
C++ — DDP's reducer, the functional collectives — leaves the default) and, for a synchronous
call, waits on the Work at once. Queueing such a call to the thread and waiting for it costs
two wake-ups (~100 µs on a loaded machine, 40x the all-reduce of 8 bytes), so a call with
``asyncOp`` False runs on the caller's thread where the group is idle (``begin_inline``):
nothing queued and nothing running (``finished == queued``, read under the ``running`` lock
that the thread holds for each task it runs — and for the delivery of its outcome, so that a
synchronous call woken by it finds the count already done — and a caller holds for one it
runs itself, so that no two run at once). Where work is queued or running, the call queues
behind it and waits, which keeps the group's order (the order the ranks agree on) and the
thread's callbacks before it. An asynchronous call always takes the thread: running it inline
"because the queue is empty" would make torch's DDP, whose reducer all-reduces each bucket
asynchronously from inside backward, wait for every bucket in backward instead of
overlapping them. A call run inline raises its error itself (the front would raise it from
``wait``) and its binding returns None: every front function of torch that passes
``asyncOp`` waits only on a Work that is not None ("the backend has synced at C++ level", as
NCCL's synchronous calls do), and making a completed Work would cost as much as the
all-reduce of 8 bytes."""
from __future__ import annotations

import contextlib
import queue
import threading
import time
from typing import Any, Callable, Optional, Sequence

from .. import runtime
from ..errors import MpidpError

FIRST_BUCKET_BYTES = 1 << 20  # the first bucket small, so the first all-reduce starts early
                              # (PyTorch DDP's; Note [Bucket order] in mpidp/ddp/distributed.py)

_get_ident = threading.get_ident
_making = threading.Lock()  # one scheduler made per group, whichever thread asks first


class SchedulerStoppedError(MpidpError):
    """A task was queued to a group's communication thread that stopped (mpidp's shutdown, a
    destroyed group) before running it."""


def _stopped() -> SchedulerStoppedError:
    return SchedulerStoppedError("mpidp: the group's communication thread stopped (shutdown, "
                                 "or the group destroyed) before this operation ran")


def check_thread_level() -> None:
    """Note [One communication thread per group]: MPI at SERIALIZED or better."""
    level = runtime.thread_level()
    if level not in ("serialized", "multiple"):
        raise MpidpError(f"mpidp's communication thread (DistributedDataParallel, Horovod's "
                         f"DistributedOptimizer) needs MPI_THREAD_SERIALIZED or better; MPI "
                         f"was initialised with MPI_THREAD_{level.upper()} (let mpidp.init() "
                         "start MPI, or call MPI.Init_thread(MPI.THREAD_MULTIPLE) yourself)")


def of(g, name: str) -> "Scheduler":
    """Group ``g``'s scheduler, started (its thread named ``name``) where it has none, or
    where its last one was stopped and the group is still open; a stopped one of a group
    that is shutting down stays (what is queued to it fails at once)."""
    s = g.resources.scheduler
    if s is None or s.stopped:
        with _making:
            s = g.resources.scheduler
            if g.resources.closed:  # shutting down: its users were stopped already, and a
                if s is None:       # thread started now would outlive the group
                    raise _stopped()
            elif s is None or s.stopped:
                s = g.resources.scheduler = Scheduler(g, name)
    return s


def find(g) -> Optional["Scheduler"]:
    """Group ``g``'s scheduler where one runs; None where none was made or it stopped."""
    s = g.resources.scheduler
    return None if s is None or s.stopped else s


class Scheduler:
    """Group ``g``'s communication thread and its queue (Note [One communication thread per
    group]); made by ``of``. A task is ``fn`` (no arguments) with the watchdog's ``context``
    (a format and its arguments, or None) and ``deliver``, called once with ``(error or None,
    seconds)``."""

    def __init__(self, g, name: str):
        check_thread_level()
        self.g = g
        self.tasks: queue.SimpleQueue = queue.SimpleQueue()
        self.stopped = False  # by stop: nothing queued after it would ever run
        self.lock = threading.Lock()  # a submit queues before stop or fails after it
        # Note [Synchronous calls on the caller's thread]: the group is idle while
        # finished == queued; whoever runs a task holds ``running``
        self.queued = self.finished = 0
        self.running = threading.Lock()
        self.after_stop: list = []  # run once the thread has ended (a binding's frees)
        self.parked_by: Optional[int] = None  # the thread whose block the gate waits for
        self.thread = threading.Thread(target=self._run, name=name, daemon=True)
        self.thread.start()
        self.ident = self.thread.ident
        g.resources.add_user(self.stop)  # Note [Stopping the users first]

    def submit(self, context: Any, fn: Callable[[], None],
               deliver: Callable[[tuple], Any]) -> None:
        """Queues task ``fn``; on the thread itself it runs at once."""
        if _get_ident() == self.ident:  # from a task or a delivery's callback
            deliver(outcome(fn))
            return
        with self.lock:
            if not self.stopped:
                self.queued += 1
                self.tasks.put((context, fn, deliver))
                return
        deliver((_stopped(), 0.0))

    def begin_inline(self) -> bool:
        """True where the group is idle and this is not its thread: the caller then holds
        ``running``, runs its operation on its own thread and calls ``running.release()``
        (Note [Synchronous calls on the caller's thread]); else False, holding nothing."""
        if self.finished == self.queued and _get_ident() != self.ident:
            self.running.acquire()
            if self.finished == self.queued and not self.stopped:
                return True
            self.running.release()
        return False

    def here(self) -> bool:
        """True on the thread itself, or on the thread whose ``parked`` block it waits for:
        a task or a block in its turn, whose collectives run as they are."""
        ident = _get_ident()
        return ident == self.ident or ident == self.parked_by

    @contextlib.contextmanager
    def parked(self):
        """Runs the block once the thread has finished the tasks queued before it, with the
        thread waiting until the block ends: the block's collectives come in their place in
        the order, and only one thread calls MPI at a time. On the thread itself, or inside
        another ``parked`` block, the block runs as it is. SchedulerStoppedError where the
        scheduler stopped before the block's turn."""
        if self.here():
            yield
            return
        reached, released = threading.Event(), threading.Event()
        failed: list = []

        def gate():
            self.parked_by = caller
            reached.set()
            released.wait()
            if self.parked_by == caller:  # a caller interrupted before its turn left it
                self.parked_by = None

        def delivered(outcome):
            if outcome[0] is not None:  # stopped before the gate's turn
                failed.append(outcome[0])
                reached.set()
        caller = _get_ident()
        self.submit(None, gate, delivered)
        try:
            reached.wait()
            if failed:
                raise failed[0]
            yield
        finally:
            if self.parked_by == caller:  # reset here: the caller's next block may follow
                self.parked_by = None     # before the thread wakes
            released.set()

    def drain(self) -> None:
        """Returns once every task queued so far has run (at once where the scheduler has
        stopped, or on the thread itself)."""
        done = threading.Event()
        self.submit(None, _nothing, lambda outcome: done.set())
        done.wait()

    def _run(self) -> None:
        board, tasks, running = self.g.board, self.tasks, self.running
        with runtime.using(self.g):
            while True:
                task = tasks.get()
                if task is None:
                    return
                context, fn, deliver = task
                with running:  # counted done before its waiter wakes: a synchronous call
                    board.context = context  # after the wait finds the group idle
                    done = outcome(fn)
                    self.finished += 1
                    board.context = None
                    deliver(done)

    def stop(self, timeout_s: float = 10.0) -> bool:
        """Ends the thread after the task it is in (shutdown closed the context its waits
        are in first: Note [Stopping the users first] in mpidp/runtime/resources.py); the
        tasks still queued fail (nobody can run them now). True once it has ended, after
        ``after_stop``."""
        with self.lock:
            self.stopped = True
        while True:
            try:
                task = self.tasks.get_nowait()
            except queue.Empty:
                break
            if task is not None:
                task[2]((_stopped(), 0.0))
        self.tasks.put(None)
        self.thread.join(timeout_s)
        if self.thread.is_alive():
            return False
        after, self.after_stop = self.after_stop, []
        for fn in after:
            fn()
        return True


def outcome(fn: Callable[[], None]) -> tuple:
    """Runs ``fn``: (what it raised, or None; the seconds it ran), a task's outcome."""
    t0 = time.perf_counter()
    try:
        fn()
    except BaseException as exc:  # noqa: BLE001 - delivered to its waiter
        return exc, time.perf_counter() - t0
    return None, time.perf_counter() - t0


def _nothing() -> None:
    pass


_NOTHING = (None, 0.0)


class BucketLaunch:
    """The launch of one model's gradient buckets, bucket k holding ``sizes[k]`` parameters
    (``bucket_of[i]``: parameter i's bucket), strictly in index order: ``ready(i)``, as
    parameter i's gradient is final, counts its bucket down and returns the buckets that may
    launch now — a full bucket waits for the ones before it — so every rank queues the same
    all-reduces in the same order whatever its timing (Note [Bucket order] in
    mpidp/ddp/distributed.py); ``rest()`` returns those left. The binding builds each one's
    work and ``submit``s it to ``scheduler``; ``wait`` waits for every bucket submitted.
    ``what`` (a format of k + 1 and the number of buckets) names a bucket on the watchdog's
    board. One launching thread at a time."""

    def __init__(self, sizes: Sequence[int], bucket_of: Sequence[int], what: str):
        self.sizes, self.bucket_of, self.what = tuple(sizes), bucket_of, what
        self.results: queue.SimpleQueue = queue.SimpleQueue()
        self.queued = 0  # submitted and not waited for
        self.begin(None)

    def begin(self, scheduler: Optional[Scheduler]) -> None:
        """A new pass, its buckets to go to ``scheduler`` (None: set ``scheduler`` before the
        first ``submit``); the buckets of a pass that was not waited for are waited for
        first."""
        if self.queued:
            self.wait()
        self.pending = list(self.sizes)
        self.next = 0  # the first bucket not launched yet
        self.scheduler = scheduler

    def ready(self, i: int) -> range:
        pending = self.pending
        pending[self.bucket_of[i]] -= 1
        first = k = self.next
        while k < len(pending) and pending[k] == 0:
            k += 1
        self.next = k
        return range(first, k)

    def rest(self) -> range:
        first, self.next = self.next, len(self.pending)
        return range(first, self.next)

    def submit(self, k: int, fn: Optional[Callable[[], None]]) -> None:
        """Queues bucket ``k``'s work ``fn`` (None: nothing to do, done at once)."""
        self.queued += 1
        if fn is None:
            self.results.put(_NOTHING)
            return
        self.scheduler.submit((self.what, k + 1, len(self.pending)), fn, self.results.put)

    def abandon(self) -> None:
        """Forgets the buckets submitted and not waited for, without waiting (their group
        lost a rank and its thread was stopped: Note [In-job recovery] in
        mpidp/runtime/recovery.py); what they report later goes nowhere. A new pass next."""
        self.results, self.queued = queue.SimpleQueue(), 0
        self.begin(None)

    def wait(self) -> tuple:
        """Waits for every bucket submitted: (the first error a bucket met, or None; the
        seconds they ran on the thread)."""
        error, seconds, get = None, 0.0, self.results.get
        while self.queued:
            exc, s = get()
            self.queued -= 1
            seconds += s
            error = error or exc
        return error, seconds
