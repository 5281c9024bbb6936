"""The watchdog: the board on which every blocking mpidp operation is posted (which one, its
sequence number on the group), and the thread that aborts the job with a report naming the
ranks that had and had not arrived when an operation has waited longer than MPIDP_TIMEOUT_S.

Note [Watchdog]
Every collective on the group publishes its handshake header on this process's ``Board``
(``seq`` counts collectives, so the same collective has the same number on every rank) and
marks it done when it returns, whatever the outcome; the parameter server posts its one-sided
waits (pull, push, a server waiting for pushes, epoch-end reads) on a second lane. That is
the whole cost on the hot path: a few attribute stores per collective, no clock, no lock, no
wake-up. One thread per process wakes every ``interval_s`` (1 s, or a quarter of the timeout
if that is shorter) and compares the board with what it saw before: an operation seen under
way for MPIDP_TIMEOUT_S (measured from the first sample that saw it, so never early) is a
stall. The thread then asks every other rank's watchdog thread for its board, over a private
duplicate of the group's communicator (a query and a reply of point-to-point messages that
the thread itself progresses, so they are answered while the main thread computes, sleeps or
waits inside MPI or the shared-memory protocol), waits at most ``grace_s`` for the answers,
prints one report on stderr and aborts the job with exit code 124, as coreutils' ``timeout``
does (mpidp.runtime.abort: Note [Forwarding before abort]).
A rank asked first postpones its own report, so one rank normally speaks.

Progress: MPICH moves a message only while the receiving process is inside MPI. Each
watchdog thread enters MPI at every wake (it tests for questions), so questions are answered
within one interval whatever the main thread does — computing, sleeping, spinning in the
shared-memory protocol (which is not MPI) or blocked in an MPI call (which, at
MPI_THREAD_MULTIPLE, does not keep another thread out). Those wakes also progress the
parameter server's one-sided operations a little, harmlessly.

What the report can know: every rank that answers says what it is in (collective number and
header, or a parameter-server wait) or that it is in none since collective #k (its own code:
computing, loading data, stalled), and for how long. A rank that does not answer within
``grace_s`` has exited, is stopped, or holds Python's GIL in a long C call; across nodes a
lost node or network looks the same, and the report cannot tell these apart. Without
MPI_THREAD_MULTIPLE the thread cannot ask, and the report holds this rank's view only. A
dead process is usually reported sooner by the launcher (Hydra ends the job at once).

A rank that has shut down: its shutdown (mpidp.shutdown, at exit too) begins by telling
every other rank's watchdog, before anything of it can wait (Resources.depart): a notice on
the same private communicator carrying the number of the last collective it completed. A
rank waiting in a collective with a higher number — one that rank will never reach — that
is not itself part of a shutdown, for a whole interval after its watchdog heard, cannot
complete: the watchdog ends the job at once with a report naming that rank and the
collective (exit code 1, as for an exception on one rank), where it would otherwise wait
the whole timeout. On one node the shared-memory wait sees the same thing first and raises
on every waiting rank (Note [A rank that has shut down] in csrc/shm.c), so this is the path
of waits inside MPI (across nodes), which nothing but an abort ends.

Why 180 s by default: the watchdog must outwait every legitimate wait inside an operation,
and those are the waits for one rank doing work the others do not — rank 0 writing a
checkpoint (the model and optimizer state of a billion float32 parameters is 12 GB: about
a minute on shared storage at 200 MB/s) or evaluating alone in a user's script, a slow first
import or data download on one rank. Three minutes covers them with margin and still reports
a hang in a third of the time PyTorch's NCCL watchdog takes (10 minutes; gloo waits 30).
Longer legitimate waits: raise MPIDP_TIMEOUT_S."""
from __future__ import annotations

import contextlib
import json
import os
import secrets
import socket
import sys
import threading
import time
from typing import Optional

import numpy as np

from ..engine import header
from . import recovery
from .abort import abort_job
from .mpi import AnySourceReceive
from .stall_report import COLLECTIVE, ONE_SIDED, departed_report, report  # noqa: F401
from ..engine.library import mpi

EXIT_CODE = 124                        # the job was ended for waiting too long
EXIT_DEPARTED = 1                      # ... for waiting on a rank that has shut down
QUERY_TAG, REPLY_TAG, DEPART_TAG = 0x7764, 0x7765, 0x7766  # "wd", on its own communicator
# how long a rank's shutdown waits to hear the other ranks' departure notices: ranks that end
# together hear them within 2 ms (measured across two emulated nodes); one left unreceived,
# MPICH over UCX warns at finalize ("unexpected tag-receive descriptor ... was not matched")
NOTICES_WAIT_S = 0.25
REPLY_BYTES = 1024  # a JSON state: two descriptions of at most 300 characters and a few numbers


