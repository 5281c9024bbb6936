"""The scale model's cost of a lost node (docs/scale-model.md, "A lost node"): in-job recovery,
shrunk or respawned, against a relaunch from the newest checkpoint, at any number of nodes.
Pure functions of the phases measured here (bench/RESULTS.md) and a link's alpha and beta
(mpidp.bench.costs, its broadcast's too): no MPI, no torch."""
from __future__ import annotations

import math
from typing import Dict, NamedTuple

from . import costs


class Phases(NamedTuple):
    """Seconds that do not grow with the job, measured on this machine (bench/RESULTS.md:
    "In-job recovery on Open MPI", 2026-12-02, medians of 4; "Recovery under the supervisor",
    2026-11-27, medians of 5). Every process of a node starts at once, so a node's start
    costs what one process's does."""
    spawn_s: float = 1.900       # MPI_Comm_spawn to the replacement joined: its start included
    group_s: float = 0.005       # mpidp's group made anew over the shrunk or merged communicator
    handover_s: float = 0.150    # the state handed over at 3 ranks, its host work (the bytes apart)
    first_step_s: float = 1.6    # a new process's first optimizer step: torch._dynamo's import
    end_job_s: float = 1.02      # a relaunch: the job ended (the interrupt's grace, the abort)
    launch_s: float = 0.12       # a relaunch: the launcher to the new job's first line, per level
    imports_s: float = 1.11      # a relaunch: Python's and torch's imports and MPI_Init


def levels(count: int) -> int:
    """The depth of a binary tree over ``count`` (at least 1): the rounds of a broadcast, an
    agreement, a launcher's fan-out."""
    return max(1, math.ceil(math.log2(max(count, 1))))


def shrink(ranks: int) -> costs.Terms:
    """ULFM's revoke (a reliable broadcast over the group) and MPI_Comm_shrink's agreement (up
    and down a tree), then the fingerprint's all-reduce of 8 bytes: 4 tree depths."""
    return costs.Terms(messages=4 * levels(ranks))


def in_job_s(ranks: int, lost: int, state_bytes: float, step_s: float,
             machine: costs.Machine, phases: Phases = Phases(), respawn: bool = True
             ) -> Dict[str, float]:
    """Seconds per phase, from the survivors' learning of the loss of ``lost`` of ``ranks``
    to their next step done: shrunk (``respawn`` False: the survivors go on with the replicas
    they hold) or respawned (replacements spawned, merged and handed ``state_bytes``, the
    model and its optimizer state). The failed step is redone (``step_s``) either way."""
    if not 0 < lost < ranks:
        raise ValueError(f"lost {lost!r} of {ranks!r} ranks: between 1 and ranks - 1")
    left = ranks - lost
    parts = {"shrink_s": costs.seconds(shrink(ranks), machine)}
    if respawn:
        parts["spawn_s"] = phases.spawn_s + costs.seconds(
            costs.Terms(messages=2 * levels(ranks)), machine)  # the merge and the order
    parts["group_s"] = phases.group_s + costs.seconds(
        costs.Terms(messages=2 * levels(ranks if respawn else left)), machine)
    if respawn:
        parts["state_s"] = phases.handover_s + costs.seconds(
            costs.broadcast(state_bytes, ranks), machine)
        parts["first_step_s"] = phases.first_step_s
    parts["redo_s"] = step_s
    return parts


def relaunch_s(ranks: int, nodes: int, state_bytes: float, step_s: float,
               machine: costs.Machine, read_bytes_per_s: float, checkpoint_every_s: float,
               phases: Phases = Phases()) -> Dict[str, float]:
    """Seconds per phase of a relaunch after the loss is known: the job ended, launched anew
    over ``nodes`` (a launcher's tree), every process's imports and MPI's start, rank 0
    reading the checkpoint at ``read_bytes_per_s`` and broadcasting it (mpidp.train's resume),
    the first step's import; and apart, the steps since the last checkpoint, written every
    ``checkpoint_every_s`` (half of it, on average), redone."""
    return {"end_s": phases.end_job_s,
            "launch_s": phases.launch_s * levels(nodes),
            "start_s": phases.imports_s + costs.seconds(
                costs.Terms(messages=levels(ranks)), machine),  # MPI's wire-up exchange
            "load_s": state_bytes / read_bytes_per_s + costs.seconds(
                costs.broadcast(state_bytes, ranks), machine),
            "first_step_s": phases.first_step_s,
            "redo_s": step_s + checkpoint_every_s / 2}
