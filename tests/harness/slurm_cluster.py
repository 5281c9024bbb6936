"""A real Slurm cluster for tests: slurm.conf, state and logs in a private directory,
slurmctld and slurmd started in the foreground (``-D``) as children of this process and
stopped by PID. One node (this machine), or with ``nodes`` (an emulated cluster,
tests/harness/multinode_cluster.py) slurmctld on its head and a slurmd in each of its nodes. Needs root (jobs run as the submitting user, SlurmUser is root) and the
Debian packages slurmctld, slurmd, slurm-client (tests/slurm/install.sh installs them).

By hand: ``python tests/harness/slurm_cluster.py DIR`` starts one, prints the SLURM_CONF to export,
and stops it on Ctrl-C."""
from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

DAEMONS = ("slurmctld", "slurmd")
CLIENTS = ("sbatch", "srun", "sinfo", "squeue", "scontrol", "scancel")


def missing_programs() -> list[str]:
    """The Slurm programs this cluster needs that are not installed (searched on PATH and in
    the sbin directories, where Debian puts the daemons)."""
    return [p for p in DAEMONS + CLIENTS if _which(p) is None]


def _which(program: str) -> Optional[str]:
    path = os.environ.get("PATH", "") + os.pathsep + "/usr/sbin:/sbin:/usr/local/sbin"
    return shutil.which(program, path=path)


def _free_ports(count: int) -> list[int]:
    """Ports nothing listens on right now (the kernel's choice, so parallel clusters differ)."""
    sockets, ports = [], []
    try:
        for _ in range(count):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind(("127.0.0.1", 0))
            sockets.append(s)
            ports.append(s.getsockname()[1])
    finally:
        for s in sockets:
            s.close()
    return ports


def node_hardware(min_cpus: int = 1) -> str:
    """This machine's node description as slurmd measures it (``slurmd -C``): CPUs, boards,
    sockets, cores, threads and memory, without the node name and uptime. With fewer than
    ``min_cpus`` CPUs the node is described as one socket of ``min_cpus`` cores instead (the
    cluster then runs with SlurmdParameters=config_overrides)."""
    out = subprocess.run([_which("slurmd"), "-C"], capture_output=True, text=True, timeout=30,
                         check=True).stdout
    line = next(l for l in out.splitlines() if l.startswith("NodeName="))
    fields = dict(w.split("=", 1) for w in line.split() if "=" in w)
    if int(fields["CPUs"]) < min_cpus:
        fields.update(CPUs=min_cpus, Boards=1, SocketsPerBoard=1, CoresPerSocket=min_cpus,
                      ThreadsPerCore=1)
    keep = ("CPUs", "Boards", "SocketsPerBoard", "CoresPerSocket", "ThreadsPerCore",
            "RealMemory")
    return " ".join(f"{k}={fields[k]}" for k in keep if k in fields)


