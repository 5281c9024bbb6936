"""mpidp.alloc (mpidp/comm/node_memory.py, Note [Node heap] in csrc/heap.c) in one process:
what it returns, what it refuses, and that its memory goes with the last array over it. Its
all-reduces across ranks are checked in tests/mpi/bodies/body_collectives.py."""
import gc
import os

import numpy as np
import pytest
import torch

import mpidp
from mpidp.engine import host_ops


def heap_blocks() -> int:
    """This process's node-heap blocks: its descriptors naming an mpidp-heap memfd."""
    fds = os.listdir("/proc/self/fd")
    names = []
    for fd in fds:
        try:
            names.append(os.readlink(f"/proc/self/fd/{fd}"))
        except OSError:
            continue
    return sum("mpidp-heap" in name for name in names)


needs_extension = pytest.mark.skipif(host_ops.EXTENSION is None,
                                     reason="the C extension is not built here")


@needs_extension
def test_numpy_and_torch_arrays_in_the_heap_and_freed_with_the_last_view():
    gc.collect()
    start = heap_blocks()
    a = mpidp.alloc((3, 4), np.int16)
    t = mpidp.alloc(5, torch.bfloat16)
    assert type(a) is np.ndarray and a.shape == (3, 4) and a.dtype == np.int16
    assert np.array_equal(a, np.zeros((3, 4), np.int16)) and a.flags.writeable
    assert isinstance(t, torch.Tensor) and t.shape == (5,) and t.dtype == torch.bfloat16
    assert torch.equal(t, torch.zeros(5, dtype=torch.bfloat16))
    assert heap_blocks() == start + 2
    view = a[1:]
    del a
    gc.collect()
    assert heap_blocks() == start + 2  # the view keeps its block
    view[:] = 7
    assert int(view.sum()) == 56
    del view, t
    gc.collect()
    assert heap_blocks() == start


@needs_extension
def test_a_torch_tensor_alone_keeps_its_block_and_frees_it():
    gc.collect()
    start = heap_blocks()
    t = mpidp.alloc(np.int64(6), torch.float32)  # a numpy integer is a size too
    t += 2
    assert heap_blocks() == start + 1 and float(t.sum()) == 12.0
    del t
    gc.collect()
    assert heap_blocks() == start


def ordinary_where(monkeypatch, setting):
    """Node memory withheld: no block made, a zeroed ordinary array returned."""
    from mpidp import config
    from mpidp.comm import node_memory
    if setting == "no extension":
        monkeypatch.setattr(host_ops, "EXTENSION", None)
    elif setting == "Yama ptrace_scope 1":  # /proc/<pid>/fd would widen who may write it
        monkeypatch.setattr(node_memory, "yama_scope", lambda: 1)
    else:
        monkeypatch.setattr(config, "_current",
                            config.from_env({**os.environ, "MPIDP_SHM_PEERS": "window"}))
    gc.collect()
    start = heap_blocks()
    a = mpidp.alloc([2, 2], "float64")
    t = mpidp.alloc(3, torch.int64)
    assert a.dtype == np.float64 and not a.any() and t.dtype == torch.int64
    assert heap_blocks() == start and not node_memory.offered()


@pytest.mark.parametrize("setting", ["no extension", "Yama ptrace_scope 1", "window peers"])
def test_ordinary_arrays_where_node_memory_is_not_offered(monkeypatch, setting):
    ordinary_where(monkeypatch, setting)
    assert mpidp.alloc((0, 3)).shape == (0, 3)


@pytest.mark.parametrize("shape", [-1, (2, -3), (2.5,), (True,), "4", None])
def test_a_bad_shape_is_refused_by_name(shape):
    with pytest.raises(ValueError, match="shape must be non-negative ints"):
        mpidp.alloc(shape)


@pytest.mark.parametrize("dtype", [object(), object, "U4", "V8"])
def test_a_bad_dtype_is_refused_by_name(dtype):
    with pytest.raises(TypeError, match="numpy or torch dtype|numeric dtype"):
        mpidp.alloc(3, dtype)
