"""The torch.distributed process group of the "mpidp" backend: torch's operations on an mpidp
group of its own (mpidp.backend.ops), run in order — asynchronous ones on the group's
scheduler (mpidp.comm.scheduler; their Work: mpidp.backend.thread), so that ``async_op=True``
returns at once and torch's DDP overlaps its all-reduces with backward, synchronous ones on the
caller's thread where the group is idle — within the group's timeout (Note [A group's timeout]);
point-to-point on the group's own communicator (mpidp.backend.p2p).

Note [What torch calls on a Python group]
A backend written in Python is a subclass of torch's ProcessGroup, and torch reaches it two
ways. torch.distributed's Python front (dist.all_reduce, all_gather_single as FSDP2 calls it,
all_gather_coalesced, the coalescing manager, destroy_process_group's ``shutdown``) calls the
group's methods by their Python names, which a subclass overrides like any method. torch's
C++ (the functional collectives, which DTensor and tensor parallelism use; DeviceMesh's and
``group.group_name``'s names) calls virtual methods that torch's pybind11 trampoline
(c10d/PyProcessGroup.hpp) forwards to Python only where it declares them, under their C++
names: getGroupName/setGroupName/getGroupDesc/setGroupDesc (without them torch keeps the name
nowhere, and a group torch named says "ProcessGroup name not set"), allreduce,
allreduce_coalesced, broadcast, allgather, all_gather_single, all_gather_single_coalesced (or
its older name allgather_into_tensor_coalesced), reduce_scatter, reduce_scatter_single,
reduce_scatter_single_coalesced (or reduce_scatter_tensor_coalesced), all_to_all_single (or
alltoall_base), barrier, send, recv, splitGroup, mergeRemoteGroup, and in newer torch
start_coalescing/end_coalescing (the front calls _start_coalescing/_end_coalescing). A method
left to torch's base class asks for the group's per-device backend, which a Python group has
none of, and fails with "No backend type associated with device type cpu", naming no
operation; so every method torch's front or trampoline can reach is defined here, those the
backend does not do raising an error that names them.

Note [A group's timeout]
torch promises that ``init_process_group(timeout=...)`` and ``new_group(timeout=...)`` bound
how long the group's operations wait (``barrier(timeout=...)`` one barrier's). On mpidp every
operation starts by exchanging its header, and that is where a rank waits for late ones; on
one node the exchange is the shared-memory protocol, whose waits already poll a deadline in
their slow path (Note [Interrupting a wait] in csrc/shm.c) — so the group's timeout is that
deadline (ShmContext.set_timeout, made with the group, before its first operation), and the
common path pays nothing: no clock, no extra thread, whether the operation runs on the
caller's thread or the group's. Across nodes the exchange's records travel over MPI
point-to-point (mpidp.engine.doubling), and with a timeout set their receives are polled
against it (MPITransport.take; the one C call across nodes, whose waits are MPI's, is left
for the Python path then): a rank names the rank that did not answer — with several ranks
per node, a node's leader answers for its node, so the late rank is one of that node's, all
of which are named, and a rank waiting for its own node's leader names the leader. A wait
past it ends the operation on the waiting rank with WaitTimeoutError naming the ranks that
had not come, raised as torch's DistBackendError (a RuntimeError, as gloo's timeouts are):
"<op> timed out: after the timeout of T s, rank R had not reached it". An MPI collective
cannot be taken back — this rank's arrival is published, and a late rank that comes
afterwards may complete the operation with what the others left (a barrier, a small
all-reduce) or time out in its turn — so, as gloo closes its pairs, the group is unusable
on this rank from then on: every later operation raises at once naming the timeout.
Destroy the group on every rank (``dist.destroy_process_group(group)``, which the late ranks
reach too) or end the job. The watchdog stays the backstop: a timeout longer than
MPIDP_TIMEOUT_S (torch's default is 30 minutes) is reached by the watchdog first, which
reports the stall and ends the job (exit 124), as before. Not bounded: a wait without the C
extension on one node (in MPI's own collectives, which cannot be interrupted; the watchdog
ends those), and point-to-point.
"""
from __future__ import annotations

