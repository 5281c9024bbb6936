"""Tier 2: DistributedDataParallel and the fused helpers under mpiexec -n 2
(tests/mpi/bodies/body_ddp.py; n = 1, 3 with the other bodies: test_together.py)."""
import pytest

from mpirun import assert_ok, body


@pytest.mark.parametrize("n", [2])  # n = 1, 3 with the other bodies: test_together.py
def test_ddp_matches_single_process_training(n):
    assert_ok(body(n, "body_ddp.py", timeout_s=240), n)


def test_ddp_in_staging_window_mode():
    """Ranks that may not read each other's memory: zero-copy buckets go through the window."""
    assert_ok(body(2, "body_ddp.py", env={"MPIDP_SHM_PEERS": "window"}, timeout_s=240), 2)
