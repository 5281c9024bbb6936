import os
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
_STARTED = time.time()


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
