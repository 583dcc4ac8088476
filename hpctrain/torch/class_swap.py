"""The class swap of torch's optimizer wrappers: the optimizer object stays itself, its class becomes a subclass of
its own with the wrapper's mixin first (``isinstance``, param groups, state and schedulers keep working)."""
from __future__ import annotations

from typing import Dict, Tuple

__all__ = ["subclass_with"]

_MADE: Dict[Tuple[type, type], type] = {}


def subclass_with(mixin: type, base: type, name: str) -> type:
    """The class ``name`` deriving from ``(mixin, base)``, made once per pair (``base``'s docstring kept)."""
    cls = _MADE.get((mixin, base))
    if cls is None:
        cls = _MADE[(mixin, base)] = type(name, (mixin, base), {"__module__": mixin.__module__,
                                                               "__doc__": base.__doc__})
    return cls
