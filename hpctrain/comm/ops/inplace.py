"""In-place collectives: the restore step that leaves a planned call's result in the caller's tensor."""
from __future__ import annotations

from typing import Any, Callable

import numpy as np

from ...tensors import framework_of

__all__ = ["copy_back_into"]


def copy_back_into(x: Any, arr: np.ndarray, restore: Callable[[Any], Any]) -> Callable[[Any], Any]:
    """Return a restore function that leaves the result in ``x`` (``arr`` is x's numpy form) and returns ``x``.

    Raises ValueError (at planning time, so every rank hears of it) when ``x``
    cannot be written: TensorFlow tensors, read-only or non-contiguous arrays.
    """
    kind = framework_of(x)
    if kind == "tensorflow":
        raise ValueError("allreduce(inplace=True) cannot write into a TensorFlow tensor (they are immutable)")
    if kind == "numpy" and not (isinstance(x, np.ndarray) and x.flags.writeable
                                and (x.size == 0 or np.may_share_memory(arr, x))):
        raise ValueError("allreduce(inplace=True) needs a writable C-contiguous numpy array")

    view = kind == "numpy" or (x.device.type == "cpu" and x.is_contiguous())  # is ``arr`` x's memory?

    def into(result: np.ndarray) -> Any:
        if not (view and np.may_share_memory(result, arr)):
            if kind == "numpy":
                np.copyto(x, result.reshape(x.shape))
            else:
                x.detach().copy_(restore(result).view(x.shape))   # torch on CUDA, or a widened dtype (detached:
                # the result lands in the memory as the CPU view does, not as an autograd op)
        return x
    return into
