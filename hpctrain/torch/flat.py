"""One flat host vector from a list of torch tensors, and back (the adapters' conversion to the core's buffers).

Cost: one copy of the tensors' bytes each way (CUDA tensors are staged
through host memory by the copy).
"""
from __future__ import annotations

from typing import Iterable, Sequence, Union

import numpy as np
import torch

__all__ = ["flatten", "unflatten_into"]


def flatten(tensors: Iterable[torch.Tensor]) -> torch.Tensor:
    """The tensors' values end to end in one new CPU tensor (detached)."""
    return torch.cat([t.detach().reshape(-1).cpu() for t in tensors])


def unflatten_into(flat: Union[torch.Tensor, np.ndarray], tensors: Sequence[torch.Tensor]) -> None:
    """Copy consecutive pieces of ``flat`` into ``tensors`` in place (each keeps its device and shape)."""
    if isinstance(flat, np.ndarray):
        flat = torch.from_numpy(flat)
    offset = 0
    with torch.no_grad():
        for t in tensors:
            n = t.numel()
            t.copy_(flat[offset:offset + n].view_as(t))
            offset += n
