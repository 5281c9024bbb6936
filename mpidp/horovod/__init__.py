"""``import mpidp.horovod as hvd``: Horovod's PyTorch API (``horovod.torch``) on mpidp, so
that a script written for Horovod runs with its import line changed (docs/horovod.md: what is
supported, mapped and refused). Importing it starts neither MPI nor CUDA; ``hvd.init()``
starts MPI."""
from __future__ import annotations

from ..engine import header
from .basics import (Adasum, Average, HorovodInternalError, Max, Min, Product, Sum, ccl_built,
                     cross_rank, cross_size, cuda_built, ddl_built, gloo_built, gloo_enabled, init,
                     is_homogeneous, is_initialized, local_rank, local_size, mpi_built,
                     mpi_enabled, mpi_threads_supported, nccl_built, rank, rocm_built, shutdown,
                     size, start_timeline, stop_timeline)
from .alltoall import alltoall, alltoall_async
from .compression import Compression
from .ops import (allgather, allgather_async, allreduce, allreduce_,
                  allreduce_async, allreduce_async_, barrier, broadcast, broadcast_,
                  broadcast_async, broadcast_async_, grouped_allgather,
                  grouped_allgather_async, grouped_allreduce, grouped_allreduce_,
                  grouped_allreduce_async, grouped_allreduce_async_, join, poll,
                  sparse_allreduce_async, synchronize, SyncBatchNorm)
from .reducescatter import (grouped_reducescatter, grouped_reducescatter_async, reducescatter,
                            reducescatter_async)
from .optimizer import (DistributedOptimizer, allgather_object, broadcast_object,
                        broadcast_optimizer_state, broadcast_parameters)
from .process_sets import (ProcessSet, add_process_set, global_process_set,
                           remove_process_set)
from . import elastic

header.binding(__name__)  # a call site is the script's line, not this package's

__all__ = ["Adasum", "Average", "Compression", "DistributedOptimizer", "HorovodInternalError",
           "Max", "Min", "ProcessSet", "Product", "Sum", "SyncBatchNorm", "add_process_set",
           "allgather", "allgather_async", "allgather_object", "allreduce", "allreduce_",
           "allreduce_async", "allreduce_async_", "alltoall", "alltoall_async", "barrier",
           "broadcast", "broadcast_", "broadcast_async", "broadcast_async_", "broadcast_object",
           "broadcast_optimizer_state", "broadcast_parameters", "ccl_built", "cross_rank",
           "cross_size", "cuda_built", "ddl_built", "elastic", "global_process_set", "gloo_built",
           "gloo_enabled", "grouped_allgather", "grouped_allgather_async", "grouped_allreduce",
           "grouped_allreduce_", "grouped_allreduce_async", "grouped_allreduce_async_",
           "grouped_reducescatter", "grouped_reducescatter_async", "init", "is_homogeneous",
           "is_initialized", "join", "local_rank", "local_size", "mpi_built", "mpi_enabled",
           "mpi_threads_supported", "nccl_built", "poll", "rank", "reducescatter",
           "reducescatter_async", "remove_process_set", "rocm_built", "shutdown", "size",
           "sparse_allreduce_async", "start_timeline", "stop_timeline", "synchronize"]
