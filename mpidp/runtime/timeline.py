"""The timeline: with ``MPIDP_TIMELINE=FILE`` every rank records spans (backward, pack,
all-reduce, unpack, optimizer step, PS pull/push/apply, ...) and instants (bucket ready), and
at shutdown rank 0 merges every rank's events into one Chrome-trace JSON file that
chrome://tracing and https://ui.perfetto.dev open: one process track per rank ("rank N"), one
thread track per thread (main, the DDP communication thread).

Note [Timeline cost]
Whether the timeline records (``ON``) is decided by ``mpidp.init()`` from ``mpidp.config``
(``switch``), not at import, where a bad MPIDP_* value must not raise (Note [Settings read at
init] in mpidp/config.py). ``traced`` decides when it decorates, at import: it wraps only
where MPIDP_TIMELINE is set then (``config.timeline_requested``, which reads that variable
alone and cannot fail), and the wrapper records while ON. Off, ``traced`` returns the
function itself (no cost at all), ``span`` returns one shared no-op context manager and
``instant`` returns at once (tens of nanoseconds a call;
bench/overhead/timeline_overhead.py measures both); so MPIDP_TIMELINE set only after mpidp's modules were imported records the spans but
not the traced functions (``mpidp.init`` warns). On, an event is one tuple
appended to a list (about a microsecond), nothing is written until shutdown, and a rank keeps
at most ``MAX_EVENTS`` events (the rest are counted as dropped).

Note [Timeline clocks]
Events are stamped with each process's ``time.perf_counter_ns`` (CLOCK_MONOTONIC on Linux:
nanosecond resolution, never stepped by NTP). Processes on one host share that clock, but hosts
do not, and their clocks drift apart by some parts per million. So rank 0 measures every
rank's offset twice, when the timeline starts (``mpidp.init``) and when it ends (shutdown),
with a ping-pong of ``PING_PONG_ROUNDS`` messages (Cristian's algorithm: rank r's time t_r
answers rank 0's message sent at t_1 and received back at t_2; offset = t_r - (t_1 + t_2) / 2,
taken from the round with the shortest round trip, whose half is the error bound: a few
microseconds on one node, tens over a network). Each rank's events are shifted by the offset
interpolated linearly between the two measurements, which also removes a constant drift.

Note [A timeline started while running]
Besides MPIDP_TIMELINE (from ``mpidp.init`` to shutdown), the timeline may be started and
stopped while the job runs: mpidp.runtime's ``start_timeline(path)`` and ``stop_timeline()``
(Horovod's ``hvd.start_timeline``/``hvd.stop_timeline`` with HOROVOD_TIMELINE=DYNAMIC,
mpidp/horovod/basics.py). Both are collective over the group made by ``mpidp.init``: the
trace holds every rank's events on rank 0's clock, which takes every rank's events and a
ping-pong with each, so every rank calls them (Horovod lets rank 0's call alone matter); the
binding first agrees on the call (``called`` in mpidp/comm/agreement.py), so a rank that
calls something else meanwhile raises on every rank instead of waiting. Rank 0's path is the
one written (the others' are not used, as in Horovod). ``start_timeline`` to the file being
recorded does nothing; to another file it writes the one being recorded first, then starts
afresh (Horovod switches files too). ``stop_timeline`` gathers and writes the trace (rank 0,
atomically, as at shutdown) and recording stops; a timeline still started at shutdown is
written then. While it records, the one-call paths of every group are off (Resources.record
in mpidp/runtime/resources.py), as under MPIDP_TIMELINE, so that every collective is seen;
they come back when it stops. What ``traced`` wraps is still decided at import (Note
[Timeline cost]): HOROVOD_TIMELINE (DYNAMIC too) or MPIDP_TIMELINE set before the import
records the traced functions; set only later, the spans alone (a warning says so).
"""
from __future__ import annotations

import functools
import json
import os
import socket
import sys
import threading
import time
import warnings
from typing import Callable, Optional, Sequence

from .. import config, files
from ..engine.library import mpi

