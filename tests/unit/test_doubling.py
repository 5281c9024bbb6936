"""Tier 1: recursive doubling with the check in the messages (mpidp/engine/doubling.py), for 1-9
virtual ranks over the loopback transport: the schedule pairs every rank once per round and
folds the ranks beyond a power of two; every rank ends with the exact reduction, bitwise the
same everywhere, and every rank's free word; one disagreeing or refusing rank makes every
rank's status DISAGREE; a refusing rank's short record never breaks a peer's merge."""
import threading

import numpy as np
import pytest

from mpidp.engine import doubling, host_ops
from mpidp.engine.dtypes import F16, F32, I64, OP_MAX, OP_MIN, OP_SUM
from mpidp.engine.transports import LoopbackNetwork

HDR = (1, 8, 0, 3, 5, 77, 0, 0)


@pytest.mark.parametrize("size", range(1, 10))
def test_schedule_pairs_every_rank_and_folds_the_rest(size):
    m = 1 << (size.bit_length() - 1)
    plans = [doubling.schedule(r, size) for r in range(size)]
    for r, p in enumerate(plans):
        if r >= m:
            assert p.fold_out == r - m and p.rounds == () and plans[r - m].fold_in == r
        else:
            assert p.fold_out is None and len(p.rounds) == m.bit_length() - 1
            for k, peer in enumerate(p.rounds):  # symmetric: my partner's partner is me
                assert plans[peer].rounds[k] == r
    with pytest.raises(ValueError, match="rank 3 is not in 0..2"):
        doubling.schedule(3, 3)


def exchange(records, dtype=F32, op=OP_SUM):
    net = LoopbackNetwork(len(records))
    out = [None] * len(records)

    def rank_main(r):
        out[r] = doubling.run(net.transport(r), records[r], host_ops, dtype, op)

    threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(len(records))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert not any(t.is_alive() for t in threads), "virtual doubling hung"
    return out


@pytest.mark.parametrize("size", range(1, 10))
@pytest.mark.parametrize("dtype,np_dtype,op", [(F32, np.float32, OP_SUM), (I64, np.int64, OP_MAX),
                                               (F16, np.float16, OP_MIN)])
def test_every_rank_ends_with_the_exact_reduction(size, dtype, np_dtype, op):
    rng = np.random.default_rng(size)
    inputs = [rng.integers(-8, 9, 37).astype(np_dtype) for _ in range(size)]
    want = {OP_SUM: np.sum, OP_MAX: np.max, OP_MIN: np.min}[op](np.stack(inputs), axis=0)
    records = [doubling.Record(HDR[:7] + (10 + r,), r, size, x.copy())
               for r, x in enumerate(inputs)]
    for r, rec in enumerate(exchange(records, dtype, op)):
        assert rec.status == doubling.OK
        assert np.array_equal(rec.data, want) and rec.data.dtype == np_dtype
        assert rec.free.tolist() == [10 + q for q in range(size)]  # every rank's free word


def test_floats_end_bitwise_equal_on_every_rank():
    rng = np.random.default_rng(0)
    inputs = [rng.standard_normal(1000).astype(np.float32) for _ in range(7)]
    out = exchange([doubling.Record(HDR, r, 7, x.copy()) for r, x in enumerate(inputs)])
    assert all(np.array_equal(o.data.view(np.uint32), out[0].data.view(np.uint32)) for o in out)


@pytest.mark.parametrize("size", [2, 3, 4, 5, 8])
@pytest.mark.parametrize("odd", ["header", "refusal", "count"])
def test_one_odd_rank_makes_every_status_disagree(size, odd):
    for bad in range(size):
        records = []
        for r in range(size):
            x = np.arange(6, dtype=np.float32)
            hdr = HDR
            if r == bad and odd == "header":
                hdr = HDR[:3] + (4,) + HDR[4:]  # another dtype
            if r == bad and odd == "refusal":  # its error header, no data
                records.append(doubling.Record((1, 0, 0, 0, 0, 0, 2, 0), r, size, None))
                continue
            if r == bad and odd == "count":
                x = np.arange(7, dtype=np.float32)  # the header says 5: lengths differ too
            records.append(doubling.Record(hdr, r, size, x))
        assert {rec.status for rec in exchange(records)} == {doubling.DISAGREE}, (size, bad)


def test_a_header_only_exchange_gathers_the_free_words():
    out = exchange([doubling.Record(HDR[:7] + (-r,), r, 5, None) for r in range(5)])
    assert all(o.status == doubling.OK and o.free.tolist() == [0, -1, -2, -3, -4] for o in out)


def test_a_truncated_record_is_an_error():
    rec = doubling.Record(HDR, 0, 2, None)
    with pytest.raises(ValueError, match="a record of 8 bytes"):
        rec.merge(np.zeros(8, np.uint8), True, host_ops, F32, OP_SUM)
