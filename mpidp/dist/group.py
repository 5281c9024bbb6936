"""The torch.distributed process group of the "mpidp" backend: torch's operations on one mpidp
group (mpidp.dist.ops), run in order on one communication thread per group so that
``async_op=True`` returns at once and torch's DDP overlaps its all-reduces with backward
(Note [One communication thread per group]); point-to-point on the group's own communicator.

Note [One communication thread per group]
Every collective of a group, asynchronous or not, is queued to the group's one thread, which
runs them in the order they were called — the order every rank calls them in — under the
group's watchdog; its Work completes (its future is set, its wait returns or raises) when the
operation has. A synchronous call is the same call followed by ``wait``. The caller's tensors
must stay untouched until then, as with any torch backend. An operation that raises on the
thread raises from ``wait`` and from the future; the thread goes on with the next one (a
disagreement raises on every rank alike, so the ranks stay in step)."""
from __future__ import annotations

import queue
import threading
import time
from datetime import timedelta
from typing import Optional

import numpy as np
import torch
import torch.distributed as dist

from .. import config, runtime
from ..errors import CommunicationError
from . import ops

STOP_JOIN_S = 10.0


class Work(dist.Work):
    """A collective's Work: complete when its future is; ``wait`` raises what the
    operation raised (torch's future-wrapping Work would only log it)."""

    def __init__(self, future: torch.futures.Future):
        super().__init__()
        self.future = future

    def wait(self, timeout: Optional[timedelta] = None) -> bool:
        self.future.wait()
        return True

    def is_completed(self) -> bool:
        return self.future.done()

    def is_success(self) -> bool:
        if not self.future.done():
            return False
        try:
            self.future.value()
        except Exception:  # noqa: BLE001 - the operation's own error: not a success
            return False
        return True

    def exception(self):
        try:
            self.future.value()
        except Exception as exc:  # noqa: BLE001 - returned, as torch's Work returns it
            return exc
        return None

    def get_future(self) -> torch.futures.Future:
        return self.future

    def result(self):
        return self.future.value()


def _done_work(result) -> Work:
    f = torch.futures.Future()
    f.set_result(result)
    return Work(f)


class _Thread:
    """The group's communication thread (Note [One communication thread per group])."""

    def __init__(self, g, name: str):
        self.g = g
        self.tasks: queue.SimpleQueue = queue.SimpleQueue()
        self.thread = threading.Thread(target=self._run, name=f"mpidp-dist-{name}", daemon=True)
        self.thread.start()
        g.resources.add_user(self.stop)  # Note [Stopping the users first] in resources.py

    def submit(self, fn, result) -> dist.Work:
        f = torch.futures.Future()
        self.tasks.put((fn, f, result))
        return Work(f)

    def _run(self) -> None:
        with runtime.using(self.g):
            while True:
                task = self.tasks.get()
                if task is None:
                    return
                fn, f, result = task
                try:
                    fn()
                except BaseException as exc:  # noqa: BLE001 - handed to whoever waits
                    f.set_exception(exc)
                else:
                    f.set_result(result)

    def stop(self, timeout_s: float) -> bool:
        self.tasks.put(None)
        self.thread.join(timeout_s)
        return not self.thread.is_alive()


class P2PWork(dist.Work):
    """A send or receive: MPI's request, waited for under the watchdog's one-sided lane."""

    def __init__(self, g, request, what: tuple, finish=None):
        super().__init__()
        self.g, self.request, self.what, self.finish = g, request, what, finish
        self.status = None
        self.source = -1
        self._lock = threading.Lock()

    def _complete(self) -> None:
        from mpi4py import MPI  # deferred for cost, as everywhere in mpidp
        with self._lock:
            if self.request is None:
                return
            status = MPI.Status()
            with self.g.board.waiting(self.what):
                self.request.Wait(status)
            self.request = None
            self.source = status.Get_source()
            if self.finish is not None:
                self.finish(status)

    def wait(self, timeout: Optional[timedelta] = None) -> bool:
        self._complete()
        return True

    def is_completed(self) -> bool:
        with self._lock:
            return self.request is None or bool(self.request.Test())

    def is_success(self) -> bool:
        return self.is_completed()

    def _source_rank(self) -> int:
        self._complete()
        return self.source

    def get_future(self) -> torch.futures.Future:
        f = torch.futures.Future()

        def complete():
            try:
                self._complete()
            except BaseException as exc:  # noqa: BLE001 - handed to the future
                f.set_exception(exc)
            else:
                f.set_result(None)
        threading.Thread(target=complete, daemon=True).start()
        return f


