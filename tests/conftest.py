import os
import sys
import time
from pathlib import Path

import pytest

# the harness (mpirun, file_faults, the emulated and the Slurm cluster) imports by module name
sys.path.insert(0, str(Path(__file__).parent / "harness"))
_STARTED = time.time()
TIERS = ("unit", "mpi", "multinode", "slurm", "gpu")  # one folder of tests/ and one marker each


def pytest_addoption(parser):
    parser.addoption("--horovod-examples", metavar="DIR", default=None,
                     help="examples/pytorch of a Horovod checkout: run its scripts on mpidp "
                          "(tests/mpi/test_horovod_examples.py; the project carries no copy)")
    parser.addoption("--horovod-checkout", metavar="DIR", default=None,
                     help="a Horovod checkout at v0.28.1: run its test/parallel/test_torch.py "
                          "on mpidp.horovod (tests/mpi/test_horovod_suite.py; needs "
                          "cloudpickle and mock, which its test/utils/common.py imports)")


def pytest_collection_modifyitems(config, items):
    """Marks each test with its tier, the folder of tests/ it is in (docs/tests.md), so that
    ``pytest -m unit`` or ``-m "not multinode"`` selects by tier; explicit marks stay."""
    here = Path(__file__).parent
    for item in items:
        try:
            tier = item.path.relative_to(here).parts[0]
        except ValueError:
            continue
        if tier in TIERS and item.get_closest_marker(tier) is None:
            item.add_marker(getattr(pytest.mark, tier))


@pytest.fixture(scope="session", autouse=True)
def _remove_what_aborted_test_jobs_left():
    """The fault tests end MPI jobs with MPI_Abort or SIGKILL on purpose, and MPICH then leaves
    its shared-memory file behind (docs/troubleshooting.md): at the end of the session, remove
    those this session's jobs left — files created since it started that no process holds."""
    yield
    from mpidp.doctor.leftovers import dead_files
    for f in dead_files():
        try:
            if os.lstat(f.path).st_mtime >= _STARTED:
                os.unlink(f.path)
        except OSError:
            pass
