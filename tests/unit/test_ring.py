"""Tier 1: the ring's plan as pure data, and the ring itself for n virtual ranks in one process
over the loopback transport (threads in lockstep through mailboxes: deterministic)."""
import threading

import numpy as np
import pytest
import torch

from mpidp.engine import host_ops, host_ops_numpy
from mpidp.engine.dtypes import (
    BF16,
    F16,
    F32,
    F64,
    I32,
    I64,
    NUMPY_STORAGE,
    OP_MAX,
    OP_MIN,
    OP_SUM)
from mpidp.engine.ring import (
    partition,
    pieces,
    reduce_scatter_phase,
    ring_allreduce,
    ring_schedule)
from mpidp.engine.transports import LoopbackNetwork


@pytest.mark.parametrize("count", [0, 1, 2, 5, 8, 17, 1000])
@pytest.mark.parametrize("parts", [1, 2, 3, 4, 7, 8])
def test_partition_is_array_split(count, parts):
    spans = partition(count, parts)
    ref = np.array_split(np.arange(count), parts)
    assert [c for _, c in spans] == [len(r) for r in ref]
    assert [o for o, c in spans if c] == [int(r[0]) for r in ref if len(r)]


def test_partition_by_rows():
    assert partition(12, 3, unit=4) == ((0, 4), (4, 4), (8, 4))
    assert partition(20, 3, unit=4) == ((0, 8), (8, 8), (16, 4))
    with pytest.raises(ValueError, match="multiple"):
        partition(10, 2, unit=4)
    with pytest.raises(ValueError, match="parts"):
        partition(10, 0)


@pytest.mark.parametrize("n", [1, 2, 3, 4, 5, 8])
def test_schedule_delivers_every_chunk(n):
    """Simulate the schedule symbolically: after reduce-scatter rank r's chunk r holds every
    rank's contribution; after all-gather every rank holds every chunk."""
    have = [[{r} for _ in range(n)] for r in range(n)]  # have[rank][chunk] = contributors
    sched = [ring_schedule(r, n) for r in range(n)]
    for k in range(n - 1):
        sent = [(sched[r][0][k][0], set(have[r][sched[r][0][k][0]])) for r in range(n)]
        for r in range(n):
            chunk, data = sent[(r - 1) % n]
            assert chunk == sched[r][0][k][1], "receiver expects the chunk its neighbour sends"
            have[r][chunk] |= data
    for r in range(n):
        assert have[r][r] == set(range(n))
    full = [[set(c) if i == r else None for i, c in enumerate(have[r])] for r in range(n)]
    for k in range(n - 1):
        sent = [(sched[r][1][k][0], full[r][sched[r][1][k][0]]) for r in range(n)]
        for r in range(n):
            chunk, data = sent[(r - 1) % n]
            assert chunk == sched[r][1][k][1] and data == set(range(n))
            full[r][chunk] = data
    assert all(c == set(range(n)) for row in full for c in row)


def test_pieces():
    assert pieces((10, 7), 3) == ((10, 3), (13, 3), (16, 1))
    assert pieces((0, 0), 3) == ()


def run_virtual_ring(bufs, dtype, op, divisor=1, piece_count=5, ops=host_ops):
    net = LoopbackNetwork(len(bufs))
    errors = []

    def rank_main(r):
        try:
            scratch = (np.empty(piece_count, bufs[r].dtype), np.empty(piece_count, bufs[r].dtype))
            ring_allreduce(bufs[r], scratch, net.transport(r), ops, dtype, op, divisor,
                           piece_count)
        except Exception as exc:  # noqa: BLE001 - re-raised in the test thread
            errors.append(exc)

    threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(len(bufs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors
    assert not any(t.is_alive() for t in threads), "virtual ring hung"


def small_ints(rng, count, dtype):
    vals = rng.integers(-8, 9, size=count)
    if dtype == BF16:
        return torch.tensor(vals, dtype=torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    return vals.astype(NUMPY_STORAGE[dtype])


def as_float(a, dtype):
    if dtype == BF16:
        return (a.astype(np.uint32) << 16).view(np.float32).astype(np.float64)
    return a.astype(np.float64)


@pytest.mark.parametrize("ops", [host_ops, host_ops_numpy], ids=["c", "numpy"])
@pytest.mark.parametrize("n", [1, 2, 3, 4, 5, 8])
@pytest.mark.parametrize("dtype", [F16, BF16, F32, F64, I32, I64])
def test_virtual_ring_is_exact(ops, n, dtype):
    rng = np.random.default_rng(n * 31 + dtype)
    for count in sorted({0, 1, max(n - 1, 1), n + 1, 3 * n + 2, 97}):
        for op in (OP_SUM, OP_MIN, OP_MAX):
            inputs = [small_ints(rng, count, dtype) for _ in range(n)]
            bufs = [x.copy() for x in inputs]
            run_virtual_ring(bufs, dtype, op, ops=ops)
            stack = np.stack([as_float(x, dtype) for x in inputs])
            want = {OP_SUM: stack.sum(0), OP_MIN: stack.min(0), OP_MAX: stack.max(0)}[op]
            for b in bufs:
                assert np.array_equal(as_float(b, dtype), want), (n, count, op)
                assert np.array_equal(b.view(np.uint8), bufs[0].view(np.uint8))


@pytest.mark.parametrize("n", [2, 3, 8])
def test_virtual_ring_average_and_reduce_scatter(n):
    rng = np.random.default_rng(n)
    inputs = [rng.integers(-8, 9, size=50).astype(np.float64) for _ in range(n)]
    bufs = [x.copy() for x in inputs]
    run_virtual_ring(bufs, F64, OP_SUM, divisor=n, piece_count=4)
    for b in bufs:
        assert np.array_equal(b, np.sum(inputs, axis=0) / n)
    # reduce-scatter alone leaves rank r with chunk r
    net, chunks = LoopbackNetwork(n), partition(50, n)
    bufs = [x.copy() for x in inputs]
    threads = [threading.Thread(target=reduce_scatter_phase, args=(
        bufs[r], (np.empty(4), np.empty(4)), net.transport(r), host_ops, F64, OP_SUM,
        chunks, 4)) for r in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    total = np.sum(inputs, axis=0)
    for r, (o, c) in enumerate(chunks):
        assert np.array_equal(bufs[r][o:o + c], total[o:o + c])