class ProcessGroup(dist.ProcessGroup):
    """torch.distributed's group on mpidp group ``g`` (the one made by ``mpidp.init`` for
    the default group, a sub-group for ``new_group``): every method is torch's, and
    collective over ``g`` as torch's are."""

    def __init__(self, g, name: str):
        super().__init__(g.rank, g.size)
        self.g = g
        self.p2p = g.comm.Dup()  # point-to-point apart from mpidp's own messages
        self._thread = _Thread(g, name) if g.size > 1 else None

    def getBackendName(self) -> str:  # noqa: N802 - torch's name
        return "mpidp"

    def name(self) -> str:
        return "mpidp"

    def _run(self, fn, result) -> dist.Work:
        """``fn`` (the operation) queued on the group's thread; a Work that completes with
        ``result`` (the output tensors). CUDA outputs: the caller's stream is synchronised
        first (the inputs are ready before the thread reads them) and the device after
        (the outputs are ready when the Work completes)."""
        devices = _cuda_devices(result)
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
                fn()
            return _done_work(result)
        return self._thread.submit(fn, result)

    # ---- collectives ---------------------------------------------------------------------

    def allreduce(self, tensors, opts=None):
        op = dist.ReduceOp.SUM if opts is None else opts.reduceOp
        return self._run(lambda: [ops.all_reduce(self.g, t, op) for t in tensors], tensors)

    def allreduce_coalesced(self, tensors, opts=None):
        return self.allreduce(tensors, opts)

    def broadcast(self, tensors, opts):
        return self._run(lambda: [ops.broadcast(self.g, t, opts.rootRank) for t in tensors],
                         tensors)

    def reduce(self, tensors, opts):
        return self._run(lambda: [ops.reduce(self.g, t, opts.rootRank, opts.reduceOp)
                                  for t in tensors], tensors)

    def allgather(self, outputs, inputs, opts=None):
        def run():
            for outs, x in zip(outputs, inputs):
                ops.gather_all(self.g, outs, x)
        return self._run(run, outputs)

    def all_gather_single(self, output, x, opts=None):
        return self._run(lambda: ops.all_gather_into_tensor(self.g, output, x), [output])

    _allgather_base = all_gather_single

    def allgather_into_tensor_coalesced(self, outputs, inputs, opts=None):
        return self._run(lambda: [ops.all_gather_into_tensor(self.g, o, x)
                                  for o, x in zip(outputs, inputs)], outputs)

    def reduce_scatter(self, outputs, inputs, opts=None):
        op = dist.ReduceOp.SUM if opts is None else opts.reduceOp

        def run():
            for out, ins in zip(outputs, inputs):
                ops.reduce_scatter_list(self.g, out, ins, op)
        return self._run(run, outputs)

    def reduce_scatter_single(self, output, x, opts=None):
        op = dist.ReduceOp.SUM if opts is None else opts.reduceOp
        return self._run(lambda: ops.reduce_scatter_tensor(self.g, output, x, op), [output])

    _reduce_scatter_base = reduce_scatter_single

    def reduce_scatter_tensor_coalesced(self, outputs, inputs, opts=None):
        op = dist.ReduceOp.SUM if opts is None else opts.reduceOp
        return self._run(lambda: [ops.reduce_scatter_tensor(self.g, o, x, op)
                                  for o, x in zip(outputs, inputs)], outputs)

    def gather(self, outputs, inputs, opts):
        outs = outputs[0] if outputs else []
        return self._run(lambda: ops.gather(self.g, outs, inputs[0], opts.rootRank), outputs)

    def scatter(self, outputs, inputs, opts):
        ins = inputs[0] if inputs else []
        return self._run(lambda: ops.scatter(self.g, outputs[0], ins, opts.rootRank), outputs)

    def alltoall(self, outputs, inputs, opts=None):
        return self._run(lambda: ops.all_to_all(self.g, outputs, inputs), outputs)

    def all_to_all_single(self, output, x, output_split_sizes, input_split_sizes, opts=None):
        return self._run(lambda: ops.all_to_all_single(self.g, output, x, output_split_sizes,
                                                       input_split_sizes), [output])

    alltoall_base = all_to_all_single

    def barrier(self, opts=None):
        return self._run(lambda: ops.barrier(self.g), None)

    def monitored_barrier(self, timeout: Optional[timedelta] = None,
                          wait_all_ranks: bool = False) -> None:
        """torch's monitored barrier (torch's front offers it for gloo only: call
        ``mpidp.dist.monitored_barrier``): rank 0 waits up to ``timeout`` (default: the
        watchdog's) for every rank and raises a RuntimeError naming the first rank that did not
        come (every such rank with ``wait_all_ranks``); the others raise when rank 0 does not
        release them in twice that time."""
        from mpi4py import MPI  # deferred for cost, as above
        self.barrier_sync()
        timeout_s = timeout.total_seconds() if timeout is not None else \
            config.get().timeout_s
        if self.g.size == 1:
            return
        tag = MPI.COMM_WORLD.Get_attr(MPI.TAG_UB)
        token = np.zeros(1, np.uint8)
        if self.g.rank != 0:
            self.p2p.Isend(token, dest=0, tag=tag).Wait()
            release = self.p2p.Irecv(token, source=0, tag=tag)
            if not _poll([release], 2 * timeout_s):
                release.Cancel()
                raise RuntimeError(f"rank {self.g.rank}: monitored barrier: rank 0 did not "
                                   f"release it within {2 * timeout_s:g} s")
            return
        buffers = [np.zeros(1, np.uint8) for _ in range(self.g.size)]
        arrivals = [self.p2p.Irecv(buffers[r], source=r, tag=tag)
                    for r in range(1, self.g.size)]
        if not _poll(arrivals, timeout_s):
            missing = [r for r, a in enumerate(arrivals, 1) if not a.Test()]
            for a in arrivals:
                if a != MPI.REQUEST_NULL:
                    a.Cancel()
            shown = missing if wait_all_ranks else missing[:1]
            raise RuntimeError(f"Ranks {', '.join(map(str, shown))} failed to pass "
                               f"monitoredBarrier in {timeout_s:g} s")
        for r in range(1, self.g.size):
            self.p2p.Isend(token, dest=r, tag=tag).Wait()

    def barrier_sync(self) -> None:
        """Waits until every operation queued so far on this group has completed here."""
        self._run(lambda: None, None).wait()

    # ---- point-to-point ------------------------------------------------------------------

    def send(self, tensors, dst: int, tag: int):
        return self._p2p(tensors, dst, tag, send=True)

    def recv(self, tensors, src: int, tag: int):
        return self._p2p(tensors, src, tag, send=False)

    def recv_anysource(self, tensors, tag: int):
        from mpi4py import MPI  # deferred for cost, as above
        return self._p2p(tensors, MPI.ANY_SOURCE, tag, send=False)

    def _p2p(self, tensors, peer: int, tag: int, send: bool) -> P2PWork:
        from mpi4py import MPI  # deferred for cost, as above
        if len(tensors) != 1:
            raise ValueError(f"the mpidp backend sends one tensor per call, got {len(tensors)}")
        tag_ub = MPI.COMM_WORLD.Get_attr(MPI.TAG_UB)  # kept for the monitored barrier
        if not 0 <= tag < tag_ub:
            raise ValueError(f"tag {tag} is out of the backend's range 0..{tag_ub - 1}")
        if peer != MPI.ANY_SOURCE:
            ops.check_root(peer, self.g.size)
        self.barrier_sync()  # after every collective called before it (torch's order)
        t = tensors[0]
        staged = ops.Staged(t, read=send)
        if send:
            request = self.p2p.Isend(staged.bytes, dest=peer, tag=tag)
            return P2PWork(self.g, request, ("send to rank {} (tag {})", peer, tag),
                           lambda status: staged)
        request = self.p2p.Irecv(staged.bytes, source=peer, tag=tag)

        def finish(status):
            got = status.Get_count(MPI.BYTE)
            if got != staged.bytes.nbytes:
                raise CommunicationError(self.g.rank, "recv", f"rank {status.Get_source()} "
                                         f"sent {got} bytes, the tensor holds "
                                         f"{staged.bytes.nbytes}")
            staged.done()
        return P2PWork(self.g, request, ("receive from rank {} (tag {})", peer, tag), finish)