ON = False  # set by mpidp.init (``switch``): Note [Timeline cost]
_WRAP = config.timeline_requested()  # what ``traced`` decides by: Note [Timeline cost]
MAX_EVENTS = 1_000_000            # per rank
PING_PONG_ROUNDS = 8
_TAG = 7177

_clock = time.perf_counter_ns
_events: list = []    # (phase "X" or "i", name, start ns, duration ns, thread ident, args)
_threads: dict = {}   # thread ident -> thread name
_dropped = 0
_main_ident = threading.main_thread().ident
_state: dict = {}     # set by start(): comm, path, first sync


def _record(event: tuple) -> None:
    global _dropped
    ident = event[4]
    if ident not in _threads:
        _threads[ident] = threading.current_thread().name
    if len(_events) < MAX_EVENTS:
        _events.append(event)  # list.append is atomic under the GIL: threads may record
    else:
        _dropped += 1


def complete(name: str, start_ns: int, args: Optional[dict] = None) -> None:
    """Records a span ``name`` from ``start_ns`` (a ``now()``) until now (when ON)."""
    if ON:
        _record(("X", name, start_ns, _clock() - start_ns, threading.get_ident(), args))


def instant(name: str, args: Optional[dict] = None) -> None:
    """Records an instant event ``name`` now (when ON)."""
    if ON:
        _record(("i", name, _clock(), 0, threading.get_ident(), args))


def now() -> int:
    """The timeline's clock, in nanoseconds (Note [Timeline clocks])."""
    return _clock()


class _Span:
    __slots__ = ("name", "args", "t0")

    def __init__(self, name: str, args: Optional[dict]):
        self.name, self.args = name, args

    def __enter__(self):
        self.t0 = _clock()
        return self

    def __exit__(self, *exc) -> bool:
        _record(("X", self.name, self.t0, _clock() - self.t0, threading.get_ident(),
                 self.args))
        return False


class _NoSpan:
    __slots__ = ()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> bool:
        return False


_NO_SPAN = _NoSpan()


def span(name: str, args: Optional[dict] = None):
    """``with span("backward"): ...`` records the block as a span (a shared no-op when off)."""
    return _Span(name, args) if ON else _NO_SPAN


def switch(on: bool, asked: str = "MPIDP_TIMELINE") -> None:
    """Turns recording on or off (``mpidp.init``, from MPIDP_TIMELINE; mpidp.runtime's
    ``start_timeline`` and ``stop_timeline``): Note [Timeline cost]. Warns where it turns it
    on but ``traced`` did not wrap (``asked``, the variable that asks for the timeline, was
    set after the import)."""
    global ON
    ON = on
    if on and not _WRAP:
        warnings.warn(f"mpidp: {asked} was set after mpidp's modules were imported: the "
                      "timeline records spans but not the traced functions (collectives, "
                      "pack, unpack); set it before starting Python", RuntimeWarning,
                      stacklevel=3)


def traced(name: str) -> Callable:
    """Decorator: every call of the function while ON is a span ``name``; where the timeline
    was not asked for at import, the function itself (Note [Timeline cost])."""
    def decorate(fn: Callable) -> Callable:
        if not (_WRAP or ON):
            return fn

        @functools.wraps(fn)
        def recorded(*args, **kwargs):
            if not ON:
                return fn(*args, **kwargs)
            t0 = _clock()
            try:
                return fn(*args, **kwargs)
            finally:
                _record(("X", name, t0, _clock() - t0, threading.get_ident(), None))
        return recorded
    return decorate


# ---- pure: clock alignment and the Chrome trace -------------------------------------------

def estimate_offset(samples: Sequence[tuple]) -> tuple:
    """(offset ns, round trip ns) of a remote clock from ping-pong ``samples`` of (local send
    time, remote time, local receive time): Cristian's estimate from the shortest round trip
    (Note [Timeline clocks]). ``remote - offset`` is the time on the local clock."""
    t1, remote, t2 = min(samples, key=lambda s: s[2] - s[0])
    return remote - (t1 + t2) // 2, t2 - t1


