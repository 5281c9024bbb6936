"""``python -m mpidp.doctor`` (alone or under ``mpiexec -n N``): a preflight check of the MPI
library, the job's rank/host/GPU map and launcher, shared memory, files left by dead MPI jobs,
one-sided communication, every all-reduce algorithm, CuPy/NCCL and Slurm, printed by rank 0
on one screen, each problem with its fix. Exit code 0 when nothing failed, 1 otherwise.
``python -m mpidp.doctor --leftovers`` only prints the paths of this host's files of dead jobs,
one a line, without starting MPI (for ``| xargs rm``); the doctor never deletes them.

Every rank runs every check in the same order, and a check that raises is reported as FAIL
with the exception, so one failing rank never leaves the others waiting in a later check. A
rank stuck inside a check (a hang in MPI) cannot report itself: a deadline per check
(``--timeout-s``) then aborts the whole job with a message naming the check."""
from __future__ import annotations

import argparse
import contextlib
import importlib.metadata
import sys
import threading

from ..runtime import launcher, mpi
from ..runtime.helpformat import Parser
from ..runtime.abort import abort_job
from . import leftovers, probes, verdicts
from .findings import (
    FAIL,
    Finding,
    Raised,
    Skipped,
    exit_code,
    format_findings,
    format_report,
    judge,
    summary_line)

CHECKS = (
    ("MPI", probes.mpi_library, verdicts.verdict_mpi),
    ("Ranks", probes.ranks, verdicts.verdict_ranks),
    ("mpidp", probes.setup, verdicts.verdict_mpidp),
    ("Shared memory", probes.shared_memory, verdicts.verdict_shm),
    ("Leftover files", probes.leftover_files, verdicts.verdict_leftovers),
    ("One-sided (RMA)", probes.one_sided, verdicts.verdict_rma),
    ("All-reduce", probes.allreduce, verdicts.verdict_allreduce),
    ("GPU", probes.gpu, verdicts.verdict_gpu),
    ("Slurm", probes.slurm, verdicts.verdict_slurm),
)


@contextlib.contextmanager
def deadline(what: str, seconds: float, rank: int):
    """Aborts the job (MPI_Abort) when the block has not finished within ``seconds``."""
    def expire():
        abort_job(
            f"mpidp.doctor: rank {rank}: FAIL: the {what!r} check did not finish within "
            f"{seconds:g} s: a rank is stuck in MPI or died; aborting the job\n"
            "        fix: the rank that failed printed its error above; if none did, check "
            "the network between the hosts (firewall, FI_PROVIDER / UCX_NET_DEVICES)\n", 1)
    timer = threading.Timer(seconds, expire)
    timer.daemon = True
    timer.start()
    try:
        yield
    finally:
        timer.cancel()


def probe_value(probe, ctx):
    """What ``probe`` found on this rank, or Raised/Skipped: a probe never ends the doctor."""
    try:
        return probe(ctx)
    except probes.SkipProbe as exc:
        return Skipped(str(exc))
    except Exception as exc:
        return Raised(f"{type(exc).__name__}: {exc}")


def _title(size: int) -> str:
    def version(dist: str) -> str:
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            return "not installed"
    return (f"mpidp doctor: {size} rank(s); Python {sys.version.split()[0]}, numpy "
            f"{version('numpy')}, torch {version('torch')}, mpich wheel {version('mpich')}")


def parser() -> argparse.ArgumentParser:
    p = Parser(
        prog="python -m mpidp.doctor",
        description="Checks MPI, the launcher, shared memory, one-sided communication, every "
                    "all-reduce algorithm, CuPy/NCCL and Slurm; run it as your job would run "
                    "(mpiexec -n N python -m mpidp.doctor). Exit code 1 when a check failed.")
    p.add_argument("--timeout-s", type=float, default=60.0,
                   help="a check that takes longer than this aborts the job (a hang)")
    p.add_argument("--leftovers", action="store_true",
                   help=f"print the paths of the files dead MPI jobs left on this host "
                        f"({leftovers.globs()}) that no process of yours holds, one a line, "
                        "and exit without starting MPI; remove them with: python -m "
                        "mpidp.doctor --leftovers | xargs rm")
    return p


def main(argv=None) -> int:
    """Runs every check on every rank; rank 0 prints. Returns the exit code (the same on
    every rank). With --leftovers: prints this host's files of dead jobs, starts no MPI."""
    args = parser().parse_args(argv)
    if not args.timeout_s > 0:
        parser().error(f"--timeout-s must be > 0, got {args.timeout_s}")
    if args.leftovers:
        for found in leftovers.dead_files():
            print(found.path)
        return 0
    try:
        launcher.prepare_mpi_start()
        world = mpi.world()
    except Exception as exc:
        print(format_report(_title(1), [("MPI", [Finding(
            FAIL, f"mpi4py cannot start MPI: {type(exc).__name__}: {exc}",
            "pip install mpich mpi4py (or point mpi4py at the site MPI: see docs/troubleshooting.md)")])]))
        return 1
    ctx = probes.Context(world)
    printing = ctx.rank == 0 and probes.prints_report(ctx.size)
    if printing:
        print(_title(ctx.size), flush=True)
    sections = []
    for name, probe, verdict in CHECKS:
        with deadline(name, args.timeout_s, ctx.rank):
            values = mpi.gather_objects(world, probe_value(probe, ctx), 0)
        if ctx.rank == 0:
            findings = judge(verdict, values)
            sections.append((name, findings))
            if printing:
                print("\n".join([name] + format_findings(findings)), flush=True)
    code = mpi.bcast_object(world, exit_code(sections) if ctx.rank == 0 else None, 0)
    if printing:
        print(summary_line(sections), flush=True)
    return code


__all__ = ["main", "format_report"]
