"""Tier 1: the C extension against its numpy twin (and torch for bfloat16), bit for bit."""
import numpy as np
import pytest
import torch

from mpidp import config, host_kernels, host_kernels_numpy as twin
from mpidp.dtypes import BF16, F16, F32, F64, I32, I64, NUMPY_STORAGE, OP_MAX, OP_MIN, OP_SUM

ext = pytest.importorskip("mpidp._ext") if not config.get().require_extension else \
    host_kernels.extension()

ALL = [F16, BF16, F32, F64, I32, I64]
OPS = [OP_SUM, OP_MIN, OP_MAX]


def test_extension_is_the_host_implementation():
    assert host_kernels.IMPLEMENTATION == "c"


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
