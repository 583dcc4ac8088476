"""The random number generator states of this process, as one checkpointable object."""
from __future__ import annotations

import random
import sys
from typing import Any, Dict

import numpy as np

__all__ = ["RNGState"]


class RNGState:
    """Save and restore Python's, numpy's global, torch's and TensorFlow's global RNG states.

    Put it in the checkpoint state wrapped in :class:`~hpctrain.checkpoint.Sharded`
    (each rank has its own streams)::

        state = {"model": model, "rng": Sharded(RNGState())}

    torch (CPU, and every CUDA device once CUDA is initialised) and TensorFlow
    (its global ``tf.random.Generator``) are included only when already
    imported, so this never imports a framework.  Restoring a stream the
    checkpoint does not have (it was saved without that framework) leaves it
    as it is.
    """

    def state_dict(self) -> Dict[str, Any]:
        """Return the current states (numbers and arrays only)."""
        version, internal, gauss = random.getstate()
        out: Dict[str, Any] = {"python": [version, np.asarray(internal, dtype=np.int64), gauss],
                               "numpy": list(np.random.get_state(legacy=True))}
        torch = sys.modules.get("torch")
        if torch is not None:
            out["torch"] = torch.get_rng_state()
            if torch.cuda.is_available() and torch.cuda.is_initialized():
                out["torch_cuda"] = torch.cuda.get_rng_state_all()
        tf = sys.modules.get("tensorflow")
        if tf is not None and hasattr(tf, "random"):
            out["tensorflow"] = np.asarray(tf.random.get_global_generator().state.numpy())
        return out

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        """Set the generators to ``state`` (from :meth:`state_dict`)."""
        version, internal, gauss = state["python"]
        random.setstate((int(version), tuple(int(v) for v in np.asarray(internal)), gauss))
        name, keys, pos, has_gauss, cached = state["numpy"]
        np.random.set_state((name, np.asarray(keys, dtype=np.uint32), int(pos), int(has_gauss), float(cached)))
        torch = sys.modules.get("torch")
        if torch is not None and "torch" in state:
            torch.set_rng_state(state["torch"].to(torch.uint8))
            if "torch_cuda" in state and torch.cuda.is_available():
                torch.cuda.set_rng_state_all(state["torch_cuda"])
        tf = sys.modules.get("tensorflow")
        if tf is not None and "tensorflow" in state:
            tf.random.get_global_generator().state.assign(np.asarray(state["tensorflow"]))
