"""The MPI backend: its primitives and the one-node machinery under them.

- ``communicator.py``: :class:`MPIBackend` (collectives through mpi4py, the call check, hpctrain's
  algorithms over MPI messages and windows);
- ``world.py``: ``init_world`` and ``world_over`` (MPI initialised, the world's runtime and backend);
- ``node.py``: the ranks of each node and their shared-memory windows (the arena, shared buffers);
- ``mailbox.py`` (+ ``_mailbox_kernel.c``): the one-node call check and the small inputs it carries;
- ``mailbox_collectives.py``: the collectives whose inputs the call check carries;
- ``direct.py``, ``cross_memory.py``: large one-node all-reduces by direct copies between processes;
- ``requests.py``: non-blocking requests and the ring's point-to-point transport;
- ``half_ops.py``: the MPI ops that reduce float16 and bfloat16 as 16-bit words (MPI has no such type);
- ``ulfm.py``: MPI's fault-tolerance verbs (revoke, shrink, acknowledge, the failed ranks).

The backend is imported on first use of its names, so that ``ulfm`` can be
imported by the runtime's failure machinery without it.
"""
__all__ = ["MPIBackend", "init_world", "world_over"]


def __getattr__(name: str):
    if name in __all__:
        from . import world         # (which has MPIBackend from communicator.py)
        return getattr(world, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
