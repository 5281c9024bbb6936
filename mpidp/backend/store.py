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
``get``, ``multi_get`` and ``wait`` for keys not yet set are answered when a ``set``, ``add``,
``compare_set``, ``append`` or ``multi_set`` makes them. Rank 0's thread polls with sleeps that
grow to SERVER_IDLE_S while nothing comes (MPICH's blocking MPI_Probe would spin a core for the
whole job); it ends at mpidp's shutdown (Note [Stopping the users first] in mpidp/runtime/resources.py).

Note [What torch calls on a store written in Python]
torch reaches a Python subclass of ``dist.Store`` through its C++ trampoline (PythonStore in
torch/csrc/distributed/c10d/init.cpp), and every call through the PrefixStore that
init_process_group puts in front of this one goes that way. The trampoline looks methods up by
name, and not always by the Python binding's name: ``deleteKey`` and ``getNumKeys`` (the C++
names) serve ``delete_key`` and ``num_keys``; ``set``, ``get``, ``add``, ``compare_set``,
``check``, ``wait`` (with and without a timeout), ``clone``, ``append``, ``multi_get``,
``multi_set`` and ``has_extended_api`` go by their Python names. The timeout is not forwarded:
``timeout`` and ``set_timeout`` are C++'s own (the PrefixStore forwards them to this store's C++
part), so the store keeps its timeout there, and every request reads it from there. torch's
``barrier`` without a timeout on a PrefixStore takes the PrefixStore's own (5 minutes), whatever
the store's is. Queues and ``list_keys`` are never forwarded to Python (torch raises its own
NotImplementedError through a PrefixStore); called on this store directly they raise one naming
mpidp. Checked at every world size by tests/mpi/bodies/body_dist.py."""
from __future__ import annotations

import itertools
import threading
import time
from datetime import timedelta
from typing import Optional

import numpy as np
import torch.distributed as dist

from ..runtime import mpi, recovery

(SET, GET, ADD, COMPARE_SET, CHECK, WAIT, DELETE, NUM_KEYS, APPEND, MULTI_GET, MULTI_SET,
 STOP) = range(12)
CHANGES = (SET, ADD, COMPARE_SET, APPEND, MULTI_SET)  # requests that may answer waiting ones
REQUEST = 1
ERROR = b"\0mpidp-store-error:"  # an answer starting so is an error for the client to raise
POLL_S = 0.0005       # a waiting client's poll interval
SERVER_IDLE_S = 0.01  # the longest sleep of an idle server between polls


class StoreTimeoutError(dist.DistStoreError, TimeoutError):
    """A request to the store got no answer within its timeout: torch's DistStoreError (what
    torch's own code catches, as from its TCPStore) and Python's TimeoutError."""


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
        self.comm = comm
        self.set_timeout(timeout)  # C++'s (Note [What torch calls on a store written in Python])
        self._tags = itertools.cycle(range(REQUEST + 1, mpi.tag_limit()))
        self._lock = threading.Lock()
        self._server = None
        if mpi.rank_size(comm)[0] == 0:
            self._server = threading.Thread(target=_serve, args=(comm,), daemon=True,
                                            name="mpidp-store")
            self._server.start()

    # ---- the client ----------------------------------------------------------------------

    def _ask(self, op: int, fields, timeout_s: Optional[float] = None) -> bytes:
        with self._lock:
            tag = next(self._tags)
        mpi.send_bytes(self.comm, _encode(op, tag, fields), 0, REQUEST)
        limit = self.timeout.total_seconds() if timeout_s is None else timeout_s
        deadline = time.monotonic() + limit
        while (waiting := mpi.iprobe(self.comm, 0, tag)) is None:
            if time.monotonic() > deadline:
                raise StoreTimeoutError(f"mpidp store: no answer to {_NAMES[op]} "
                                        f"{[bytes(f) for f in fields][:3]} within {limit:g} s")
            time.sleep(POLL_S)
        answer = bytearray(waiting[1])
        mpi.recv_bytes(self.comm, answer, 0, tag)
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

    # the names torch's C++ side calls (Note [What torch calls on a store written in Python])
    deleteKey = delete_key
    getNumKeys = num_keys

    def append(self, key, value) -> None:
        self._ask(APPEND, [_key(key), _value(value)])

    def multi_get(self, keys) -> list:
        """The values of ``keys``, waiting (up to the store's timeout) until all are set."""
        return _decode(np.frombuffer(self._ask(MULTI_GET, [_key(k) for k in keys]), np.uint8))[2]

    def multi_set(self, keys, values) -> None:
        keys, values = list(keys), list(values)
        if len(keys) != len(values):
            raise ValueError(f"mpidp store: multi_set of {len(keys)} keys and {len(values)} "
                             "values; give one value per key")
        self._ask(MULTI_SET, [f for k, v in zip(keys, values) for f in (_key(k), _value(v))])

    def has_extended_api(self) -> bool:
        return True  # append, multi_get and multi_set are served in one request each

    def clone(self) -> "MPIStore":
        """This store: a client is safe to share between threads (a reply tag per request,
        MPI_THREAD_MULTIPLE), so a clone needs nothing of its own."""
        return self

    def queue_push(self, key, value) -> None:
        raise _unsupported("queue_push")

    def queue_pop(self, key, block: bool = True) -> bytes:
        raise _unsupported("queue_pop")

    def queue_len(self, key) -> int:
        raise _unsupported("queue_len")

    def list_keys(self) -> list:
        raise _unsupported("list_keys")

    def close(self, timeout_s: float = 10.0) -> bool:
        """Ends rank 0's serving thread (this rank only); True once it has ended."""
        if self._server is None or not self._server.is_alive():
            return True
        try:
            mpi.send_bytes(self.comm, _encode(STOP, 0, []), 0, REQUEST)
        except Exception as exc:  # noqa: BLE001 - the job lost a process: the server ends
            if not recovery.is_process_failure(exc):
                raise
        self._server.join(timeout_s)
        return not self._server.is_alive()


_NAMES = ("set", "get", "add", "compare_set", "check", "wait", "delete_key", "num_keys",
          "append", "multi_get", "multi_set", "stop")


def _unsupported(name: str) -> NotImplementedError:
    return NotImplementedError(f"mpidp's store does not support {name} (torch forwards no "
                               "queues nor list_keys to a store written in Python)")


def _key(key) -> bytes:
    return key.encode() if isinstance(key, str) else bytes(key)


def _value(value) -> bytes:
    if isinstance(value, str):
        return value.encode()
    return bytes(value)


def _serve(comm) -> None:
    """Rank 0's loop: answers requests until STOP (Note [A store over MPI]), or until the
    job lost a process (under fault tolerance: the store goes with the job's group, and the
    next init_process_group makes a new one)."""
    try:
        _answer(comm)
    except Exception as exc:  # noqa: BLE001 - a lost process ends it, else raised
        if not recovery.is_process_failure(exc):
            raise


def _answer(comm) -> None:
    keys: dict = {}
    pending: list = []  # (source, reply tag, op, fields) waiting for keys
    sending: list = []  # (request, buffer): an answer whose client may have stopped waiting

    def answer_to(source: int, tag: int, answer: bytes) -> None:
        buffer = np.frombuffer(answer, np.uint8)
        sending.append((mpi.isend_bytes(comm, buffer, source, tag), buffer))

    while True:
        sending[:] = [s for s in sending if not mpi.test(s[0])]
        idle_s = POLL_S
        while (waiting := mpi.iprobe(comm, None, REQUEST)) is None:
            time.sleep(idle_s)  # not MPI_Probe: MPICH's blocking calls spin on a core
            idle_s = min(2 * idle_s, SERVER_IDLE_S)
        source, nbytes = waiting
        message = np.empty(nbytes, np.uint8)
        mpi.recv_bytes(comm, message, source, REQUEST)
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
        if op in CHANGES and pending:
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
    if op == APPEND:
        keys[fields[0]] = keys.get(fields[0], b"") + fields[1]
        return b""
    if op == MULTI_GET:
        if not all(k in keys for k in fields):
            return None
        return _encode(0, 0, [keys[k] for k in fields]).tobytes()
    if op == MULTI_SET:
        keys.update(zip(fields[0::2], fields[1::2]))
        return b""
    return str(len(keys)).encode()  # NUM_KEYS
