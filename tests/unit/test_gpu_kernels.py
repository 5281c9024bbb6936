"""Tier 1, no GPU needed: every CUDA source in mpidp/engine/gpu/kernels compiles with nvcc for sm_80 and
sm_90 with warnings as errors, and the kernels' element math (elementwise.cuh, compiled for
the host) equals the C extension's bit for bit. Without nvcc the compile tests skip, except
in CI (CI set), where a missing nvcc is a failure."""
import ctypes
import os
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch

from mpidp import _ext
from mpidp.engine.dtypes import BF16, F16, F32, F64, FLOATING, I32, I64, NUMPY_STORAGE

KERNELS = Path(__file__).parents[2] / "mpidp" / "engine" / "gpu" / "kernels"
HARNESS = Path(__file__).parents[1] / "harness" / "host_harness.cu"
SOURCES = sorted(KERNELS.glob("*.cu"))
ARCHS = ("sm_75", "sm_80", "sm_90")  # sm_75: the bfloat16 conversion's pre-sm_80 path
SUFFIXES = ("f16", "bf16", "f32", "f64", "i32", "i64")
ENTRY_POINTS = {
    "reduce.cu": [f"mpidp_reduce_{d}_{o}" for d in SUFFIXES for o in ("sum", "min", "max")]
    + [f"mpidp_divide_{d}" for d in SUFFIXES[:4]],
    "pack.cu": ["mpidp_copy_bytes"] + [f"mpidp_unpack_divide_{d}" for d in SUFFIXES[:4]]
    + ["mpidp_cast_f16", "mpidp_cast_bf16"],
}


def nvcc():
    found = shutil.which("nvcc") or next(
        (str(p) for p in Path("/usr/local").glob("cuda*/bin/nvcc") if p.exists()), None)
    if found is None:
        if os.environ.get("CI"):
            pytest.fail("CI must compile the CUDA kernels, but nvcc is not on PATH")
        pytest.skip("nvcc not found: the CUDA sources are compiled where the CUDA toolkit is")
    return found


