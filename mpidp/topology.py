"""What a group of ranks is: its communicator, this process's rank, the node map and the
sub-communicators of a node and of the node leaders. Built once by ``mpidp.init`` and fixed
after it; what collectives use on top of it (shared memory, transports, the watchdog's board)
is mpidp.resources."""
from __future__ import annotations

from typing import Any, Optional


class Topology:
    """``comm`` is mpidp's duplicate of ``user_comm`` (the communicator passed to init);
    ``node_comm`` holds the ranks of this node (or of an emulated node: ``emulate_node_size``
    consecutive ranks), ``leader_comm`` the local rank 0 of every node (None on other ranks).
    Collective: every rank of ``user_comm`` constructs it together."""

    __slots__ = ("user_comm", "comm", "rank", "size", "node_comm", "leader_comm", "local_rank",
                 "local_size", "node_count", "node_index")

    def __init__(self, user_comm: Any, emulate_node_size: int = 0):
        from mpi4py import MPI  # deferred for cost: import mpidp starts no MPI
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

    @property
    def single_node(self) -> bool:
        return self.node_count == 1

    def free(self) -> None:
        """Frees mpidp's communicators (collective)."""
        for c in (self.node_comm, self.leader_comm, self.comm):
            if c is not None:
                c.Free()
