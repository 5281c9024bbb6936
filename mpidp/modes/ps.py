"""Asynchronous parameter server on dedicated MPI ranks: parameters sharded across servers by
bytes, held in MPI one-sided windows; workers pull with ``Get`` and push with
``Accumulate(SUM)`` while servers apply the optimizer and publish, with bounded staleness
(SSP: a worker is at most S steps ahead of the slowest). With the C extension the shards are
also in shared memory (Note [Node-local shards] in ps_shared.py): on one node only there
(memory "shared"), across nodes for each node's own worker-server pairs, the windows carrying
the rest and every count ("mixed"); MPIDP_PS_MEMORY=window, MPIDP_EMULATE_NODE_SIZE or no
extension keep them in windows alone. The windows' protocol follows.

Note [Publishing a shard]
A pull must never see a half-updated shard, and a push must be applied exactly once. Workers
pull inside a *shared* lock epoch on the server (parameters, version and applied counts read
together) and push inside one (gradient ``Accumulate`` and their pending count together). The
server drains pushes (copies and zeroes the accumulated gradient and the pending counts) and
publishes (writes the new parameters, adds the drained counts to the applied counts, bumps the
version) each inside an *exclusive* lock epoch on its own window, which MPI guarantees no
shared epoch overlaps: a pull sees the shard before or after a publish, and each push lands
wholly before or wholly after a drain. The optimizer step runs between the two epochs with no
lock held; a publish holds the lock only for one copy of the shard. (Double buffering with a
version would let pulls proceed during the copy too; the copy is short and the lock is simpler
to reason about.) MPICH progresses passive-target operations only while the target is inside
MPI, so a server's pushes and pulls wait while it runs its optimizer step; with a spare core
per server that is a short wait, on an oversubscribed node it is what limits throughput.
Control words that workers update with ``Fetch_and_op`` are read with ``Get_accumulate
(NO_OP)`` (an atomic read), never a plain ``Get`` racing an accumulate.

Every wait of a worker (next batch, pull with its staleness wait, push, end of epoch) and a
server's wait for pushes is posted on the watchdog's board (Note [Watchdog] in
mpidp/runtime/watchdog.py): a worker or server that stalls or dies leaves the others waiting at most
MPIDP_TIMEOUT_S, and a server's clock restarts at every push it applies.
"""
from __future__ import annotations

import time
from typing import Callable, Optional, Sequence

import numpy as np

from .. import config, runtime
from ..runtime import mpi, timeline
from ..engine import host_ops
from ..engine.blocks import partition
from ..comm import objects
from ..runtime.frame import collective
from ..runtime.watchdog import board_of
from ..runtime.windows import Window, layout
from .ps_shared import SharedShards, eligible

# Note [Claims in chunks]
# Through a window every batch number costs a worker a lock, a fetch-and-add and an unlock on
# the first server, which MPICH serves only while that server is inside MPI: across 2
# emulated nodes that was about a millisecond a batch even for a worker on the server's
# node. So a worker takes up to MAX_CLAIM at once, fewer as the epoch runs out (the batches
# it guesses are left, over CLAIM_SHARE times the number of workers, as OpenMP's guided
# schedule does), so that a slow worker holds few batches at the end. In shared memory a
# claim is one atomic add, and a worker takes one batch at a time.
MAX_CLAIM, CLAIM_SHARE = 8, 4

# control words of every server's window, then per-worker pending[W], applied[W], done[W]
VERSION, FINISHED, NEXT_BATCH, CONTROL_WORDS = 0, 1, 2, 3
IDLE_SLEEP_S = 0.0002  # a server with nothing to apply yields the core this long


def shard_map(counts: Sequence[int], servers: int) -> tuple:
    """Splits tensors of ``counts`` elements (one flat float32 vector, in order) into
    ``servers`` contiguous shards balanced by bytes. Returns, per server, a tuple of pieces
    (tensor index, offset in the tensor, count, offset in the shard); every element of every
    tensor is in exactly one piece. Pure."""
    if servers < 1:
        raise ValueError(f"servers must be >= 1, got {servers}")
    total = int(sum(counts))
    starts = np.cumsum([0] + [int(c) for c in counts])
    shards = []
    for lo, n in partition(total, servers):
        pieces, hi = [], lo + n
        for t, count in enumerate(counts):
            a, b = max(lo, int(starts[t])), min(hi, int(starts[t]) + int(count))
            if a < b:
                pieces.append((t, a - int(starts[t]), b - a, a - lo))
        shards.append(tuple(pieces))
    return tuple(shards)