def test_every_kernel_source_is_shipped():
    assert {p.name for p in SOURCES} == {"reduce.cu", "pack.cu"}
    assert (KERNELS / "elementwise.cuh").exists()


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("source", SOURCES, ids=lambda p: p.name)
def test_kernel_compiles_without_warnings(source, arch, tmp_path):
    cmd = [nvcc(), "-std=c++17", f"-arch={arch}", "-cubin", "-Werror", "all-warnings",
           "-I", str(KERNELS), "-o", str(tmp_path / f"{source.stem}.cubin"), str(source)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"{' '.join(cmd)}\n{proc.stdout}{proc.stderr}"
    symbols = (tmp_path / f"{source.stem}.cubin").read_bytes()  # the ELF's string table
    for name in ENTRY_POINTS[source.name]:  # what mpidp.engine.gpu.ops asks CuPy for
        assert name.encode() + b"\0" in symbols, name


@pytest.mark.parametrize("source", SOURCES, ids=lambda p: p.name)
def test_float_math_keeps_denormals_under_ftz(source, tmp_path):
    """CuPy compiles with -ftz=true; our float ops must not flush (Note [Rounding like the
    host] in elementwise.cuh): no .ftz instruction in the PTX even with the flag."""
    out = tmp_path / f"{source.stem}.ptx"
    cmd = [nvcc(), "-std=c++17", "-arch=sm_90", "-ptx", "-ftz=true", "-I", str(KERNELS),
           "-o", str(out), str(source)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    flushing = [line.strip() for line in out.read_text().splitlines() if ".ftz" in line]
    assert not flushing, flushing[:5]


@pytest.fixture(scope="module")
def harness(tmp_path_factory):
    """elementwise.cuh compiled for the host: by nvcc where present (as CI does), else by the
    C++ compiler that builds the C extension."""
    out = tmp_path_factory.mktemp("harness") / "libharness.so"
    compiler = shutil.which("nvcc")
    if compiler:
        cmd = [compiler, "-std=c++17", "--shared", "-Xcompiler", "-fPIC,-Wall,-Wextra",
               "-Werror", "all-warnings", "-I", str(KERNELS), "-o", str(out), str(HARNESS)]
    else:
        compiler = shutil.which("c++") or shutil.which("g++")
        if compiler is None:
            pytest.skip("no nvcc and no C++ compiler to build the host harness")
        cmd = [compiler, "-std=c++17", "-x", "c++", "-shared", "-fPIC", "-O2", "-Wall",
               "-Wextra", "-Werror", "-I", str(KERNELS), "-o", str(out), str(HARNESS)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"{' '.join(cmd)}\n{proc.stderr}"
    return ctypes.CDLL(str(out))


def ptr(a):
    return ctypes.c_void_p(a.ctypes.data)


def convert(lib, name, values, out_dtype):
    out = np.empty(len(values), out_dtype)
    getattr(lib, name)(ptr(values), ptr(out), ctypes.c_longlong(len(values)))
    return out


def test_every_float16_widens_as_numpy(harness):
    bits = np.arange(1 << 16, dtype=np.uint16)
    got = convert(harness, "mpidp_host_f16_to_float", bits, np.float32)
    want = bits.view(np.float16).astype(np.float32)
    nan = np.isnan(want)
    assert np.array_equal(np.isnan(got), nan)
    assert np.array_equal(got[~nan].view(np.uint32), want[~nan].view(np.uint32))


def special_floats(rng):
    """Every float16/bfloat16 value, halfway points between neighbours, and random floats
    over the whole exponent range: where rounding to nearest even is decided."""
    f16 = np.arange(1 << 16, dtype=np.uint16).view(np.float16).astype(np.float32)
    f16 = f16[np.isfinite(f16)]
    mid = (np.sort(f16)[:-1] + np.diff(np.sort(f16)) / 2).astype(np.float32)
    wild = rng.integers(0, 1 << 32, size=200_000, dtype=np.uint64).astype(np.uint32).view(
        np.float32)
    specials = np.array([0.0, -0.0, np.inf, -np.inf, 65504, 65520, 65519.99, 1e-8, 6e-8,
                         2.9802322e-08, 3e38, -3e38], np.float32)
    return np.concatenate([f16, mid, np.nextafter(mid, np.float32(np.inf)), wild, specials])


def test_float_rounds_to_float16_as_numpy(harness):
    x = special_floats(np.random.default_rng(0))
    got = convert(harness, "mpidp_host_float_to_f16", x, np.uint16)
    with np.errstate(over="ignore"):
        want = x.astype(np.float16)
    nan = np.isnan(want)
    assert np.array_equal(np.isnan(got.view(np.float16)), nan)
    assert np.array_equal(got[~nan], want[~nan].view(np.uint16))


def test_bfloat16_round_trip_as_torch(harness):
    x = special_floats(np.random.default_rng(1))
    got = convert(harness, "mpidp_host_float_to_bf16", x, np.uint16)
    want = torch.from_numpy(x).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    back = torch.from_numpy(want.view(np.int16)).view(torch.bfloat16).float().numpy()
    nan = np.isnan(back)
    assert np.array_equal(got[~nan], want[~nan])
    assert np.isnan(convert(harness, "mpidp_host_bf16_to_float", got[nan], np.float32)).all()
    widened = convert(harness, "mpidp_host_bf16_to_float", want[~nan], np.float32)
    assert np.array_equal(widened.view(np.uint32), back[~nan].view(np.uint32))


def operands(dtype, rng, count=4099):
    """Values where the rounding of sums and averages is decided: random floats of every
    magnitude the type holds, small integers, zeros of both signs, infinities, NaN."""
    storage = NUMPY_STORAGE[dtype]
    if dtype in (I32, I64):
        info = np.iinfo(storage)
        a = rng.integers(info.min, info.max, size=count, dtype=storage, endpoint=True)
        a[:8] = [info.max, info.min, -1, 0, 1, info.max, info.min, 7]
        return a
    if dtype in (F16, BF16):
        a = rng.integers(0, 1 << 16, size=count, dtype=np.uint64).astype(np.uint16)
    else:
        a = rng.standard_normal(count).astype(storage) * np.exp2(
            rng.integers(-60, 60, size=count)).astype(storage)
    return a


@pytest.mark.parametrize("dtype", [F16, BF16, F32, F64, I32, I64])
@pytest.mark.parametrize("op", [0, 1, 2], ids=["sum", "min", "max"])
def test_reduce_equals_the_c_extension(harness, dtype, op):
    rng = np.random.default_rng(dtype * 3 + op)
    a, b = operands(dtype, rng), operands(dtype, rng)
    divisors = (1, 2, 3, 8) if dtype in FLOATING and op == 0 else (1,)
    for divisor in divisors:
        ours, host = a.copy(), a.copy()
        assert harness.mpidp_host_reduce(dtype, op, ptr(ours), ptr(b),
                                         ctypes.c_longlong(len(a)),
                                         ctypes.c_longlong(divisor)) == 0
        _ext.reduce_into(host, b, dtype, op)
        if divisor > 1:
            _ext.divide(host, dtype, divisor)
        assert np.array_equal(ours.view(np.uint8), host.view(np.uint8)), (dtype, op, divisor)


NAN_BITS = {F16: (0x7E00, 0xFE00, 0x7E2B, 0x7C01), BF16: (0x7FC0, 0xFFC0, 0x7FC5, 0x7F81),
            F32: (0x7FC00000, 0xFFC00000, 0x7FC12345, 0x7F800001),
            F64: (0x7FF8000000000000, 0xFFF8000000000000, 0x7FF8000000012345,
                  0x7FF0000000000001)}  # quiet, negative, payload, signalling
BITS = {F16: np.uint16, BF16: np.uint16, F32: np.uint32, F64: np.uint64}


def with_nans(dtype, n, rng, mask):
    """Small integers in the dtype (and infinities, and +-0), NaN of varied bits where mask."""
    v = rng.integers(-50, 50, size=n).astype(np.float32)
    v[rng.random(n) < 0.05] = np.inf
    v[rng.random(n) < 0.05] = -0.0
    a = (v.view(np.uint32) >> 16).astype(np.uint16) if dtype == BF16 else \
        v.astype(NUMPY_STORAGE[dtype])
    a.view(BITS[dtype])[mask] = rng.choice(np.array(NAN_BITS[dtype], BITS[dtype]),
                                           size=int(mask.sum()))
    return a


@pytest.mark.parametrize("dtype", [F16, BF16, F32, F64], ids=["f16", "bf16", "f32", "f64"])
@pytest.mark.parametrize("op", [1, 2], ids=["min", "max"])
@pytest.mark.parametrize("where", ["dst", "src", "both", "mixed"])
def test_min_max_nan_equals_the_c_extension(harness, dtype, op, where):
    """NaN in dst only, src only, both, or each at its own places: the kernels' element math
    propagates it as the C extension does (Note [NaN in min and max]), bit for bit."""
    rng = np.random.default_rng(dtype * 8 + op * 4 + len(where))
    for n in (1, 7, 33, 1000, 300001):
        fixed = np.zeros(n, bool)
        fixed[[0, n - 1, n // 2]] = True
        ma = (rng.random(n) < 0.03) | fixed if where != "src" else np.zeros(n, bool)
        mb = ma if where == "both" else np.zeros(n, bool) if where == "dst" else \
            (rng.random(n) < 0.03) | fixed
        a, b = with_nans(dtype, n, rng, ma), with_nans(dtype, n, rng, mb)
        ours, host = a.copy(), a.copy()
        assert harness.mpidp_host_reduce(dtype, op, ptr(ours), ptr(b), ctypes.c_longlong(n),
                                         ctypes.c_longlong(1)) == 0
        _ext.reduce_into(host, b, dtype, op)
        assert np.array_equal(ours.view(BITS[dtype]), host.view(BITS[dtype])), (n, where)
        got = (ours.astype(np.uint32) << 16).view(np.float32) if dtype == BF16 else ours
        assert np.array_equal(np.isnan(got), ma | mb), (n, where)


@pytest.mark.parametrize("dtype", [F16, BF16, F32, F64])
@pytest.mark.parametrize("divisor", [1, 2, 3, 7, 16])
def test_divide_equals_the_c_extension(harness, dtype, divisor):
    a = operands(dtype, np.random.default_rng(divisor))
    ours, host = a.copy(), a.copy()
    assert harness.mpidp_host_divide(dtype, ptr(ours), ctypes.c_longlong(len(a)),
                                     ctypes.c_longlong(divisor)) == 0
    _ext.divide(host, dtype, divisor)
    assert np.array_equal(ours.view(np.uint8), host.view(np.uint8))


@pytest.mark.parametrize("wire", [F16, BF16])
@pytest.mark.parametrize("divisor", [1, 3, 4])
def test_cast_equals_the_c_extension(harness, wire, divisor):
    """The compression hooks' fused cast (Note [Casting buckets]): float32 into 16 bits and
    back, divided on the way, as the C extension's cast_segments, bit for bit."""
    values = operands(F32, np.random.default_rng(wire + divisor))
    ours, host = np.zeros(len(values), np.uint16), np.zeros(len(values), np.uint16)
    n, d = ctypes.c_longlong(len(values)), ctypes.c_longlong(divisor)
    assert harness.mpidp_host_cast(wire, 0, ptr(ours), ptr(values), n, d) == 0
    _ext.cast_segments(host, [values], wire, F32, divisor, False)
    assert np.array_equal(ours, host)
    back, host_back = np.empty_like(values), np.empty_like(values)
    assert harness.mpidp_host_cast(wire, 1, ptr(ours), ptr(back), n, d) == 0
    _ext.cast_segments(host, [host_back], wire, F32, divisor, True)
    assert np.array_equal(back.view(np.uint32), host_back.view(np.uint32))


# ---- the GPU path's host-side pieces ---------------------------------------------------------

def test_kernel_names_asked_for_are_compiled():
    from mpidp.engine.gpu.ops import DTYPE_SUFFIX, OP_SUFFIX
    for d in DTYPE_SUFFIX.values():
        for o in OP_SUFFIX:
            assert f"mpidp_reduce_{d}_{o}" in ENTRY_POINTS["reduce.cu"]


def test_is_device_array_needs_neither_cupy_nor_cuda():
    from mpidp.engine.dtypes import as_host_array
    from mpidp.engine.gpu import is_device_array
    assert not is_device_array(np.ones(3))
    assert not is_device_array(torch.ones(3))
    assert not is_device_array(as_host_array(np.ones(3)))
    FakeCupy = type("ndarray", (), {"__module__": "cupy._core.core"})
    assert is_device_array(FakeCupy())
    FakeCuda = type("Tensor", (), {"is_cuda": True})
    assert is_device_array(FakeCuda())


def test_each_rank_binds_to_local_rank_modulo_devices():
    from mpidp.engine.gpu.device import device_for
    assert [device_for(r, 4) for r in range(6)] == [0, 1, 2, 3, 0, 1]
    with pytest.raises(ValueError, match="no GPU"):
        device_for(0, 0)


def test_missing_cupy_says_what_to_install(monkeypatch):
    import sys
    from mpidp.errors import BackendUnavailableError
    from mpidp.engine.gpu import device
    monkeypatch.setitem(sys.modules, "cupy", None)  # import cupy raises ImportError
    with pytest.raises(BackendUnavailableError, match=r"pip install 'mpidp\[gpu\]'"):
        device.cupy()
    with pytest.raises(ImportError, match="CUDA 12"):
        device.nccl()
    assert not device.nccl_available()


def test_cpu_runs_never_import_cupy():
    """mpidp.init and every host collective, in a fresh process: CuPy stays unimported; a
    device array without CuPy installed gets the install line."""
    import sys
    code = """
import sys, numpy as np, torch, mpidp
mpidp.init()
mpidp.allreduce(np.ones(3)); mpidp.broadcast(torch.ones(2)); mpidp.grouped_allreduce([torch.ones(2)])
assert "cupy" not in sys.modules, "cupy imported"
try:
    import cupy  # noqa: F401
except ImportError:
    fake = type("ndarray", (), {"__module__": "cupy._core.core"})()
    try:
        mpidp.allreduce(fake)
    except ImportError as exc:
        assert "pip install 'mpidp[gpu]'" in str(exc), exc
    else:
        raise AssertionError("no ImportError")
print("ok")
"""
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stdout + proc.stderr
