"""An emulated cluster on one Linux host (root): N nodes and a head node, each a set of Linux
namespaces, for the multi-node test tier and by hand.

Each node has its own network namespace (an ``eth0`` veth into a bridge in the head's network
namespace), hostname (UTS: MPI tells nodes apart by it), IPC namespace and mount namespace
with a private tmpfs on /dev/shm and its own /etc/hosts; the head has a network, UTS and mount
namespace and runs the launcher, as a login node does. Addresses come from 198.18.0.0/24 (RFC
2544's range for benchmark networks), and exist only inside these namespaces: the root
namespace gets no interface at all (the veths are made inside the head's namespace), so no
test traffic can leave. Each namespace set is held open by one anchor process (``sleep``);
every command enters a node with ``nsenter -t ANCHOR``. Hydra reaches the nodes through a
small exec script given as its ssh (``-launcher ssh -launcher-exec``), which enters the named
node and runs the proxy there. Links may be shaped to a rate (HTB/TBF: ``tc ... tbf``); added
latency needs netem, which some kernels lack (``Cluster.latency_reason``). Teardown kills every
process in the cluster's namespaces by PID (the anchors last), so the namespaces, veths, bridge
and tmpfs go with them; set-up and teardown take well under a second.

By hand (as root)::

    python tests/harness/multinode_cluster.py --nodes 2 [--rate 1gbit] -- \\
        mpiexec -n 2 -ppn 1 .venv/bin/python -m mpidp.doctor

runs the command on the head with HYDRA_LAUNCHER, HYDRA_LAUNCHER_EXEC and HYDRA_HOST_FILE set
(so a plain ``mpiexec -n N -ppn K`` reaches the nodes), then tears the cluster down.
"""
from __future__ import annotations

import argparse
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional, Sequence

NET = "198.18.0"  # /24; the head is .1, node i is .(11 + i)
BRIDGE = "mpidpbr0"
MAX_NODES = 200


def unavailable() -> Optional[str]:
    """Why this host cannot run an emulated cluster, or None."""
    if os.geteuid() != 0:
        return "the emulated cluster needs root (network, UTS, IPC and mount namespaces)"
    for tool in ("unshare", "nsenter", "ip"):
        if shutil.which(tool) is None:
            return f"the emulated cluster needs {tool} (util-linux, iproute2)"
    probe = subprocess.run(["unshare", "--net", "--uts", "--ipc", "--mount", "true"],
                           capture_output=True, text=True)
    if probe.returncode != 0:
        return f"cannot create namespaces here: {probe.stderr.strip()}"
    return None


def _sh(*lines: str) -> str:
    return "set -e\n" + "\n".join(lines)


