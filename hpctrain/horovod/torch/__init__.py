"""Horovod 0.28's ``horovod.torch`` API on hpctrain: change ``import horovod.torch as hvd`` to
``import hpctrain.horovod.torch as hvd``.

What differs from Horovod and what is refused: the "Coming from Horovod"
section of the README.  Collectives are negotiated by name as in Horovod
(:mod:`hpctrain.horovod.controller`) and run on hpctrain's algorithms.
"""
from ..basics import (Adasum, Average, HorovodInternalError, HostsUpdatedInterrupt, Max, Min, ProcessSet,
                      Product, Sum, add_process_set, ccl_built, cross_rank, cross_size, cuda_built, ddl_built,
                      global_process_set, gloo_built, gloo_enabled, init, is_homogeneous, is_initialized,
                      local_rank, local_size, mpi_built, mpi_enabled, mpi_threads_supported, nccl_built, rank,
                      remove_process_set, rocm_built, shutdown, size, start_timeline, stop_timeline)
from . import elastic
from .compression import Compression
from .functions import allgather_object, broadcast_object, broadcast_optimizer_state, broadcast_parameters
from .mpi_ops import (allgather, allgather_async, allreduce, allreduce_, allreduce_async, allreduce_async_,
                      alltoall, alltoall_async, barrier, broadcast, broadcast_, broadcast_async, broadcast_async_,
                      grouped_allgather, grouped_allgather_async, grouped_allreduce, grouped_allreduce_,
                      grouped_allreduce_async, grouped_allreduce_async_, grouped_reducescatter,
                      grouped_reducescatter_async, join, poll, reducescatter, reducescatter_async,
                      sparse_allreduce_async, synchronize)
from .optimizer import DistributedOptimizer
from .sync_batch_norm import SyncBatchNorm

__all__ = [
    "init", "shutdown", "is_initialized", "rank", "size", "local_rank", "local_size", "cross_rank", "cross_size",
    "is_homogeneous", "mpi_threads_supported", "mpi_enabled", "mpi_built", "gloo_enabled", "gloo_built",
    "nccl_built", "ddl_built", "ccl_built", "cuda_built", "rocm_built", "start_timeline", "stop_timeline",
    "Average", "Sum", "Adasum", "Min", "Max", "Product", "ProcessSet", "global_process_set", "add_process_set",
    "remove_process_set", "HorovodInternalError", "HostsUpdatedInterrupt", "Compression", "allgather_object",
    "broadcast_object", "broadcast_optimizer_state", "broadcast_parameters", "allgather", "allgather_async",
    "allreduce", "allreduce_", "allreduce_async", "allreduce_async_", "alltoall", "alltoall_async", "barrier",
    "broadcast", "broadcast_", "broadcast_async", "broadcast_async_", "grouped_allgather",
    "grouped_allgather_async", "grouped_allreduce", "grouped_allreduce_", "grouped_allreduce_async",
    "grouped_allreduce_async_", "grouped_reducescatter", "grouped_reducescatter_async", "join", "poll",
    "reducescatter", "reducescatter_async", "sparse_allreduce_async", "synchronize", "DistributedOptimizer",
    "SyncBatchNorm", "elastic",
]
