"""Tier 2: DistributedDataParallel and the fused helpers (tests/mpi/bodies/body_ddp.py) where
ranks may not read each other's memory (at n = 1, 2, 3 as it is: test_together.py)."""
from mpirun import assert_ok, body


def test_ddp_in_staging_window_mode():
    """Ranks that may not read each other's memory: zero-copy buckets go through the window."""
    assert_ok(body(2, "body_ddp.py", env={"MPIDP_SHM_PEERS": "window"}, timeout_s=240), 2)