def aligner(first: tuple, last: Optional[tuple] = None) -> Callable[[int], float]:
    """A function from a rank's clock to rank 0's, given the (rank's time, offset) pairs
    measured at the start and (optionally) the end: the offset interpolated linearly."""
    (ta, oa), (tb, ob) = first[:2], (last or first)[:2]
    if tb == ta:
        return lambda t: t - oa
    slope = (ob - oa) / (tb - ta)
    return lambda t: t - (oa + slope * (t - ta))


def chrome_trace(ranks: Sequence[dict]) -> dict:
    """The merged Chrome trace ("traceEvents" format) of every rank's record: a dict with
    ``rank``, ``host``, ``events`` (tuples as recorded), ``threads`` ({ident: name}),
    ``main`` (the main thread's ident), ``sync`` ((time, offset[, round trip]) at start and
    at end, as rank 0 measured that rank; None for rank 0 itself) and ``dropped``. Timestamps are
    microseconds from the earliest event of the job on rank 0's clock; pid is the rank, tid
    0 the main thread and 1, 2, ... the others in order of appearance."""
    out, aligned = [], []
    for rec in ranks:
        sync = rec.get("sync") or ((0, 0), (0, 0))
        to_rank0 = aligner(*sync)
        aligned.append([(to_rank0(e[2]),) + e for e in rec["events"]])
    base = min((e[0] for evs in aligned for e in evs), default=0.0)
    for rec, evs in zip(ranks, aligned):
        pid = rec["rank"]
        out.append({"name": "process_name", "ph": "M", "pid": pid, "tid": 0,
                    "args": {"name": f"rank {pid}"}})
        out.append({"name": "process_sort_index", "ph": "M", "pid": pid, "tid": 0,
                    "args": {"sort_index": pid}})
        if rec.get("host"):
            out.append({"name": "process_labels", "ph": "M", "pid": pid, "tid": 0,
                        "args": {"labels": rec["host"]}})
        tids = {rec.get("main"): 0}
        for _, _, _, _, _, ident, _ in evs:
            tids.setdefault(ident, len(tids))
        for ident, tid in tids.items():
            name = "main" if tid == 0 else rec["threads"].get(ident, f"thread {tid}")
            out.append({"name": "thread_name", "ph": "M", "pid": pid, "tid": tid,
                        "args": {"name": name}})
            out.append({"name": "thread_sort_index", "ph": "M", "pid": pid, "tid": tid,
                        "args": {"sort_index": tid}})
        for t, phase, name, _, dur, ident, args in evs:
            e = {"name": name, "ph": phase, "ts": round((t - base) / 1000, 3), "pid": pid,
                 "tid": tids[ident]}
            if phase == "X":
                e["dur"] = round(dur / 1000, 3)
            else:
                e["s"] = "t"  # an instant on its thread's track
            if args:
                e["args"] = args
            out.append(e)
    dropped = {str(r["rank"]): r["dropped"] for r in ranks if r.get("dropped")}
    syncs = {str(r["rank"]): [{"offset_us": s[1] / 1000, "round_trip_us": s[2] / 1000}
                              for s in r["sync"] if len(s) > 2]
             for r in ranks if r.get("sync")}
    return {"traceEvents": out, "displayTimeUnit": "ms",
            "otherData": {"producer": "mpidp", "ranks": len(ranks),
                          "clock": "perf_counter_ns, aligned to rank 0 by ping-pong",
                          "clock_sync": syncs, "dropped_events": dropped}}


def write_atomically(path: str, trace: dict) -> None:
    """Writes ``trace`` as JSON at ``path``, whole or not at all and never through a link
    (Note [Writing a file] in mpidp/files/__init__.py); OutputError naming the path and the cause."""
    files.write_atomically(path, lambda f: f.write(json.dumps(trace, separators=(",", ":"))
                                                   .encode()), what="timeline")


# ---- collective: start and finish ----------------------------------------------------------

