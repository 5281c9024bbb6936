"""The parameter server's shards in a node's shared memory: when every rank of the job is on
one node, workers pull and push with loads and stores, and no MPI call waits on a server.

Note [Node-local shards]
Over MPI windows (Note [Publishing a shard] in ps.py) a pull or a push on one node waits for
the server to be inside MPI: MPICH progresses passive-target operations only then, so every
pull and push waited for the server's optimizer step, and on an oversubscribed node for the
server to be scheduled at all. Here each server's shard, its push slots and its control words
lie in one segment of an ``MPI_Win_allocate_shared`` window that every rank maps, and each
word has one writer, except the batch counter, which every worker adds to atomically
(``atomic_add`` in csrc/atomics.c). The orders that matter are made by the extension's
atomics: a store-release after the data it announces, a load-acquire before the data it
guards.
- A pull never waits for the server's optimizer step on anyone else's push. The shard has
  two buffers. To publish version v + 1 the server stores BEGUN = v + 1, writes buffer
  (v + 1) % 2, then stores VERSION = v + 1. A reader loads VERSION = v, copies buffer v % 2,
  then loads BEGUN: if BEGUN <= v + 1 the server had not started on version v + 2 (the next
  writer of buffer v % 2) before the copy ended, so the copy is whole; otherwise it reads
  again (a publish takes far longer than a copy, so a retry is rare).
- A pull does wait until the worker's own pushes of the epoch are applied (APPLIED[w] >= its
  steps): it reads its own writes. Without it a worker computes its next gradient at
  parameters that lack its own last one, whatever the other workers do, and on 2 cores,
  where the server is often off the CPU, two such gradients were summed into one momentum
  step: the digits job (2 workers, batches of 16, SGD with momentum 0.9) ended its 5th epoch
  at 10-77% held-out accuracy in 9 runs, against 94-98% with this wait. A pull through the
  windows waits for the same (Worker._pull): it used to get it by queueing behind the
  server, until the batch claims in chunks (Note [Claims in chunks] in ps.py) removed that
  queue, and the digits fell to 31% after 3 epochs.
- So a worker has at most one push outstanding (SLOTS = 1). Worker w owns its slot and the
  count FILLED[w]; the server owns CONSUMED[w]. A push waits until FILLED - CONSUMED <
  SLOTS, writes slot FILLED % SLOTS, then stores FILLED + 1. The server adds every filled
  slot into its sum, then stores CONSUMED: each push is added exactly once, and a slot is
  rewritten only after the server has read it.
- The server applies what it drained with no lock held, then publishes, and only then
  stores APPLIED[w] += what it drained from w: a worker that sees an applied count (its own
  wait, SSP's) sees a version holding those pushes.
- An epoch ends when every worker has stored DONE[w] (its final step count + 1, after its
  last push) and every slot is consumed. Between epochs, under the barriers of the loop, the
  server resets the batch counter, DONE and APPLIED; FILLED, CONSUMED and VERSION only grow.
Every wait is a loop of short sleeps under the watchdog's board, as the window path's waits
are: a dead or stalled peer leaves the others waiting at most MPIDP_TIMEOUT_S.
"""
from __future__ import annotations

import time
from typing import Optional, Sequence

import numpy as np

from ..runtime.windows import SharedWindow, layout

SLOTS = 1  # push slots per worker (Note [Node-local shards])
VERSION, BEGUN, NEXT_BATCH = 0, 1, 2
HEADER = 8   # control words before the workers' (one cache line)
PER_WORKER = 8  # a cache line per worker: FILLED, CONSUMED, APPLIED, DONE, then padding
FILLED, CONSUMED, APPLIED, DONE = 0, 1, 2, 3
WAIT_SLEEP_S = 0.00005  # a waiting rank yields the core this long between looks


class SharedLayout:
    """One server's segment: control words, two parameter buffers, the workers' slots."""

    def __init__(self, count: int, workers: int):
        self.count, self.workers = count, workers
        self.control, self.params, self.slots, self.nbytes = layout(
            (HEADER + PER_WORKER * workers, np.int64), (2 * count, np.float32),
            (workers * SLOTS * count, np.float32))

    def word(self, w: int, which: int) -> int:
        return HEADER + PER_WORKER * w + which


