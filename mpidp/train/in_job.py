"""A training run that outlives a lost rank inside the job (Note [Recovering a run]): the
in-memory snapshots of the last two steps, and the recovery the survivors and the
replacements go through together.

Note [Recovering a run]
Under in-job recovery (mpidp.runtime.recovery, Note [In-job recovery]) every rank keeps, in
memory, the run's state at the end of each of its last two steps (``Snapshots``: the
parameters, the optimizer's state, its generators, the position). Two suffice: an
all-reduce completes on a rank only once every rank has entered it, so a survivor is at most
one step past another when a rank is lost (the one that saw its step's gradients complete
and went on). When a step's MPI call reports the loss, every survivor
(mpidp.runtime.world.recover) revokes, shrinks and respawns; then on the new group every rank,
the replacements too (``join``), runs ``rejoin``: the ranks say which step their newest
snapshot is of; all go on from the oldest of those (the redone step is never half applied:
what a survivor had of a later step is dropped), taken from the first rank that has it:
the parameters broadcast, the optimizer's state broadcast, each survivor's generators its
own, the position and the run's totals broadcast; then a new strategy (its buckets, its DDP)
on the new group and a new data shard for this rank: from the epoch's sample cursor, as a
resume on another number of ranks (Note [Sample cursor]), so each remaining sample of the
epoch is seen once (the snapshot of an epoch's last step is where the next epoch starts once
that epoch's end, its score, event and checkpoint, is done; before that, going on from it
redoes the end alone). Respawned to the same number of ranks, each rank takes its old shard and
the run ends bit for bit as the uninterrupted one. A replacement starts the generators of
its rank afresh (seeded): a model that draws random numbers at each step (dropout) is then
not bit for bit on that rank. In-job recovery covers ``--strategy mirrored`` without
``--zero``, ``--compression`` or a gradient scaler (``recoverable``); a run of another mode
ends at a lost rank as without it, for ``python -m mpidp.run`` to relaunch. The new rank 0
prints one line at once and writes the recovery's record after the first step done since:
its seconds per phase (leaving the old group, the shrink, the spawn, the new group, the
state handed over) and from the failure seen to that step (``next_step_s``), in wall-clock
time (time.time()), the one clock a replacement's process shares with the survivors'."""
from __future__ import annotations

import copy
import sys
import time
from typing import Optional

from ..comm import objects
from ..comm.state_broadcast import broadcast_state_dict, broadcast_tensors_
from ..runtime import recovery, world
from . import checkpoint


def recoverable(settings, strategy) -> Optional[str]:
    """None where a failure of this run can be recovered in the job, else why not."""
    if settings.strategy != "mirrored":
        return f"--strategy {settings.strategy}"
    if settings.zero or strategy.compression != "none" or strategy.scaler is not None:
        return "--zero, --compression or a gradient scaler"
    return None


class Snapshots:
    """This rank's copies of the run's state after each of its last two steps (Note
    [Recovering a run]). This rank only."""

    def __init__(self):
        self.kept: list = []
        self.pending: Optional[dict] = None  # the recovery's record, written after a step

    def take(self, run, position: tuple) -> None:
        """The state after the step just done; ``position``: (epoch, batches done in it, its
        sample cursor)."""
        state = {"global_step": run.global_step, "position": position,
                 "model": {k: v.detach().clone() for k, v in run.model.state_dict().items()},
                 "optimizer": copy.deepcopy(run.strategy.optimizer.state_dict()),
                 "rng": checkpoint.rng_state(), "samples_total": run.samples_total}
        self.kept = [self.kept[-1], state] if self.kept else [state]
        if self.pending is not None:  # the first step done since a recovery
            self.pending["next_step_s"] = round(time.time() - self.pending["began_at"], 6)
            run.report.record(self.pending)
            self.pending = None

    def epoch_done(self, epoch: int, samples_total: int) -> None:
        """Epoch ``epoch``'s end (its score, event, checkpoint) is done too: the snapshot of
        its last step is where epoch ``epoch + 1`` starts (a loss in that epoch's first step
        goes on from there, not into the end again), with the run's samples counted by the
        epoch's event (``samples_total``)."""
        if self.kept and self.kept[-1]["position"][0] == epoch:
            self.kept[-1] = {**self.kept[-1], "position": (epoch + 1, 0, 0),
                             "samples_total": samples_total}

    def newest(self) -> int:
        return self.kept[-1]["global_step"] if self.kept else -1

    def at(self, global_step: int) -> dict:
        for state in self.kept:
            if state["global_step"] == global_step:
                return state
        raise AssertionError(f"no snapshot of step {global_step}: Note [Recovering a run]")


