"""Tier 2: Horovod v0.28.1's own ``test/parallel/test_torch.py`` on mpidp.horovod, from a
Horovod checkout (tests/harness/horovod_suite.py: the file unmodified but for the two
changes torch 2.13 forces, applied to a copy at run time; ``import horovod.torch`` resolves
to mpidp.horovod through tests/harness/horovod_shim). The project carries no copy of
Horovod's tests and no package index ships them, so this runs where a checkout is named and
skips, saying so, elsewhere:

    pytest tests/mpi/test_horovod_suite.py --horovod-checkout=<horovod at v0.28.1>

Horovod itself passes 103 and skips 12 at 2 ranks; the table and each difference are in
docs/horovod.md ("Horovod's own test suite")."""
from pathlib import Path

import pytest

import horovod_suite  # tests/harness, as mpirun
from mpirun import named_checkout

# Horovod's passes at 2 ranks that mpidp does not match, each named in docs/horovod.md
KNOWN = {"test_sparse_embeddings"}


@pytest.fixture(scope="module")
def suite(request, tmp_path_factory) -> Path:
    checkout = named_checkout(request, "--horovod-checkout", "Horovod's tests are",
                              "<a Horovod checkout at v0.28.1>")
    pytest.importorskip("cloudpickle")
    pytest.importorskip("mock")
    return horovod_suite.prepare(checkout, tmp_path_factory.mktemp("horovod_suite"))


def test_horovod_suite_at_two_ranks_passes_what_horovod_passes(suite, tmp_path):
    proc = horovod_suite.launch(suite, 2, tmp_path, timeout_s=900)
    ranks = horovod_suite.summary(tmp_path, 2)
    assert all(c is not None for c in ranks.values()), \
        f"exit {proc.returncode}: a rank did not finish:\n{(proc.stdout + proc.stderr)[-4000:]}"
    for rank, count in ranks.items():
        assert set(count["failures"]) <= KNOWN, (rank, count["failures"])
        assert count["passed"] >= 102 and count["skipped"] == 12, (rank, count)
