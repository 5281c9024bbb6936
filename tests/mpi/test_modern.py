"""Tier 2: torch's newer layers on the "mpidp" backend under mpiexec, each against gloo in
the same launch (tests/mpi/bodies/body_modern.py): group names, a destroyed sub-group,
DeviceMesh (1-D, 2-D, sub-meshes), the functional collectives, DTensor redistribute, tensor
parallelism, FSDP2 (with and without resharding, bfloat16 parameters reduced in float32) and
torch.distributed.checkpoint — at n = 2, which also saves a checkpoint, and n = 3, which also
loads that checkpoint onto its 3 ranks (a reshard)."""
import pytest

from mpirun import assert_ok, body

NO_MASTER = {"MASTER_ADDR": None, "MASTER_PORT": None}


@pytest.fixture(scope="module")
def saved_at_2(tmp_path_factory):
    """The launch at n = 2 and the folder where it saved its checkpoint."""
    folder = tmp_path_factory.mktemp("modern") / "saved_at_2"
    return body(2, "body_modern.py", env=NO_MASTER, extra=["--save", folder]), folder


def test_newer_layers_at_2_equal_gloo(saved_at_2):
    assert_ok(saved_at_2[0], 2)


def test_newer_layers_at_3_equal_gloo_and_load_the_checkpoint_saved_at_2(saved_at_2):
    folder = saved_at_2[1]
    assert (folder / "expected.pt").exists(), "the launch at n = 2 saved no checkpoint"
    assert_ok(body(3, "body_modern.py", env=NO_MASTER, extra=["--load", folder]), 3)
