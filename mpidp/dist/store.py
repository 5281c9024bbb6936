"""A torch.distributed ``Store`` served over MPI: rank 0 of a communicator keeps the keys in a
thread of its own, every rank (rank 0 too) asks it in MPI messages. No socket is opened and
nothing is pickled: keys and values travel as bytes.

Note [A store over MPI]
torch.distributed wants a key-value store at init (its TCPStore listens on a port that every
rank must reach: MASTER_ADDR and MASTER_PORT). Under an MPI launcher the ranks already reach
each other, so this one is served on a duplicate of mpidp's communicator. A request is one
message to rank 0 with tag REQUEST: int64 words (operation, reply tag, number of fields, each
field's length) and the fields' bytes; the answer comes back on the reply tag the client chose,
so a client that gave up waiting (its timeout) never takes a later answer for another request.
``get`` and ``wait`` for keys not yet set are answered when a ``set``, ``add`` or
``compare_set`` makes them. Rank 0's thread polls with sleeps that grow to SERVER_IDLE_S while
nothing comes (MPICH's blocking MPI_Probe would spin a core for the whole job); it ends at
mpidp's shutdown (Note [Stopping the users first] in mpidp/runtime/resources.py)."""
from __future__ import annotations

import itertools
import threading
import time
from datetime import timedelta
from typing import Optional

import numpy as np
import torch.distributed as dist

SET, GET, ADD, COMPARE_SET, CHECK, WAIT, DELETE, NUM_KEYS, STOP = range(9)
REQUEST = 1
ERROR = b"\0mpidp-store-error:"  # an answer starting so is an error for the client to raise
POLL_S = 0.0005       # a waiting client's poll interval
SERVER_IDLE_S = 0.01  # the longest sleep of an idle server between polls


def _encode(op: int, reply_tag: int, fields) -> np.ndarray:
    fields = [f if isinstance(f, bytes) else str(f).encode() for f in fields]
    words = np.array([op, reply_tag, len(fields)] + [len(f) for f in fields], np.int64)
    return np.frombuffer(words.tobytes() + b"".join(fields), np.uint8)


def _decode(message: np.ndarray) -> tuple:
    op, tag, n = (int(w) for w in message[:24].view(np.int64))
    lengths = message[24:24 + 8 * n].view(np.int64)
    fields, at = [], 24 + 8 * n
    for length in lengths:
        fields.append(message[at:at + int(length)].tobytes())
        at += int(length)
    return op, tag, fields


class MPIStore(dist.Store):
    """torch.distributed's Store on communicator ``comm`` (mpidp's duplicate; collective:
    every rank of it constructs one together). Rank 0 serves it."""

    def __init__(self, comm, timeout: timedelta = timedelta(minutes=5)):
        super().__init__()
        from mpi4py import MPI  # deferred for cost, as everywhere in mpidp
        self.comm = comm
        self._timeout_s = timeout.total_seconds()
        self._tags = itertools.cycle(range(REQUEST + 1, MPI.COMM_WORLD.Get_attr(MPI.TAG_UB)))
        self._lock = threading.Lock()
        self._server = None
        if comm.Get_rank() == 0:
            self._server = threading.Thread(target=_serve, args=(comm,), daemon=True,
                                            name="mpidp-store")
            self._server.start()

    # ---- the client ----------------------------------------------------------------------

    def _ask(self, op: int, fields, timeout_s: Optional[float] = None) -> bytes:
        from mpi4py import MPI  # deferred for cost, as above
        with self._lock:
            tag = next(self._tags)
        self.comm.Send(_encode(op, tag, fields), dest=0, tag=REQUEST)
        limit = self._timeout_s if timeout_s is None else timeout_s
        deadline = time.monotonic() + limit
        status = MPI.Status()
        while not self.comm.Iprobe(source=0, tag=tag, status=status):
            if time.monotonic() > deadline:
                raise TimeoutError(f"mpidp store: no answer to {_NAMES[op]} "
                                   f"{[bytes(f) for f in fields][:3]} within {limit:g} s")
            time.sleep(POLL_S)
        answer = bytearray(status.Get_count(MPI.BYTE))
        self.comm.Recv([answer, MPI.BYTE], source=0, tag=tag)
        if answer.startswith(ERROR):
            raise ValueError(f"mpidp store: {_NAMES[op]}: "
                             f"{answer[len(ERROR):].decode(errors='replace')}")
        return bytes(answer)

    def set(self, key, value) -> None:
        self._ask(SET, [_key(key), _value(value)])

    def get(self, key) -> bytes:
        return self._ask(GET, [_key(key)])

    def add(self, key, amount: int) -> int:
        return int(self._ask(ADD, [_key(key), int(amount)]))

    def compare_set(self, key, expected, desired) -> bytes:
        return self._ask(COMPARE_SET, [_key(key), _value(expected), _value(desired)])

    def check(self, keys) -> bool:
        return self._ask(CHECK, [_key(k) for k in keys]) == b"1"

    def wait(self, keys, timeout: Optional[timedelta] = None) -> None:
        self._ask(WAIT, [_key(k) for k in keys],
                  None if timeout is None else timeout.total_seconds())

    def delete_key(self, key) -> bool:
        return self._ask(DELETE, [_key(key)]) == b"1"

    def num_keys(self) -> int:
        return int(self._ask(NUM_KEYS, []))

    def set_timeout(self, timeout: timedelta) -> None:
        self._timeout_s = timeout.total_seconds()

    @property
    def timeout(self) -> timedelta:
        return timedelta(seconds=self._timeout_s)

    def close(self, timeout_s: float = 10.0) -> bool:
        """Ends rank 0's serving thread (this rank only); True once it has ended."""
        if self._server is None:
            return True
        self.comm.Send(_encode(STOP, 0, []), dest=0, tag=REQUEST)
        self._server.join(timeout_s)
        return not self._server.is_alive()


