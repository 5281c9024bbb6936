"""Tier 3, on a GPU (marked ``gpu``; skipped with the reason where CuPy or a device is
missing): our kernels against the host kernels bit for bit, at aligned and misaligned
offsets; multi-tensor pack and unpack; the ring on device buffers for n virtual ranks; and
under mpiexec every collective and DDP with device arrays (tests/mpi/bodies/body_gpu.py), the
torch.distributed backend with CUDA tensors (tests/mpi/bodies/body_dist_gpu.py), and torch's newer
layers on it — DeviceMesh, functional collectives, DTensor, FSDP2 — on CUDA
(tests/mpi/bodies/body_modern_gpu.py).
Without a GPU the tier-1 tests of the same code run instead: tests/unit/test_gpu_kernels.py."""
import json
import threading

import numpy as np
import pytest

from mpidp.engine import host_ops
from mpidp.engine.dtypes import BF16, F16, F32, F64, FLOATING, I32, I64, NUMPY_STORAGE
from mpirun import assert_ok, body, run


def _no_gpu_reason():
    try:
        import cupy
    except ImportError:
        return "CuPy is not installed (pip install 'mpidp[gpu]')"
    try:
        count = cupy.cuda.runtime.getDeviceCount()
    except Exception as exc:  # CuPy without a driver
        return f"no CUDA device ({type(exc).__name__}: {exc})"
    return None if count else "no CUDA device visible"


def _torch_cuda():
    import torch
    return torch.cuda.is_available()


REASON = _no_gpu_reason()
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(REASON is not None, reason=str(REASON))]
DTYPES = [F16, BF16, F32, F64, I32, I64]


@pytest.fixture(scope="module")
def cp():
    import cupy
    return cupy


@pytest.fixture(scope="module")
def ops(cp):
    from mpidp.engine.gpu.ops import DeviceOps
    return DeviceOps(cp.cuda.get_current_stream())


def values(dtype, count, seed):
    rng = np.random.default_rng(seed)
    if dtype in (F16, BF16):
        return rng.integers(0, 1 << 16, size=count, dtype=np.uint64).astype(np.uint16)
    if dtype in (I32, I64):
        return rng.integers(-1 << 30, 1 << 30, size=count).astype(NUMPY_STORAGE[dtype])
    return (rng.standard_normal(count) * 1e3).astype(NUMPY_STORAGE[dtype])


