"""Tier 2: Horovod v0.28.1's own ``test/parallel/test_torch.py`` on mpidp.horovod, from a
Horovod checkout (tests/harness/horovod_suite.py: the file unmodified but for the two
changes torch 2.13 forces, applied to a copy at run time; ``import horovod.torch`` resolves
to mpidp.horovod through tests/harness/horovod_shim). The project carries no copy of
Horovod's tests and no package index ships them, so this runs where a checkout is named and
skips, saying so, elsewhere:

    pytest tests/mpi/test_horovod_suite.py --horovod-checkout=<horovod at v0.28.1>

Horovod itself passes 103 and skips 12 at 2 ranks; at 3 ranks it fails the three
``*_prescale`` tests (float16 sums of three ranks compared exactly) and its ranks then hang.
The table and each difference are in docs/horovod.md ("Horovod's own test suite")."""
from pathlib import Path

import pytest

import horovod_suite  # tests/harness, as mpirun
from mpirun import named_checkout

# At 3 ranks: the tests Horovod 0.28.1 fails there too, and those that then fail because the
# ranks left those tests' loops at different calls (docs/horovod.md, "What remains")
FAIL_IN_HOROVOD_AT_3 = {"test_horovod_allreduce_prescale", "test_horovod_reducescatter_prescale",
                        "test_horovod_grouped_reducescatter_prescale"}
AFTER_THEM_AT_3 = {"test_horovod_reducescatter_process_sets", "test_no_named_parameters",
                   "test_optimizer_no_named_parameters", "test_optimizer_process_sets",
                   "test_process_set_barrier_op", "test_sparse_embeddings",
                   "test_synchronize_step_warning"}


@pytest.fixture(scope="module")
def suite(request, tmp_path_factory) -> Path:
    checkout = named_checkout(request, "--horovod-checkout", "Horovod's tests are",
                              "<a Horovod checkout at v0.28.1>")
    pytest.importorskip("cloudpickle")
    pytest.importorskip("mock")
    return horovod_suite.prepare(checkout, tmp_path_factory.mktemp("horovod_suite"))


def finished(proc, results, n) -> dict:
    ranks = horovod_suite.summary(results, n)
    assert all(c is not None for c in ranks.values()), \
        f"exit {proc.returncode}: a rank did not finish:\n{(proc.stdout + proc.stderr)[-4000:]}"
    return ranks


def test_horovod_suite_at_two_ranks_passes_what_horovod_passes(suite, tmp_path):
    ranks = finished(horovod_suite.launch(suite, 2, tmp_path, timeout_s=900), tmp_path, 2)
    for rank, count in ranks.items():
        assert count["failures"] == [], (rank, count["failures"])
        assert count["passed"] == 103 and count["skipped"] == 12, (rank, count)


def test_horovod_suite_at_three_ranks_ends_and_fails_only_as_horovod(suite, tmp_path):
    whole = finished(horovod_suite.launch(suite, 3, tmp_path / "whole", timeout_s=900),
                     tmp_path / "whole", 3)
    for rank, count in whole.items():
        assert FAIL_IN_HOROVOD_AT_3 <= set(count["failures"]) <= \
            FAIL_IN_HOROVOD_AT_3 | AFTER_THEM_AT_3, (rank, count["failures"])
    rest = finished(horovod_suite.launch(suite, 3, tmp_path / "rest", "not prescale",
                                         timeout_s=900), tmp_path / "rest", 3)
    for rank, count in rest.items():
        assert count["failures"] == [] and count["passed"] == 100 and \
            count["skipped"] == 12, (rank, count)
