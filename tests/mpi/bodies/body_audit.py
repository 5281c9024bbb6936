"""Run under mpiexec at any world size: DistributedDataParallel(audit_every=2) passes while
the replicas agree (each rank on its own data, so the BatchNorm buffers differ: they are not
audited); after the last rank's first weight is perturbed, the next audit raises on every rank
naming that tensor and the ranks (with audit_action="warn", rank 0 warns and training goes
on); bad settings, and settings that differ between ranks, are refused on every rank.
Prints 'ok <rank>'."""
import warnings

import torch
from torch import nn

import mpidp
from bodykit import expect, failures, finish
from mpidp.ddp.audit import ReplicaDivergenceError

torch.set_num_threads(1)
mpidp.init()
rank, n = mpidp.rank(), mpidp.size()


def step(model):  # each rank its own batch: the BatchNorm buffers differ, the weights do not
    model(torch.arange(8.0).reshape(2, 4) * (rank + 1)).sum().backward()


for action in ("raise", "warn"):
    torch.manual_seed(0)
    model = mpidp.DistributedDataParallel(nn.Sequential(nn.Linear(4, 3), nn.BatchNorm1d(3)),
                                          audit_every=2, audit_action=action)
    for _ in range(4):
        step(model)  # steps 2 and 4 audited: the replicas agree
    if rank == n - 1 and n > 1:
        with torch.no_grad():
            model.module[0].weight[0, 0] += 1e-6
    step(model)  # step 5: not audited
    caught = None
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        try:
            step(model)  # step 6: audited
        except ReplicaDivergenceError as exc:
            caught = exc
    if n == 1:
        expect(caught is None and not seen, f"{action}: one rank cannot diverge")
        continue
    diverged = ", ".join(map(str, range(n - 1)))
    expected = (f"first differing tensor '0.weight': "
                f"{'ranks' if n > 2 else 'rank'} {diverged} {'hold' if n > 2 else 'holds'} "
                f"version 1; rank {n - 1} holds version 2")
    if action == "raise":
        expect(caught is not None and expected in str(caught)
               and "synchronised step 6" in str(caught), f"raise: {caught}")
    else:
        messages = [str(w.message) for w in seen if "replica audit" in str(w.message)]
        expect(caught is None and (bool(messages) == (rank == 0))
               and all(expected in m for m in messages), f"warn: {caught}, {messages}")

if n > 1:  # settings that differ between ranks are refused on every rank
    try:
        mpidp.DistributedDataParallel(nn.Linear(2, 2), audit_every=rank)
        failures.append("different audit settings accepted")
    except mpidp.MismatchError as exc:
        expect("its arguments differ between ranks" in str(exc) and
               "rank 1: audit_every = 1 where rank 0 has 0" in str(exc),
               f"differing settings: {exc}")

for bad in ({"audit_every": -1}, {"audit_every": 1.5}, {"audit_every": True},
            {"audit_action": "ignore"}):
    try:
        mpidp.DistributedDataParallel(nn.Linear(2, 2), **bad)
        failures.append(f"{bad} accepted")
    except ValueError as exc:
        expect("audit_" in str(exc), f"{bad}: {exc}")

finish(rank)