import functools
from datetime import timedelta
from typing import Optional

import torch
import torch.distributed as dist

from .. import config, runtime
from ..runtime import mpi, recovery, world
from ..errors import MpidpError, WaitTimeoutError
from ..comm import scheduler
from . import ops, p2p, sparse, thread
from .thread import Work, run_now


LOST = "a process of the job was lost"
# Note [A lost process under torch] in mpidp/backend/__init__.py
GO_ON = ("Every operation of every group raises from now on; to go on, destroy the groups "
         "(dist.destroy_process_group()) and call dist.init_process_group again on every "
         "survivor: that remakes the job, rank 0 a survivor (docs/recovery.md)")


class ProcessGroup(dist.ProcessGroup):
    """torch.distributed's group on mpidp group ``g`` (a group of its own: Note [Sub-groups]
    in mpidp/runtime/world.py): every method is torch's, and collective over ``g`` as torch's
    are."""

    def __init__(self, g, name: str, timeout: Optional[timedelta] = None, global_ranks=()):
        super().__init__(g.rank, g.size)
        self.g = g
        self.p2p = mpi.dup(g.comm)  # point-to-point apart from mpidp's own messages
        # the group's scheduler (Note [One communication thread per group] in
        # mpidp/comm/scheduler.py); its stop frees the point-to-point communicator
        self._thread = scheduler.of(g, f"mpidp-dist-{name}") if g.size > 1 else None
        if self._thread is not None:
            self._thread.after_stop.append(lambda: mpi.free(self.p2p))
        self._group_name: Optional[str] = None  # torch sets both (setGroupName, below)
        self._group_desc = ""
        self._global_ranks = tuple(global_ranks) or tuple(range(g.size))
        # Note [A group's timeout]: the waits' limit (None: the backstop's) and, once one
        # was passed or a process lost (Note [A lost process under torch]), why every later
        # operation raises
        self.timeout_s = _seconds(timeout)
        self.unusable: Optional[str] = None
        self._lost = False  # the reason is a lost process
        if g.size > 1:
            g.resources.links_ready()  # the node's context, before the first wait (collective)
            g.resources.set_wait_timeout(self.timeout_s)

    def getBackendName(self) -> str:  # noqa: N802 - torch's name
        return "mpidp"

    def name(self) -> str:
        return "mpidp"

    # ---- the name and description torch gives the group: Note [What torch calls on a Python
    # group]; its functional collectives and DeviceMesh find the group by this name ---------

    def getGroupName(self) -> str:  # noqa: N802 - the C++ name torch's trampoline calls
        if self._group_name is None:
            raise RuntimeError("ProcessGroup name not set: torch names a group when "
                               "init_process_group or new_group makes it")
        return self._group_name

    def setGroupName(self, name: str) -> None:  # noqa: N802 - as above
        self._group_name = name

    def getGroupDesc(self) -> str:  # noqa: N802 - as above
        return self._group_desc

    def setGroupDesc(self, desc: str) -> None:  # noqa: N802 - as above
        self._group_desc = desc

    def shutdown(self) -> None:
        """torch's ``destroy_process_group``: after the group's queued operations, stops its
        thread and frees its mpidp group (runtime.free_subgroup: Note [Sub-groups]).
        Collective over the group's ranks; a later call, or one after mpidp's shutdown (which
        freed the group), does nothing."""
        if self._thread is not None:
            self._thread.drain()
        if runtime.free_subgroup(self.g) and self._thread is None:
            mpi.free(self.p2p)  # with a thread, freed when the thread stops

    def _run(self, opts, fn, result, *inputs) -> Optional[Work]:
        """``fn`` (the operation) run in the group's order: on the caller's thread where
        ``opts`` says the call is synchronous and the group is idle (then None is returned),
        else queued on the group's scheduler (Note [Synchronous calls on the caller's thread]
        in mpidp/comm/scheduler.py): a Work that completes with ``result`` (the output
        tensors). CUDA tensors among ``result`` and ``inputs``: the caller's stream is
        synchronised first (the inputs are ready before the operation reads them) and the
        device after (the outputs are ready when the Work completes). Once an operation of
        the group timed out, every later one raises (Note [A group's timeout])."""
        devices = _cuda_devices(result, inputs) if _CUDA_BUILT else None
        if devices:
            for d in devices:
                torch.cuda.current_stream(d).synchronize()
            operation = fn

            def fn():
                operation()
                for d in devices:
                    torch.cuda.synchronize(d)
        if self._thread is None:  # one rank: nothing to wait for
            with runtime.using(self.g):
                return run_now(fn, result)
        s = self._thread
        if getattr(opts, "asyncOp", True) is False and s.begin_inline():
            try:  # here, in the group's order
                self._watched(fn)
            finally:
                s.running.release()
            return None
        return thread.submit(s, self.g.board, functools.partial(self._watched, fn), result)

    def _watched(self, fn) -> None:
        """Runs operation ``fn`` unless the group was made unusable before, by a timeout (Note
        [A group's timeout]) or a lost process (Note [A lost process under torch]), either of
        which makes it so. Each raises torch's DistBackendError."""
        if self.unusable is not None:
            raise self._unusable_error(f"{self._describe()} is unusable: {self.unusable}")
        try:
            fn()
        except WaitTimeoutError as exc:  # ranks named as torch's default group numbers them
            late = [self._global_ranks[q if exc.across else self.g.node_ranks[q]]
                    for q in exc.late]
            self.unusable = (
                f"{exc.operation} timed out: after the timeout of {exc.timeout_s:g} s, "
                f"{'rank' if len(late) == 1 else 'ranks'} {', '.join(map(str, late))} had "
                "not reached it")
            raise self._unusable_error(
                f"{self._describe()}: {self.unusable}. A collective cannot be taken back, so "
                "the group is unusable from now on: destroy it on every rank "
                "(dist.destroy_process_group(group)) or end the job") from exc
        except Exception as exc:  # noqa: BLE001 - a lost process, else raised as it is
            if self.g.recovery == "off" or not recovery.is_process_failure(exc):
                raise
            world.revoke_all()  # every survivor's waits end (Note [A lost process under torch])
            self.unusable, self._lost = f"{LOST} ({exc})", True
            raise self._unusable_error(f"{self._describe()}: {self.unusable}. {GO_ON}") from exc

    def _unusable_error(self, what: str) -> dist.DistBackendError:
        """torch's error for ``what`` on this rank; after a lost process, one that
        recovery.is_process_failure knows."""
        error = dist.DistBackendError(f"mpidp: rank {self._global_ranks[self.g.rank]}: {what}")
        error.process_failure = self._lost
        return error

    def _describe(self) -> str:
        """"process group NAME (DESCRIPTION) of ranks [...]", in torch's words."""
        desc = f" ({self._group_desc})" if self._group_desc not in ("", "undefined") else ""
        return f"process group {self._group_name}{desc} of ranks {list(self._global_ranks)}"

    # ---- collectives ---------------------------------------------------------------------

    def allreduce(self, tensors, opts=None):
        op = dist.ReduceOp.SUM if opts is None else opts.reduceOp
        if len(tensors) == 1:  # dist.all_reduce's, with one frame less
            t = tensors[0]
            reduce = _reduce_for(t)
            return self._run(opts, lambda: reduce(self.g, t, op), tensors)
        return self._run(opts, lambda: [_reduce_for(t)(self.g, t, op) for t in tensors],
                         tensors)

    def allreduce_coalesced(self, tensors, opts=None):
        return self.allreduce(tensors, opts)

    def broadcast(self, tensors, opts):
        return self._run(opts, lambda: [ops.broadcast(self.g, t, opts.rootRank)
                                        for t in tensors], tensors)

    def reduce(self, tensors, opts):
        return self._run(opts, lambda: [ops.reduce(self.g, t, opts.rootRank, opts.reduceOp)
                                        for t in tensors], tensors)

    def allgather(self, outputs, inputs, opts=None):
        def run():
            for outs, x in zip(outputs, inputs):
                ops.gather_all(self.g, outs, x)
        return self._run(opts, run, outputs, inputs)

    def all_gather_single(self, output, x, opts=None):
        return self._run(opts, lambda: ops.all_gather_into_tensor(self.g, output, x), [output],
                         x)

    _allgather_base = all_gather_single

    def all_gather_single_coalesced(self, outputs, inputs, opts=None):
        return self._run(opts, lambda: [ops.all_gather_into_tensor(self.g, o, x)
                                        for o, x in zip(outputs, inputs)], outputs, inputs)

    allgather_into_tensor_coalesced = all_gather_single_coalesced  # its older name

    def allgather_coalesced(self, output_lists, inputs, opts=None):
        return self._run(opts, lambda: ops.all_gather_coalesced(self.g, output_lists, inputs),
                         output_lists, inputs)

    def reduce_scatter(self, outputs, inputs, opts=None):
        op = dist.ReduceOp.SUM if opts is None else opts.reduceOp

        def run():
            for out, ins in zip(outputs, inputs):
                ops.reduce_scatter_list(self.g, out, ins, op)
        return self._run(opts, run, outputs, inputs)

    def reduce_scatter_single(self, output, x, opts=None):
        op = dist.ReduceOp.SUM if opts is None else opts.reduceOp
        return self._run(opts, lambda: ops.reduce_scatter_tensor(self.g, output, x, op),
                         [output], x)

    _reduce_scatter_base = reduce_scatter_single

    def reduce_scatter_single_coalesced(self, outputs, inputs, opts=None):
        op = dist.ReduceOp.SUM if opts is None else opts.reduceOp
        return self._run(opts, lambda: [ops.reduce_scatter_tensor(self.g, o, x, op)
                                        for o, x in zip(outputs, inputs)], outputs, inputs)

    reduce_scatter_tensor_coalesced = reduce_scatter_single_coalesced  # its older name

    def gather(self, outputs, inputs, opts):
        outs = outputs[0] if outputs else []
        return self._run(opts, lambda: ops.gather(self.g, outs, inputs[0], opts.rootRank),
                         outputs, inputs)

    def scatter(self, outputs, inputs, opts):
        ins = inputs[0] if inputs else []
        return self._run(opts, lambda: ops.scatter(self.g, outputs[0], ins, opts.rootRank),
                         outputs, inputs)

    def alltoall(self, outputs, inputs, opts=None):
        return self._run(opts, lambda: ops.all_to_all(self.g, outputs, inputs), outputs, inputs)

    def all_to_all_single(self, output, x, output_split_sizes, input_split_sizes, opts=None):
        return self._run(opts, lambda: ops.all_to_all_single(
            self.g, output, x, output_split_sizes, input_split_sizes), [output], x)

    alltoall_base = all_to_all_single

    def barrier(self, opts=None):
        limit = _seconds(getattr(opts, "timeout", None))
        if limit is None:
            return self._run(opts, lambda: ops.barrier(self.g), None)

        def run():  # barrier(timeout=...): this barrier's limit (Note [A group's timeout])
            self.g.resources.set_wait_timeout(limit)
            try:
                ops.barrier(self.g)
            finally:
                self.g.resources.set_wait_timeout(self.timeout_s)
        return self._run(opts, run, None)

    def start_coalescing(self, device) -> None:
        """torch's coalescing (``_coalescing_manager`` with a device, coalesced functional
        collectives): the operations called until ``end_coalescing`` run as they are called,
        in order, on the group's thread."""

    def end_coalescing(self, device) -> Work:
        """A Work complete when every operation called since ``start_coalescing`` is."""
        return self._run(None, lambda: None, None)

    _start_coalescing = start_coalescing  # the names torch's Python front calls
    _end_coalescing = end_coalescing

    # ---- what the backend does not do: Note [What torch calls on a Python group] ----------

    def split_group(self, *args, **kwargs):
        raise _unsupported("split_group (ProcessGroup.split_group, "
                           "torch.distributed.split_group)", "use new_group")

    splitGroup = split_group  # noqa: N815 - the C++ name torch's trampoline calls

    def merge_remote_group(self, *args, **kwargs):
        raise _unsupported("merge_remote_group", "")

    mergeRemoteGroup = merge_remote_group  # noqa: N815 - as above

    def monitored_barrier(self, timeout: Optional[timedelta] = None,
                          wait_all_ranks: bool = False) -> None:
        """torch's monitored barrier (``dist.monitored_barrier`` reaches it once mpidp is
        registered), after this group's queued operations: rank 0 waits up to ``timeout`` (a
        timedelta or seconds, as torch's front takes; default: the group's timeout, else the
        watchdog's) and names the ranks that did not come, in gloo's words
        (mpidp.backend.p2p.monitored_barrier)."""
        self._run(None, lambda: None, None).wait()
        timeout_s = _seconds(timeout) if timeout is not None else self.timeout_s
        if timeout_s is None:
            timeout_s = 0.0 if timeout is not None else config.get().timeout_s
        p2p.monitored_barrier(self.g, self.p2p, timeout_s, wait_all_ranks)

    # ---- point-to-point: not ordered with the collectives, as torch's backends ------------

    def send(self, tensors, dst: int, tag: int):
        return p2p.post(self.g, self.p2p, tensors, dst, tag, send=True)

    def recv(self, tensors, src: int, tag: int):
        return p2p.post(self.g, self.p2p, tensors, src, tag, send=False)

    def recv_anysource(self, tensors, tag: int):
        return p2p.post(self.g, self.p2p, tensors, p2p.ANY, tag, send=False)