class Layout:
    """Where things are in one server's window, for a shard of ``count`` floats and
    ``workers`` workers."""

    def __init__(self, count: int, workers: int):
        self.count, self.workers = count, workers
        self.control, self.params, self.grads, self.nbytes = layout(
            (CONTROL_WORDS + 3 * workers, np.int64), (count, np.float32), (count, np.float32))

    def pending(self, w: int) -> int:
        return CONTROL_WORDS + w

    def applied(self, w: int) -> int:
        return CONTROL_WORDS + self.workers + w

    def done(self, w: int) -> int:
        return CONTROL_WORDS + 2 * self.workers + w


class ParameterServer:
    """The servers and workers of one job over ``comm`` (every rank constructs it, a
    collective): the last ``num_servers`` ranks are servers, the others workers. ``counts``:
    element counts of the float32 tensors shared (the same on every rank); ``initial_flat``:
    every tensor concatenated, from which each server takes its shard (zeros when None);
    ``memory``: "auto" or "window" (Note [Node-local shards]; None: MPIDP_PS_MEMORY's)."""

    def __init__(self, comm, num_servers: int, counts: Sequence[int],
                 initial_flat: Optional[np.ndarray] = None, memory: Optional[str] = None):
        rank, size = mpi.rank_size(comm)
        if not 1 <= num_servers < size:
            raise ValueError(f"num_servers must be between 1 and the number of ranks - 1 "
                             f"({size - 1}), got {num_servers}")
        self.comm, self.rank = comm, rank
        g = runtime.group() if runtime.is_initialized() else None
        self.group = g if g is not None and g.comm == comm else None  # watched collectives
        self.board = board_of(g)
        self.num_workers = size - num_servers
        self.servers = tuple(range(self.num_workers, size))
        self.is_server = self.rank >= self.num_workers
        self.shards = shard_map(counts, num_servers)
        self.counts = tuple(int(c) for c in counts)
        self.layouts = tuple(Layout(sum(p[2] for p in s), self.num_workers)
                             for s in self.shards)
        self.starts = tuple(int(sum(self.counts[:p[0][0]])) + p[0][1] if p else 0
                            for p in self.shards)  # each shard's start in the flat vector
        self.index = self.rank - self.num_workers if self.is_server else None
        mine = self.layouts[self.index] if self.is_server else None
        # Note [Node-local shards] in ps_shared.py: a node's own worker-server pairs meet in
        # its shared memory; the windows carry the rest, and on several nodes every count
        cfg = config.get()
        if memory not in (None, *config.PS_MEMORIES):
            raise ValueError(f"memory must be one of {', '.join(config.PS_MEMORIES)} or None, "
                             f"got {memory!r}")
        self.why_windows = eligible(g, comm, host_ops.EXTENSION, memory or cfg.ps_memory,
                                    cfg.emulate_node_size)
        if self.why_windows is None and g.node_count > 1 and mpi.thread_level() != "multiple":
            self.why_windows = "across nodes without MPI_THREAD_MULTIPLE (Note [A server " \
                "across nodes] in ps_server.py)"
        self.shared, self.window = None, None
        if self.why_windows is None:
            with collective(self.group, "ps: mapping the node's shared shards"):
                self.shared = SharedShards(g.node_comm, g.node_ranks,
                                           [lay.count for lay in self.layouts],
                                           self.num_workers, self.servers, rank,
                                           host_ops.EXTENSION)
        if self.shared is None or g.node_count > 1:
            self.window = Window(comm, mine.nbytes if mine else 0)
        if self.is_server and initial_flat is not None:
            shard = self.gather_shard(initial_flat, self.index)
            if self.shared is not None:
                self.shared.publish_initial(self.index, shard)
            if self.window is not None:
                with self.window.locked(self.rank, exclusive=True):
                    self.window.local(mine.params)[...] = shard
        self.barrier("ps: initial shards published")  # before any pull

    @property
    def memory(self) -> str:
        """Where the shards are: "shared" (the node's memory: one node), "mixed" (each node's
        own pairs in its memory, the rest and every count in MPI windows) or "window"."""
        return "window" if self.shared is None else "shared" if self.window is None \
            else "mixed"

    def near(self, k: int) -> bool:
        """Server k's shard is in this node's shared memory."""
        return self.shared is not None and self.shared.near(k)

    def barrier(self, name: str) -> None:
        """A barrier over ``comm`` named ``name`` under the watchdog. Collective."""
        objects.barrier(self.group, name, comm=self.comm)

    # ---- flat vector <-> shards --------------------------------------------------------

    def gather_shard(self, flat: np.ndarray, s: int) -> np.ndarray:
        """Server ``s``'s part of the full flat vector ``flat``: a view (a shard is one
        contiguous range of the vector: shard_map)."""
        lo = self.starts[s]
        return flat[lo:lo + self.layouts[s].count]

    def read(self, k: int, shard: Optional[np.ndarray], control: np.ndarray) -> None:
        """Server ``k``'s control words and (unless None) published shard, read together
        (one shared epoch: Note [Publishing a shard]). Any rank may read."""
        s, lay = self.servers[k], self.layouts[k]
        with self.window.locked(s):
            self.window.get_atomic(control, s, lay.control)
            if shard is not None:
                self.window.get(shard, s, lay.params)

    def controls(self) -> list:
        """Buffers for every server's control words."""
        return [np.empty(CONTROL_WORDS + 3 * lay.workers, np.int64) for lay in self.layouts]

    def read_all(self, flat: np.ndarray, own: Optional[tuple] = None) -> list:
        """Every server's published parameters into ``flat`` (no staleness wait); returns
        the version each shard was read at. ``own``: (worker, pushes): a shard read through
        a window is read again until its counts show that worker's first pushes applied
        (Note [Node-local shards]; one epoch a try)."""
        versions = []
        for k, control in enumerate(self.controls()):
            shard = self.gather_shard(flat, k)  # read into its place
            if self.near(k):
                versions.append(self.shared.read(k, shard))
                continue
            self.read(k, shard, control)
            while own is not None and control[self.layouts[k].applied(own[0])] < own[1]:
                time.sleep(IDLE_SLEEP_S)
                self.read(k, shard, control)
            versions.append(int(control[VERSION]))
        return versions

    def free(self) -> None:
        """Collective over ``comm``."""
        with collective(self.group, "ps: freeing the window"):
            if self.shared is not None:
                self.shared.free()
            if self.window is not None:
                self.window.free()


