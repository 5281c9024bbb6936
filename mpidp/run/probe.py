"""Which nodes still answer: one tiny launch per node through the launcher the job itself
uses, all at once, each bounded in time (Note [Probing the nodes])."""
from __future__ import annotations

import os
import signal
import subprocess
import time
from typing import Sequence

from ..runtime.hostlist import Host
from ..runtime.launcher import Mpiexec
from . import allocation

PROBE_S = 10.0  # a node that has not run the probe by then is taken as lost

# Note [Probing the nodes]
# The question is whether the job could run on a node again, so the probe goes the way the
# job goes: `mpiexec -n 1 -hosts NODE true` (Open MPI's: `--host NODE`) with this process's
# environment, so whatever makes the launch work (Hydra's -launcher/-launcher-exec through
# HYDRA_LAUNCHER*, ssh's configuration, Slurm's srun inside an allocation) makes the probe
# work, and nothing else is assumed (no port of ours, no ping: a node can answer pings and
# not run processes). Every node is probed at once, each launch in a session of its own,
# whose process group is killed at the timeout (--probe-timeout, PROBE_S by default); a node
# whose probe did not end with exit 0 in time is left out.


def answering(hosts: Sequence[Host], mpiexec: Mpiexec, timeout_s: float = PROBE_S) -> list:
    """The hosts of ``hosts`` on which ``mpiexec`` ran a process within ``timeout_s``."""
    env = dict(os.environ, **allocation.BESIDE_STEPS)  # Note [Inside an allocation]
    procs: list = []
    try:
        for h in hosts:
            line = [mpiexec.path, "-n", "1", *mpiexec.hosts(h.name), "true"]
            procs.append(subprocess.Popen(line, stdin=subprocess.DEVNULL,
                                          stdout=subprocess.DEVNULL,
                                          stderr=subprocess.DEVNULL, start_new_session=True,
                                          env=env))
        deadline = time.monotonic() + timeout_s
        codes = []
        for p in procs:
            try:
                codes.append(p.wait(max(0.0, deadline - time.monotonic())))
            except subprocess.TimeoutExpired:
                codes.append(None)
    finally:
        for p in procs:  # the ones still waiting for a node, and their process groups
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                p.wait()
    return [h for h, code in zip(hosts, codes) if code == 0]