def _unsupported(what: str, instead: str) -> NotImplementedError:
    return NotImplementedError(f"the mpidp torch.distributed backend does not support {what}"
                               + (f"; {instead}" if instead else ""))


_CUDA_BUILT = torch.backends.cuda.is_built()  # without it no tensor is a CUDA one


def _reduce_for(t: torch.Tensor):
    """The all-reduce of tensor ``t``: the sparse one for a sparse COO tensor (as gloo's)."""
    return sparse.all_reduce if t.layout is torch.sparse_coo else ops.all_reduce


def _seconds(timeout) -> Optional[float]:
    """A torch timeout in seconds; None where it is unset (torch's options hold -1 ms)."""
    if timeout is None:
        return None
    seconds = timeout.total_seconds() if isinstance(timeout, timedelta) else float(timeout)
    return seconds if seconds > 0 else None


def _cuda_devices(*tensors) -> list:
    """The CUDA devices of the tensors in ``tensors`` (nested lists and tuples too)."""
    found, todo = None, list(tensors)
    for t in todo:  # grows as nested lists are met
        if isinstance(t, torch.Tensor):
            if t.is_cuda:
                found = found or set()
                found.add(t.device)
        elif isinstance(t, (list, tuple)):
            todo.extend(t)
    return sorted(found, key=str) if found else []


