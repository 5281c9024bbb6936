"""Tier 2: communication hooks and the replica audit of mpidp's DistributedDataParallel under
mpiexec: torch's own hooks, on torch.distributed's mpidp backend, against torch's DDP with the
same hook on gloo (tests/mpi/bodies/body_hooks.py), and the audit catching a perturbed rank
(tests/mpi/bodies/body_audit.py), mpidp's own compression hooks without torch.distributed
(tests/mpi/bodies/body_compression.py) and ZeRO against the unsharded optimizer
(tests/mpi/bodies/body_zero.py), at n = 2 (n = 1, 3 with the other bodies: test_together.py)."""
import pytest

from mpirun import assert_ok, body


@pytest.mark.parametrize("n", [2])  # n = 1, 3 with the other bodies: test_together.py
def test_torch_hooks_on_mpidp_ddp_end_as_torch_ddp(n):
    assert_ok(body(n, "body_hooks.py", env={"MASTER_ADDR": None, "MASTER_PORT": None}), n)


@pytest.mark.parametrize("n", [2])  # n = 1, 3 with the other bodies: test_together.py
def test_replica_audit_names_the_diverged_rank_and_tensor(n):
    assert_ok(body(n, "body_audit.py"), n)


@pytest.mark.parametrize("n", [2])  # n = 1, 3 with the other bodies: test_together.py
def test_mpidp_compression_hooks_exact_against_their_definitions(n):
    assert_ok(body(n, "body_compression.py"), n)


@pytest.mark.parametrize("n", [2])  # n = 1, 3 with the other bodies: test_together.py
def test_zero_equals_the_unsharded_optimizer(n):
    assert_ok(body(n, "body_zero.py"), n)
