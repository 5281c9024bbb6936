"""Tier 1: host_view (Note [Host views] in csrc/view.c) and tensor_view (Note [Tensor views in
C] there), the C extension's against their numpy twins — the same array over a CPU tensor's
memory, written through to the tensor, the tensor left resizable — and their refusals."""
import numpy as np
import pytest
import torch

from mpidp import config
from mpidp.engine import host_ops, host_ops_numpy as twin

ext = pytest.importorskip("mpidp._ext") if not config.get().require_extension else \
    host_ops.extension()
IMPLS = [pytest.param(ext.host_view, id="c"), pytest.param(twin.host_view, id="numpy")]
CASES = [(torch.float32, "f", (2, 3)), (torch.float64, "d", (5,)), (torch.float16, "e", (4, 1)),
         (torch.int32, "i", ()), (torch.int64, "q", (3, 0)), (torch.uint8, "B", (7,))]


@pytest.mark.parametrize("host_view", IMPLS)
@pytest.mark.parametrize("dtype, fmt, shape", CASES)
def test_a_view_is_the_tensors_memory(host_view, dtype, fmt, shape):
    t = (torch.arange(int(np.prod(shape, dtype=np.int64))) % 7 + 1).to(dtype).reshape(shape)
    a = np.asarray(host_view(t.data_ptr(), t.nbytes, fmt, t.shape, t))
    assert a.shape == tuple(shape) and a.dtype == np.dtype(fmt) and a.flags.writeable
    assert a.flags.c_contiguous and a.tolist() == t.tolist()
    if a.size:
        a.reshape(-1)[0] = 6
        assert t.reshape(-1)[0].item() == 6  # written through
    t.resize_(t.numel() + 8)  # torch's .numpy() would forbid this for good


@pytest.mark.parametrize("host_view", IMPLS)
def test_a_view_the_c_calls_take(host_view):
    """The one-call all-reduce reads the buffer's format and shape (its header's hash)."""
    t = torch.ones(2, 3)
    m = memoryview(ext.host_view(t.data_ptr(), t.nbytes, "f", t.shape, t))
    assert (m.format, m.shape, m.strides, m.readonly) == ("f", (2, 3), (12, 4), False)
    assert np.asarray(host_view(t.data_ptr(), t.nbytes, "f", t.shape, t)).ctypes.data == \
        t.data_ptr()


@pytest.mark.parametrize("host_view", IMPLS)
def test_refusals(host_view):
    t = torch.ones(4)
    with pytest.raises(ValueError, match="not 12 bytes"):
        host_view(t.data_ptr(), 12, "f", (4,), t)
    with pytest.raises((ValueError, TypeError)):
        host_view(t.data_ptr(), 16, "x", (4,), t)


def test_a_tensors_view_for_the_one_call_path_is_its_memory():
    """Note [Views of torch tensors] in mpidp/comm/tensor_views.py."""
    from mpidp.comm import tensor_views

    t = torch.arange(4, dtype=torch.float32)
    v = np.asarray(tensor_views.tensor_view(t))
    v += 1  # the tensor's own memory
    assert torch.equal(t, torch.tensor([1.0, 2.0, 3.0, 4.0]))
    t.resize_(8)  # torch's .numpy() would have made the storage unresizable for good
    assert np.asarray(tensor_views.tensor_view(torch.zeros(2, 3, dtype=torch.int64))).shape == (2, 3)
    for declined in (torch.zeros(2, dtype=torch.bool), torch.zeros(2, dtype=torch.bfloat16),
                     torch.zeros(0), torch.zeros(4)[::2], torch.zeros(3, 3).t(),
                     torch.zeros(2).to_sparse(), torch.nn.Parameter(torch.zeros(2))):
        assert tensor_views.tensor_view(declined) is None
    before = t._version
    tensor_views.bump_version(t)
    assert t._version == before + 1


FORMATS = {torch.float32: "f", torch.float64: "d", torch.float16: "e", torch.int32: "i",
           torch.int64: "q"}


@pytest.mark.parametrize("tensor_view", [pytest.param(ext.tensor_view, id="c"),
                                         pytest.param(twin.tensor_view, id="numpy")])
def test_tensor_view_takes_what_host_view_would_and_declines_the_rest(tensor_view):
    def view(x):
        return tensor_view(x, torch.Tensor, torch.strided, FORMATS)

    for dtype, fmt, shape in CASES[:-1]:  # uint8: a dtype FORMATS does not name
        t = (torch.arange(int(np.prod(shape, dtype=np.int64))) % 7 + 1).to(dtype).reshape(shape)
        v = view(t)
        if not t.numel():
            assert v is None  # nothing to reduce: the general path says what it says
            continue
        m = memoryview(v)
        assert (m.format, m.shape, m.readonly) == (fmt, tuple(shape), False), (dtype, shape)
        a = np.asarray(v)
        assert a.ctypes.data == t.data_ptr() and a.tolist() == t.tolist()
        a.reshape(-1)[0] = 6
        assert t.reshape(-1)[0].item() == 6  # written through
        del v, m, a
        t.resize_(t.numel() + 8)  # the storage stays resizable
    kept = torch.ones(3)
    v = view(kept)
    del kept
    assert np.asarray(v).tolist() == [1.0, 1.0, 1.0]  # the view holds its tensor
    declined = [torch.zeros(2, dtype=torch.bool), torch.zeros(2, dtype=torch.bfloat16),
                torch.zeros(2, dtype=torch.uint8), torch.zeros(4)[::2], torch.zeros(3, 3).t(),
                torch.zeros(2).to_sparse(), torch.nn.Parameter(torch.zeros(2)),
                torch.zeros(2, device="meta"), np.zeros(2, np.float32), [1.0, 2.0], None]
    for x in declined:
        assert view(x) is None, x
