"""Tier 2: communication hooks on mpidp's DistributedDataParallel under mpiexec
(tests/mpi/body_hooks.py): torch's own hooks, on torch.distributed's mpidp backend, against
torch's DDP with the same hook on gloo at n = 1, 2, 3."""
import pytest

from mpirun import assert_ok, body


@pytest.mark.parametrize("n", [1, 2, 3])
def test_torch_hooks_on_mpidp_ddp_end_as_torch_ddp(n):
    assert_ok(body(n, "body_hooks.py", env={"MASTER_ADDR": None, "MASTER_PORT": None}), n)