def create(opts, backend_options) -> ProcessGroup:
    """The backend's creator (torch's extended API): the default group and every
    ``new_group`` each on an mpidp group of its own over their ranks (Note [Sub-groups] in
    mpidp/runtime/world.py), mpidp started first. Collective over the group's ranks."""
    g = runtime.init()
    if runtime.thread_level() != "multiple":
        raise MpidpError(f"the mpidp torch.distributed backend needs MPI_THREAD_MULTIPLE; MPI "
                         f"was initialised with level {runtime.thread_level()} (let mpidp or "
                         "mpi4py start MPI, as they ask for MULTIPLE)")
    ranks = list(opts.global_ranks_in_group)
    if dist.distributed_c10d._world.default_pg is None or not ranks:  # the default group
        if (opts.group_rank, opts.group_size) != (g.rank, g.size):
            raise ValueError(f"torch.distributed says this process is rank {opts.group_rank} "
                             f"of {opts.group_size}, MPI says rank {g.rank} of {g.size}: "
                             "start every rank with one MPI launcher (mpiexec, srun) and let "
                             "init_process_group take rank and world size from it")
        return ProcessGroup(runtime.subgroup(range(g.size)), "default", opts.timeout)
    if dist.get_rank() != g.rank:
        raise ValueError(f"torch.distributed's default group has this process as rank "
                         f"{dist.get_rank()}, MPI as rank {g.rank}: a new_group on the mpidp "
                         "backend needs the two to agree")
    return ProcessGroup(runtime.subgroup(ranks), str(opts.group_id), opts.timeout, ranks)
