"""What the features may call on a communicator: :class:`FeatureComm`, a ``typing.Protocol``.

Two classes satisfy it: :class:`~hpctrain.comm.base.Communicator` (every
backend) and hpctrain.horovod's ``NegotiatedComm``, whose collectives are
negotiated by name and which states the optional capabilities explicitly
(``timeline``, ``life``, ``on_close``, ``bucket_strategy``,
``adasum_allreduce``) instead of features probing for them with ``getattr``.
Every ``*_async`` call of either returns a :class:`~hpctrain.comm.call.handle.Waitable`
(``wait(timeout=None)``, ``test()``).
"""
from __future__ import annotations

from typing import Any, Callable, List, Optional, Protocol, Sequence, Tuple, runtime_checkable

from .call.handle import Waitable

__all__ = ["FeatureComm", "Waitable", "CAPABILITIES"]

CAPABILITIES = ("timeline", "life", "on_close", "bucket_strategy", "adasum_allreduce", "topology")


@runtime_checkable
class FeatureComm(Protocol):
    """The communicator as gradients, optimizers, checkpoints, metrics and elastic state use it."""

    name: str
    world_ranks: Tuple[int, ...]
    bucket_strategy: str        # the default way a gradient bucket is reduced (hpctrain.bucket_strategies)
    backend: str                # "mpi", "horovod" or "local"

    @property
    def rank(self) -> int: ...

    @property
    def size(self) -> int: ...

    @property
    def timeline(self) -> Any: ...

    @property
    def topology(self) -> Any: ...

    @property
    def life(self) -> Any: ...      # comm.life: the world's life (world_life.WorldLife)

    def allreduce(self, x: Any, op: str = "sum", **kwargs: Any) -> Any: ...

    def allreduce_async(self, x: Any, op: str = "sum", **kwargs: Any) -> Any: ...

    def grouped_allreduce(self, xs: Sequence[Any], op: str = "sum", **kwargs: Any) -> List[Any]: ...

    def allgather(self, x: Any, **kwargs: Any) -> Any: ...

    def broadcast(self, x: Any, root: int = 0, **kwargs: Any) -> Any: ...

    def reduce_scatter_async(self, x: Any, op: str = "sum", **kwargs: Any) -> Any: ...

    def broadcast_object(self, obj: Any, root: int = 0) -> Any: ...

    def allgather_object(self, obj: Any) -> List[Any]: ...

    def barrier(self) -> None: ...

    def adasum_allreduce(self, x: Any, segments: Sequence[int]) -> Any: ...

    def on_close(self, callback: Callable[..., object], what: str, owner: Optional[object] = None
                 ) -> Callable[[], None]: ...