class Cluster:
    """``nodes`` emulated nodes and a head (see the module's doc). A context manager;
    ``start`` and ``stop`` by hand otherwise. ``rate``: each node's link, as tc writes it
    ("1gbit"), or None for unshaped veths."""

    def __init__(self, nodes: int, rate: Optional[str] = None):
        if not 1 <= nodes <= MAX_NODES:
            raise ValueError(f"nodes must be 1..{MAX_NODES}, got {nodes}")
        self.nodes, self.rate = nodes, rate
        self.names = [f"node{i}" for i in range(nodes)]
        self.head: Optional[subprocess.Popen] = None
        self.anchors: list = []
        self.dir: Optional[Path] = None

    # -- set-up ---------------------------------------------------------------------------
    def start(self) -> "Cluster":
        reason = unavailable()
        if reason:
            raise RuntimeError(reason)
        self.dir = Path(tempfile.mkdtemp(prefix="mpidp-cluster-"))
        hosts = self.dir / "hosts"
        hosts.write_text("127.0.0.1 localhost\n" + f"{NET}.1 head\n" + "".join(
            f"{self.address(i)} {name}\n" for i, name in enumerate(self.names)))
        try:
            self.head = self._anchor(["--net", "--uts", "--mount"], _sh(
                "hostname head", f"mount --bind {hosts} /etc/hosts", "ip link set lo up",
                f"ip link add {BRIDGE} type bridge", f"ip addr add {NET}.1/24 dev {BRIDGE}",
                f"ip link set {BRIDGE} up"))
            for i, name in enumerate(self.names):
                node = self._anchor(["--net", "--uts", "--ipc", "--mount"], _sh(
                    f"hostname {name}", f"mount --bind {hosts} /etc/hosts",
                    "mount -t tmpfs -o mode=1777 tmpfs /dev/shm", "ip link set lo up"))
                self.anchors.append(node)
                self.head_run(_sh(
                    f"ip link add v{i} type veth peer name eth0 netns {node.pid}",
                    f"ip link set v{i} master {BRIDGE}", f"ip link set v{i} up"))
                shape = f"tc qdisc add dev eth0 root tbf rate {self.rate} burst 256kb " \
                    "latency 100ms" if self.rate else "true"
                self.node_run(i, _sh(f"ip addr add {self.address(i)}/24 dev eth0",
                                     "ip link set eth0 up", shape))
            self._write_ssh()
            (self.dir / "hostfile").write_text("".join(f"{n}\n" for n in self.names))
        except BaseException:
            self.stop()
            raise
        return self

    def _anchor(self, flags: Sequence[str], setup: str) -> subprocess.Popen:
        """A process holding new namespaces of ``flags``, set up by ``setup`` inside them."""
        anchor = subprocess.Popen(
            ["unshare", *flags, "--propagation", "private", "--", "sh", "-c",
             setup + "\necho ready\nexec sleep infinity"],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
            preexec_fn=_die_with_parent)
        line = anchor.stdout.readline()
        if line.strip() != "ready":
            anchor.kill()
            anchor.wait()
            error = anchor.stderr.read()
            anchor.stdout.close()
            anchor.stderr.close()
            raise RuntimeError(f"emulated cluster: a node did not start: {error}")
        return anchor

    def _write_ssh(self) -> None:
        """The exec script Hydra runs in place of ssh: ``ssh.sh [-x ...] HOST COMMAND``."""
        cases = "".join(f"  {name}) pid={a.pid} ;;\n" for name, a in zip(self.names,
                                                                          self.anchors))
        self.ssh = self.dir / "ssh.sh"
        self.ssh.write_text(
            "#!/bin/sh\n# ssh for Hydra into the nodes of an mpidp emulated cluster\n"
            'while [ $# -gt 0 ]; do case "$1" in -*) shift ;; *) break ;; esac; done\n'
            'host=$1; shift\ncase "$host" in\n' + cases +
            '  *) echo "emulated cluster: no node $host" >&2; exit 255 ;;\nesac\n'
            'exec nsenter -t "$pid" -n -u -i -m -- sh -c "$*"\n')
        self.ssh.chmod(0o700)

    # -- use --------------------------------------------------------------------------------
    def address(self, i: int) -> str:
        return f"{NET}.{11 + i}"

    def hosts(self, per_node: int, nodes: Optional[int] = None) -> str:
        """Hydra's -hosts value: ``per_node`` ranks on each of the first ``nodes`` nodes."""
        return ",".join(f"{n}:{per_node}" for n in self.names[:nodes or self.nodes])

    def env(self) -> dict:
        """What the head's launcher needs to reach the nodes (Hydra reads these)."""
        return {"HYDRA_LAUNCHER": "ssh", "HYDRA_LAUNCHER_EXEC": str(self.ssh),
                "HYDRA_HOST_FILE": str(self.dir / "hostfile")}

    def head_command(self, argv: Sequence[str], wd=None) -> list:
        """``argv`` run on the head node, in ``wd`` (default this process's directory)."""
        return ["nsenter", "-t", str(self.head.pid), "-n", "-u", "-m",
                f"--wd={wd or os.getcwd()}", "--", *argv]

    def head_run(self, script: str) -> None:
        subprocess.run(self.head_command(["sh", "-c", script]), check=True,
                       capture_output=True, text=True)

    def node_command(self, i: int, argv: Sequence[str], wd=None) -> list:
        """``argv`` run on node ``i``, in ``wd`` (default this process's directory)."""
        return ["nsenter", "-t", str(self.anchors[i].pid), "-n", "-u", "-i", "-m",
                f"--wd={wd or os.getcwd()}", "--", *argv]

    def node_run(self, i: int, script: str) -> subprocess.CompletedProcess:
        return subprocess.run(self.node_command(i, ["sh", "-c", script]), check=True,
                              capture_output=True, text=True)

    def processes(self, i: Optional[int] = None) -> list:
        """PIDs of the processes in node ``i``'s network namespace (None: every node's and
        the head's), anchors included."""
        anchors = [self.head] + self.anchors if i is None else [self.anchors[i]]
        wanted = {_netns(a.pid) for a in anchors if a is not None} - {None}
        return [p for p in _pids() if _netns(p) in wanted]

    def kill_node(self, i: int, crash: bool = False) -> list:
        """SIGKILLs every process of node ``i`` except its anchor; returns their PIDs. The
        kernel closes their connections (as when an out-of-memory killer or a scheduler ends
        every process of a node); with ``crash`` the node's link goes down first, so nothing
        it sends arrives any more (a power loss, a kernel panic, a cut cable)."""
        if crash:
            self.head_run(f"ip link set v{i} down")
        victims: set = set()
        for _ in range(50):  # until none is left (one may fork while the others die)
            alive = [p for p in self.processes(i) if p != self.anchors[i].pid]
            if not alive:
                break
            for pid in alive:
                _kill(pid)
            victims.update(alive)
            time.sleep(0.01)
        return sorted(victims)

    def restore_node(self, i: int) -> None:
        """Brings node ``i``'s link back after ``kill_node(i, crash=True)``; every namespace
        forgets the addresses it failed to resolve while it was down."""
        self.head_run(_sh(f"ip link set v{i} up", "ip neigh flush all"))
        for k in range(self.nodes):
            self.node_run(k, "ip neigh flush all")

    # -- teardown -----------------------------------------------------------------------------
    def stop(self) -> None:
        anchors = [a for a in [self.head] + self.anchors if a is not None]
        for _ in range(50):
            others = [p for p in self.processes() if p not in {a.pid for a in anchors}]
            if not others:
                break
            for pid in others:
                _kill(pid)
            time.sleep(0.02)
        for a in anchors:
            _kill(a.pid)
            a.wait()
            for stream in (a.stdout, a.stderr):
                stream.close()
        self.head, self.anchors = None, []
        if self.dir is not None:
            shutil.rmtree(self.dir, ignore_errors=True)
            self.dir = None

    def __enter__(self) -> "Cluster":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def _die_with_parent() -> None:
    """In an anchor before it execs: SIGKILL it when the process that made the cluster dies
    (PR_SET_PDEATHSIG), so that a killed test or bench leaves no namespace behind."""
    import ctypes
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG = 1


def _pids() -> list:
    return [int(p) for p in os.listdir("/proc") if p.isdigit()]


def _netns(pid: int) -> Optional[str]:
    try:
        return os.readlink(f"/proc/{pid}/ns/net")
    except OSError:
        return None


def _kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python tests/harness/multinode_cluster.py",
                                description="run a command on the head of an emulated cluster")
    p.add_argument("--nodes", type=int, default=2)
    p.add_argument("--rate", help="shape every node's link to this rate (tc: 1gbit, 100mbit)")
    p.add_argument("command", nargs="+", help="the command, after --")
    args = p.parse_args(argv)
    reason = unavailable()
    if reason:
        print(f"multinode_cluster.py: {reason}", file=sys.stderr)
        return 2
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))  # tear down
    with Cluster(args.nodes, args.rate) as cluster:
        env = dict(os.environ, **cluster.env())
        print(f"multinode_cluster.py: {args.nodes} nodes ({', '.join(cluster.names)}), head runs: "
              f"{shlex.join(args.command)}", file=sys.stderr)
        return subprocess.run(cluster.head_command(args.command), env=env).returncode


if __name__ == "__main__":
    sys.exit(main())
