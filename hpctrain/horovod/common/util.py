"""``horovod.common.util``'s public helpers: version comparison and build queries."""
from __future__ import annotations

import importlib.util

from packaging import version

__all__ = ["is_version_greater_equal_than", "check_extension", "gpu_available", "split_list", "env",
           "gloo_built", "mpi_built", "nccl_built"]


def is_version_greater_equal_than(ver: str, target: str) -> bool:
    """Return whether version string ``ver`` is at least ``target`` (local tags such as ``+cpu`` ignored)."""
    if any(v.count(".") > 3 for v in (ver, target)):
        raise ValueError(f"cannot compare versions {ver!r} and {target!r}: too many parts")
    return version.parse(ver.split("+")[0]) >= version.parse(target.split("+")[0])


def check_extension(ext_name: str, ext_env_var: str, pkg_path: str, *args) -> None:
    """Horovod checks that its compiled extension loads; hpctrain has none to check."""


def gpu_available(ext_base_name: str, verbose: bool = False) -> bool:
    """Return whether the framework (``tensorflow`` or ``torch``) sees a GPU."""
    if ext_base_name == "tensorflow" and importlib.util.find_spec("tensorflow"):
        import tensorflow as tf
        return bool(tf.config.list_physical_devices("GPU"))
    if ext_base_name == "torch" and importlib.util.find_spec("torch"):
        import torch
        return torch.cuda.is_available()
    return False


def split_list(items: list, parts: int) -> list:
    """Split ``items`` into ``parts`` consecutive lists whose lengths differ by at most one."""
    q, r = divmod(len(items), parts)
    out, start = [], 0
    for i in range(parts):
        end = start + q + (1 if i < r else 0)
        out.append(items[start:end])
        start = end
    return out


class env:
    """Set environment variables inside a ``with`` block and restore them afterwards."""

    def __init__(self, **kwargs):
        self._new, self._old = {k: str(v) for k, v in kwargs.items()}, {}

    def __enter__(self):
        import os
        for k, v in self._new.items():
            self._old[k] = os.environ.get(k)
            os.environ[k] = v
        return self

    def __exit__(self, *exc):
        import os
        for k, v in self._old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def gloo_built() -> bool:
    """Return whether an installed Horovod has Gloo (hpctrain has no Gloo of its own)."""
    from ..basics import gloo_built as built
    return built()


def mpi_built() -> bool:
    """Return whether MPI is available to hpctrain (mpi4py importable)."""
    return importlib.util.find_spec("mpi4py") is not None


def nccl_built() -> int:
    """Return 0: hpctrain moves CUDA tensors through host memory, never NCCL."""
    return 0
