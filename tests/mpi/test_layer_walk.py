"""Tier 2: a DDP gradient and a torch.distributed all_reduce reach the C call without a call
back up a layer (tests/mpi/bodies/body_layer_walk.py), on one node (the shared-memory path)
and on emulated nodes of two ranks (the hierarchical path, the header exchange across nodes)."""
import pytest

from mpirun import assert_ok, body


@pytest.mark.parametrize("n, node_size", [(2, 0), (3, 2)])
def test_no_call_goes_back_up_a_layer(n, node_size):
    proc = body(n, "body_layer_walk.py", env={"MPIDP_EMULATE_NODE_SIZE": str(node_size)},
                timeout_s=180)
    assert_ok(proc, n)
    assert "DDP gradient:" in proc.stdout and "dist.all_reduce:" in proc.stdout, proc.stdout
