"""Tier 1: the C extension against its numpy twin (and torch for bfloat16), bit for bit."""
import numpy as np
import pytest
import torch

from mpidp import config
from mpidp.engine import host_ops, host_ops_numpy as twin
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

ext = pytest.importorskip("mpidp._ext") if not config.get().require_extension else \
    host_ops.extension()

ALL = [F16, BF16, F32, F64, I32, I64]
OPS = [OP_SUM, OP_MIN, OP_MAX]


def test_extension_is_the_host_implementation():
    assert host_ops.IMPLEMENTATION == "c"


def finite_bits(dtype, n, rng):
    """Random bit patterns of every magnitude (subnormals included), NaNs left out."""
    if dtype == BF16:
        bits = rng.integers(0, 1 << 16, size=n, dtype=np.uint32).astype(np.uint16)
        vals = (bits.astype(np.uint32) << 16).view(np.float32)
        return np.where(np.isnan(vals), np.uint16(0x3F80), bits)
    if dtype == F16:
        bits = rng.integers(0, 1 << 16, size=n, dtype=np.uint32).astype(np.uint16).view(np.float16)
        return np.where(np.isnan(bits), np.float16(1), bits)
    if dtype in (F32, F64):
        return (rng.standard_normal(n) * 10.0 ** rng.integers(-30, 30, n)).astype(NUMPY_STORAGE[dtype])
    info = np.iinfo(NUMPY_STORAGE[dtype])
    return rng.integers(info.min, info.max, size=n, dtype=NUMPY_STORAGE[dtype])


@pytest.mark.parametrize("dtype", ALL)
@pytest.mark.parametrize("op", OPS)
def test_reduce_into_matches_twin(dtype, op):
    rng = np.random.default_rng(dtype * 10 + op)
    for n in (0, 1, 7, 4099):
        a, b = finite_bits(dtype, n, rng), finite_bits(dtype, n, rng)
        c_dst, t_dst = a.copy(), a.copy()
        ext.reduce_into(c_dst, b, dtype, op)
        with np.errstate(over="ignore"):
            twin.reduce_into(t_dst, b, dtype, op)
        assert np.array_equal(c_dst.view(np.uint8), t_dst.view(np.uint8)), (dtype, op, n)


@pytest.mark.parametrize("dtype", [F16, BF16, F32, F64])
def test_divide_matches_twin(dtype):
    rng = np.random.default_rng(dtype)
    a = finite_bits(dtype, 5000, rng)
    for divisor in (1, 2, 3, 4, 7, 8, 1024):  # powers of two multiply (exact)
        c, t = a.copy(), a.copy()
        ext.divide(c, dtype, divisor)
        with np.errstate(over="ignore", under="ignore"):
            twin.divide(t, dtype, divisor)
        assert np.array_equal(c.view(np.uint8), t.view(np.uint8)), (dtype, divisor)


def test_float16_matches_numpy_and_bfloat16_matches_torch():
    rng = np.random.default_rng(1)
    a = finite_bits(F16, 10000, rng)
    b = finite_bits(F16, 10000, rng)
    got = a.copy()
    ext.reduce_into(got, b, F16, OP_SUM)
    with np.errstate(over="ignore"):
        assert np.array_equal(got.view(np.uint16), (a + b).view(np.uint16))
    x = torch.randn(10000).to(torch.bfloat16) * 1000
    y = torch.randn(10000).to(torch.bfloat16)
    got = x.view(torch.int16).numpy().view(np.uint16).copy()
    ext.reduce_into(got, y.view(torch.int16).numpy().view(np.uint16), BF16, OP_SUM)
    assert np.array_equal(got, (x + y).view(torch.int16).numpy().view(np.uint16))
    ext.divide(got, BF16, 3)
    assert np.array_equal(got, ((x + y) / 3).view(torch.int16).numpy().view(np.uint16))


def test_integer_sum_wraps_like_numpy():
    a = np.array([np.iinfo(np.int32).max, -5], np.int32)
    ext.reduce_into(a, np.array([1, 2], np.int32), I32, OP_SUM)
    assert a.tolist() == [np.iinfo(np.int32).min, -3]


