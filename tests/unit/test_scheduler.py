"""Tier 1: a group's communication thread (mpidp.comm.scheduler, Note [One communication thread
per group]) on a stand-in group, without MPI: tasks in order on one thread, each outcome
delivered to its waiter (an error too, and the next task runs), what is queued to a stopped
scheduler failed rather than left waiting, the parked gate, the synchronous call on the
caller's thread, and buckets launched strictly in order."""
import threading
from types import SimpleNamespace

import pytest

from mpidp.comm import scheduler
from mpidp.comm.scheduler import BucketLaunch, SchedulerStoppedError


class Resources:
    def __init__(self):
        self.scheduler, self.closed, self.users = None, False, []

    def add_user(self, stop):
        self.users.append(stop)


@pytest.fixture
def group(monkeypatch):
    monkeypatch.setattr(scheduler, "check_thread_level", lambda: None)  # no MPI here
    g = SimpleNamespace(board=SimpleNamespace(context=None), resources=Resources())
    yield g
    for stop in g.resources.users:
        stop(10.0)


class Waiter:
    """A task's deliveries, and an event set at the first."""

    def __init__(self):
        self.outcomes, self.done = [], threading.Event()

    def __call__(self, outcome):
        self.outcomes.append(outcome)
        self.done.set()

    def error(self):
        assert self.done.wait(30) and len(self.outcomes) == 1, self.outcomes
        return self.outcomes[0][0]


def held(s):
    """Queues a task that holds the thread until the returned event is set."""
    started, release = threading.Event(), threading.Event()

    def hold():
        started.set()
        release.wait(30)
    waiter = Waiter()
    s.submit(None, hold, waiter)
    assert started.wait(30)
    return release, waiter


def test_tasks_run_in_order_on_the_thread_and_an_error_goes_to_its_waiter_only(group):
    s = scheduler.of(group, "test-comm")
    assert scheduler.of(group, "another") is s and s.thread.name == "test-comm"
    ran, seen_context = [], []

    def task(k):
        def run():
            ran.append((k, threading.get_ident()))
            seen_context.append(group.board.context)
            if k == 1:
                raise ValueError("bucket 1 refused")
        return run
    waiters = [Waiter() for _ in range(3)]
    for k, w in enumerate(waiters):
        s.submit(("task {}", k), task(k), w)
    assert waiters[0].error() is None
    assert isinstance(waiters[1].error(), ValueError)
    assert waiters[2].error() is None  # the thread went on after the error
    assert [k for k, _ in ran] == [0, 1, 2]
    assert {t for _, t in ran} == {s.ident} and s.ident != threading.get_ident()
    assert seen_context == [("task {}", 0), ("task {}", 1), ("task {}", 2)]
    assert group.board.context is None
    assert s.queued == s.finished == 3


def test_stop_fails_what_is_queued_and_what_comes_after(group):
    s = scheduler.of(group, "test-comm")
    release, first = held(s)
    queued = [Waiter() for _ in range(2)]
    for w in queued:
        s.submit(None, lambda: None, w)
    stopped = []
    stopper = threading.Thread(target=lambda: stopped.append(s.stop(30)))
    stopper.start()
    for w in queued:  # failed while the thread is still in its task
        assert isinstance(w.error(), SchedulerStoppedError)
    release.set()
    stopper.join(30)
    assert stopped == [True] and not s.thread.is_alive()
    assert first.error() is None  # the task it was in ran to its end
    late = Waiter()
    s.submit(None, lambda: None, late)
    assert isinstance(late.error(), SchedulerStoppedError)
    s.drain()  # at once: nothing can run
    with pytest.raises(SchedulerStoppedError):
        with s.parked():
            pass
    # a new one for a group still open; none for one that is shutting down
    again = scheduler.of(group, "test-comm")
    assert again is not s and not again.stopped
    again.stop(30)
    group.resources.closed = True
    assert scheduler.of(group, "test-comm") is again and scheduler.find(group) is None


def test_after_stop_runs_once_the_thread_ended(group):
    s = scheduler.of(group, "test-comm")
    freed = []
    s.after_stop.append(lambda: freed.append(not s.thread.is_alive()))
    assert s.stop(30) and s.stop(30)
    assert freed == [True]


def test_a_task_submitted_from_the_thread_runs_at_once(group):
    s = scheduler.of(group, "test-comm")
    inner, outer, order = Waiter(), Waiter(), []

    def task():
        s.submit(None, lambda: order.append("inner"), inner)  # queued, it would never run
        order.append("after inner")
    s.submit(None, task, outer)
    assert outer.error() is None and inner.error() is None
    assert order == ["inner", "after inner"]


