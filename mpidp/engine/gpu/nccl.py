"""The NCCL transport: the ring's point-to-point steps as NCCL send/recv in a group, and
NCCL's own all-reduce as the baseline. It knows no algorithm.

Note [Streams of the ring on GPU]: two streams of our own. NCCL's sends and receives run on
``comm``; our reduction kernels on ``compute``. Before each step ``comm`` waits for
everything ``compute`` has queued (a send may read, and a receive overwrite, what the last
reduction wrote), and ``wait`` makes ``compute`` wait for the step's transfers. The host never
blocks inside the ring: the ordering is all events. At entry both streams wait for the
producer's stream (torch's current stream for torch tensors), and at exit the producer's
stream waits for both, so the caller sees the result in stream order, as with NCCL."""
from __future__ import annotations

from .device import cupy, nccl

_NCCL_OPS = ("NCCL_SUM", "NCCL_MIN", "NCCL_MAX")
_NCCL_TYPES = {0: "NCCL_FLOAT16", 1: "NCCL_BFLOAT16", 2: "NCCL_FLOAT32", 3: "NCCL_FLOAT64",
               4: "NCCL_INT32", 5: "NCCL_INT64"}  # mpidp.engine.dtypes codes


class NCCLTransport:
    """An NCCL communicator over the ranks of an MPI communicator ``comm`` (every rank of it
    constructs one at the same time: the unique id travels over MPI), with the two streams of
    Note [Streams of the ring on GPU]."""

    def __init__(self, comm):
        cp, nc = cupy(), nccl()
        self.rank, self.size = comm.Get_rank(), comm.Get_size()
        uid = nc.get_unique_id() if self.rank == 0 else None
        uid = comm.bcast(uid, root=0)  # 128 bytes, once per communicator
        self.nccl = nc.NcclCommunicator(self.size, uid, self.rank)
        self.device = cp.cuda.Device().id
        self.comm = cp.cuda.Stream(non_blocking=True)
        self.compute = cp.cuda.Stream(non_blocking=True)

    # ---- the transport seam of mpidp.engine.ring --------------------------------------------

    def start(self, send, dst: int, recv, src: int):
        """Queues one ring step (send to ``dst``, receive from ``src``, as bytes) on the comm
        stream; returns the event that marks its end."""
        nc = self.nccl
        self.comm.wait_event(self.compute.record())
        module = nccl()
        module.groupStart()
        try:
            if recv is not None:
                nc.recv(recv.data.ptr, recv.nbytes, module.NCCL_UINT8, src, self.comm.ptr)
            if send is not None:
                nc.send(send.data.ptr, send.nbytes, module.NCCL_UINT8, dst, self.comm.ptr)
        finally:
            module.groupEnd()
        return self.comm.record()

    def wait(self, handle) -> None:
        """Orders the compute stream after the step (no host wait)."""
        self.compute.wait_event(handle)

    # ---- around a collective -------------------------------------------------------------

    def enter(self, producer) -> None:
        """Both streams wait for what ``producer`` has queued (the input's writer)."""
        event = producer.record()
        self.comm.wait_event(event)
        self.compute.wait_event(event)

    def leave(self, producer) -> None:
        """``producer`` waits for everything the collective queued."""
        producer.wait_event(self.compute.record())
        producer.wait_event(self.comm.record())

    def allreduce(self, src, dst, dtype: int, op: int, average: bool) -> None:
        """ncclAllReduce of ``src`` into ``dst`` on the comm stream (the baseline)."""
        module = nccl()
        nccl_op = module.NCCL_AVG if average else getattr(module, _NCCL_OPS[op])
        self.nccl.allReduce(src.data.ptr, dst.data.ptr, len(src),
                            getattr(module, _NCCL_TYPES[dtype]), nccl_op, self.comm.ptr)

    def free(self) -> None:
        self.nccl.destroy()
