"""PyTorch adapter: data-parallel training on hpctrain's collectives.

Four lines turn a single-process script into a data-parallel one::

    import hpctrain, hpctrain.torch as ht
    hpctrain.init()
    optimizer = ht.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())
    ht.broadcast_parameters(model.state_dict(), root=0)

and :class:`hpctrain.data.DistributedSampler` gives each rank its share of the data.
"""
from .state_broadcast import allreduce, average_metrics, broadcast_optimizer_state, broadcast_parameters
from .joining import Join
from .optimizer import DistributedOptimizer
from .zero import ShardedOptimizer
from .local_sgd import LocalSGDOptimizer
from .parameter_server import ParameterServer
from .elastic_state import TorchState
from .pipeline import Pipeline, PipelineError
from .observe import trace_forward, track_steps
from .sync_batchnorm import SyncBatchNorm, convert_sync_batchnorm
from .tensor_parallel import ColumnParallelLinear, ParallelMLP, ParallelSelfAttention, RowParallelLinear

__all__ = ["DistributedOptimizer", "ShardedOptimizer", "LocalSGDOptimizer", "ParameterServer", "broadcast_parameters", "broadcast_optimizer_state", "allreduce",
           "average_metrics", "Join", "SyncBatchNorm", "convert_sync_batchnorm", "Pipeline", "PipelineError",
           "ColumnParallelLinear", "RowParallelLinear", "ParallelMLP", "ParallelSelfAttention", "track_steps", "trace_forward",
           "TorchState"]
