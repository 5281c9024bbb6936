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
    "allreduce": "comm.collectives", "allreduce_": "comm.collectives",
    "broadcast": "comm.collectives", "broadcast_": "comm.collectives",
    "reduce_": "comm.collectives", "allgather": "comm.collectives",
    "reduce_scatter": "comm.collectives",
    "alloc": "comm.node_memory",
    "grouped_allreduce": "comm.fusion", "grouped_allreduce_": "comm.fusion",
    "broadcast_parameters": "comm.state_broadcast",
    "broadcast_optimizer_state": "comm.state_broadcast",
    "DistributedDataParallel": "ddp.distributed", "CentralStorage": "modes.central",
    "SyncBatchNorm": "ddp.sync_bn", "ZeroRedundancyOptimizer": "ddp.zero",
    "fit": "train", "Trainer": "train", "TrainSettings": "train",
    "MpidpError": "errors", "CommunicationError": "errors", "MismatchError": "errors",
    "NotInitializedError": "errors", "BackendUnavailableError": "errors",
    "LaunchError": "errors", "ConfigError": "errors",
}

# the documented modules of DistributedDataParallel's hooks and ZeRO, reached as attributes
# (``mpidp.compression.fp16_compress_hook``) where they lived before the packages by layer
_MODULES = {"compression": "ddp.compression", "powersgd": "ddp.powersgd", "zero": "ddp.zero",
            "audit": "ddp.audit"}

__all__ = sorted(_EXPORTS)


__getattr__, __dir__ = exports(__name__, _EXPORTS, _MODULES)
