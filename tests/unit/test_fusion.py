"""Tier 1: bucket fusion — the C pack/unpack against its numpy twin, the Bucket on torch
tensors, and the pure bucket assignment."""
import numpy as np
import pytest
import torch

from mpidp import config
from mpidp.engine import host_ops, host_ops_numpy as twin
from mpidp.engine.dtypes import BF16, F16, F32, F64, I32, I64, NUMPY_STORAGE
from mpidp.comm.buckets import Bucket
from mpidp.comm.fusion import assign_buckets, plan

ext = pytest.importorskip("mpidp._ext") if not config.get().require_extension else \
    host_ops.extension()
IMPLS = [ext, twin]
FLOATS = [F16, BF16, F32, F64]


def small_ints(dtype, n, rng):
    """Small integers in the dtype's storage (bfloat16 as its bit pattern)."""
    vals = rng.integers(-50, 51, size=n)
    if dtype == BF16:
        return torch.tensor(vals, dtype=torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    return vals.astype(NUMPY_STORAGE[dtype])


@pytest.mark.parametrize("dtype", [F16, BF16, F32, F64, I32, I64])
def test_pack_unpack_match_twin_on_odd_sizes(dtype):
    rng = np.random.default_rng(dtype)
    sizes = [0, 1, 7, 1000, 3, 4099, 0, 2]
    sources = [small_ints(dtype, n, rng) for n in sizes]
    total = sum(sizes)
    results = []
    for impl in IMPLS:
        bucket = np.full(total + 5, 7, NUMPY_STORAGE[dtype])  # spare room stays untouched
        assert impl.pack(bucket, sources) == total * bucket.itemsize
        assert np.array_equal(bucket[:total], np.concatenate(sources))
        assert np.all(bucket[total:] == 7)
        outs = [np.empty(n, NUMPY_STORAGE[dtype]) for n in sizes]
        assert impl.unpack(bucket, outs, dtype, 1) == total * bucket.itemsize
        for o, s in zip(outs, sources):
            assert np.array_equal(o, s)
        if dtype in FLOATS:
            divided = [np.empty(n, NUMPY_STORAGE[dtype]) for n in sizes]
            impl.unpack(bucket, divided, dtype, 3)
            results.append(np.concatenate(divided).view(np.uint8))
    if results:
        assert np.array_equal(results[0], results[1])  # the fused divide, bit for bit


@pytest.mark.parametrize("dtype", FLOATS)
def test_unpack_divide_equals_divide_after_copy(dtype):
    rng = np.random.default_rng(10 + dtype)
    src = small_ints(dtype, 999, rng)
    fused = np.empty_like(src)
    ext.unpack(src, [fused], dtype, 7)
    separate = src.copy()
    ext.divide(separate, dtype, 7)
    assert np.array_equal(fused.view(np.uint8), separate.view(np.uint8))


@pytest.mark.parametrize("impl", IMPLS, ids=["c", "numpy"])
def test_pack_and_unpack_edge_cases_and_errors(impl):
    bucket = np.zeros(4, np.float32)
    assert impl.pack(bucket, []) == 0
    assert impl.unpack(bucket, [], F32, 2) == 0
    assert impl.pack(bucket, [bytearray(b"\x01\x02\x03")]) == 3  # any buffer, any size
    with pytest.raises(ValueError, match="more than the bucket"):
        impl.pack(bucket, [np.ones(3, np.float32), np.ones(2, np.float32)])
    with pytest.raises(ValueError, match="more than the bucket"):
        impl.unpack(bucket, [np.ones(5, np.float32)], F32, 1)
    with pytest.raises(ValueError, match="floating"):
        impl.unpack(np.zeros(4, np.int32), [np.ones(4, np.int32)], I32, 2)
    with pytest.raises(ValueError, match="positive"):
        impl.unpack(bucket, [np.ones(4, np.float32)], F32, 0)
    with pytest.raises(ValueError, match="multiple of the item"):
        impl.unpack(bucket, [bytearray(3)], F32, 1)
    with pytest.raises(TypeError, match="contiguous"):
        impl.pack(bucket, [np.ones((4, 2), np.float32)[:, 0]])
    with pytest.raises(TypeError):
        impl.unpack(bucket, [bytes(4)], F32, 1)  # read-only destination
    with pytest.raises(TypeError):
        impl.pack(bucket, [object()])


def test_bucket_on_torch_tensors_of_every_float_dtype():
    for dtype in (torch.float16, torch.bfloat16, torch.float32, torch.float64):
        ts = [torch.randint(-9, 10, s).to(dtype) for s in ((3, 4), (5,), (0,), (2, 2, 2))]
        bucket = plan(ts, 1 << 20)
        assert len(bucket) == 1
        b = bucket[0]
        b.pack([ts[i] for i in b.indices])
        outs = [torch.empty_like(t) for t in ts]
        b.unpack([outs[i] for i in b.indices], 2)
        for o, t in zip(outs, ts):
            assert torch.equal(o, t / 2), dtype
        view = b.torch_view(b.indices.index(0), ts[0])
        assert view.dtype == dtype and view.shape == ts[0].shape and torch.equal(view, ts[0])


def test_bucket_handles_none_noncontiguous_and_own_slots():
    a = torch.arange(6.0).reshape(2, 3)
    b = Bucket((0, 1), (6, 6), F32)
    b.pack([a, None])
    assert np.array_equal(b.flat, np.r_[np.arange(6.0), np.zeros(6)])
    dest = torch.zeros(3, 2).t()  # non-contiguous destination
    b.unpack([dest, None])
    assert torch.equal(dest, a)
    b.unpack_one(1, dest)
    assert torch.equal(dest, torch.zeros(2, 3))
    own = b.torch_view(0, a)
    own.copy_(a * 10)
    b.pack([own, torch.ones(6)], skip_own_slots=True)
    assert np.array_equal(b.flat, np.r_[np.arange(6.0) * 10, np.ones(6)])


# ---- bucket assignment --------------------------------------------------------------------

def check_assignment(sizes, dtypes, cap, first, order, buckets, max_count=None):
    flat = [i for b in buckets for i in b]
    assert sorted(flat) == list(range(len(sizes)))  # every tensor exactly once
    position = {t: k for k, t in enumerate(order)}
    assert [position[b[0]] for b in buckets] == sorted(position[b[0]] for b in buckets)
    started = set()
    for b in buckets:
        assert len({dtypes[i] for i in b}) == 1  # one dtype per bucket
        assert [position[i] for i in b] == sorted(position[i] for i in b)
        limit = cap if dtypes[b[0]] in started else first
        assert sum(sizes[i] for i in b[:-1]) < limit  # closed as soon as it reached the cap
        assert max_count is None or len(b) <= max_count
        started.add(dtypes[b[0]])


def test_assign_buckets_properties_on_random_inputs():
    rng = np.random.default_rng(0)
    for trial in range(200):
        n = int(rng.integers(0, 40))
        sizes = [int(s) for s in rng.integers(0, 5000, n)]
        dtypes = [str(d) for d in rng.choice(["f32", "f16", "i64"], n)]
        cap, first = int(rng.integers(1, 20000)), int(rng.integers(1, 20000))
        order = [int(i) for i in rng.permutation(n)]
        max_count = None if trial % 2 else int(rng.integers(1, 6))
        buckets = assign_buckets(sizes, dtypes, cap, first, order, max_count)
        check_assignment(sizes, dtypes, cap, first, order, buckets, max_count)


def test_assign_buckets_examples():
    # DDP's reverse order with a small first bucket
    assert assign_buckets([4, 4, 4, 4], ["f"] * 4, 8, 4, order=[3, 2, 1, 0]) == \
        ((3,), (2, 1), (0,))
    # a tensor larger than the cap gets its own bucket; dtypes never mix
    assert assign_buckets([100, 1, 1, 1], ["f", "h", "f", "h"], 10) == ((0,), (1, 3), (2,))
    assert assign_buckets([], [], 10) == ()
    assert assign_buckets([1] * 5, ["f"] * 5, 100, max_count=2) == ((0, 1), (2, 3), (4,))
    with pytest.raises(ValueError, match="max_count"):
        assign_buckets([1], ["f"], 10, max_count=0)
    with pytest.raises(ValueError, match="permutation"):
        assign_buckets([1, 2], ["f", "f"], 10, order=[0, 0])
    with pytest.raises(ValueError, match="positive"):
        assign_buckets([1], ["f"], 0)
    with pytest.raises(ValueError, match="dtypes"):
        assign_buckets([1, 2], ["f"], 10)


@pytest.mark.parametrize("wire", [F16, BF16])
@pytest.mark.parametrize("divisor", [1, 3, 4])
def test_cast_segments_match_torch_and_twin(wire, divisor):
    """Note [Casting buckets]: float32 -> 16 bits (x / divisor, one rounding) and back
    (widened, then divided in float32): bit for bit torch's own casts, in C and the twin,
    on values that round (ties, subnormals, overflow to inf, NaN) and odd segment sizes."""
    rng = np.random.default_rng(wire * 10 + divisor)
    sizes = [0, 1, 7, 1000, 3, 4099]
    special = np.array([0.0, -0.0, 1 + 2 ** -11, 1 + 3 * 2 ** -11, 65504.0, 65520.0, 1e-7,
                        -3e-8, 1e38, np.inf, -np.inf, np.nan, 1 + 2 ** -8, 257.0], np.float32)
    sources = [np.concatenate([special, (rng.standard_normal(n) * 10.0 ** rng.integers(-6, 6, n))
                               .astype(np.float32)])[:n] for n in sizes]
    torch_wire = {F16: torch.float16, BF16: torch.bfloat16}[wire]
    expected = torch.cat([torch.from_numpy(s) / divisor if divisor > 1 else torch.from_numpy(s)
                          for s in sources]).to(torch_wire)
    back = expected.float() / divisor if divisor > 1 else expected.float()
    want = expected.view(torch.int16).numpy().view(np.uint16)
    nan = torch.isnan(expected).numpy()  # torch's NaN bits vary (0x7fc0, 0xffff): any NaN
    packed = []
    for impl in IMPLS:
        bucket = np.full(sum(sizes) + 3, 7, np.uint16)
        assert impl.cast_segments(bucket, sources, wire, F32, divisor, False) == sum(sizes) * 2
        assert np.array_equal(bucket[:sum(sizes)][~nan], want[~nan])
        assert np.all(bucket[sum(sizes):] == 7)
        packed.append(bucket)
        outs = [np.full(n, 5, np.float32) for n in sizes]
        impl.cast_segments(bucket, outs, wire, F32, divisor, True)
        got = np.concatenate(outs)
        assert np.array_equal(got[~nan].view(np.uint32), back.numpy()[~nan].view(np.uint32))
        assert np.isnan(got[nan]).all()
    assert np.array_equal(packed[0], packed[1])  # the C kernel and its twin: every bit


@pytest.mark.parametrize("impl", IMPLS, ids=["c", "twin"])
def test_cast_segments_errors(impl):
    bucket, f32 = np.zeros(4, np.uint16), [np.zeros(4, np.float32)]
    with pytest.raises(ValueError, match="float32 buffers to and from"):
        impl.cast_segments(bucket, f32, F32, F32, 1, False)
    with pytest.raises(ValueError, match="divisor must be positive"):
        impl.cast_segments(bucket, f32, F16, F32, 0, False)
    with pytest.raises(ValueError, match="need 8 bucket bytes, more than the bucket's 6"):
        impl.cast_segments(np.zeros(3, np.uint16), f32, BF16, F32, 1, False)
    with pytest.raises(ValueError, match="not a multiple of the item size 4"):
        impl.cast_segments(bucket, [np.zeros(3, np.uint16)], BF16, F32, 1, True)