@pytest.mark.parametrize("impl", [ext, twin], ids=["c", "numpy"])
def test_bad_arguments_are_clear_errors(impl):
    with pytest.raises(ValueError, match="bytes"):
        impl.reduce_into(np.ones(3, np.float32), np.ones(4, np.float32), F32, OP_SUM)
    with pytest.raises(ValueError, match="floating"):
        impl.divide(np.ones(3, np.int32), I32, 2)
    with pytest.raises(ValueError, match="positive"):
        impl.divide(np.ones(3, np.float32), F32, 0)
    if impl is ext:
        with pytest.raises(TypeError, match="writable"):
            ext.reduce_into(np.ones(3, np.float32).setflags(write=False) or
                            np.frombuffer(bytes(12), np.float32), np.ones(3, np.float32), F32, 0)
        with pytest.raises(ValueError, match="dtype code"):
            ext.reduce_into(np.ones(3, np.float32), np.ones(3, np.float32), 9, 0)


# ---- NaN in min and max (Note [NaN in min and max] in csrc/kernels.c) ------------------------

FLOATS = [F16, BF16, F32, F64]
NAN_LENGTHS = (1, 7, 33, 1000, 300001)  # scalar only, vector tails, vector bodies
# quiet, negative quiet, quiet with a payload, signalling (every one a NaN in its dtype)
NAN_BITS = {F16: (0x7E00, 0xFE00, 0x7E2B, 0x7C01), BF16: (0x7FC0, 0xFFC0, 0x7FC5, 0x7F81),
            F32: (0x7FC00000, 0xFFC00000, 0x7FC12345, 0x7F800001),
            F64: (0x7FF8000000000000, 0xFFF8000000000000, 0x7FF8000000012345,
                  0x7FF0000000000001)}
BITS = {F16: np.uint16, BF16: np.uint16, F32: np.uint32, F64: np.uint64}


def small_ints(dtype, n, rng):
    """Small integers stored in the dtype (exact in all four), infinities now and then."""
    v = rng.integers(-50, 50, size=n).astype(np.float32)
    v[rng.random(n) < 0.02] = np.inf
    v[rng.random(n) < 0.02] = -np.inf
    if dtype == BF16:
        return (v.view(np.uint32) >> 16).astype(np.uint16)
    return v.astype(NUMPY_STORAGE[dtype])


