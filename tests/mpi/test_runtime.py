"""Tier 2: init, topology, sub-communicators and the abort of the whole job."""
import time

import pytest

from mpirun import assert_ok, body


@pytest.mark.parametrize("n", [1, 2, 3])
def test_runtime(n):
    assert_ok(body(n, "body_runtime.py"), n)


def test_sub_communicator_group():
    assert_ok(body(3, "body_runtime.py", env={"BODY_SUBCOMM": "1"}), 3)


def test_uncaught_exception_on_one_rank_aborts_every_rank():
    start = time.monotonic()
    proc = body(3, "body_runtime.py", env={"BODY_RAISE_ON": "1"}, timeout_s=50)
    elapsed = time.monotonic() - start
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0
    assert "mpidp: rank 1 of 3" in out and "deliberate failure" in out, out[-3000:]
    assert elapsed < 40, f"abort took {elapsed:.0f} s: the other ranks were left waiting"
