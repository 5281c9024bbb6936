"""What the engine's executors use of one group, handed down to them (Note [Handed down]):
its communicators and place, the node's shared-memory context, the transports, and the
header exchange over them."""
from __future__ import annotations

from typing import Any, Callable, Optional

import numpy as np

from . import exchange

# Note [Handed down]
# Data flows down the layers, and so do the objects a layer works with: the engine never
# reaches up into the group that called it. The runtime's Resources own one Links per group
# and fill it as they make what it holds (the node's shared-memory context on first use, the
# C context across nodes at init); the collective front (mpidp.comm) asks the runtime for it,
# ready, once per collective (Resources.links_ready) and hands it to an executor
# (mpidp.engine.host_executor, mpidp.engine.gpu.executor), which reads its fields and calls
# only what is defined here, at its own layer or below.


class Links:
    """One group's communicators and place, copied from its topology at init (fixed from
    then on, so reading them calls nothing), and what the engine made for it. ``shm``: the
    node's ShmContext once made (None before, or without the C extension); ``c_exchange``:
    the C context across nodes (csrc/exchange.c) or None; ``wait_timeout_s``: how long the
    header exchange waits for other ranks across nodes (None: as long as it takes). Not
    thread-safe beyond what a group's collectives already serialise."""

    __slots__ = ("rank", "size", "comm", "node_comm", "leader_comm", "local_rank",
                 "local_size", "node_ranks", "node_of", "single_node", "one_per_node", "shm",
                 "c_exchange", "transports", "wait_timeout_s", "__weakref__")

    def __init__(self, rank: int, size: int, comm: Any, node_comm: Any, leader_comm: Any,
                 local_rank: int, local_size: int, node_ranks: tuple, node_of: tuple,
                 single_node: bool, one_per_node: bool):
        self.rank, self.size, self.comm = rank, size, comm
        self.node_comm, self.leader_comm = node_comm, leader_comm
        self.local_rank, self.local_size = local_rank, local_size
        self.node_ranks, self.node_of = tuple(node_ranks), tuple(node_of)
        self.single_node = single_node
        self.one_per_node = one_per_node
        self.shm = None
        self.c_exchange = None
        self.transports: dict = {}
        self.wait_timeout_s = None  # a group's timeout (Resources.set_wait_timeout)

    def transport(self, key: Any, make: Callable[[], Any]) -> Any:
        """The transport under ``key`` (a communicator's or a device's), made by ``make`` on
        first use (collective then)."""
        t = self.transports.get(key)
        if t is None:
            t = self.transports[key] = make()
        return t

    def exchange(self, hdr: tuple, operation: str, local_error: Optional[BaseException] = None,
                 data: Optional[np.ndarray] = None, dtype: int = 0, op: int = 0) -> np.ndarray:
        """The header check every collective starts with (mpidp.engine.exchange.exchange):
        every rank's free word, or an error raised on every rank. Collective."""
        return exchange.exchange(self, hdr, operation, local_error, data, dtype, op)