def _cuda_devices(tensors) -> list:
    """The CUDA devices of the tensors in ``tensors`` (nested lists too)."""
    found, todo = set(), [tensors]
    while todo:
        t = todo.pop()
        if isinstance(t, torch.Tensor):
            if t.is_cuda:
                found.add(t.device)
        elif isinstance(t, (list, tuple)):
            todo.extend(t)
    return sorted(found, key=str)


def _poll(requests: list, timeout_s: float) -> bool:
    """True once every request of ``requests`` completed, False after ``timeout_s``."""
    from mpi4py import MPI  # deferred for cost, as above
    deadline = time.monotonic() + timeout_s
    while not MPI.Request.Testall(requests):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.001)
    return True


def create(opts, backend_options) -> ProcessGroup:
    """The backend's creator (torch's extended API): the default group on mpidp's group
    (starting it), a ``new_group`` on a sub-group of its ranks."""
    ranks = list(opts.global_ranks_in_group)
    g = runtime.init()
    world = dist.distributed_c10d._world.default_pg
    if world is None or not ranks:  # the default group
        if (opts.group_rank, opts.group_size) != (g.rank, g.size):
            raise ValueError(f"torch.distributed says this process is rank {opts.group_rank} "
                             f"of {opts.group_size}, MPI says rank {g.rank} of {g.size}: "
                             "start every rank with one MPI launcher (mpiexec, srun) and let "
                             "init_process_group take rank and world size from it")
        return ProcessGroup(g, "default")
    if dist.get_rank() != g.rank:
        raise ValueError(f"torch.distributed's default group has this process as rank "
                         f"{dist.get_rank()}, MPI as rank {g.rank}: a new_group on the mpidp "
                         "backend needs the two to agree")
    return ProcessGroup(runtime.subgroup(ranks), str(opts.group_id))
