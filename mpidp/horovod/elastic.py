"""``hvd.elastic``: Horovod's elastic training API on mpidp's in-job recovery (Note [Elastic
on in-job recovery]): ``run``, the states (``State``, ``ObjectState``, ``TorchState``) with
``commit``, ``restore`` and reset callbacks, ``ElasticSampler``, ``HostsUpdatedInterrupt``.

Note [Elastic on in-job recovery]
Horovod's elastic mode has a driver that watches the hosts: a worker lost or added makes every
worker's collectives fail (HorovodInternalError) or its next ``commit`` raise
HostsUpdatedInterrupt; ``hvd.elastic.run`` then restores the last committed state (on a
failure), shuts Horovod down and starts it again on the new set of workers, runs the reset
callbacks, broadcasts the state from rank 0 (``sync``) and calls the training function again.
mpidp has no driver: its elastic events are the MPI's own, where the job runs with fault
tolerance (Note [In-job recovery] in mpidp/runtime/recovery.py). A collective that meets a lost
process raises (recovery.is_process_failure); ``run`` restores the last commit, and the group is
remade by mpidp.runtime.world.recover — revoke, shrink and, under ``MPIDP_RECOVERY=respawn``
(the default there), a replacement per lost rank, started with the script's own command line,
whose ``hvd.init()`` joins the survivors — then the reset callbacks run and the state is
synchronised, and the function is called again. The differences from Horovod:
- ``sync`` broadcasts from the first rank that holds the state (the lowest survivor; rank 0
  when no process was replaced; ``state.sync_root``, an mpidp addition, which a State of a
  script's own should broadcast from too), where Horovod's broadcasts from rank 0, which its
  driver gives to a survivor: mpidp's replacements keep the lost ranks' numbers, and a
  replacement of rank 0 would otherwise hand out its fresh state;
- after a sync every rank saves what it received as its restore point (Horovod's handlers
  keep what they held before), so that a replacement that has not committed yet restores the
  synchronised state at a second loss, not its fresh one;
- the optimizer's state is synchronised by loading the holder's (``broadcast_optimizer_state``
  of mpidp.comm), without hvd.broadcast_optimizer_state's zero-gradient step on a rank whose
  optimizer has no state yet: that step would move a replacement's parameters after their
  broadcast wherever the optimizer decays weights;
- ``commit`` checks no host updates (there is no driver to send them) and so calls no
  collective; ``HostsUpdatedInterrupt`` exists for the scripts that raise or catch it;
- ElasticSampler pads the epoch's last batch with the epoch's first samples, as the partition
  made at the epoch's start does, where Horovod's pads with the first of those left: so a run
  respawned to its size ends bit for bit as the uninterrupted run.
As in Horovod, DistributedOptimizer's ``load_state_dict`` forgets the pass in progress
(gradients counted, buckets launched; Horovod clears its handles there), so that the restore
after a failure that came between a backward and its step leaves the optimizer ready.
Where the MPI has no fault tolerance (MPICH, the default) or recovery is off, a lost rank ends
the job as without ``run`` (``python -m mpidp.run`` relaunches it); ``run`` still synchronises
the state at the start, as Horovod's does."""
from __future__ import annotations

import copy
import functools
import math
import random
import sys
from typing import Any, Callable, Optional

import torch

from .. import runtime
from ..comm import collectives, state_broadcast
from . import process_sets as process_sets_
from .optimizer import broadcast_object

_synced = False  # this process has taken part in a sync (Note [Elastic on in-job recovery])


def _holds_state() -> bool:
    """Whether this process holds the run's state: it has synchronised it, or it is not a
    replacement of a lost rank (mpidp.runtime.recovery starts those with -X mpidp-replaces)."""
    from ..runtime import recovery  # loads the engine: not at import (Note [The runtime's front])
    return _synced or recovery.REPLACEMENT not in sys._xoptions


class HostsUpdatedInterrupt(RuntimeError):
    """Horovod's: the set of hosts changed; ``skip_sync``: only hosts were removed, so the
    state need not be broadcast again."""

    def __init__(self, skip_sync: bool = False):
        super().__init__("hosts updated")
        self.skip_sync = skip_sync


def _root() -> int:
    """The rank ``sync`` broadcasts from: the first that holds the state (Note [Elastic on
    in-job recovery]). Collective."""
    holds = collectives.allgather(torch.tensor([int(_holds_state())], dtype=torch.int64)).tolist()
    return holds.index(1) if 1 in holds else 0


