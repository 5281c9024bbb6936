"""The nodes of the Slurm allocation the supervisor runs in, as a host list (Note [Inside an
allocation])."""
from __future__ import annotations

import re
import subprocess
from typing import Mapping, Optional

from ..runtime.hostlist import Host

# Note [Inside an allocation]
# In a batch script or an salloc shell, Hydra's mpiexec starts its proxies through Slurm (srun,
# one step), so the supervisor launches there as anywhere else, with the allocation's nodes as
# its host list: SLURM_JOB_NODELIST expanded by `scontrol show hostnames`, each node's slots
# from SLURM_TASKS_PER_NODE ("2(x3),1": three nodes of 2, then one of 1). A relaunch then
# leaves a lost node out of -hosts, and Hydra's srun runs on the others. A probe is a step of
# its own beside the job's, which holds the node's CPUs: it runs with SLURM_OVERLAP=1 (srun
# --overlap), or it would wait for them. A relaunch runs with it too: the step of a job that
# lost a node outlives the job in slurmctld, holding its CPUs on every node, the survivors'
# included, until slurmctld declares the node DOWN (SlurmdTimeout, 300 s by default), and
# a step that does not overlap it waits that long ("Requested nodes are busy"). The ranks
# inherit the variable too (nothing of mpidp's calls srun from a rank; a user's script that
# does would overlap). Outside an allocation it means nothing. The job needs sbatch's
# --no-kill to outlive a node: without it Slurm ends the whole allocation when one of its
# nodes fails.
BESIDE_STEPS = {"SLURM_OVERLAP": "1"}  # srun --overlap for whatever mpiexec starts through it


def tasks_per_node(value: str) -> list:
    """[slots per node] from SLURM_TASKS_PER_NODE's ``value`` ("2(x3),1" -> [2, 2, 2, 1]);
    ValueError for anything else."""
    out = []
    for item in value.split(","):
        m = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", item.strip())
        if not m or int(m.group(1)) < 1:
            raise ValueError(f"SLURM_TASKS_PER_NODE={value!r}: expected counts like 2(x3),1")
        out += [int(m.group(1))] * int(m.group(2) or 1)
    return out


def hosts(env: Mapping[str, str], show_hostnames=None) -> Optional[list]:
    """[Host] of the allocation this process runs in (None: not in one). ``show_hostnames``:
    the node list expanded (default: scontrol's). ValueError where the two disagree."""
    nodelist = env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST")
    counts = env.get("SLURM_TASKS_PER_NODE")
    if not nodelist or not counts:
        return None
    names = (show_hostnames or _scontrol_hostnames)(nodelist)
    slots = tasks_per_node(counts)
    if len(slots) != len(names):
        raise ValueError(f"the allocation's {len(names)} node(s) ({nodelist}) and "
                         f"SLURM_TASKS_PER_NODE={counts} ({len(slots)} node(s)) disagree")
    return [Host(n, s) for n, s in zip(names, slots)]


def _scontrol_hostnames(nodelist: str) -> list:
    """The nodes of ``nodelist`` (SLURM_JOB_NODELIST's) by `scontrol show hostnames`;
    ValueError naming the variable where scontrol cannot say (variables left from an
    allocation this shell is no longer in, or no Slurm here)."""
    fix = ("; outside a Slurm allocation unset the SLURM_* variables left from one, or give "
           "--hosts or --hostfile")
    try:
        proc = subprocess.run(["scontrol", "show", "hostnames", nodelist], capture_output=True,
                              text=True, timeout=60)
    except (OSError, subprocess.SubprocessError) as exc:
        why = "no scontrol on PATH" if isinstance(exc, FileNotFoundError) else str(exc)
        raise ValueError(f"SLURM_JOB_NODELIST={nodelist} is set, but `scontrol show "
                         f"hostnames` could not expand it ({why}){fix}") from None
    if proc.returncode != 0 or not proc.stdout.split():
        said = (proc.stderr.strip().splitlines() or [f"exit {proc.returncode}"])[-1]
        raise ValueError(f"SLURM_JOB_NODELIST={nodelist} is set, but `scontrol show "
                         f"hostnames` could not expand it ({said}){fix}")
    return proc.stdout.split()
