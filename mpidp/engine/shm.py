"""The shared-memory algorithm of ranks on one node: the control window, the choice between
cross-memory attach and staging segments (Note [Cross-memory attach]), and the calls of the C
protocol through its context type (Note [Shared-memory protocol] in csrc/shm.c)."""
from __future__ import annotations

import os
from typing import Sequence

from .. import config
from . import header
from ..errors import CommunicationError, WaitTimeoutError
from .host_ops import extension
from .library import mpi

SHM_OK, SHM_MISMATCH, SHM_TIMEOUT, SHM_PEER_ERROR, SHM_OUT_OF_STEP, SHM_INTERRUPTED, \
    SHM_DEPARTED, SHM_LOST = range(8)
PEERS_CMA, PEERS_WINDOW = range(2)
YAMA_SCOPE = "/proc/sys/kernel/yama/ptrace_scope"
# where an all-reduce waits for a rank that has shut down, the likely cause
UNEVEN = (". If ranks run different numbers of batches, wrap the training loop in "
          "`with model.join():` (docs/troubleshooting.md)")

# Note [Cross-memory attach]
# The single-copy mode reads and writes the other local ranks' buffers with process_vm_readv
# and process_vm_writev, which the kernel allows where this process may ptrace the other one.
# Nothing is asked at import; the mode is chosen when the node's context is made, and then as
# narrowly as the kernel allows:
# - no Yama, or ptrace_scope 0: processes of one user may already attach to each other, so
#   nothing is declared;
# - ptrace_scope 1 (Ubuntu's default: only an ancestor may attach): every rank declares the
#   ranks' common parent — the launcher's proxy on this node (hydra_pmi_proxy, slurmstepd) —
#   with PR_SET_PTRACER; Yama then allows that process and its descendants, that is the job's
#   own ranks on this node, and nothing else of the user's. Where the local ranks have no
#   common parent nothing is declared and the staging window is used;
# - ptrace_scope 2 or 3 (admin only, or never): the staging window.
# Whatever is chosen, every rank then probes its neighbour; one failure anywhere means the
# staging window for all (MPIDP_SHM_PEERS=cma makes it an error instead).


def yama_scope(path: str = YAMA_SCOPE) -> int:
    """Yama's ptrace_scope, 0 where Yama is absent."""
    try:
        with open(path) as f:
            return int(f.read().strip() or 0)
    except (OSError, ValueError):
        return 0


def plan_peers(wanted: str, scope: int, parents: Sequence[int]) -> tuple:
    """("cma", pid to declare or 0) or ("window", why) from MPIDP_SHM_PEERS, Yama's scope and
    the local ranks' parent pids (Note [Cross-memory attach]). Pure."""
    if wanted == "window":
        return "window", "MPIDP_SHM_PEERS=window"
    if scope >= 2:
        return "window", f"Yama ptrace_scope is {scope}"
    if scope == 1:
        if len(set(parents)) != 1:
            return "window", "Yama ptrace_scope is 1 and the local ranks have no common parent"
        return "cma", parents[0]
    return "cma", 0


def identity(ext) -> tuple:
    """(pid, parent pid, pid namespace, start time) of this process: what a rank tells the
    others at set-up (Note [A lost peer] in csrc/shm.c); namespace and start time None where
    /proc does not say."""
    try:
        namespace = os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        namespace = None
    stat = ext.ShmContext.process_stat(os.getpid())
    return os.getpid(), os.getppid(), namespace, None if stat is None else stat[2]


def watched(procs: Sequence[tuple], rank: int) -> tuple:
    """(pids, start times) to watch of every local rank's ``identity`` (0, 0: not watched):
    the ranks of this rank's pid namespace that said when they started. Pure."""
    mine = procs[rank][2]
    keep = [mine is not None and ns == mine and start is not None for _, _, ns, start in procs]
    return (tuple(p[0] if k else 0 for p, k in zip(procs, keep)),
            tuple(p[3] if k else 0 for p, k in zip(procs, keep)))