class SlurmCluster:
    """One node (this machine, named after its short host name) in one partition ``test``,
    or with ``nodes`` the nodes of that emulated cluster (tests/harness/multinode_cluster.py).

    The node offers at least ``min_cpus`` CPUs to jobs, however many the machine has: Slurm
    refuses more tasks per node than CPUs even with --overcommit, and the examples are tested
    with up to 3 ranks on a node (CPUs are slots here: TaskPlugin=task/none binds nothing).

    ``start()`` returns once the node is idle; ``stop()`` cancels what is still running and
    ends both daemons by PID (always call it: ``with SlurmCluster(dir) as c:`` does)."""

    def __init__(self, root: Path, min_cpus: int = 4, nodes=None):
        self.root = Path(root)
        self.min_cpus = min_cpus
        self.conf = self.root / "etc" / "slurm.conf"
        self.node = socket.gethostname().split(".")[0]
        self.procs: dict[str, subprocess.Popen] = {}
        # an emulated cluster (tests/harness/multinode_cluster.py): slurmctld on its head, a slurmd
        # in each of its nodes, the clients run on the head
        self.nodes = nodes

    def _names(self) -> list:
        return self.nodes.names if self.nodes is not None else [self.node]

    def _wrap(self, argv: list, node: Optional[int] = None, wd=None) -> list:
        """``argv`` where it runs: this machine, or the emulated cluster's head or ``node``
        (in ``wd``, default this process's working directory)."""
        if self.nodes is None:
            return argv
        if node is None:
            return self.nodes.head_command(argv, wd)
        return self.nodes.node_command(node, argv, wd)

    # -- configuration -------------------------------------------------------------------
    def write_config(self) -> None:
        for d in ("etc", "state", "spool", "log", "run"):
            (self.root / d).mkdir(parents=True, exist_ok=True)
        ctld_port, slurmd_port = _free_ports(2)
        r = self.root
        hardware = node_hardware(self.min_cpus)
        if self.nodes is None:
            ctld_host = f"{self.node}(127.0.0.1)"
            node_lines = f"NodeName={self.node} NodeAddr=127.0.0.1 {hardware} State=UNKNOWN"
        else:
            ctld_host = "head"
            node_lines = "\n".join(f"NodeName={name} NodeAddr={self.nodes.address(i)} "
                                   f"{hardware} State=UNKNOWN"
                                   for i, name in enumerate(self.nodes.names))
        # Only plugins that need no system set-up: no munge (auth/none), no cgroups
        # (proctrack/linuxproc, task/none), no accounting database.
        self.conf.write_text(f"""\
ClusterName=mpidptest
SlurmctldHost={ctld_host}
SlurmctldPort={ctld_port}
SlurmdPort={slurmd_port}
SlurmUser=root
SlurmdUser=root
AuthType=auth/none
CredType=cred/none
StateSaveLocation={r}/state
SlurmdSpoolDir={r}/spool/%n
SlurmctldPidFile={r}/run/slurmctld.pid
SlurmdPidFile={r}/run/slurmd-%n.pid
SlurmctldLogFile={r}/log/slurmctld.log
SlurmdLogFile={r}/log/slurmd-%n.log
SlurmctldDebug=info
SlurmdDebug=info
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
MpiDefault=none
ReturnToService=2
SlurmdParameters=config_overrides
SchedulerType=sched/builtin
KillWait=5
MinJobAge=300
{node_lines}
PartitionName=test Nodes={",".join(self._names())} Default=YES MaxTime=INFINITE State=UP
""")

    def env(self) -> dict:
        """The environment for Slurm's clients (and jobs) to talk to this cluster: without
        the variables of any Slurm job this process runs in, or of a user's sbatch/srun
        defaults."""
        env = {k: v for k, v in os.environ.items()
               if not k.startswith(("SLURM_", "SBATCH_", "SRUN_", "SALLOC_", "SQUEUE_"))}
        env["SLURM_CONF"] = str(self.conf)
        env["PATH"] = env.get("PATH", "") + os.pathsep + "/usr/sbin:/sbin"
        return env

    # -- daemons -------------------------------------------------------------------------
    def start(self, timeout_s: float = 60) -> None:
        """Writes the configuration, starts both daemons in the foreground and waits until
        the node is idle; RuntimeError with the daemons' logs if it is not within timeout_s."""
        self.write_config()
        env = self.env()
        daemons = [("slurmctld", "slurmctld", ["-i"], None)] + [
            (f"slurmd-{name}", "slurmd", ["-N", name], i if self.nodes is not None else None)
            for i, name in enumerate(self._names())]
        for key, name, extra, node in daemons:
            self._start(key, name, extra, node, env)
        self._until_idle(timeout_s)

    def _start(self, key: str, name: str, extra: list, node: Optional[int], env: dict) -> None:
        if name == "slurmd":
            (self.root / "spool" / extra[-1]).mkdir(parents=True, exist_ok=True)
        log = open(self.root / "log" / f"{key}.stderr", "ab")
        # -D: foreground, a child of this process; -i: ignore state from an earlier run
        self.procs[key] = subprocess.Popen(
            self._wrap([_which(name), "-D", "-f", str(self.conf), *extra], node),
            stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
            start_new_session=True)
        log.close()

    def _until_idle(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            for name, p in self.procs.items():
                if p.poll() is not None:
                    raise RuntimeError(f"{name} exited with {p.returncode}:\n{self.logs()}")
            state = self.run(["sinfo", "-h", "-N", "-o", "%T"], check=False).stdout.split()
            if state == ["idle"] * len(self._names()):
                return
            time.sleep(0.5)
        raise RuntimeError(f"the Slurm node(s) did not become idle in {timeout_s} s "
                           f"(last state {state!r}):\n{self.logs()}")

    def lose_node(self, i: int) -> list:
        """Node ``i`` of the emulated cluster lost: every process on it SIGKILLed, its slurmd
        with them (multinode_cluster.Cluster.kill_node), so nothing runs there any more while
        slurmctld still counts it as up; returns their PIDs. ``restore_node`` undoes it."""
        victims = self.nodes.kill_node(i)
        self.procs[f"slurmd-{self.nodes.names[i]}"].wait(timeout=10)
        return victims

    def restore_node(self, i: int, timeout_s: float = 60) -> None:
        """Starts node ``i``'s slurmd again after ``lose_node(i)`` and waits until every node
        is idle (what is left of a job there ended first: cancel it before)."""
        name = self.nodes.names[i]
        self._start(f"slurmd-{name}", "slurmd", ["-N", name], i, self.env())
        self._until_idle(timeout_s)

    def stop(self) -> None:
        """Cancels every job of this cluster, then ends slurmd and slurmctld by PID (TERM,
        then KILL after 10 s). Safe to call more than once or after a failed start."""
        if not self.procs:
            return
        try:
            if all(p.poll() is None for p in self.procs.values()):
                self.run(["scancel", "--full", "--user", str(os.getuid())], check=False)
                deadline = time.monotonic() + 15
                while time.monotonic() < deadline and \
                        self.run(["squeue", "-h"], check=False).stdout.strip():
                    time.sleep(0.5)
        except (OSError, subprocess.SubprocessError):
            pass   # the daemons are stopped all the same
        for name in sorted(self.procs, key=lambda k: k == "slurmctld"):  # slurmd's first
            p = self.procs.get(name)
            if p is None or p.poll() is not None:
                continue
            p.send_signal(signal.SIGTERM)
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(timeout=10)
        self.procs.clear()

    def __enter__(self) -> "SlurmCluster":
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    # -- clients -------------------------------------------------------------------------
    def run(self, args: list, check: bool = True, timeout_s: float = 30, env: dict | None = None,
            cwd: Path | None = None) -> subprocess.CompletedProcess:
        """Runs a Slurm client program (sbatch, srun, ...) against this cluster."""
        full_env = self.env()
        full_env.update(env or {})
        return subprocess.run(self._wrap([_which(args[0]) or args[0], *map(str, args[1:])],
                                         wd=cwd),
                              capture_output=True, text=True, timeout=timeout_s, env=full_env,
                              check=check, cwd=cwd)

    def logs(self, tail_lines: int = 30) -> str:
        """The last lines of each daemon's log, for failure messages."""
        parts = []
        for f in sorted((self.root / "log").glob("*")):
            lines = f.read_text(errors="replace").splitlines()[-tail_lines:]
            parts.append(f"--- {f.name}\n" + "\n".join(lines))
        return "\n".join(parts)


def _interrupt(signum, frame):
    raise KeyboardInterrupt


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print(f"usage: {sys.argv[0]} DIR", file=sys.stderr)
        return 2
    # Ctrl-C or SIGTERM stop the cluster (SIGINT is ignored in a background job otherwise)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, _interrupt)
    with SlurmCluster(Path(argv[0]).resolve()) as c:
        print(f"export SLURM_CONF={c.conf}   # Ctrl-C or kill {os.getpid()} stops the cluster",
              flush=True)
        try:
            while all(p.poll() is None for p in c.procs.values()):
                time.sleep(1)
        except KeyboardInterrupt:
            pass
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
