"""Recursive doubling with the collective's check in the same messages: what crosses the
network for the header exchange of every collective across nodes, and for small all-reduces
their data too (Note [Checked in the message]). Written, like mpidp.engine.ring, over two seams:

* a transport: ``rank``, ``size``, ``swap(msg, peer) -> msg`` (send one byte string to
  ``peer`` and receive one of any length from it), ``put(msg, peer)`` and ``take(peer)``;
* an array namespace: ``reduce_into(dst, src, dtype, op, divisor)`` on flat buffers.

Planning is pure (``schedule``); ``run`` walks it. It knows neither MPI nor CUDA.

Note [Checked in the message]
A collective across nodes must check that every rank called it with agreeing inputs (mpidp.
handshake) before data moves; done as its own exchange, the check costs a network latency
of its own, and for a small all-reduce that doubled its time (issue 15: 22 us against MPI's
5.9 us between two emulated nodes). Here each message carries the sender's record: a status
word, its header (which collective, algorithm, op, dtype, count, shape, local error), every
rank's free word it has gathered so far (allgather's row counts, reduce's roots), and
optionally its partial result. In round k rank r swaps records with r XOR 2^k and merges:
the headers must be equal (words 0-6), else the status becomes DISAGREE; free words are
merged slot by slot (each rank writes only its own); partial results are reduced, the lower
rank's first, so every rank computes the same expression and ends bitwise equal. After
log2(p) rounds every rank has seen, transitively, every header: all statuses agree, so all
ranks take the same branch — the result, or (on DISAGREE) the detailed exchange that names
each rank's input and raises on every rank. A rank that refuses its input sends its error
header and no data; lengths are read from the message (MPI_Mprobe), so a short record never
truncates. Where p is not a power of two, the ranks from 2^m up first fold their record into
rank r - 2^m and receive the outcome from it at the end: two more latencies, as MPICH pays.
Two nodes, one rank each: one swap, one network latency, check included."""
from __future__ import annotations

from typing import Optional, Sequence, Tuple

import numpy as np

OK, DISAGREE = 0, 1
HEADER_WORDS = 8
COMPARED = 7  # header words 0-6 must agree; word 7 is the free word


class Schedule(tuple):
    """(fold_out, fold_in, rounds): ``fold_out`` the rank this one folds into and hears the
    outcome from (None unless rank >= 2^m), ``fold_in`` the rank folding into this one
    (None if none), ``rounds`` the partner of each doubling round."""

    @property
    def fold_out(self) -> Optional[int]:
        return self[0]

    @property
    def fold_in(self) -> Optional[int]:
        return self[1]

    @property
    def rounds(self) -> Tuple[int, ...]:
        return self[2]


def schedule(rank: int, size: int) -> Schedule:
    """Recursive doubling for ``rank`` of ``size``. Pure."""
    if not 0 <= rank < size:
        raise ValueError(f"rank {rank} is not in 0..{size - 1}")
    m = 1 << (size.bit_length() - 1)  # the largest power of two <= size
    if rank >= m:
        return Schedule((rank - m, None, ()))
    partners = tuple(rank ^ (1 << k) for k in range(m.bit_length() - 1))
    return Schedule((None, rank + m if rank + m < size else None, partners))


class Record:
    """One rank's view during the exchange, kept as the message it sends: a status word, its
    header, the free words of every rank (0 where not yet heard), then the partial result
    (none: a header-only exchange). ``out``, the caller's array, receives the result."""

    __slots__ = ("msg", "words", "data", "out")

    def __init__(self, header: Sequence[int], rank: int, size: int,
                 data: Optional[np.ndarray]):
        n_words = 1 + HEADER_WORDS + size
        self.msg = np.empty(8 * n_words + (0 if data is None else data.nbytes), np.uint8)
        self.words = self.msg[:8 * n_words].view(np.int64)
        self.words[0] = OK
        self.words[1:1 + HEADER_WORDS] = header
        self.words[1 + HEADER_WORDS:] = 0
        self.words[1 + HEADER_WORDS + rank] = header[COMPARED]
        self.out = data
        self.data = None
        if data is not None:
            self.data = self.msg[8 * n_words:].view(data.dtype)
            self.data[...] = data.reshape(-1)

    @property
    def status(self) -> int:
        return int(self.words[0])

    @status.setter
    def status(self, value: int) -> None:
        self.words[0] = value

    @property
    def free(self) -> np.ndarray:
        return self.words[1 + HEADER_WORDS:]

    @free.setter
    def free(self, value) -> None:
        self.words[1 + HEADER_WORDS:] = value

    def pack(self) -> np.ndarray:
        return self.msg if self.words[0] == OK else self.msg[:self.words.nbytes]

    def merge(self, msg: np.ndarray, mine_first: bool, ops, dtype: int, op: int) -> None:
        """Merges a peer's record into this one (``mine_first``: this rank is the lower, its
        partial result comes first in the reduction)."""
        n = self.words.nbytes
        if len(msg) < n:
            raise ValueError(f"a record of {len(msg)} bytes, {n} at least expected")
        theirs = msg[:n].view(np.int64)
        free = self.words[1 + HEADER_WORDS:]
        np.bitwise_or(free, theirs[1 + HEADER_WORDS:], out=free)  # a slot: its owner's only
        same = theirs[0] == OK and msg[8:8 * (1 + COMPARED)].tobytes() == \
            self.msg[8:8 * (1 + COMPARED)].tobytes()
        if self.words[0] != OK or not same or len(msg) != len(self.msg):
            self.words[0] = DISAGREE
            return
        if self.data is not None and len(self.data):
            peer = msg[n:].view(self.data.dtype)
            if mine_first:
                ops.reduce_into(self.data, peer, dtype, op, 1)
            else:  # theirs first: into their copy, then back
                ops.reduce_into(peer, self.data, dtype, op, 1)
                self.data[...] = peer

    def deliver(self) -> "Record":
        """The result into the caller's array, where the exchange agreed."""
        if self.out is not None and self.words[0] == OK and len(self.data):
            self.out.reshape(-1)[...] = self.data
        return self


def run(transport, record: Record, ops=None, dtype: int = 0, op: int = 0) -> Record:
    """The exchange for ``record`` over every rank of ``transport``; returns it merged: the
    same status everywhere, every free word, and (if it carried data, status OK) the reduced
    result, equal on every rank, delivered into the caller's array. Every rank must call
    it."""
    r = transport.rank
    plan = schedule(r, transport.size)
    if plan.fold_out is not None:
        transport.put(record.pack(), plan.fold_out)
        return _adopt(record, transport.take(plan.fold_out)).deliver()
    if plan.fold_in is not None:
        record.merge(transport.take(plan.fold_in), True, ops, dtype, op)
    for peer in plan.rounds:
        record.merge(transport.swap(record.pack(), peer), r < peer, ops, dtype, op)
    if plan.fold_in is not None:
        transport.put(record.pack(), plan.fold_in)
    return record.deliver()


def _adopt(record: Record, msg: np.ndarray) -> Record:
    """The folded-out rank takes the outcome as its partner sent it."""
    n = record.words.nbytes
    record.words[...] = msg[:n].view(np.int64)
    if record.words[0] == OK and record.data is not None:
        record.data[...] = msg[n:].view(record.data.dtype)
    return record