_NAMES = ("set", "get", "add", "compare_set", "check", "wait", "delete_key", "num_keys", "stop")


def _key(key) -> bytes:
    return key.encode() if isinstance(key, str) else bytes(key)


def _value(value) -> bytes:
    if isinstance(value, str):
        return value.encode()
    return bytes(value)


def _serve(comm) -> None:
    """Rank 0's loop: answers requests until STOP (Note [A store over MPI])."""
    from mpi4py import MPI  # deferred for cost, as above
    keys: dict = {}
    pending: list = []  # (source, reply tag, op, fields) waiting for keys
    sending: list = []  # (request, buffer): an answer whose client may have stopped waiting
    status = MPI.Status()

    def answer_to(source: int, tag: int, answer: bytes) -> None:
        buffer = np.frombuffer(answer, np.uint8)
        sending.append((comm.Isend([buffer, MPI.BYTE], dest=source, tag=tag), buffer))

    while True:
        sending[:] = [s for s in sending if not s[0].Test()]
        idle_s = POLL_S
        while not comm.Iprobe(source=MPI.ANY_SOURCE, tag=REQUEST, status=status):
            time.sleep(idle_s)  # not MPI_Probe: MPICH's blocking calls spin on a core
            idle_s = min(2 * idle_s, SERVER_IDLE_S)
        message = np.empty(status.Get_count(MPI.BYTE), np.uint8)
        source = status.Get_source()
        comm.Recv([message, MPI.BYTE], source=source, tag=REQUEST)
        op, tag, fields = _decode(message)
        if op == STOP:
            return
        try:
            answer = _apply(keys, op, fields)
        except ValueError as exc:  # a value ``add`` cannot count with: the client raises it
            answer = ERROR + str(exc).encode()
        if answer is None:
            pending.append((source, tag, op, fields))
        else:
            answer_to(source, tag, answer)
        if op in (SET, ADD, COMPARE_SET) and pending:
            still = []
            for source, tag, op, fields in pending:
                answer = _apply(keys, op, fields)
                if answer is None:
                    still.append((source, tag, op, fields))
                else:
                    answer_to(source, tag, answer)
            pending = still


def _apply(keys: dict, op: int, fields: list) -> Optional[bytes]:
    """The answer to request ``op`` on ``keys``, or None while it must wait for keys."""
    if op == SET:
        keys[fields[0]] = fields[1]
        return b""
    if op == GET:
        return keys.get(fields[0])
    if op == ADD:
        value = int(keys.get(fields[0], b"0")) + int(fields[1])
        keys[fields[0]] = str(value).encode()
        return keys[fields[0]]
    if op == COMPARE_SET:
        key, expected, desired = fields
        current = keys.get(key)
        if (current is None and expected == b"") or current == expected:
            keys[key] = desired
            return desired
        return expected if current is None else current
    if op == CHECK:
        return b"1" if all(k in keys for k in fields) else b"0"
    if op == WAIT:
        return b"" if all(k in keys for k in fields) else None
    if op == DELETE:
        return b"1" if keys.pop(fields[0], None) is not None else b"0"
    return str(len(keys)).encode()  # NUM_KEYS
