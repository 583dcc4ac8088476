"""Coordinated checkpoint/restart: atomic, verified, asynchronous, preemption-aware.

    from hpctrain.checkpoint import CheckpointManager, RNGState, Sharded, on_preemption

    manager = CheckpointManager("ckpt", keep=3, every_steps=100)
    on_preemption(manager)                     # SIGUSR2/SIGTERM -> save on all ranks and exit 75
    state = {"model": model, "optimizer": optimizer, "sampler": sampler,
             "rng": Sharded(RNGState(), missing="skip")}
    start = manager.restore(state) or 0        # newest valid checkpoint, any world size
    for step in range(start, total_steps):
        ...
        manager.save(step + 1, state)
    manager.wait()

Files are safetensors plus JSON (a manifest with sizes and CRC-32s); loading
never unpickles.  See :mod:`hpctrain.checkpoint.manager` for the protocol.
"""
from .manager import EXIT_PREEMPTED, CheckpointError, CheckpointManager, Sharded
from .preemption import on_preemption
from .rng import RNGState

__all__ = ["CheckpointManager", "Sharded", "RNGState", "on_preemption", "CheckpointError", "EXIT_PREEMPTED"]
