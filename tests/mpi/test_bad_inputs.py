"""Tier 2: no silent wrong answer (tests/mpi/bodies/body_bad_inputs.py; at n = 2 and 3 on one
node with the other bodies, test_together.py) across emulated nodes and through the staging
window; ranks started with settings that must agree but do not."""
import pytest

from mpirun import assert_ok, body, run


def test_bad_inputs_across_emulated_nodes():
    env = {"MPIDP_EMULATE_NODE_SIZE": "1", "BODY_TRIALS": "15"}
    assert_ok(body(3, "body_bad_inputs.py", env=env), 3)


def test_bad_inputs_through_the_staging_window():
    env = {"MPIDP_SHM_PEERS": "window", "BODY_TRIALS": "15", "BODY_ALGORITHMS": "shm"}
    assert_ok(body(2, "body_bad_inputs.py", env=env), 2)


@pytest.mark.parametrize("n", [2, 3])
def test_settings_that_must_agree_are_compared_at_init(n):
    """The last rank starts with another MPIDP_SHM_INLINE_BYTES: init raises on every rank,
    naming the variable and every rank's value, instead of a wrong sum and a hang."""
    code = ("import os, sys\n"
            f"if os.environ.get('PMI_RANK') == '{n - 1}':\n"
            "    os.environ['MPIDP_SHM_INLINE_BYTES'] = '0'\n"
            "import mpidp\n"
            "from mpidp.errors import MismatchError\n"
            "try:\n"
            "    mpidp.init()\n"
            "except MismatchError as exc:\n"
            "    print('refused', exc)\n"
            "    sys.exit(0)\n"
            "print('accepted')\n")
    proc = run(n, ["-c", code], timeout_s=60)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert out.count("refused") == n, out
    assert "MPIDP_SHM_INLINE_BYTES" in out and "=4096" in out and "=0" in out, out
