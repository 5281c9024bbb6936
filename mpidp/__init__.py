"""mpidp: an MPI-native data-parallel training runtime for PyTorch.

``import mpidp`` starts neither MPI nor CUDA; ``mpidp.init()`` starts MPI."""
from __future__ import annotations

from .lazy import exports

__version__ = "0.1.0"

# public name -> module that defines it; loaded on first access so that importing mpidp
# stays cheap and side-effect free
_EXPORTS = {
    "init": "runtime", "shutdown": "runtime", "is_initialized": "runtime", "rank": "runtime",
    "size": "runtime", "local_rank": "runtime", "local_size": "runtime",
    "node_count": "runtime",
    "allreduce": "collectives", "allreduce_": "collectives", "broadcast": "collectives",
    "broadcast_": "collectives", "reduce_": "collectives", "allgather": "collectives",
    "reduce_scatter": "collectives",
    "grouped_allreduce": "fusion", "grouped_allreduce_": "fusion",
    "broadcast_parameters": "state_broadcast", "broadcast_optimizer_state": "state_broadcast",
    "DistributedDataParallel": "mirrored", "CentralStorage": "central",
    "SyncBatchNorm": "sync_bn", "ZeroRedundancyOptimizer": "zero",
    "fit": "train", "Trainer": "train", "TrainSettings": "train",
    "MpidpError": "errors", "CommunicationError": "errors", "MismatchError": "errors",
    "NotInitializedError": "errors", "BackendUnavailableError": "errors",
    "LaunchError": "errors", "ConfigError": "errors",
}

__all__ = sorted(_EXPORTS)


__getattr__, __dir__ = exports(__name__, _EXPORTS)