class Worker:
    """A worker's side: ``pull`` parameters (waiting for SSP), ``push`` gradients, take the
    next batch of an epoch, and say it has finished the epoch. ``staleness``: S (None: fully
    asynchronous)."""

    def __init__(self, ps: ParameterServer, staleness: Optional[int]):
        assert not ps.is_server
        self.ps, self.staleness, self.w = ps, staleness, ps.rank
        self.steps = 0               # pushes this epoch (this worker's clock)
        self.pulled_versions = [0] * len(ps.servers)
        self.staleness_seen: list = []   # per push: server updates since the pull it used
        self._claimed: list = []  # batches taken and not yet handed out (last first)
        self._claim_end = 0       # where the last claim ended

    def next_batch(self, total: Optional[int] = None) -> int:
        """The next batch number of this epoch, shared among the workers (fetch-and-add on
        the first server): a fast worker takes more batches. Through the window, given the
        epoch's ``total``, it takes them a few at a time (Note [Claims in chunks])."""
        s0, lay = self.ps.servers[0], self.ps.layouts[0]
        if self.ps.window is None:
            return self.ps.shared.next_batch()
        if not self._claimed:
            left = (total - self._claim_end) if total is not None else 0
            chunk = max(1, min(MAX_CLAIM, left // (CLAIM_SHARE * self.ps.num_workers)))
            with self.ps.board.waiting(("ps worker: taking the next batch from server rank {}",
                                        s0)):
                with self.ps.window.locked(s0):
                    start = self.ps.window.fetch_add(s0, lay.control, NEXT_BATCH, chunk)
            self._claimed = list(range(start + chunk - 1, start - 1, -1))
            self._claim_end = start + chunk
        return self._claimed.pop()

    @timeline.traced("pull")
    def pull(self, flat: np.ndarray) -> None:
        """Fills ``flat`` (every tensor concatenated) with the servers' parameters, first
        waiting until this worker's own pushes are applied (Note [Node-local shards]) and
        (SSP) until every worker has at least (steps - S) pushes applied, or, if it has
        finished the epoch, all of its pushes. Only control words are polled; the
        applied counts only grow within an epoch, so the shards read afterwards satisfy it."""
        what = ("ps worker: pull, waiting until every worker has at least {} pushes applied "
                "(staleness {})", self.steps - self.staleness, self.staleness) \
            if self.staleness is not None else ("ps worker: pull",)
        with self.ps.board.waiting(what):
            self._pull(flat)

    def _pull(self, flat: np.ndarray) -> None:
        ps = self.ps
        if ps.shared is not None:  # Note [Node-local shards]: its own pushes applied first
            ps.shared.wait_applied(self.w, self.steps)  # (by this node's servers)
        if self.staleness is None:  # the others' counts read with their shards
            self.pulled_versions = ps.read_all(flat, own=(self.w, self.steps))
            return
        far = [k for k in range(len(ps.servers)) if not ps.near(k)]
        while True:  # SSP, and its own pushes on the servers of other nodes
            done, applied = self._counts()
            need = np.full(len(done), self.steps - self.staleness, np.int64)
            need = np.where(done > 0, np.minimum(need, done - 1), need)
            own = need.copy()
            own[self.w] = max(own[self.w], self.steps)
            if all((applied[k] >= (own if k in far else need)).all()
                   for k in range(len(applied))):
                break
            time.sleep(IDLE_SLEEP_S)
        self.pulled_versions = ps.read_all(flat)

    def _counts(self) -> tuple:
        """(every worker's DONE word: final steps + 1 or 0, [its applied pushes on each
        server])."""
        ps = self.ps
        if ps.window is None:
            return ps.shared.done(), [ps.shared.applied(k) for k in range(len(ps.servers))]
        controls = ps.controls()
        for k in range(len(ps.servers)):
            ps.read(k, None, controls[k])
        lay0 = ps.layouts[0]
        return (controls[0][lay0.done(0):lay0.done(0) + lay0.workers],
                [c[lay.applied(0):lay.applied(0) + lay.workers]
                 for c, lay in zip(controls, ps.layouts)])

    @timeline.traced("push")
    def push(self, grad_flat: np.ndarray, scale_by_staleness: bool = False) -> None:
        """Adds this worker's gradient into every server's accumulator, counted once. Its
        staleness (server updates since the pull it was computed from) is recorded; with
        ``scale_by_staleness`` the gradient is divided by it first (Zhang et al. 2016)."""
        with self.ps.board.waiting(("ps worker: push {} of this epoch", self.steps + 1)):
            worst = self._push(grad_flat, scale_by_staleness)
        self.staleness_seen.append(worst)
        self.steps += 1

    def _push(self, grad_flat: np.ndarray, scale_by_staleness: bool) -> int:
        ps, win = self.ps, self.ps.window
        worst = 0
        for k, s in enumerate(ps.servers):
            lay = ps.layouts[k]
            part = ps.gather_shard(grad_flat, k)
            if ps.near(k):  # staleness: the version as the push lands
                stale = ps.shared.version(k) - self.pulled_versions[k]
                if scale_by_staleness and stale > 1:
                    part = part * np.float32(1.0 / stale)  # not the caller's vector
                ps.shared.push(k, self.w, part)
                worst = max(worst, stale)
                continue
            with win.locked(s):
                stale = win.fetch_add(s, lay.control, VERSION, 0) - self.pulled_versions[k]
                if scale_by_staleness and stale > 1:
                    part = part * np.float32(1.0 / stale)  # not the caller's vector
                win.accumulate(part, s, lay.grads)
                win.fetch_add(s, lay.control, lay.pending(self.w), 1)
            worst = max(worst, stale)
        return worst

    def finish_epoch(self) -> None:
        """This worker has pushed its last gradient of the epoch: its final step count is
        published (others wait for those pushes, no more) and its clock restarts."""
        ps, win = self.ps, self.ps.window
        lay0 = ps.layouts[0]
        with ps.board.waiting(("ps worker: telling the servers it finished the epoch",)):
            if ps.window is None:
                ps.shared.finish(self.w, self.steps)
                self.steps = 0
                return
            with win.locked(ps.servers[0]):
                win.fetch_add(ps.servers[0], lay0.control, lay0.done(self.w), self.steps + 1)
            self.steps = 0
            self._claimed, self._claim_end = [], 0  # what is left of a claim is past the end
            for k, s in enumerate(ps.servers):
                with win.locked(s):
                    win.fetch_add(s, ps.layouts[k].control, FINISHED, 1)
