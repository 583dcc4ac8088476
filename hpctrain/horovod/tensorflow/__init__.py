"""Horovod 0.28's ``horovod.tensorflow`` API on hpctrain: change ``import horovod.tensorflow as hvd`` to
``import hpctrain.horovod.tensorflow as hvd``.

Works eagerly, inside ``tf.function`` and in TF1 graphs (not under XLA),
with TensorFlow 2.21 and Keras 3 or Keras 2 (``tf-keras``).  Collectives
are negotiated by name as in Horovod (:mod:`hpctrain.horovod.controller`)
and run on hpctrain's algorithms; what differs from Horovod and what is
refused: the "Coming from Horovod" section of the README.
"""
import tensorflow as _tf

from ..basics import (Adasum, Average, HorovodInternalError, HostsUpdatedInterrupt, Max, Min, ProcessSet,
                      Product, Sum, add_process_set, ccl_built, cross_rank, cross_size, cuda_built, ddl_built,
                      global_process_set, gloo_built, gloo_enabled, init, is_homogeneous, is_initialized,
                      local_rank, local_size, mpi_built, mpi_enabled, mpi_threads_supported, nccl_built, rank,
                      remove_process_set, rocm_built, shutdown, size, start_timeline, stop_timeline)
from ..requests import barrier as _barrier
from . import elastic, util
from .compression import Compression
from .functions import (allgather_object, broadcast_global_variables, broadcast_object, broadcast_object_fn,
                        broadcast_variables)
from .gradient_tape import DistributedGradientTape, PartialDistributedGradientTape
from .mpi_ops import (_allreduce, _grouped_allreduce, _grouped_reducescatter, _reducescatter, allgather, alltoall,
                      broadcast, broadcast_, grouped_allgather, join, local_rank_op, local_size_op,
                      process_set_included_op, rank_op, size_op)
from .optimizer import DistributedOptimizer
from .reductions import allreduce, grouped_allreduce, grouped_reducescatter, reducescatter
from .sync_batch_norm import sync_batch_norm_class as _sync_batch_norm_class
from .util import _executing_eagerly

SyncBatchNormalization = _sync_batch_norm_class(_tf.keras.layers.BatchNormalization, __name__)


def barrier(process_set=global_process_set) -> None:
    """Return when every rank of ``process_set`` has entered the barrier."""
    _barrier(process_set)


__all__ = [
    "init", "shutdown", "is_initialized", "rank", "size", "local_rank", "local_size", "cross_rank", "cross_size",
    "is_homogeneous", "mpi_threads_supported", "mpi_enabled", "mpi_built", "gloo_enabled", "gloo_built",
    "nccl_built", "ddl_built", "ccl_built", "cuda_built", "rocm_built", "start_timeline", "stop_timeline",
    "Average", "Sum", "Adasum", "Min", "Max", "Product", "ProcessSet", "global_process_set", "add_process_set",
    "remove_process_set", "HorovodInternalError", "HostsUpdatedInterrupt", "Compression", "allreduce",
    "grouped_allreduce", "reducescatter", "grouped_reducescatter", "allgather", "grouped_allgather", "broadcast",
    "broadcast_", "alltoall", "join", "barrier", "size_op", "local_size_op", "rank_op", "local_rank_op",
    "process_set_included_op", "broadcast_variables", "broadcast_global_variables", "broadcast_object",
    "broadcast_object_fn", "allgather_object", "DistributedOptimizer", "DistributedGradientTape",
    "PartialDistributedGradientTape", "SyncBatchNormalization", "elastic", "util", "_executing_eagerly",
    "_allreduce", "_grouped_allreduce", "_reducescatter", "_grouped_reducescatter",
]
