"""torch's Join for mpidp's DistributedDataParallel (Note [Uneven inputs]): the Joinable side
of the DDP class — ``join``, ``join_hook``, the shadow of one iteration on a rank without
batches, the final broadcast from the last rank to join."""
from __future__ import annotations

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.algorithms.join import Join, Joinable, JoinHook

from ..comm import collectives
from .. import runtime
from ..backend import process_group_for_join
from ..comm.fingerprint import check_same
from ..comm.state_broadcast import broadcast_tensors_
from .hooks import reduce_scatters

# Note [Uneven inputs]
# torch's Join (``with Join([model]):``, ``with model.join():``) lets ranks that ran out of
# batches shadow the others' collectives until every rank has: at each forward a rank that
# has not joined says so in an all-reduce on torch.distributed's default group (started on
# the mpidp backend if it is not; waited for at once, so that it comes before the forward's
# own collectives on every rank) and whether it will reduce gradients (not inside no_sync);
# a joined rank answers both and then makes, from the main thread, the collectives of one
# iteration: the buffer broadcast and, where the others reduce, each bucket's all-reduce
# with zero gradients (so the average stays over the initial world size, torch's
# divide_by_initial_world_size=True), the used-parameter count (every parameter counted as
# used) and, once, the bucket rebuild. At the end the last rank to join broadcasts its
# parameters and buffers, so every rank ends with the same model, as torch's DDP does. What
# Join refuses (divide_by_initial_world_size=False, the audit, an attached ZeRO, SyncBatchNorm)
# is refused on every rank: each rank's refusal is exchanged when the Join is built (join_hook,
# which every rank calls), so a rank that refuses never leaves the others waiting in a forward;
# so are enable and throw_on_early_termination compared there (model.join() hands them to
# join_hook), since either changes how many all-reduces a forward makes.



class JoinSupport(Joinable):
    """Mixed into mpidp.ddp.distributed.DistributedDataParallel, whose state it reads (its buckets,
    parameters, buffers, settings and ``_reduce``, ``_exchange_used``, ``_agree_on_hook``,
    ``_rebuild``)."""

    def join(self, divide_by_initial_world_size: bool = True, enable: bool = True,
             throw_on_early_termination: bool = False) -> Join:
        """torch's ``DistributedDataParallel.join``: ``with model.join(): <training loop>``
        lets ranks with fewer batches finish (Note [Uneven inputs]). Only
        ``divide_by_initial_world_size=True`` (torch's default) is supported. Collective:
        ``enable`` and ``throw_on_early_termination`` decide how many all-reduces each
        forward makes, so they are compared across ranks with the rest (``join_hook``)."""
        return Join([self], enable, throw_on_early_termination,
                    divide_by_initial_world_size=divide_by_initial_world_size,
                    join_settings={"enable": bool(enable), "throw_on_early_termination":
                                   bool(throw_on_early_termination)})

    def join_hook(self, **kwargs) -> JoinHook:
        """torch's; collective: what one rank refuses every rank refuses, and the settings
        that decide each forward's collectives (``enable``, ``throw_on_early_termination``)
        must agree: ``join()`` hands them here as ``join_settings`` (torch's Join passes extra
        keywords to every joinable's join_hook; its own ``enable`` cannot be one), and a
        ``Join`` built directly, which does not, is taken to use torch's defaults (Note
        [Uneven inputs])."""
        try:
            self._check_joinable(kwargs.get("divide_by_initial_world_size", True))
            failed = None
        except ValueError as exc:
            failed = exc
        given = kwargs.get("join_settings", {})
        settings = [("enable", given.get("enable", True)),
                    ("throw_on_early_termination", given.get("throw_on_early_termination",
                                                             False))]
        check_same(runtime.group(), settings, "Join", "the Join settings", failed)
        return _JoinHook(self)

    def _check_joinable(self, divide_by_initial_world_size: bool) -> None:
        """ValueError for what Join cannot shadow (Note [Uneven inputs])."""
        if not divide_by_initial_world_size:
            raise ValueError("divide_by_initial_world_size=False is not supported: mpidp "
                             "averages over the initial world size while ranks join")
        if self.audit_every:
            raise ValueError("Join: the replica audit (audit_every) would compare the "
                             "models of ranks that stopped stepping; turn it off under Join")
        if self._hook is not None and reduce_scatters(self._hook[1]):  # ZeRO's hook
            raise ValueError("Join: a ZeroRedundancyOptimizer all-gathers at every step, which "
                             "a rank without a batch does not take; give every rank the same "
                             "number of batches instead")
        if self.sync_batchnorm_layers:
            raise ValueError(f"Join: the SyncBatchNorm layers {self.sync_batchnorm_layers} "
                             "cannot be shadowed by a rank without a batch; give every rank "
                             "the same number of batches instead")

    @property
    def join_device(self) -> torch.device:
        return self._params[0].device if self._params else torch.device("cpu")

    @property
    def join_process_group(self):
        return process_group_for_join()

    def _syncing_ranks(self, mine: int) -> int:
        """How many ranks will reduce gradients in this iteration (not in ``no_sync``): an
        all-reduce on the Join's group, to which a joined rank adds 0."""
        flag = torch.tensor([mine], dtype=torch.int64, device=self.join_device)
        dist.all_reduce(flag, group=self.join_process_group)
        return int(flag.item())

    def _shadow_iteration(self) -> None:
        """A joined rank's part of one iteration of the others (Note [Uneven inputs])."""
        syncing = self._syncing_ranks(0) > 0
        if syncing and not self._hook_agreed:
            self._agree_on_hook()
        if self.broadcast_buffers and self._module_buffers and self._size > 1:
            broadcast_tensors_(self._module_buffers, 0)
        if self._size > 1 and syncing:
            for bucket in self._buckets:  # zero gradients
                none = [None] * len(bucket.indices)
                self._reduce(bucket, none, None if self.gradient_as_bucket_view else none)
            self._exchange_used([1] * len(self._params), False)
        if not self._rebuilt and syncing:
            self._rebuild()

class _JoinHook(JoinHook):
    def __init__(self, ddp: JoinSupport):
        self.ddp = ddp

    def main_hook(self) -> None:
        self.ddp._shadow_iteration()

    def post_hook(self, is_last_joiner: bool) -> None:
        """The last rank to join broadcasts its model (the highest such rank)."""
        ddp = self.ddp
        if ddp._size == 1:
            return
        last = np.array([runtime.rank() if is_last_joiner else -1], np.int64)
        collectives.allreduce_(last, "max")
        broadcast_tensors_([p.detach() for p in ddp.module.parameters()]
                           + ddp._module_buffers, int(last[0]))
