"""Tier 2: DistributedDataParallel and the fused helpers under mpiexec -n 1, 2, 3
(tests/mpi/bodies/body_ddp.py)."""
import pytest

from mpirun import assert_ok, body


@pytest.mark.parametrize("n", [1, 2, 3])
def test_ddp_matches_single_process_training(n):
    assert_ok(body(n, "body_ddp.py", timeout_s=240), n)


def test_ddp_in_staging_window_mode():
    """Ranks that may not read each other's memory: zero-copy buckets go through the window."""
    assert_ok(body(2, "body_ddp.py", env={"MPIDP_SHM_PEERS": "window"}, timeout_s=240), 2)
