"""Horovod v0.28.1's own ``test/parallel/test_torch.py`` on ``mpidp.horovod``, from a Horovod
checkout (the project carries no copy of Horovod's code or tests).

The checkout's ``test/`` folder is copied to a temporary folder and two things are changed
there, both forced by torch 2.13, nothing else:

- ``torch.optim.Muon`` (new in torch, 2-D parameters only) is left out of the three "every
  optimizer" loops, as the file already leaves out ``LBFGS`` and ``SparseAdam``;
- ``test/utils/common.py`` imports ``horovod.runner`` inside ``delay()`` only (the only user;
  test_torch.py never calls it), since mpidp has no ``horovod.runner``.

``import horovod.torch as hvd`` then resolves to ``mpidp.horovod`` through the shim package
in tests/harness/horovod_shim. The suite runs as Horovod's CI runs it,
``mpiexec -n N python -m pytest -v test_torch.py``, each rank writing its own JUnit file.

    python tests/harness/horovod_suite.py <horovod checkout> -n 2

prints each rank's passed / failed / skipped and the tests that failed.
"""
from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

from mpidp.runtime.launcher import mpiexec

SHIM = Path(__file__).parent / "horovod_shim"
EVERY_OPTIMIZER = ("               subclass != torch.optim.SparseAdam\n",
                   "               subclass != torch.optim.SparseAdam and\n"
                   "               subclass.__name__ != 'Muon'\n")
RUNNER_IMPORT = ("from horovod.runner.util.threads import in_thread\n", "")
LAZY_RUNNER = ("    return in_thread(target=fn)\n",
               "    from horovod.runner.util.threads import in_thread\n"
               "    return in_thread(target=fn)\n")
# Each rank runs pytest with a JUnit file and a log of its own (rank from the MPI launcher's variable).
PER_RANK = ("import os, sys, pytest\n"
            "rank = os.environ.get('PMI_RANK', os.environ.get('OMPI_COMM_WORLD_RANK', '0'))\n"
            "log = os.open(os.path.join(sys.argv[1], f'rank{rank}.log'),\n"
            "              os.O_WRONLY | os.O_CREAT | os.O_TRUNC)\n"
            "os.dup2(log, 1); os.dup2(log, 2)\n"
            "class Failures:  # each failure's traceback as it happens (a hang ends no run)\n"
            "    def pytest_runtest_logreport(self, report):\n"
            "        if report.failed:\n"
            "            print('\\n' + report.longreprtext, flush=True)\n"
            "sys.exit(pytest.main(['-v', '-p', 'no:cacheprovider', '-o', 'addopts=',\n"
            "    '--junitxml=' + os.path.join(sys.argv[1], f'rank{rank}.xml'), *sys.argv[2:]],\n"
            "    plugins=[Failures()]))\n")


def _replace(text: str, old: str, new: str, count: int, where: str) -> str:
    found = text.count(old)
    assert found == count, f"{where}: {old!r} found {found} times, expected {count}"
    return text.replace(old, new)


def prepare(checkout: Path, into: Path) -> Path:
    """Copies the checkout's test/ folder into ``into`` with the two changes; returns the
    folder holding test_torch.py."""
    tests = into / "test"
    shutil.copytree(Path(checkout) / "test", tests)
    suite = tests / "parallel" / "test_torch.py"
    suite.write_text(_replace(suite.read_text(), *EVERY_OPTIMIZER, 3, suite.name))
    common = tests / "utils" / "common.py"
    text = _replace(common.read_text(), *RUNNER_IMPORT, 1, common.name)
    common.write_text(_replace(text, *LAZY_RUNNER, 1, common.name))
    (tests / "parallel" / "per_rank_pytest.py").write_text(PER_RANK)
    return tests / "parallel"


def launch(folder: Path, n: int, results: Path, select: str | None = None,
           timeout_s: float = 1200) -> subprocess.CompletedProcess:
    """``mpiexec -n n`` pytest over test_torch.py in ``folder``; JUnit files in ``results``."""
    results.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [str(SHIM), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep),
        PYTHONUNBUFFERED="1")
    env.pop("HOROVOD_TIMELINE", None)  # the suite sets its own
    args = ["test_torch.py", *(["-k", select] if select else [])]
    cmd = ["timeout", "-k", "10", str(int(timeout_s)), mpiexec(), "-n", str(n), sys.executable,
           "per_rank_pytest.py", str(results), *args]
    return subprocess.run(cmd, cwd=folder, env=env, capture_output=True, text=True)


def summary(results: Path, n: int) -> dict:
    """Per rank: {"passed", "failed", "skipped", "failures": [names]}; a rank without a JUnit
    file did not finish (None)."""
    ranks = {}
    for rank in range(n):
        path = results / f"rank{rank}.xml"
        if not path.exists():
            ranks[rank] = None
            continue
        count = {"passed": 0, "failed": 0, "skipped": 0, "failures": []}
        for case in ET.parse(path).getroot().iter("testcase"):
            kinds = {child.tag for child in case}
            if kinds & {"failure", "error"}:
                count["failed"] += 1
                count["failures"].append(case.get("name"))
            elif "skipped" in kinds:
                count["skipped"] += 1
            else:
                count["passed"] += 1
        ranks[rank] = count
    return ranks


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("checkout", type=Path, help="a Horovod checkout at v0.28.1")
    parser.add_argument("-n", type=int, default=2, help="ranks")
    parser.add_argument("-k", default=None, help="pytest's -k")
    parser.add_argument("--timeout-s", type=float, default=1200)
    parser.add_argument("--keep", type=Path, default=None, help="folder for the copy and logs")
    args = parser.parse_args(argv)
    import tempfile
    into = args.keep or Path(tempfile.mkdtemp(prefix="horovod_suite_"))
    folder = prepare(args.checkout, into)
    proc = launch(folder, args.n, into / "junit", args.k, args.timeout_s)
    (into / "output.txt").write_text(proc.stdout + proc.stderr)
    print(f"exit {proc.returncode}; output in {into / 'output.txt'}")
    for rank, count in summary(into / "junit", args.n).items():
        if count is None:
            print(f"rank {rank}: did not finish")
            continue
        print(f"rank {rank}: {count['passed']} passed, {count['failed']} failed, "
              f"{count['skipped']} skipped")
        for name in count["failures"]:
            print(f"    FAILED {name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
