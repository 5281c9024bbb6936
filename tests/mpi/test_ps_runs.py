"""Parameter server: the windows under mpiexec -n 2, 3, 4 with 1 or 2 servers
(tests/mpi/bodies/body_ps.py); the shard map alone: tests/unit/test_ps.py."""
import pytest

from mpirun import assert_ok, body


@pytest.mark.parametrize("n,servers", [(2, 1), (3, 1), (4, 2)])
def test_pushes_pulls_and_staleness_over_rma_windows(n, servers):
    assert_ok(body(n, "body_ps.py", env={"BODY_SERVERS": str(servers)}, timeout_s=180), n)