class ShmContext:
    """The control block and (in window mode) staging segments of one node's ranks.

    Made collectively by every rank of ``node_comm``; every call below is collective too.
    ``inline_bytes``: the largest buffer carried in the control block (mpidp.runtime.resources reads
    it once, into the algorithm facts); ``ranks``: the group's rank of each local rank, as
    errors name them (default: the local ranks)."""

    def __init__(self, node_comm, inline_bytes: int, ranks: Sequence[int] = ()):
        MPI = mpi()
        ext = extension()
        self.comm = node_comm
        self.rank, self.size = node_comm.Get_rank(), node_comm.Get_size()
        self.ranks = tuple(ranks) or tuple(range(self.size))
        if self.size > ext.SHM_MAX_RANKS:
            raise ValueError(f"{self.size} ranks on one node; shm supports at most "
                             f"{ext.SHM_MAX_RANKS}")
        nbytes = self.size * ext.SHM_SLOT_BYTES if self.rank == 0 else 0
        self._ctrl_win = MPI.Win.Allocate_shared(nbytes, 1, comm=node_comm)
        mem, _ = self._ctrl_win.Shared_query(0)
        ctrl_addr = MPI.memory(mem).address
        if self.rank == 0:
            MPI.memory(mem)[:] = b"\0" * len(mem)
        node_comm.Barrier()
        cfg = config.get()
        self.inline_bytes = inline_bytes
        procs = node_comm.allgather(identity(ext))
        self.peers, self.peers_why = self._choose_peers(ext, cfg.shm_peers, ctrl_addr,
                                                        [p[1] for p in procs])
        self._seg_win = None
        # the backstop behind the watchdog, which reports first (Note [Watchdog] in watchdog.py)
        self.backstop_s = 2 * cfg.timeout_s + 10
        self.c = ext.ShmContext(ctrl_addr, self.size, self.rank, self.peers, self.inline_bytes,
                                cfg.shm_chunk_bytes, self.backstop_s)
        self.c.watch(*watched(procs, self.rank))

    @property
    def timeout_s(self) -> float:
        """Seconds a wait for the other local ranks lasts before its call raises
        WaitTimeoutError: the backstop, or a group's shorter timeout (``set_timeout``)."""
        return self.c.timeout_s

    def set_timeout(self, timeout_s) -> None:
        """The calls entering from now on wait at most ``timeout_s`` (None: the backstop) for
        the other local ranks — never longer than the backstop (Note [A group's timeout] in
        mpidp/backend/group.py). This rank only."""
        self.c.timeout_s = self.backstop_s if timeout_s is None else \
            min(float(timeout_s), self.backstop_s)

    def _choose_peers(self, ext, wanted: str, ctrl_addr: int, parents: list) -> tuple:
        """(PEERS_CMA or PEERS_WINDOW, why) — Note [Cross-memory attach] (``parents``: every
        local rank's parent pid)."""
        mode, detail = plan_peers(wanted, yama_scope(), parents)
        if mode == "window" and wanted == "cma":
            raise CommunicationError(self.rank, "shm set-up", f"MPIDP_SHM_PEERS=cma but {detail}")
        if mode == "window" or self.size == 1:
            return (PEERS_WINDOW, detail) if mode == "window" else (PEERS_CMA, "one rank")
        err = ext.set_ptracer(detail) if detail else 0
        everyone = self.comm.allgather((os.getpid(), ctrl_addr))
        right = everyone[(self.rank + 1) % self.size]
        err = err or ext.cma_probe(right[0], right[1], 8)
        errors = self.comm.allgather(err)
        if all(e == 0 for e in errors):
            return PEERS_CMA, (f"ptracer: the ranks' parent, pid {detail}" if detail else
                               "no Yama restriction")
        if detail:
            ext.set_ptracer(0)  # declare nothing we do not use
        bad = [r for r, e in enumerate(errors) if e]
        why = f"process_vm_readv failed on local ranks {bad} ({os.strerror(errors[bad[0]])})"
        if wanted == "cma":
            raise CommunicationError(self.rank, "shm set-up", f"MPIDP_SHM_PEERS=cma but {why}")
        return PEERS_WINDOW, why

    @property
    def mode_name(self) -> str:
        return "cma" if self.peers == PEERS_CMA else "window"

    def ensure_segments(self, nbytes: int) -> None:
        """Window mode: grows every rank's staging segment to ``nbytes`` (collective; callers
        pass the same size on every rank)."""
        MPI = mpi()
        if nbytes <= self.c.capacity:
            return
        capacity = max(1 << 20, 1 << (nbytes - 1).bit_length())
        if self._seg_win is not None:
            self._seg_win.Free()
        self._seg_win = MPI.Win.Allocate_shared(
            capacity, 1, comm=self.comm, info=MPI.Info.Create(dict(alloc_shared_noncontig="true")))
        self.c.set_segments(tuple(MPI.memory(self._seg_win.Shared_query(q)[0]).address
                                  for q in range(self.size)), capacity)

    def check(self, status: int, info, operation: str) -> bool:
        """True for OK, False for a header mismatch (``info`` then holds every rank's header);
        raises CommunicationError for the protocol's failures."""
        if status == SHM_OK:
            return True
        if status == SHM_MISMATCH:
            # every local rank sees these headers: where they carry call sites and none is a
            # refusal (a rank refused in C raises at once), every rank names them all
            if any(h[1] >> 8 for h in info) and not any(h[6] for h in info):
                header.share_sites(self.comm, info)
            return False
        if status == SHM_TIMEOUT:
            limit = self.timeout_s
            why = "2 x MPIDP_TIMEOUT_S + 10 s, and the watchdog did not end the job" \
                if limit >= self.backstop_s else "the group's timeout"
            raise WaitTimeoutError(
                self.rank, operation, limit, info, f"timed out after {limit:g} s waiting for "
                f"local ranks {info} ({why}); they had not reached this collective")
        if status == SHM_DEPARTED:  # Note [A rank that has shut down] in csrc/shm.c
            gone = [self.ranks[q] for q in info]
            raise CommunicationError(
                self.ranks[self.rank], operation,
                f"{'rank' if len(gone) == 1 else 'ranks'} {', '.join(map(str, gone))} "
                f"{'has' if len(gone) == 1 else 'have'} shut down (mpidp.shutdown, or the end "
                "of its script) without reaching this collective, and never will; every rank "
                "waiting for it raises this error" + (UNEVEN if operation == "allreduce" else ""))
        if status == SHM_LOST:  # Note [A lost peer] in csrc/shm.c
            gone = [self.ranks[q] for q in info]
            raise CommunicationError(
                self.ranks[self.rank], operation,
                f"the process of {'rank' if len(gone) == 1 else 'ranks'} "
                f"{', '.join(map(str, gone))} on this node has ended (killed or crashed) "
                "without reaching this collective; every rank waiting for it raises this error")
        if status == SHM_INTERRUPTED:  # Note [Interrupting a wait] in csrc/shm.c
            raise CommunicationError(
                self.rank, operation, "the node's shared-memory context was closed (mpidp is "
                "shutting down), or an earlier call of it was interrupted, which leaves this "
                "rank out of step with the others")
        if status == SHM_OUT_OF_STEP:
            raise CommunicationError(
                self.rank, operation, "local ranks' protocol counters are out of step: their "
                "records are of calls " + ", ".join(f"rank {q}: #{s}" for q, s in enumerate(info))
                + f" (this is call #{self.c.seq}); mpidp's shared-memory state is inconsistent")
        failed, peer, errno = info
        raise CommunicationError(self.rank, operation, f"local rank {failed} could not reach "
                                 f"local rank {peer}: {os.strerror(errno)}")

    def exchange(self, header: tuple, operation: str) -> tuple:
        """Handshake only: (True, every rank's free word) or (False, every rank's header)."""
        status, info = self.c.exchange(header)
        return self.check(status, info, operation), info

    def allreduce(self, header: tuple, src, dst, dtype: int, op: int, divisor: int) -> tuple:
        """Reduces every local rank's flat buffer ``src`` into ``dst`` (may be ``src``), or with
        ``src`` a list of contiguous buffers (``dst`` None) reduces them where they lie (Note
        [Zero-copy buckets] in mpidp/comm/buckets.py). Returns (True, None) or (False, every rank's
        header) when the headers disagree."""
        if self.peers == PEERS_WINDOW:
            nbytes = src.nbytes if dst is not None else sum(s.nbytes for s in src)
            if nbytes > self.inline_bytes and nbytes > self.c.capacity:
                ok, info = self.exchange(header, "allreduce")  # agree before allocating
                if not ok:
                    return ok, info
                self.ensure_segments(nbytes)
        r = self.c.allreduce(header, src, dst, dtype, op, divisor)
        return (True, None) if r is None else (self.check(r[0], r[1], "allreduce"), r[1])

    def close(self) -> None:
        """Ends every wait in this context, whatever thread waits, and lets no later call
        enter (they raise CommunicationError); the other ranks' waits for a call this rank
        will not enter raise CommunicationError naming it (Note [A rank that has shut down]
        in csrc/shm.c). This rank only; no communication. Before ``free``."""
        if self._ctrl_win is not None:
            self.c.close()

    def free(self) -> None:
        """Collective: frees the windows. Nothing may wait in the context then (close it
        and join the threads that use it first: Resources.free)."""
        for w in (self._seg_win, self._ctrl_win):
            if w is not None:
                w.Free()
        self._seg_win = self._ctrl_win = None