class State:
    """Horovod's base state: what ``commit`` saves in memory, ``restore`` brings back and
    ``sync`` broadcasts; reset callbacks run after the group changed (``on_reset``)."""

    def __init__(self, bcast_object: Callable = broadcast_object,
                 get_rank: Optional[Callable[[], int]] = None):
        self._bcast_object, self._rank = bcast_object, get_rank or (lambda: runtime.rank())
        self._reset_callbacks: list = []
        # the rank sync broadcasts from, set by run before each sync (an mpidp addition: a
        # State of a script's own broadcasts from it, Note [Elastic on in-job recovery])
        self.sync_root = 0

    def register_reset_callbacks(self, callbacks) -> None:
        """Functions run after every reset (a rank lost, the group remade), before the sync:
        where a script rescales its learning rate to the new size, say."""
        self._reset_callbacks.extend(callbacks)

    def on_reset(self) -> None:
        self.reset()
        for callback in self._reset_callbacks:
            callback()

    def on_hosts_updated(self, timestamp, update_res) -> None:
        """Horovod's driver's notification; mpidp has no driver and never calls it."""

    def commit(self) -> None:
        """Saves the state in memory (``restore`` goes back to it); then checks for host
        updates, which mpidp never has (no collective: Note [Elastic on in-job recovery])."""
        self.save()
        self.check_host_updates()

    def check_host_updates(self) -> None:
        """Horovod raises HostsUpdatedInterrupt here after its driver's notice; mpidp's group
        changes only by a lost process, which the collectives raise."""

    def save(self) -> None:
        raise NotImplementedError

    def restore(self) -> None:
        raise NotImplementedError

    def sync(self) -> None:
        raise NotImplementedError

    def reset(self) -> None:
        """What a subclass redoes after the group changed, before the sync."""


class ObjectState(State):
    """Horovod's state of plain values, given as keyword arguments and kept as attributes
    (an epoch, a batch number); ``sync`` broadcasts them as the holder committed them."""

    def __init__(self, bcast_object: Callable = broadcast_object,
                 get_rank: Optional[Callable[[], int]] = None, **kwargs):
        self._saved_state = kwargs
        self._set_attrs()
        super().__init__(bcast_object=bcast_object, get_rank=get_rank)

    def save(self) -> None:
        self._saved_state = {name: getattr(self, name) for name in self._saved_state}

    def restore(self) -> None:
        self._set_attrs()

    def sync(self) -> None:
        if self._saved_state:  # a bcast_object of the script's own takes one argument
            self._saved_state = self._bcast_object(self._saved_state, self.sync_root) \
                if self._bcast_object is broadcast_object else \
                self._bcast_object(self._saved_state)
            self._set_attrs()

    def _set_attrs(self) -> None:
        for name, value in self._saved_state.items():
            setattr(self, name, value)


class ElasticSampler(torch.utils.data.Sampler):
    """Horovod's sampler that re-partitions what is left of an epoch after a reset: the
    dataset's indices (shuffled by ``seed`` + epoch where ``shuffle``), those of the batches
    recorded as done (``record_batch``) left out, the rest dealt over the ranks of the
    current group, padded to a multiple of their number with the epoch's first indices
    (Horovod pads with the first of those left: after a reset its last batch takes other
    samples than the uninterrupted run's, this one the same). Kept by a TorchState, its
    position is committed, restored and synchronised with the rest."""

    def __init__(self, dataset, shuffle: bool = True, seed: int = 0):
        self.dataset, self.shuffle, self.seed = dataset, shuffle, seed
        self.epoch = 0
        self.processed_num = 0
        self.reset()

    def set_epoch(self, epoch: int) -> None:
        """The epoch from now on, none of its samples done: call it at an epoch's end."""
        self.epoch = epoch
        self.processed_num = 0
        self.reset()

    def record_batch(self, batch_idx: int, batch_size: int) -> None:
        """A batch of ``batch_size`` per rank is done on every rank."""
        self.processed_num += batch_size * self.num_replicas

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "processed_num": self.processed_num}

    def load_state_dict(self, state: dict) -> None:
        self.epoch, self.processed_num = state["epoch"], state["processed_num"]
        self.reset()

    def reset(self) -> None:
        """The partition for the current group, from the position."""
        self.num_replicas, self.rank = runtime.size(), runtime.rank()
        order = list(range(len(self.dataset)))
        if self.shuffle:
            random.Random(self.seed + self.epoch).shuffle(order)
        self.remaining_indices = order[self.processed_num:]
        self.num_samples = math.ceil(len(self.remaining_indices) / self.num_replicas)
        self.total_size = self.num_samples * self.num_replicas
        self._padding = order[:self.total_size - len(self.remaining_indices)]

    def __iter__(self):
        indices = self.remaining_indices + self._padding  # to the ranks' multiple
        return iter(indices[self.rank:self.total_size:self.num_replicas])

    def __len__(self) -> int:
        return self.num_samples


