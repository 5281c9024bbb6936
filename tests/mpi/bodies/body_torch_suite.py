"""torch's own distributed test suite (torch/testing/_internal/distributed/distributed_test.py,
shipped in the wheel), its test methods run on every rank of this launch, in this process:
``body_torch_suite.py BACKEND OUT [NAME ...]`` runs the named tests (default: all) on BACKEND
("mpidp" or "gloo", the reference) and rank 0 writes OUT, a JSON object: test name -> [outcome,
detail], outcome one of pass, fail, skip (detail: the reason or the first failing rank's
traceback).

Note [torch's suite under mpiexec]
torch runs the suite with one process per rank spawned by multiprocessing, a file:// rendezvous
per test, and the gates (decorators) reading the BACKEND variable at import. Here the ranks
are MPI's, the process is the same for every test, and each test gets what torch's runner
gives it: a default group made for it (``mpidp://`` on mpidp, a fresh file:// on gloo) with
the test's timeout, torch's file barrier reset, the barrier before and after it, the group
destroyed after it. The gates read as gloo's on both backends (BACKEND=gloo at import): the
suite is about CPU semantics, and gloo is the CPU backend its gates name; at run time the
module's BACKEND is the backend under test, so that a test re-making its group (the barrier
timeout tests, DDP's process group updates) makes it on that backend. A test passes when it
passed on every rank. Outcomes are gathered over mpi4py, outside the backend under test, and
every rank writes a line as each test starts, so a test that hangs past the launch's timeout is
named by the last line.
"""
import json
import os
import shutil
import sys
import time
import traceback
import unittest
from datetime import timedelta

from mpi4py import MPI

comm = MPI.COMM_WORLD
rank, size = comm.rank, comm.size
backend, out = sys.argv[1], sys.argv[2]
only = sys.argv[3:]
tmp = os.environ["TEMP_DIR"]  # the outer test's, the same for every rank
os.environ["BACKEND"] = "gloo"  # the gates read as gloo's (Note [torch's suite under mpiexec])
os.environ["WORLD_SIZE"] = str(size)
os.environ.setdefault("INIT_METHOD", f"file://{tmp}/init-global")
if rank == 0:
    for sub in ("barrier", "test_dir", "init_dir"):
        os.makedirs(os.path.join(tmp, sub), exist_ok=True)
comm.Barrier()

import torch.distributed as dist  # noqa: E402
from torch.testing._internal.common_distributed import TEST_SKIPS  # noqa: E402
from torch.testing._internal.common_utils import TestCase  # noqa: E402
from torch.testing._internal.distributed import distributed_test as dt  # noqa: E402

if backend == "mpidp":
    import functools
    import mpidp.backend  # noqa: F401 - registers the backend

    def on_mpidp(make):
        """``make`` (a torch call that makes a group) with the backend the suite names,
        gloo, read as mpidp: the groups a test makes are mpidp's."""
        @functools.wraps(make)
        def made(*args, **kwargs):
            if str(kwargs.get("backend")).lower() == "gloo":
                kwargs["backend"] = "mpidp"
            if make is init_process_group and kwargs.get("init_method", "").startswith("file:"):
                kwargs["init_method"] = "mpidp://"  # rank and world size are MPI's
            return make(*args, **kwargs)
        return made

    init_process_group = dist.init_process_group
    for _name in ("init_process_group", "new_group", "new_subgroups",
                  "new_subgroups_by_enumeration"):
        setattr(dist, _name, on_mpidp(getattr(dist, _name)))


skips = {skip.exit_code: skip.message for skip in TEST_SKIPS.values()}


class Result(unittest.TestResult):
    """A SystemExit with one of TEST_SKIPS' codes is torch's skip by exit code
    (skip_if_lt_x_gpu and the like, written for a process per test)."""

    def addError(self, test, err):
        if err[0] is SystemExit and err[1].code in skips:
            self.addSkip(test, skips[err[1].code])
        else:
            super().addError(test, err)


class Case(dt.DistributedTest._DistTestBase, TestCase):
    world_size = str(size)  # as torch's runner has it: the WORLD_SIZE variable

    def __init__(self, name):
        super().__init__(name)
        self.rank = rank
        self.file_name = os.path.join(tmp, "init_dir", name)

    @property
    def init_method(self):  # torch's runner's, for the tests that make their default group
        return f"file://{self.file_name}"


def run(name: str) -> Result:
    """Test ``name`` as torch's runner runs it (Note [torch's suite under mpiexec])."""
    case, result = Case(name), Result()
    method = getattr(Case, name)
    if getattr(method, "__unittest_skip__", False):  # as unittest: skipped before set-up
        result.addSkip(case, method.__unittest_skip_why__)
        return result
    try:
        seconds = dt.CUSTOM_PG_TIMEOUT.get(name, dt.default_pg_timeout)
        dist.init_process_group(backend=backend, init_method=case.init_method,
                                world_size=size, rank=rank, timeout=timedelta(seconds=seconds))
        comm.Barrier()
        case.run(result)
        comm.Barrier()
    except BaseException as exc:  # noqa: BLE001 - whatever it is, the next test runs
        result.errors.append((case, "".join(traceback.format_exception(exc))))
    finally:
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception as exc:  # noqa: BLE001
                result.errors.append((case, f"destroy_process_group: {exc!r}"))
    return result


def outcome(result: Result) -> tuple:
    if result.errors or result.failures:
        return "fail", (result.errors + result.failures)[0][1]
    if result.skipped:
        return "skip", result.skipped[0][1]
    return "pass", ""


names = sorted(n for n in dir(dt.DistributedTest._DistTestBase) if n.startswith("test_"))
if only:
    names = [n for n in names if n in only]
results = {}
progress = open(os.path.join(tmp, f"progress-{rank}"), "w", buffering=1)
for name in names:
    comm.Barrier()
    if rank == 0:  # torch's file barrier, as new for each test
        shutil.rmtree(os.path.join(tmp, "barrier"), ignore_errors=True)
        os.makedirs(os.path.join(tmp, "barrier"))
    comm.Barrier()
    dt.Barrier.barrier_id = 0
    progress.write(f"{name}\n")
    started = time.monotonic()
    mine = outcome(run(name)) + (round(time.monotonic() - started, 2),)
    every = comm.gather(mine, root=0)
    if rank == 0:
        failed = [(r, o) for r, o in enumerate(every) if o[0] == "fail"]
        kinds = {o[0] for o in every}
        if failed:
            results[name] = ["fail", f"rank {failed[0][0]}: {failed[0][1][1]}", mine[2]]
        elif len(kinds) > 1:
            results[name] = ["fail", "skipped on some ranks only: " + "; ".join(
                f"rank {r}: {o[0]} {o[1]}" for r, o in enumerate(every)), mine[2]]
        else:
            results[name] = [mine[0], mine[1], mine[2]]
        with open(out, "w") as f:
            json.dump(results, f, indent=1)
print(f"ok {rank}", flush=True)