class Board:
    """What this process is waiting in (Note [Watchdog]), written by the thread that waits
    and read by the watchdog thread. Collectives on the group: ``seq`` counts them, ``done``
    is the last one returned, ``what`` the current one's header (or name) and ``context``
    what it serves (a format string and its arguments, formatted only for a report).
    One-sided waits: ``pseq``, ``pdone``, ``pwhat``. An operation is under way while
    ``seq != done`` (``pseq != pdone``). ``failed`` counts the collectives that raised here
    (on every rank alike, as every rank raises where one does: Note [Agreement before refusal]
    in mpidp/comm/agreement.py), for what above must forget after one (Note [A group's
    layout] in mpidp/comm/fusion.py)."""

    __slots__ = ("debug", "seq", "done", "what", "context", "pseq", "pdone", "pwhat", "site",
                 "failed")

    def __init__(self, debug: bool = False):
        self.debug = debug
        self.seq = self.done = self.pseq = self.pdone = self.failed = 0
        self.what = self.context = self.pwhat = None
        self.site = None  # a stamp to carry instead of the call site (Resources.stamped):
                          # a name's hash, or another rank's (Note [Joined ranks] in
                          # engine/header.py)

    def publish(self, hdr: tuple) -> tuple:
        """Starts collective number ``seq + 1`` with header ``hdr`` and returns the header
        to exchange (carrying its call site in debug mode: Note [Debug fingerprints] in
        mpidp/engine/header.py). The caller sets ``done = seq`` when the collective returns."""
        self.seq += 1
        if self.site is not None:
            hdr = header.with_site_hash(hdr, self.site)
        elif self.debug:
            hdr = header.with_site(hdr, header.call_site())
        self.what = hdr
        return hdr

    def carry_site(self, fn):
        """``fn``, to run on another thread (the backend's: Note [One communication thread
        per group] in mpidp/comm/scheduler.py), its collectives carrying the call site of this
        thread's caller, taken now (Note [Debug fingerprints] in mpidp/engine/header.py);
        ``fn`` itself outside debug mode."""
        if not self.debug:
            return fn
        site = header.site_hash(header.call_site())

        def run():
            before, self.site = self.site, site
            try:
                return fn()
            finally:
                self.site = before
        return run

    @contextlib.contextmanager
    def waiting(self, what: tuple):
        """A one-sided wait (not nested) under the watchdog; ``what`` names it: a format
        string and its arguments."""
        self.pseq += 1
        self.pwhat = what
        try:
            yield self
        finally:
            self.pdone = self.pseq

    def progress(self) -> None:
        """The current one-sided wait made progress (a server applied a push): its clock
        starts again."""
        self.pseq += 1


_IDLE_BOARD = Board()  # for code that runs without mpidp.init (nobody watches it)


def board_of(g) -> Board:
    """The board of group ``g`` (None: the board nobody watches)."""
    return _IDLE_BOARD if g is None else g.board


def describe(what, context=None) -> str:
    """A board entry in words: a handshake header, or a format string and its arguments
    (formatted only here, for a report), and what it serves."""
    if isinstance(what, tuple) and what and isinstance(what[0], str):
        text = what[0].format(*what[1:])
    else:
        text = header.describe(what) if isinstance(what, tuple) else str(what)
    if context:
        text += f" ({describe(context)})"
    return text[:300]


class Sampler:
    """What each lane of ``board`` has shown since when, as far as samples tell (a state
    first seen at a sample began at most one interval before it)."""

    def __init__(self, board: Board, timeout_s: float, now: float):
        self.board, self.timeout_s = board, timeout_s
        self.seen = [((0, 0), now), ((0, 0), now)]  # per lane: ((seq, done), since)

    def sample(self, now: float) -> Optional[int]:
        """Records the board at ``now``; returns the first lane whose operation has been
        under way for ``timeout_s`` or more, else None."""
        b = self.board
        stalled = None
        for lane, key in enumerate(((b.seq, b.done), (b.pseq, b.pdone))):
            if self.seen[lane][0] != key:
                self.seen[lane] = (key, now)
            elif key[0] != key[1] and now - self.seen[lane][1] >= self.timeout_s:
                stalled = lane if stalled is None else stalled
        return stalled


