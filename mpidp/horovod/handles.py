"""Horovod's handles: an ``*_async`` operation is held pending, in the order submitted, and
runs at ``synchronize`` or ``poll`` of its handle or before the next operation of
mpidp.horovod (Note [Pending operations])."""
from __future__ import annotations

import itertools
from typing import Any, Callable

# Note [Pending operations]
# Horovod's ``*_async`` calls hand the tensor to a background thread that negotiates it with
# the other ranks by name; the handle is in flight until every rank has submitted it.
# Scripts and Horovod's own tests rely on three things of that: ``poll`` answers False for
# an operation just submitted; a name submitted twice while the first is in flight raises
# ValueError on that rank alone; and ``barrier`` does not wait for operations in flight (a
# rank may submit one, pass a barrier, and the others submit theirs after it). mpidp has no
# background negotiation, so it holds each ``*_async`` operation pending, in submission
# order, and runs the pending ones, oldest first, at ``synchronize`` of a pending handle (up
# to it), at ``poll`` of a pending handle (up to it; that poll answers False, as the
# operation was not done when asked, and the next answers True), and before any other
# operation of mpidp.horovod but ``barrier`` (``hvd.allreduce_``'s one-call path is taken only
# where nothing is pending: whether a call takes it depends on its dtype and on whether a
# backward pass is under way, which may differ between ranks). Every rank submits and
# reaches those points in the same order, so the ranks run the same operations in the same
# order, as mpidp matches them (Note [Names] in
# mpidp/horovod/arguments.py). An operation's error is kept and raised at ``synchronize``
# of its handle, as Horovod raises there. A pending operation reads its tensor when it
# runs: as in Horovod, a tensor handed to an ``*_async`` call is not to be changed before
# ``synchronize``. Pending operations left at ``hvd.shutdown`` are dropped on every rank.

_pending: list = []   # (handle, name, run) in submission order
_done: dict = {}      # handle -> (result, error)
_next = itertools.count(1)
_running = False


def submit(run: Callable[[], Any], name: Any = None) -> int:
    """Holds ``run`` (an operation named ``name``, or None) pending; returns its handle.
    ValueError, on this rank alone, where an operation of that name is pending."""
    if name is not None and any(n == str(name) for _, n, _ in _pending):
        raise ValueError(f"an operation named {str(name)!r} is already in flight: each "
                         "name once until it is synchronized (as in Horovod)")
    handle = next(_next)
    _pending.append((handle, None if name is None else str(name), run))
    return handle


def pending_list() -> list:
    """The list of pending operations itself (empty: none), for a check that costs no call."""
    return _pending


def run_pending(through: Any = None) -> None:
    """Runs the pending operations, oldest first (up to handle ``through`` where given).
    Inside a pending operation: nothing (its own collectives are its)."""
    global _running
    if _running:
        return
    _running = True
    try:
        while _pending:
            handle, _, run = _pending.pop(0)
            try:
                _done[handle] = (run(), None)
            except Exception as exc:  # noqa: BLE001 - raised at its synchronize
                _done[handle] = (None, exc)
            if handle == through:
                return
    finally:
        _running = False


def is_pending(handle: Any) -> bool:
    return any(h == handle for h, _, _ in _pending)


def done(result: Any) -> int:
    """A handle of an operation already run (its result ``result``)."""
    handle = next(_next)
    _done[handle] = (result, None)
    return handle


def poll(handle: Any) -> bool:
    """Whether the operation of ``handle`` was done: a pending one runs now (with those
    before it) and answers False; ValueError for a handle that is not in flight."""
    if is_pending(handle):
        run_pending(handle)
        return False
    if handle not in _done:
        raise ValueError(f"handle {handle!r} is not an operation in flight")
    return True


def synchronize(handle: Any):
    """The result of the operation of ``handle`` (run now where pending), its error raised;
    the handle is spent. None for a handle not in flight, as Horovod's."""
    if is_pending(handle):
        run_pending(handle)
    result, error = _done.pop(handle, (None, None))
    if error is not None:
        raise error
    return result


def forget() -> None:
    """At shutdown: pending operations and results are dropped."""
    _pending.clear()
    _done.clear()