class SharedShards:
    """The segments of the servers on this rank's node, mapped by every rank of ``node``
    (this node's ranks; ``node_ranks``: their job ranks in local-rank order). ``counts[k]``:
    server k's shard size; ``servers``: every server's job rank; ``workers``: how many the
    job has (ranks 0 to workers - 1), of which those on this node get a slot and words;
    ``atomics``: the C extension (atomic_add, atomic_load, atomic_store). ``near(k)``: server
    k is on this node. Collective over ``node``."""

    def __init__(self, node, node_ranks: Sequence[int], counts: Sequence[int], workers: int,
                 servers: Sequence[int], rank: int, atomics):
        self.x = atomics
        self.total_workers = workers
        self.local = tuple(w for w in node_ranks if w < workers)  # this node's workers
        self.index_of = {w: i for i, w in enumerate(self.local)}
        workers = len(self.local)
        self.layouts = [SharedLayout(c, workers) for c in counts]
        self.servers = tuple(servers)
        mine = self.servers.index(rank) if rank in self.servers else None
        self.window = SharedWindow(node, self.layouts[mine].nbytes if mine is not None else 0)
        self.control, self.buffers, self.slots = {}, {}, {}
        for k, (s, lay) in enumerate(zip(self.servers, self.layouts)):
            if s not in node_ranks:
                continue
            memory = self.window.memory_of(list(node_ranks).index(s))
            self.control[k] = _view(memory, lay.control)
            self.buffers[k] = _view(memory, lay.params).reshape(2, lay.count)
            self.slots[k] = _view(memory, lay.slots).reshape(workers, SLOTS, lay.count)
        self.filled = [0] * len(self.servers)  # a worker's own FILLED, per server
        # a server's own CONSUMED, per job worker: kept here, beside FILLED, so that a Server
        # built again on the same shards (each epoch, say) starts where the last one ended
        self.consumed = [0] * self.total_workers

    def near(self, k: int) -> bool:
        return k in self.control

    # ---- every rank ---------------------------------------------------------------------

    def load(self, k: int, index: int) -> int:
        return self.x.atomic_load(self.control[k], index)

    def version(self, k: int) -> int:
        """Server k's published version now."""
        return self.load(k, VERSION)

    def read(self, k: int, out: np.ndarray) -> int:
        """Server k's newest whole published shard into ``out``; returns its version."""
        control, x = self.control[k], self.x
        while True:
            v = x.atomic_load(control, VERSION)
            out[...] = self.buffers[k][v % 2]
            if x.atomic_load(control, BEGUN) <= v + 1:
                return v

    def applied(self, k: int) -> np.ndarray:
        lay = self.layouts[k]
        return np.array([self.load(k, lay.word(i, APPLIED)) for i in range(lay.workers)],
                        np.int64)

    def done(self) -> np.ndarray:
        """Each worker's DONE word (on the first server): its final steps + 1, or 0."""
        lay = self.layouts[0]
        return np.array([self.load(0, lay.word(i, DONE)) for i in range(lay.workers)],
                        np.int64)

    # ---- workers ------------------------------------------------------------------------

    def wait_applied(self, w: int, pushes: int) -> None:
        """Until every server on this node has applied worker w's first ``pushes`` pushes
        of the epoch."""
        for k in self.control:
            lay = self.layouts[k]
            while self.load(k, lay.word(self.index_of[w], APPLIED)) < pushes:
                time.sleep(WAIT_SLEEP_S)

    def next_batch(self) -> int:
        return self.x.atomic_add(self.control[0], NEXT_BATCH, 1)

    def push(self, k: int, w: int, part: np.ndarray) -> int:
        """Waits for a free slot on server k, writes ``part`` into it and announces it;
        returns server k's version as the push landed."""
        lay, control, x, i = self.layouts[k], self.control[k], self.x, self.index_of[w]
        f = self.filled[k]
        while f - x.atomic_load(control, lay.word(i, CONSUMED)) >= SLOTS:
            time.sleep(WAIT_SLEEP_S)
        self.slots[k][i, f % SLOTS] = part
        self.announce(k, w)
        return x.atomic_load(control, VERSION)

    def announce(self, k: int, w: int) -> None:
        """Worker w's slot on server k is written: the server may take it."""
        self.filled[k] += 1
        self.x.atomic_store(self.control[k], self.layouts[k].word(self.index_of[w], FILLED),
                            self.filled[k])

    def finish(self, w: int, steps: int) -> None:
        """After worker w's last push of the epoch: its final count, on every server."""
        for k, lay in enumerate(self.layouts):
            self.x.atomic_store(self.control[k], lay.word(self.index_of[w], DONE), steps + 1)

    # ---- a server -----------------------------------------------------------------------

    def publish_initial(self, k: int, shard: np.ndarray) -> None:
        self.buffers[k][0] = shard  # version 0, before the barrier that precedes any pull

    def drain(self, k: int, grads: np.ndarray) -> np.ndarray:
        """Adds every filled slot of server k into ``grads`` (zeroed first) and releases it.
        Returns the pushes taken per job worker."""
        lay, control, x, consumed = self.layouts[k], self.control[k], self.x, self.consumed
        taken = np.zeros(self.total_workers, np.int64)
        grads[...] = 0
        for i, w in enumerate(self.local):
            f = x.atomic_load(control, lay.word(i, FILLED))
            for j in range(consumed[w], f):
                grads += self.slots[k][i, j % SLOTS]
            if f > consumed[w]:
                taken[w] = f - consumed[w]
                consumed[w] = f
                x.atomic_store(control, lay.word(i, CONSUMED), f)
        return taken

    def finished(self, k: int) -> bool:
        """Every worker has said it finished the epoch and every push it made is drained."""
        lay = self.layouts[k]
        return all(self.load(k, lay.word(i, DONE)) > 0 and
                   self.load(k, lay.word(i, FILLED)) == self.consumed[w]
                   for i, w in enumerate(self.local))

    def publish(self, k: int, params: np.ndarray, taken: np.ndarray, applied: np.ndarray) -> None:
        """Version + 1 of server k's shard; then the applied counts (``applied`` += ``taken``,
        the server's own copy)."""
        lay, control, x = self.layouts[k], self.control[k], self.x
        v = int(control[VERSION])  # this server is VERSION's one writer
        x.atomic_store(control, BEGUN, v + 1)
        self.buffers[k][(v + 1) % 2] = params
        x.atomic_store(control, VERSION, v + 1)
        applied += taken
        for i, w in enumerate(self.local):
            if taken[w]:
                x.atomic_store(control, lay.word(i, APPLIED), int(applied[w]))

    def reset_epoch(self, k: int) -> None:
        """Between epochs, no worker active: the batch counter, DONE and APPLIED."""
        lay, control, x = self.layouts[k], self.control[k], self.x
        x.atomic_store(control, NEXT_BATCH, 0)
        for w in range(lay.workers):
            x.atomic_store(control, lay.word(w, DONE), 0)
            x.atomic_store(control, lay.word(w, APPLIED), 0)

    def free(self) -> None:
        """Collective over the node."""
        self.control, self.buffers, self.slots = {}, {}, {}
        self.window.free()


def _view(memory: np.ndarray, region) -> np.ndarray:
    return memory[region.offset:region.offset + region.nbytes].view(region.dtype)


def eligible(group, comm, extension, setting: str, emulated: int) -> Optional[str]:
    """Why the shards stay in MPI windows alone (None: shared memory serves each node's own
    pairs): MPIDP_PS_MEMORY, another communicator than the group's, nodes emulated by
    MPIDP_EMULATE_NODE_SIZE (their ranks may not share memory), or no C extension."""
    if setting == "window":
        return "MPIDP_PS_MEMORY=window"
    if group is None or group.comm != comm:
        return "not the job's group"
    if emulated:
        return "MPIDP_EMULATE_NODE_SIZE"
    if extension is None or not hasattr(extension, "atomic_add"):
        return "no C extension"
    return None