class Watchdog:
    """The watching thread of one process (Note [Watchdog]). Collective over the group to
    construct (it duplicates the communicator) and to ``stop``."""

    def __init__(self, g, timeout_s: float):
        MPI = mpi()
        self._MPI = MPI
        self.g, self.board, self.timeout_s = g, g.board, timeout_s
        # under in-job recovery the watchdog's receive from any rank is how a lost rank is
        # heard of soon (Note [In-job recovery] in mpidp/runtime/recovery.py)
        self.interval_s = min(0.05 if getattr(g, "recovery", "off") != "off" else 1.0,
                              timeout_s / 4)
        self.grace_s = 2 * self.interval_s + 1.0
        # a group's own timeout (Resources.set_wait_timeout): its waits end by themselves
        # within it, raising where the user can catch it, so a rank that shut down is left to
        # them for that long ("A rank that has shut down", Note [Watchdog])
        self.waits_bounded_s: Optional[float] = None
        self.can_ask = MPI.Query_thread() >= MPI.THREAD_MULTIPLE
        self.comm = g.comm.Dup() if self.can_ask else None
        self.host, self.pid = socket.gethostname(), os.getpid()
        self.sampler = Sampler(self.board, timeout_s, time.monotonic())
        self._defer_until = 0.0
        self._sends: list = []
        self._query_buf = np.zeros(2, np.int64)  # (asking rank, its round of questions)
        self._round = 0
        self._query = self._post_query()
        # ranks that have shut down -> the last collective each completed ("A rank that has
        # shut down", Note [Watchdog]); the notice being received, and this rank's own
        self.departed: dict = {}
        # (rank that shut down, its last collective, this watchdog's token: a notice left
        # unreceived for a freed communicator may reach a later one that MPI gives its id)
        self._notice_buf = np.zeros(3, np.int64)
        self._token = np.array([secrets.randbits(62)], np.int64)
        if self.comm is not None:
            self.comm.Bcast(self._token, root=0)
        self._notice = self._post(self._notice_buf, DEPART_TAG)
        self._notices: list = []
        self._own_notice = None
        self._stop = threading.Event()
        self.thread = threading.Thread(target=self._run, name="mpidp-watchdog", daemon=True)
        self.thread.start()

    def depart(self) -> None:
        """Tells every other rank's watchdog that this rank has shut down after its last
        completed collective ("A rank that has shut down", Note [Watchdog]). Once; no
        waiting (``stop`` completes the sends)."""
        if self.comm is None or self._own_notice is not None:
            return
        me = self.g.rank
        self._own_notice = np.array([me, self.board.done, self._token[0]], np.int64)
        self._notices = [self.comm.Isend(self._own_notice, r, DEPART_TAG)
                         for r in range(self.g.size) if r != me]

    def stop(self) -> None:
        """Ends the thread and frees its communicator (before MPI finalises), once this
        rank's departure notices have left (at most ``grace_s``: they are small enough to
        leave at once) and the others' have come (at most NOTICES_WAIT_S)."""
        self._stop.set()
        self.thread.join()
        if self.comm is not None:
            now = time.monotonic()
            deadline, heard_by = now + self.grace_s, now + NOTICES_WAIT_S
            while self._notices and not self._MPI.Request.Testall(self._notices) and \
                    time.monotonic() < deadline:
                time.sleep(0.001)
            self._hear_departures()
            while len(self.departed) < self.g.size - 1 and time.monotonic() < heard_by:
                time.sleep(0.001)
                self._hear_departures()
            for request in (self._query, self._notice):
                request.Cancel()
                request.Wait()
            self.comm.Free()
            self.comm = None

    def abandon(self) -> None:
        """Ends the thread of a group that lost a rank, its communicator revoked (Note
        [In-job recovery] in mpidp/runtime/recovery.py): no notice, nothing cancelled or
        freed. This rank only."""
        self._stop.set()
        self.thread.join()

    # ---- the thread -----------------------------------------------------------------------

    def _run(self) -> None:
        try:
            while not self._stop.wait(self.interval_s) and not self._MPI.Is_finalized():
                now = time.monotonic()
                self._answer(now)
                self._hear_departures()
                lane = self.sampler.sample(now)
                if lane is not None and now >= self._defer_until:
                    self._fire(lane, now)
                elif self.departed:
                    self._check_departed(now)
        except Exception as exc:  # a broken watchdog must not take the job down
            if getattr(self.g, "recovery", "off") != "off" and recovery.is_process_failure(exc):
                # a lost rank that no wait of this rank's may ever ask for (two live ranks
                # each in another collective): revoked, every wait hears of it (Note [In-job
                # recovery] in mpidp/runtime/recovery.py)
                recovery.revoke([*self.g.comms(), *self.g.resources.comms()])
                return
            sys.stderr.write(f"mpidp: rank {self.g.rank}: the watchdog stopped: "
                             f"{type(exc).__name__}: {exc}\n")

    def state(self, now: float) -> dict:
        """This rank's board as the report shows it."""
        self.sampler.sample(now)
        b = self.board
        ((seq, done), since), ((pseq, pdone), psince) = self.sampler.seen
        return {"rank": self.g.rank, "host": self.host, "pid": self.pid, "seq": seq,
                "in": seq != done, "for_s": now - since,
                "what": describe(b.what, b.context) if seq != done else None,
                "pin": pseq != pdone, "pfor_s": now - psince,
                "pwhat": describe(b.pwhat) if pseq != pdone else None}

    def _post_query(self):
        return self._post(self._query_buf, QUERY_TAG)

    def _post(self, buf: np.ndarray, tag: int):
        if self.comm is None:
            return None
        # Note [A receive from any source] in mpidp/runtime/mpi.py
        return AnySourceReceive(self.comm, buf, tag)

    def _hear_departures(self) -> None:
        """Records every departure notice that has arrived."""
        while self._notice is not None and self._notice.Test():
            rank, last, token = (int(w) for w in self._notice_buf)
            if token == self._token[0]:
                self.departed[rank] = last
            self._notice = self._post(self._notice_buf, DEPART_TAG)

    def _check_departed(self, now: float) -> None:
        """Ends the job where this rank has waited a whole interval in a collective that a
        rank which has shut down will never reach ("A rank that has shut down", Note
        [Watchdog]); a collective of a shutdown waits for the others' shutdowns instead, and
        in a group with a timeout of its own the wait raises first (Note [A group's timeout]
        in mpidp/backend/group.py)."""
        (seq, done), since = self.sampler.seen[COLLECTIVE]
        b = self.board
        bounded = self.waits_bounded_s
        if seq == done or now - since < self.interval_s or \
                (bounded is not None and now - since < bounded + self.grace_s):
            return
        gone = {r: last for r, last in self.departed.items() if last < seq}
        what = describe(b.what, b.context)
        if gone and not what.startswith("shutdown") and (seq, b.done) == (b.seq, done):
            abort_job(departed_report(self.g.rank, self.g.size, self.host, seq, what, gone),
                      EXIT_DEPARTED)

    def _answer(self, now: float) -> list:
        """Replies to every rank that asked for this board; returns who asked."""
        if self.comm is None:
            return []
        asked = []
        status = self._MPI.Status()
        while self._query.Test(status):
            src = status.Get_source()
            asked.append(src)
            # the asking rank is reporting: let it speak first
            self._defer_until = max(self._defer_until, now + 2 * self.grace_s + 1.0)
            answer = dict(self.state(now), round=int(self._query_buf[1]))
            data = json.dumps(answer).encode()
            if len(data) > REPLY_BYTES:  # never cut the JSON: shorten the descriptions
                answer.update({k: answer[k] and answer[k][:60] for k in ("what", "pwhat")})
                data = json.dumps(answer).encode()[:REPLY_BYTES]
            reply = np.zeros(REPLY_BYTES, np.uint8)
            reply[:len(data)] = np.frombuffer(data, np.uint8)
            self._sends.append((self.comm.Isend(reply, src, REPLY_TAG), reply))
            self._query = self._post_query()
        self._sends = [(r, buf) for r, buf in self._sends if not r.Test()]
        return asked

    def _ask_everyone(self, states: dict) -> bool:
        """Fills ``states`` with every rank's answer (None: none within grace_s); returns
        whether a lower rank is reporting too (it then speaks first)."""
        me, comm = self.g.rank, self.comm
        self._round += 1
        others = [r for r in range(self.g.size) if r != me]
        question = np.array([me, self._round], np.int64)
        buffers = {r: np.zeros(REPLY_BYTES, np.uint8) for r in others}
        pending = {r: comm.Irecv(buffers[r], r, REPLY_TAG) for r in others}
        self._sends += [(comm.Isend(question, r, QUERY_TAG), question) for r in others]
        lower_reports = False
        deadline = time.monotonic() + self.grace_s
        while pending and time.monotonic() < deadline:
            for r in [r for r, req in pending.items() if req.Test()]:
                text = bytes(buffers[r]).rstrip(b"\0").decode(errors="replace")
                buffers[r][...] = 0
                try:
                    answer = json.loads(text)
                except ValueError:
                    answer = None
                if answer is not None and answer.get("round") != self._round:
                    pending[r] = comm.Irecv(buffers[r], r, REPLY_TAG)  # a late earlier one
                    continue
                states[r] = answer
                del pending[r]
            lower_reports |= any(r < me for r in self._answer(time.monotonic()))
            time.sleep(0.005)
        for r, req in pending.items():
            req.Cancel()
            req.Wait()
            states[r] = None
        return lower_reports

    def _fire(self, lane: int, now: float) -> None:
        mine = self.state(now)
        states = {self.g.rank: mine}
        lower_reports = self._ask_everyone(states) if self.comm is not None else False
        if self.sampler.sample(time.monotonic()) != lane:
            return  # the operation completed while the others were asked: no stall after all
        text = report(self.g.rank, lane, states, self.g.size, self.timeout_s, self.grace_s,
                      self.can_ask, self.g.node_of, self.g.hosts)
        if lower_reports:  # its abort normally ends this process before the sleep does
            time.sleep(self.grace_s + 2.0)
        abort_job(text, EXIT_CODE)
