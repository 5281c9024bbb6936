"""The ring all-reduce: reduce-scatter then all-gather, pipelined in pieces, written once over
two seams so every device runs the same schedule:

* a transport: ``rank``, ``size``, ``start(send, dst, recv, src) -> handle``, ``wait(handle)``
  (MPI point-to-point on host buffers, NCCL send/recv on GPU buffers, a loopback in tests);
* an array namespace: ``reduce_into(dst, src, dtype, op, divisor)`` (dst op src, then divided
  by ``divisor`` when it is > 1, in one pass where the device can) and ``divide(buf, dtype,
  n)`` on flat 1-D buffers that slice like numpy arrays (numpy, CuPy).

Planning is pure data (``partition`` from mpidp.engine.blocks, ``ring_schedule``, ``pieces``);
the executor walks it.
The ring knows neither MPI nor CUDA."""
from __future__ import annotations

from typing import Any, Sequence, Tuple

from .blocks import Span, partition


def ring_schedule(rank: int, size: int) -> Tuple[Tuple[Tuple[int, int], ...], Tuple[Tuple[int, int], ...]]:
    """The (send chunk, receive chunk) of each step, reduce-scatter steps then all-gather
    steps. After reduce-scatter, rank r holds the fully reduced chunk r."""
    # reduce-scatter step k: send chunk (r-k-1) mod n, receive and reduce chunk (r-k-2) mod n
    scatter = tuple(((rank - k - 1) % size, (rank - k - 2) % size) for k in range(size - 1))
    # all-gather step k: send chunk (r-k) mod n, receive chunk (r-k-1) mod n into place
    gather = tuple(((rank - k) % size, (rank - k - 1) % size) for k in range(size - 1))
    return scatter, gather


def pieces(span: Span, piece_count: int) -> Tuple[Span, ...]:
    """Splits one chunk into pipelining pieces of at most ``piece_count`` elements."""
    offset, count = span
    piece_count = max(1, piece_count)
    return tuple((offset + o, min(piece_count, count - o)) for o in range(0, count, piece_count))


def _view(buf, span: Span):
    return buf[span[0]:span[0] + span[1]]


def reduce_scatter_phase(buf, scratch: Sequence[Any], transport, ops, dtype: int, op: int,
                         chunks: Sequence[Span], piece_count: int, divisor: int = 1) -> None:
    """Leaves chunk ``transport.rank`` of ``buf`` reduced over every rank (and divided by
    ``divisor`` in its last reduction: the average's scale fused into the pass). ``scratch``
    is two buffers of ``piece_count`` elements: piece i+1 arrives in one while piece i is
    reduced from the other."""
    n, r = transport.size, transport.rank
    prev, nxt = (r - 1) % n, (r + 1) % n
    for send_chunk, recv_chunk in ring_schedule(r, n)[0]:
        # step k: send chunk (r-k-1) mod n, receive and reduce chunk (r-k-2) mod n; the last
        # step (k = n-2) receives this rank's own chunk, which then holds every rank's terms
        scale = divisor if recv_chunk == r else 1
        sends, recvs = pieces(chunks[send_chunk], piece_count), pieces(chunks[recv_chunk], piece_count)
        steps = max(len(sends), len(recvs))

        def start(i):
            send = _view(buf, sends[i]) if i < len(sends) else None
            recv = scratch[i % 2][:recvs[i][1]] if i < len(recvs) else None
            return transport.start(send, nxt, recv, prev)

        handle = start(0) if steps else None
        for i in range(steps):
            transport.wait(handle)
            if i + 1 < steps:
                handle = start(i + 1)
            if i < len(recvs):
                ops.reduce_into(_view(buf, recvs[i]), scratch[i % 2][:recvs[i][1]], dtype, op,
                                scale)


def allgather_phase(buf, transport, chunks: Sequence[Span]) -> None:
    """Passes every rank's chunk (chunk r from rank r) around the ring into place."""
    n, r = transport.size, transport.rank
    prev, nxt = (r - 1) % n, (r + 1) % n
    for send_chunk, recv_chunk in ring_schedule(r, n)[1]:
        handle = transport.start(_view(buf, chunks[send_chunk]), nxt,
                                 _view(buf, chunks[recv_chunk]), prev)
        transport.wait(handle)


def ring_allreduce(buf, scratch: Sequence[Any], transport, ops, dtype: int, op: int,
                   divisor: int = 1, piece_count: int = 1 << 18) -> None:
    """In-place all-reduce of the flat buffer ``buf`` over every rank of ``transport``;
    ``divisor > 1`` divides the result (average). Every rank must call it with the same count.
    The result is bitwise identical on every rank: each chunk is reduced once, by its owner's
    ring predecessor chain, then copied."""
    n = transport.size
    if n == 1 or len(buf) == 0:
        if divisor > 1 and len(buf):
            ops.divide(buf, dtype, divisor)
        return
    chunks = partition(len(buf), n)
    reduce_scatter_phase(buf, scratch, transport, ops, dtype, op, chunks, piece_count, divisor)
    allgather_phase(buf, transport, chunks)