class _Handler:
    """How a TorchState keeps one value of a kind (a model, an optimizer, a sampler): a copy
    of its state_dict saved and loaded back; each kind says how it is synchronised."""

    def __init__(self, value):
        self.value = value
        self.save()

    def set_value(self, value) -> None:
        self.value = value
        self.save()

    def save(self) -> None:
        self._saved = copy.deepcopy(self.value.state_dict())

    def restore(self) -> None:
        self.value.load_state_dict(self._saved)


class _ModelHandler(_Handler):
    def sync(self, root: int) -> None:
        state_broadcast.broadcast_parameters(self.value.state_dict(), root)


class _OptimizerHandler(_Handler):
    def sync(self, root: int) -> None:  # Note [Elastic on in-job recovery]: no zero step
        state_broadcast.broadcast_optimizer_state(self.value, root)


class _SamplerHandler(_Handler):
    def sync(self, root: int) -> None:
        self.value.load_state_dict(broadcast_object(self.value.state_dict(), root))


_handler_registry = [(torch.nn.Module, _ModelHandler), (torch.optim.Optimizer, _OptimizerHandler),
                     (ElasticSampler, _SamplerHandler)]


def get_handler_registry() -> list:
    """The (type, handler class) pairs a TorchState keeps its values by, as Horovod's."""
    return _handler_registry


def set_handler_registry(registry: list) -> None:
    global _handler_registry
    _handler_registry = registry


class TorchState(ObjectState):
    """Horovod's state of a PyTorch run: ``model`` and ``optimizer`` (and any keyword value
    that is a module, an optimizer or an ElasticSampler) kept by their state_dicts, the other
    keyword values as ObjectState keeps them; each is an attribute."""

    def __init__(self, model=None, optimizer=None, **kwargs):
        kwargs.update(model=model, optimizer=optimizer)
        handlers, rest = {}, {}
        for name, value in kwargs.items():
            kind = next((h for t, h in _handler_registry if isinstance(value, t)), None)
            if kind is None:
                rest[name] = value
            else:
                handlers[name] = kind(value)
        object.__setattr__(self, "_handlers", handlers)
        for name, handler in handlers.items():
            object.__setattr__(self, name, handler.value)
        super().__init__(bcast_object=broadcast_object, **rest)

    def save(self) -> None:
        for handler in self._handlers.values():
            handler.save()
        super().save()

    def restore(self) -> None:
        for handler in self._handlers.values():
            handler.restore()
        super().restore()

    def sync(self) -> None:
        for handler in self._handlers.values():
            handler.sync(self.sync_root)
        super().sync()

    def __setattr__(self, name: str, value: Any) -> None:
        handlers = self.__dict__.get("_handlers", {})
        if name in handlers:
            handlers[name].set_value(value)
        super().__setattr__(name, value)


def _lost_a_process(exc: BaseException) -> bool:
    """Whether ``exc`` is a lost process that this job recovers from in the job."""
    from ..runtime import recovery  # loads the engine: not at import
    return runtime.is_initialized() and runtime.init_group().recovery != "off" and \
        recovery.is_process_failure(exc)


def _reset() -> None:
    """The survivors' side of a reset: the group remade (mpidp.runtime.world.recover), the
    process sets forgotten (as Horovod's reset forgets them: a reset callback adds them
    again), one line from the first survivor."""
    from ..runtime import recovery, world  # load the engine: not at import
    old = runtime.init_group()
    before, mine = old.size, old.rank
    g, lost, replaced, _ = world.recover()
    process_sets_.forget()
    process_sets_.started()
    if mine == min(set(range(before)) - set(lost)):
        print(f"mpidp.horovod.elastic: {recovery.describe(lost, before, g.size, replaced)}; "
              "going on from the last commit", flush=True)


def run(func: Callable) -> Callable:
    """Horovod's decorator for the elastic training function ``func(state, ...)``: the state
    synchronised (from its holder), then ``func`` called; after a lost process, the last
    commit restored, the group remade, the reset callbacks run and ``func`` called again
    (Note [Elastic on in-job recovery]). A collective outside ``func`` and its state's sync
    would meet a replacement's start: keep them inside, as Horovod asks."""
    if not callable(func):
        raise TypeError(f"hvd.elastic.run decorates a function of the state, got "
                        f"{type(func).__name__}")

    @functools.wraps(func)
    def wrapper(state: State, *args, **kwargs):
        global _synced
        skip_sync = False
        while True:
            try:
                if not skip_sync:
                    state.sync_root = _root()
                    state.sync()
                    state.save()  # the holder's state, now every rank's to restore
                    _synced = True
                return func(state, *args, **kwargs)
            except HostsUpdatedInterrupt as exc:
                skip_sync = exc.skip_sync
            except Exception as exc:  # noqa: BLE001 - a lost process, else raised again
                if not _lost_a_process(exc):
                    raise
                state.restore()
                skip_sync = False
                _reset()
            state.on_reset()

    return wrapper