def recover(run, snapshots: Snapshots) -> tuple:
    """A survivor's recovery from a lost process (an error recovery.is_process_failure
    recognised):
    the group remade (mpidp.runtime.world.recover), then ``rejoin``. Returns (the group,
    the position to go on from: epoch, its sample cursor). Every survivor calls it."""
    began = time.time()  # wall time: the replacements' clocks (Note [Recovering a run])
    before = run.g.size
    g, lost, replaced, phases = world.recover()
    return g, rejoin(run, g, snapshots, (lost, before, replaced, began, phases))


def rejoin(run, g, snapshots: Snapshots, loss: Optional[tuple] = None) -> tuple:
    """Every rank of the new group ``g`` (survivors and replacements) takes up the run from
    the oldest newest snapshot (Note [Recovering a run]) and rebinds ``run`` to ``g``; the
    new rank 0 says what happened (``loss``, a survivor's: the ranks lost, the size before,
    whether they were replaced, when the recovery began (time.time()), its seconds in each
    phase of world.recover), and records it once the next step is done. Returns (epoch, its
    sample cursor). Collective over ``g``."""
    t_rejoin = time.perf_counter()
    newest = objects.allgather(g, snapshots.newest(), "in-job recovery: every rank's newest step")
    have = [r for r, step in enumerate(newest) if step >= 0]
    if not have:
        raise RuntimeError("in-job recovery: no rank kept a snapshot of the run")
    src, step = have[0], min(newest[r] for r in have)
    state = snapshots.at(step) if snapshots.kept else None
    if state is not None:
        run.model.load_state_dict(state["model"])
        checkpoint.set_rng_state(state["rng"])
    broadcast_tensors_([t for t in run.model.state_dict().values()], src)
    facts = (state["position"], state["global_step"], state["samples_total"],
             run.checkpoint, run.resumed_from, loss) if g.rank == src else None
    position, global_step, samples_total, path, resumed_from, \
        (lost, before, replaced, began, phases) = \
        objects.bcast(g, facts, "in-job recovery: the position", root=src)
    group_s = time.time() - began
    optimizer = broadcast_state_dict(state["optimizer"] if g.rank == src else None, src)
    run.rebind(g)  # the new strategy on g (collective), the shard, the report
    run.strategy.optimizer.load_state_dict(optimizer)
    run.global_step, run.samples_total = global_step, samples_total
    run.checkpoint = path if g.rank == 0 else None
    run.resumed_from = resumed_from
    snapshots.kept = [s for s in snapshots.kept if s["global_step"] <= step]
    epoch, _, cursor = position
    run.report.line(
        f"in-job recovery: {recovery.describe(lost, before, g.size, replaced)}; redoing from "
        f"step {global_step} (epoch {epoch + 1}); the group remade in {group_s:.2f} s")
    snapshots.pending = {"event": "recovery", "lost": list(lost), "ranks": g.size,
                         "respawned": replaced, "global_step": global_step,
                         "group_s": round(group_s, 6), "began_at": began,
                         "phases_s": {**phases, "handover_s": round(time.perf_counter()
                                                                    - t_rejoin, 6)}}
    return epoch, cursor


def joining() -> bool:
    """Whether this process was started to replace a lost rank (mpidp.runtime.recovery)."""
    return recovery.REPLACEMENT in sys._xoptions