def _ping_pong(comm) -> dict:
    """Rank 0 measures every rank's clock; returns {rank: (rank's time, offset, round trip)}
    (ns) on rank 0 and {} elsewhere. Every rank of ``comm`` calls it."""
    import numpy as np
    rank, size = comm.Get_rank(), comm.Get_size()
    stamp, empty = np.zeros(1, np.int64), np.zeros(0, np.int64)
    found = {}
    for r in range(1, size):
        if rank == 0:
            samples = []
            for _ in range(PING_PONG_ROUNDS):
                t1 = _clock()
                comm.Send(empty, dest=r, tag=_TAG)
                comm.Recv(stamp, source=r, tag=_TAG)
                samples.append((t1, int(stamp[0]), _clock()))
            offset, rtt = estimate_offset(samples)
            found[r] = (min(samples, key=lambda s: s[2] - s[0])[1], offset, rtt)
        elif rank == r:
            for _ in range(PING_PONG_ROUNDS):
                comm.Recv(empty, source=0, tag=_TAG)
                stamp[0] = _clock()
                comm.Send(stamp, dest=0, tag=_TAG)
    return found


def start(comm, path: str, what: str = "MPIDP_TIMELINE") -> None:
    """Starts the timeline on ``comm``, to be written at rank 0's ``path`` (the others' are
    not used; called by ``mpidp.init`` when ON, and by mpidp.runtime's ``start_timeline``):
    checks on rank 0 that the file can be written (a ValueError on every rank otherwise, ``what``
    naming where the path came from) and measures the clock offsets. Every rank of ``comm``
    calls it."""
    asked = path
    comm = comm.Dup()
    MPI = mpi()
    if comm.Get_size() != MPI.COMM_WORLD.Get_size():  # several groups: one file each
        stem, ext = os.path.splitext(path)
        path = f"{stem}.world{MPI.COMM_WORLD.Get_rank()}{ext}"
    problem = None
    if comm.Get_rank() == 0:
        folder = os.path.dirname(os.path.abspath(path))
        if not os.path.isdir(folder) or not os.access(folder, os.W_OK):
            problem = f"{what}={path!r}: cannot write to {folder!r}"
    problem, asked = comm.bcast((problem, asked), root=0)
    if problem:
        comm.Free()
        raise ValueError(problem)
    _state.update(comm=comm, path=path, asked=asked, first=_ping_pong(comm))


def started_path() -> Optional[str]:
    """The path rank 0 was given at ``start`` (the same on every rank) while the timeline is
    started, else None."""
    return _state.get("asked") if "comm" in _state else None


def finish() -> Optional[str]:
    """``gather`` then ``write``: the merged trace's path on rank 0 (None elsewhere, or when
    not started). Every rank calls it."""
    return write(gather())


def gather() -> Optional[list]:
    """Measures the clock offsets again and gathers every rank's events on rank 0; returns
    them there (None elsewhere, or when not started). Called by ``mpidp.shutdown`` (at exit)
    and mpidp.runtime's ``stop_timeline``; every rank calls it."""
    global _dropped
    comm = _state.pop("comm", None)
    if comm is None:
        return None
    last = _ping_pong(comm)
    record = {"rank": comm.Get_rank(), "host": socket.gethostname(), "events": list(_events),
              "threads": dict(_threads), "main": _main_ident, "dropped": _dropped}
    records = comm.gather(record, root=0)
    comm.Free()
    _events.clear()  # a later start records afresh
    _dropped = 0
    if records is None:
        return None
    first = _state["first"]
    for rec in records[1:]:
        rec["sync"] = (first[rec["rank"]], last[rec["rank"]])
    return records


def write(records: Optional[list]) -> Optional[str]:
    """Writes ``gather``'s records as the merged trace (rank 0; not collective, so the
    shutdown runs it after the watchdog has stopped: a large trace on slow storage is no
    stall); returns its path, or None for None or a failed write (said on stderr)."""
    if records is None:
        return None
    path = _state["path"]
    try:
        write_atomically(path, chrome_trace(records))
    except OSError as exc:  # at exit: say so, do not turn a finished run into a failure
        sys.stderr.write(f"mpidp: rank 0: {exc}\n")
        return None
    sys.stderr.write(f"mpidp: timeline of {len(records)} rank(s) written to {path} (open it in "
                     "https://ui.perfetto.dev or chrome://tracing)\n")
    return path