def test_parked_runs_the_block_in_its_place_with_the_thread_waiting(group):
    s = scheduler.of(group, "test-comm")
    release, first = held(s)
    order = []
    s.submit(None, lambda: order.append("bucket"), Waiter())
    parked = threading.Event()

    def block():
        with s.parked():
            order.append("block")
            assert s.here()
            with s.parked():  # an inner one passes through
                order.append("inner block")
            parked.set()
        # the gate is let go at once: the caller's next block cannot pass through it
        order.append(s.parked_by)
        s.submit(None, lambda: order.append("after"), Waiter())
    caller = threading.Thread(target=block)
    caller.start()
    release.set()
    assert parked.wait(30)
    caller.join(30)
    s.drain()
    assert first.error() is None
    assert order == ["bucket", "block", "inner block", None, "after"]
    assert not s.here()


def test_a_block_left_before_its_turn_leaves_no_gate_behind(group, monkeypatch):
    """The caller's wait for its turn is interrupted (a KeyboardInterrupt caught by the
    user): the gate, run later, still lets the thread go and leaves ``parked_by`` unset, so
    that thread's later collectives are parked again, not taken as already in their turn."""
    s = scheduler.of(group, "test-comm")
    release, first = held(s)
    real = threading.Event.wait
    interrupted = []

    def wait_once(self, *args):
        if not interrupted and threading.current_thread() is threading.main_thread():
            interrupted.append(True)
            raise KeyboardInterrupt
        return real(self, *args)
    monkeypatch.setattr(threading.Event, "wait", wait_once)
    with pytest.raises(KeyboardInterrupt):
        with s.parked():
            raise AssertionError("the block ran before its turn")
    monkeypatch.setattr(threading.Event, "wait", real)
    release.set()
    s.drain()
    assert first.error() is None and s.parked_by is None and not s.here()


def test_no_scheduler_starts_on_a_group_shutting_down(group):
    """``of`` on a group whose shutdown began: no thread that would outlive it; a stopped
    scheduler stays stopped and fails what is queued to it."""
    group.resources.closed = True
    with pytest.raises(SchedulerStoppedError):
        scheduler.of(group, "test-comm")
    group.resources.closed = False
    s = scheduler.of(group, "test-comm")
    assert s.stop(10.0)
    group.resources.closed = True
    assert scheduler.of(group, "test-comm") is s
    waiter = Waiter()
    s.submit(None, lambda: None, waiter)
    assert isinstance(waiter.error(), SchedulerStoppedError)


def test_a_synchronous_call_runs_inline_only_where_the_group_is_idle(group):
    s = scheduler.of(group, "test-comm")
    assert s.begin_inline()  # idle: the caller runs its operation, holding ``running``
    assert not s.running.acquire(blocking=False)
    s.running.release()
    release, first = held(s)
    assert not s.begin_inline()  # a task running: the call queues behind it
    assert s.running.locked()  # the thread's, not the caller's
    s.submit(None, lambda: None, Waiter())
    release.set()
    s.drain()
    assert first.error() is None and s.finished == s.queued
    inner = []
    s.submit(None, lambda: inner.append(s.begin_inline()), Waiter())  # on the thread: never
    s.drain()
    assert inner == [False] and not s.running.locked()


def test_buckets_launch_strictly_in_order_and_every_one_is_waited_for(group):
    s = scheduler.of(group, "test-comm")
    ran = []

    def work(k):
        if k == 2:
            return None  # nothing to do: counted, not queued
        if k == 1:
            def fail():
                ran.append(k)
                raise ValueError("bucket 1")
            return fail
        return lambda: ran.append(k)
    # four buckets of parameters (0, 1), (2,), (3,), (4, 5)
    launch = BucketLaunch([2, 1, 1, 2], [0, 0, 1, 2, 3, 3], "bucket {} of {}")
    launch.begin(s)
    assert list(launch.ready(2)) == []  # bucket 1 full, but bucket 0 is not
    assert list(launch.ready(3)) == [] and list(launch.ready(1)) == []
    assert list(launch.ready(0)) == [0, 1, 2]  # in order
    for k in range(3):
        launch.submit(k, work(k))
    assert list(launch.rest()) == [3] and list(launch.rest()) == []  # no gradient for 4, 5
    launch.submit(3, work(3))
    error, seconds = launch.wait()
    assert isinstance(error, ValueError) and seconds >= 0.0  # and the buckets after it ran
    assert ran == [0, 1, 3] and launch.queued == 0
    launch.submit(0, lambda: ran.append("left over"))
    launch.begin(s)  # a pass that was not waited for is waited for first
    assert launch.queued == 0 and ran[-1] == "left over"
    assert [list(launch.ready(i)) for i in (5, 4, 3, 2, 1, 0)] == \
        [[], [], [], [], [], [0, 1, 2, 3]]
