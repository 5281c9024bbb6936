import os
import sys
import time
from pathlib import Path

import pytest

# the harness (mpirun, file_faults, the emulated and the Slurm cluster) imports by module name
sys.path.insert(0, str(Path(__file__).parent / "harness"))
_STARTED = time.time()
TIERS = ("unit", "mpi", "multinode", "slurm", "gpu")  # one folder of tests/ and one marker each

# Note [Two workers]
# The README's test command runs the suite on two workers (pytest-xdist: -n 2 --dist loadfile
# --no-loadscope-reorder). A serial run kept this 2-core machine's cores busy 56% of its time
# (user + system 1086 s in 966 s of wall, /usr/bin/time): the jobs wait on their launches,
# heartbeats, timeouts and watchdogs. Each file's tests run on one worker, in order, so its
# session caches (reference runs) and module fixtures (clusters, Open MPI's wheel) are made
# once; the emulated clusters of two workers are independent namespaces. Files are handed
# out in collection order as workers free up, so those that take longest come first
# (LONGEST_FIRST, from a CI run's --durations; order alone: a file left out of it runs after
# them), and no worker is left alone with a long file at the end.
LONGEST_FIRST = ("mpi/test_train.py", "multinode/test_multinode.py", "mpi/test_open_mpi.py",
                 "slurm/test_slurm.py", "mpi/test_faults.py", "mpi/test_chaos.py",
                 "mpi/test_together.py", "mpi/test_signals.py", "mpi/test_dist.py",
                 "mpi/test_ps_runs.py", "mpi/test_clients.py", "mpi/test_collectives.py",
                 "mpi/test_torch_suite.py")


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
    first = {name: k for k, name in enumerate(LONGEST_FIRST)}  # Note [Two workers]

    def place(item):
        try:
            return first.get(item.path.relative_to(here).as_posix(), len(first))
        except ValueError:
            return len(first)
    items.sort(key=place)  # stable: each file's tests keep their order


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