def small_ints(dtype, count, seed):
    """Small integers in the dtype's storage: sums exact in any order."""
    v = np.random.default_rng(seed).integers(-8, 9, size=count)
    if dtype == BF16:
        import torch
        return torch.tensor(v, dtype=torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    return v.astype(NUMPY_STORAGE[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("op", [0, 1, 2], ids=["sum", "min", "max"])
@pytest.mark.parametrize("offset", [0, 1], ids=["aligned", "misaligned"])
def test_device_reduce_equals_host(cp, ops, dtype, op, offset):
    for count in (1, 7, 8, 4099, 1 << 20):
        a, b = values(dtype, count + offset, count), values(dtype, count + offset, count + 1)
        for divisor in ((1, 3, 4) if dtype in FLOATING and op == 0 else (1,)):
            want = a[offset:].copy()
            host_ops.reduce_into(want, b[offset:], dtype, op, divisor)
            d = cp.asarray(a)
            ops.reduce_into(d[offset:], cp.asarray(b)[offset:], dtype, op, divisor)
            got = d.get()[offset:]
            if dtype in FLOATING:  # NaN payloads may differ (Note [Rounding like the host])
                nan = np.isnan(want.view(np.float16 if dtype == F16 else want.dtype)) \
                    if dtype != BF16 else (want & 0x7FFF) > 0x7F80
                assert np.array_equal(got[~nan], want[~nan])
            else:
                assert np.array_equal(got, want)


@pytest.mark.parametrize("dtype", [F16, BF16, F32, F64])
def test_device_divide_equals_host(cp, ops, dtype):
    a = values(dtype, 10_001, 5)
    want = a.copy()
    host_ops.divide(want, dtype, 7)
    d = cp.asarray(a)
    ops.divide(d, dtype, 7)
    finite = np.isfinite(want.view(np.float16)) if dtype == F16 else \
        (want & 0x7FFF) <= 0x7F80 if dtype == BF16 else np.isfinite(want)
    assert np.array_equal(d.get()[finite], want[finite])


@pytest.mark.parametrize("dtype", [F16, BF16, F32, F64])
@pytest.mark.parametrize("sizes", [[1, 3, 8, 1000, 5, 0, 70_000, 2], [8, 1000, 64, 70_000, 1003, 3]],
                         ids=["misaligned", "aligned"])  # slots at multiples of 16 bytes or not
def test_multi_tensor_pack_and_unpack(cp, ops, dtype, sizes):
    # values() gives 16-bit floats as their bits (uint16): the bucket holds what they hold
    tensors = [cp.asarray(values(dtype, s, i)) for i, s in enumerate(sizes)]
    bucket = cp.empty(sum(sizes), tensors[0].dtype)
    ops.pack(bucket, tensors)
    assert np.array_equal(bucket.get(), np.concatenate([t.get() for t in tensors]))
    # Note [Tables kept on the device]: the same counts at other addresses get their own table
    others = [cp.asarray(values(dtype, s, 100 + i)) for i, s in enumerate(sizes)]
    for again in (others, tensors):
        ops.pack(bucket, again)
        assert np.array_equal(bucket.get(), np.concatenate([t.get() for t in again]))
    outs = [cp.empty_like(t) for t in tensors]
    ops.unpack(bucket, outs, dtype, 1)
    assert all(np.array_equal(o.get(), t.get()) for o, t in zip(outs, tensors))
    want = bucket.get()
    host_ops.divide(want, dtype, 3)
    ops.unpack(bucket, outs, dtype, 3)
    got = np.concatenate([o.get() for o in outs])
    keep = want == want if dtype in (F32, F64) else np.ones(len(want), bool)
    if dtype == F16:
        keep = ~np.isnan(want.view(np.float16))
    elif dtype == BF16:
        keep = (want & 0x7FFF) <= 0x7F80
    assert np.array_equal(got[keep], want[keep])


@pytest.mark.parametrize("wire", [F16, BF16])
@pytest.mark.parametrize("divisor", [1, 3, 4])
def test_fused_cast_equals_host(cp, ops, wire, divisor):
    """The compression hooks' cast (Note [Casting buckets]): float32 tensors into a 16-bit
    bucket and back, divided on the way, as the C extension does it, bit for bit."""
    sizes = [1, 3, 8, 1000, 0, 70_000]
    host = [values(F32, s, i) for i, s in enumerate(sizes)]
    bucket = cp.empty(sum(sizes), np.uint16)
    ops.cast(bucket, [cp.asarray(h) for h in host], wire, divisor, unpack=False)
    want = np.empty(sum(sizes), np.uint16)
    host_ops.cast_segments(want, host, wire, F32, divisor, False)
    assert np.array_equal(bucket.get(), want)
    outs = [cp.empty(s, np.float32) for s in sizes]
    ops.cast(bucket, outs, wire, divisor, unpack=True)
    back = [np.empty(s, np.float32) for s in sizes]
    host_ops.cast_segments(want, back, wire, F32, divisor, True)
    got = np.concatenate([o.get() for o in outs])
    assert np.array_equal(got.view(np.uint32), np.concatenate(back).view(np.uint32))


@pytest.mark.parametrize("n", [2, 3, 4])
def test_ring_on_device_buffers_equals_host_ring(cp, n):
    """mpidp.engine.ring unchanged over device buffers and our kernels (virtual ranks, loopback)."""
    from mpidp.engine.gpu.ops import DeviceOps
    from mpidp.engine.ring import ring_allreduce
    from mpidp.engine.transports import LoopbackNetwork
    for dtype in (F32, F16, BF16):
        host = [small_ints(dtype, 10_007, r) for r in range(n)]
        results = {}
        for where, ops_of, make in (
                ("host", lambda: host_ops, lambda a: a.copy()),
                ("device", lambda: DeviceOps(cp.cuda.get_current_stream()), cp.asarray)):
            bufs = [make(a) for a in host]
            net, errors = LoopbackNetwork(n), []

            def rank_main(r):
                try:
                    with cp.cuda.Device(0):
                        empty = (lambda k: cp.empty(k, bufs[r].dtype)) if where == "device" \
                            else (lambda k: np.empty(k, bufs[r].dtype))
                        ring_allreduce(bufs[r], (empty(97), empty(97)), net.transport(r),
                                       ops_of(), dtype, 0, n, 97)
                        if where == "device":
                            cp.cuda.get_current_stream().synchronize()
                except Exception as exc:  # noqa: BLE001 - re-raised below
                    errors.append(exc)

            threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(n)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(120)
            assert not errors, errors
            results[where] = [b if where == "host" else b.get() for b in bufs]
        for h, d in zip(results["host"], results["device"]):
            assert np.array_equal(h, d)


def test_collectives_and_ddp_on_one_rank():
    assert_ok(body(1, "body_gpu.py", timeout_s=600), 1)


def test_collectives_and_ddp_on_two_ranks_sharing_the_gpu():
    assert_ok(body(2, "body_gpu.py", timeout_s=600), 2)


@pytest.mark.parametrize("n", [1, 2])
def test_torch_distributed_backend_with_cuda_tensors(n):
    assert_ok(body(n, "body_dist_gpu.py", env={"MASTER_ADDR": None}, timeout_s=600), n)


@pytest.mark.skipif(not _torch_cuda(), reason="torch sees no CUDA device (a CPU build?)")
@pytest.mark.parametrize("amp", ["bf16", "fp16"])
def test_the_training_tool_on_the_gpu(amp, tmp_path):
    """Note [Training device]: --device auto on one rank picks the GPU; --device cuda on two
    ranks sharing it trains the digits with autocast, checkpoints in the background, and a
    resume from the middle of the run ends as the run did."""
    def train(n, *flags):
        proc = run(n, ["-m", "mpidp.train", "--epochs", "2", "--no-progress", *map(str, flags)],
                   timeout_s=300)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        return [json.loads(l) for l in proc.stdout.splitlines() if l.startswith("{")][-1], \
            proc.stdout

    one, out = train(1, "--amp", amp)
    assert one["device"] == "cuda" and "training on cuda (auto: a GPU for every rank)" in out
    flags = ("--device", "cuda", "--amp", amp, "--checkpoint-every", 10, "--async-checkpoint",
             "--checkpoint-dir", tmp_path)
    whole, _ = train(2, *flags)
    # two ranks take half the steps of one in 2 epochs: 0.858 (bf16 0.861) on the CPU and on
    # an H200 alike, where chance is 0.1
    assert whole["device"] == "cuda" and whole["final_accuracy"] >= 0.8, whole
    for later in ("ckpt-000000040.pt", "ckpt-000000046.pt"):
        (tmp_path / later).unlink()
    resumed, _ = train(2, *flags, "--resume")
    assert resumed["resumed_from"].endswith("ckpt-000000030.pt")
    assert resumed["parameters_sha256"] == whole["parameters_sha256"]


@pytest.mark.skipif(not _torch_cuda(), reason="torch sees no CUDA device (a CPU build?)")
@pytest.mark.parametrize("n", [1, 2])
def test_torchs_newer_layers_with_cuda_tensors(n):
    """DeviceMesh on cuda, functional collectives, DTensor and FSDP2 on CUDA tensors over the
    mpidp backend, equal to the same on the CPU (tests/mpi/bodies/body_modern_gpu.py)."""
    assert_ok(body(n, "body_modern_gpu.py", env={"MASTER_ADDR": None}, timeout_s=600), n)