def nan_positions(n, rng):
    """First, last, middle, around 16- and 32-byte lane boundaries, and ~3% at random."""
    fixed = [0, n - 1, n // 2] + [i for i in (3, 4, 7, 8, 15, 16, 31, 32) if i < n]
    mask = rng.random(n) < 0.03
    mask[fixed] = True
    return mask


def with_nans(values, dtype, mask, rng):
    out = values.copy()
    bits = out.view(BITS[dtype])
    bits[mask] = rng.choice(np.array(NAN_BITS[dtype], BITS[dtype]), size=int(mask.sum()))
    return out


def nan_cases(dtype, n, rng, where):
    """(dst, src) of small integers with NaN in dst only, src only, both at the same places,
    or each at its own (overlapping) places."""
    a, b = small_ints(dtype, n, rng), small_ints(dtype, n, rng)
    ma = nan_positions(n, rng) if where != "src" else np.zeros(n, bool)
    mb = ma if where == "both" else nan_positions(n, rng) if where != "dst" else np.zeros(n, bool)
    return with_nans(a, dtype, ma, rng), with_nans(b, dtype, mb, rng)


def as_float(x, dtype):
    return (x.astype(np.uint32) << 16).view(np.float32) if dtype == BF16 else x


def torch_tensor(x, dtype):
    if dtype == BF16:
        return torch.from_numpy(x.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(x)


@pytest.mark.parametrize("dtype", FLOATS, ids=["f16", "bf16", "f32", "f64"])
@pytest.mark.parametrize("op", [OP_MIN, OP_MAX], ids=["min", "max"])
@pytest.mark.parametrize("where", ["dst", "src", "both", "mixed"])
def test_min_max_propagate_nan(dtype, op, where):
    """NaN wherever either operand is NaN, the exact min/max elsewhere, whichever side holds
    the NaN; the C extension and the twin bit for bit alike; the result is one operand's own
    bits: dst's NaN, else src's NaN, else the min/max."""
    rng = np.random.default_rng(100 * dtype + 10 * op + len(where))
    np_op, torch_op = (np.minimum, torch.minimum) if op == OP_MIN else (np.maximum, torch.maximum)
    for n in NAN_LENGTHS:
        a, b = nan_cases(dtype, n, rng, where)
        fa, fb = as_float(a, dtype), as_float(b, dtype)
        nan = np.isnan(fa) | np.isnan(fb)
        assert nan.any()
        results = []
        for impl in (ext, twin):
            got = a.copy()
            impl.reduce_into(got, b, dtype, op)
            g = as_float(got, dtype)
            assert np.array_equal(np.isnan(g), nan), (impl.__name__, n)
            assert np.array_equal(g[~nan], np_op(fa, fb)[~nan]), (impl.__name__, n)
            want = np.where(np.isnan(fa), a, np.where(np.isnan(fb), b, got))
            assert np.array_equal(got.view(BITS[dtype]), want.view(BITS[dtype])), \
                (impl.__name__, n)
            results.append(got.view(BITS[dtype]))
        assert np.array_equal(*results), n  # C == twin, bit for bit
        ref = torch_op(torch_tensor(a, dtype), torch_tensor(b, dtype))  # torch agrees
        assert np.array_equal(ref.isnan().numpy(), nan)
        assert np.array_equal(ref.float().numpy()[~nan], g[~nan].astype(np.float32))


@pytest.mark.parametrize("dtype", FLOATS, ids=["f16", "bf16", "f32", "f64"])
@pytest.mark.parametrize("op", [OP_MIN, OP_MAX], ids=["min", "max"])
def test_min_max_nan_whichever_order_and_slices(dtype, op):
    """Reducing a, b, c in any order, or in slices of any alignment, leaves NaN in the same
    places (the old min kept a NaN in dst and dropped one in src)."""
    rng = np.random.default_rng(7 * dtype + op)
    n = 1000
    x = [nan_cases(dtype, n, rng, "mixed")[i] for i in (0, 1)] + [small_ints(dtype, n, rng)]
    nan = np.zeros(n, bool)
    for v in x:
        nan |= np.isnan(as_float(v, dtype))
    for order in ((0, 1, 2), (2, 1, 0), (1, 2, 0)):
        for impl in (ext, twin):
            acc = x[order[0]].copy()
            for k in order[1:]:
                for lo, hi in ((0, 1), (1, 20), (20, 517), (517, n)):
                    impl.reduce_into(acc[lo:hi], x[k][lo:hi], dtype, op)
            assert np.array_equal(np.isnan(as_float(acc, dtype)), nan), (order, impl.__name__)


def test_signed_zero_ties_keep_dst_in_c_and_twin():
    """min/max of +0 and -0 keep dst in both implementations (numpy's own float32 loops keep
    src, its float16 loops dst: the twin does not lean on them)."""
    for dtype in FLOATS:
        a, b = np.zeros(4, NUMPY_STORAGE[dtype]), np.zeros(4, NUMPY_STORAGE[dtype])  # +0
        b.view(BITS[dtype])[:] |= np.array(1, BITS[dtype]) << (8 * b.itemsize - 1)  # -0
        for op in (OP_MIN, OP_MAX):
            for impl in (ext, twin):
                for dst, src in ((a, b), (b, a)):
                    got = dst.copy()
                    impl.reduce_into(got, src, dtype, op)
                    assert np.array_equal(got.view(BITS[dtype]), dst.view(BITS[dtype])), \
                        (dtype, op, impl.__name__)


def test_stream_copy_is_a_copy_at_every_alignment_and_size():
    """Note [Streaming copy]: the non-temporal copy the benchmark's memory bound uses writes
    exactly the source's bytes, whatever the destination's alignment and the size (a
    head before the first 16-byte boundary, 64-byte blocks, a tail), and nothing past them."""
    rng = np.random.default_rng(3)
    src = rng.integers(0, 256, size=4096 + 64, dtype=np.uint8)
    for offset in (0, 1, 7, 15, 16, 33):
        for n in (0, 1, 15, 16, 63, 64, 65, 200, 4096):
            dst = np.zeros(n + 64 + 16, np.uint8)
            ext.stream_copy(dst[offset:offset + n], src[3:3 + n])
            assert np.array_equal(dst[offset:offset + n], src[3:3 + n]), (offset, n)
            assert not dst[:offset].any() and not dst[offset + n:].any(), (offset, n)
    with pytest.raises(ValueError, match="stream_copy: dst has 4 bytes, src 5"):
        ext.stream_copy(np.zeros(4, np.uint8), np.zeros(5, np.uint8))
    with pytest.raises((TypeError, ValueError), match="dst"):
        ext.stream_copy(bytes(4), np.zeros(4, np.uint8))  # read-only
