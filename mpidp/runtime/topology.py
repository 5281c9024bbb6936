"""What a group of ranks is: its communicator, this process's rank, the node map and the
sub-communicators of a node and of the node leaders. Built once by ``mpidp.init`` and fixed
after it; what collectives use on top of it (shared memory, transports, the watchdog's board)
is mpidp.runtime.resources."""
from __future__ import annotations

import socket
from typing import Any, Optional

import numpy as np

from ..engine.library import mpi

HOST_BYTES = 64  # a host name as the node map keeps it (longer names are cut)


class Topology:
    """``comm`` is mpidp's duplicate of ``user_comm`` (the communicator passed to init);
    ``node_comm`` holds the ranks of this node (or of an emulated node: ``emulate_node_size``
    consecutive ranks), ``leader_comm`` the local rank 0 of every node (None on other ranks).
    ``node_of[r]`` is rank r's node index and ``hosts[k]`` node k's host name (its local rank
    0's; an emulated node: "HOST/k"), so that a report can name a node whose ranks are gone;
    ``node_ranks`` the ranks of this node in local-rank order; ``host_size`` the ranks of the
    group on this rank's machine, which is ``local_size`` except where nodes are emulated
    (the count that shares the machine's cores: mpidp.train.setup.default_threads).
    Collective: every rank of ``user_comm`` constructs it together."""

    __slots__ = ("user_comm", "comm", "rank", "size", "node_comm", "leader_comm", "local_rank",
                 "local_size", "node_count", "node_index", "node_of", "hosts", "node_ranks",
                 "host_size")

    def __init__(self, user_comm: Any, emulate_node_size: int = 0):
        MPI = mpi()
        self.user_comm = user_comm
        self.comm = comm = user_comm.Dup()
        self.rank, self.size = comm.Get_rank(), comm.Get_size()
        if emulate_node_size > 0:
            self.node_comm = comm.Split(self.rank // emulate_node_size, self.rank)
        else:
            self.node_comm = comm.Split_type(MPI.COMM_TYPE_SHARED, self.rank)
        self.local_rank, self.local_size = self.node_comm.Get_rank(), self.node_comm.Get_size()
        is_leader = self.local_rank == 0
        leaders = comm.Split(0 if is_leader else MPI.UNDEFINED, self.rank)
        self.leader_comm: Optional[Any] = leaders if is_leader else None
        self.node_count = comm.allreduce(1 if is_leader else 0)
        self.node_index = self.node_comm.bcast(leaders.Get_rank() if is_leader else -1, root=0)
        self.node_of, self.hosts, self.host_size = self._node_map(comm, emulate_node_size)
        self.node_ranks = tuple(r for r in range(self.size) if self.node_of[r] == self.node_index)

    def _node_map(self, comm, emulate_node_size: int) -> tuple:
        """(node index of every rank, host name of every node, the ranks on this rank's
        host): one Allgather of fixed-size records (no pickle), each with its rank's machine
        name; an emulated node's host is named "HOST/k"."""
        mine = np.zeros(8 + HOST_BYTES, np.uint8)
        mine[:8] = np.frombuffer(np.int64(self.node_index).tobytes(), np.uint8)
        name = socket.gethostname().encode()[:HOST_BYTES]
        mine[8:8 + len(name)] = np.frombuffer(name, np.uint8)
        everyone = np.empty((self.size, mine.size), np.uint8)
        comm.Allgather(mine, everyone)
        node_of = tuple(int(v) for v in everyone[:, :8].copy().view(np.int64)[:, 0])
        machines = [bytes(everyone[r, 8:]).rstrip(b"\0") for r in range(self.size)]
        hosts = [""] * self.node_count
        for r in range(self.size):
            if not hosts[node_of[r]]:
                host = machines[r].decode(errors="replace")
                hosts[node_of[r]] = f"{host}/{node_of[r]}" if emulate_node_size > 0 else host
        # the ranks on this machine: its node's, unless nodes are emulated on it (the names
        # of two machines may be alike, a container's "localhost": counted by name only here)
        return node_of, tuple(hosts), machines.count(name) if emulate_node_size > 0 \
            else self.local_size

    @property
    def single_node(self) -> bool:
        return self.node_count == 1

    def comms(self) -> list:
        """The group's communicators: the user's, mpidp's duplicate, the node's, the
        leaders'."""
        return [c for c in (self.user_comm, self.comm, self.node_comm, self.leader_comm)
                if c is not None]

    def free(self) -> None:
        """Frees mpidp's communicators (collective)."""
        for c in (self.node_comm, self.leader_comm, self.comm):
            if c is not None:
                c.Free()
