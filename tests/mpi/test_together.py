"""Tier 2: the bodies that pass at any world size, at n = 1 (their size-1 paths: the
collectives' and the backend's shortcuts, DDP's, ZeRO's, Join's, the audit's) and at n = 3
(3 ranks on 2 cores), each in one launch: tests/mpi/bodies/body_together.py runs them one
after another in one process per rank, each as it runs alone, for the price of one start-up
(mpiexec, and an import of torch on every rank: seconds each on two busy cores; the ten at
n = 3 took 98 s launched one by one, 32 s together). At n = 2 each runs alone, its own test
(test_collectives.py, test_ddp.py, test_dist.py, test_hooks.py, test_clients.py);
body_runtime.py, which must start before anything imports MPI, runs alone at every n
(test_runtime.py)."""
import pytest

from mpirun import assert_ok, body

TOGETHER = ("body_collectives.py", "body_ddp.py", "body_dist.py", "body_syncbn.py",
            "body_join.py", "body_metrics.py", "body_hooks.py", "body_audit.py",
            "body_compression.py", "body_zero.py")


@pytest.mark.parametrize("n", [1, 3])
def test_every_body_together(n):
    proc = body(n, "body_together.py", env={"MASTER_ADDR": None, "MASTER_PORT": None},
                extra=TOGETHER, timeout_s=600)
    assert_ok(proc, n)
    out = proc.stdout  # lines of different ranks may interleave: counted, not parsed
    for name in TOGETHER:  # every rank started each body
        assert out.count(f"body_together: {name}") == n, (name, out[-6000:])
    for r in range(n):  # and ended each
        assert out.count(f"ok {r}") == len(TOGETHER), (r, out[-6000:])
