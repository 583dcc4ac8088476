"""Convert numpy arrays, torch tensors and TensorFlow tensors to numpy buffers and back.

The core works on numpy buffers only.  This module is the one place that
knows the frameworks: it recognises a tensor by the module of its type, so
importing hpctrain never imports torch or TensorFlow.  CPU torch tensors are
shared without a copy (``Tensor.numpy()``); CUDA tensors are staged through
host memory explicitly (a GPU-direct path belongs in a NCCL backend, not
here).  bfloat16 uses the ``ml_dtypes`` numpy dtype (shipped with TensorFlow
and JAX); torch's bfloat16 is reinterpreted bit for bit through int16.
ml_dtypes is imported on the first bfloat16 value (:func:`bfloat16`), not
with hpctrain: its import costs about a second of every process's start.
"""
from __future__ import annotations

import sys
from typing import Any, Callable, Optional, Tuple

import numpy as np

__all__ = ["bfloat16", "is_bfloat16", "supported_dtypes", "to_numpy", "framework_of",
           "check_dtype", "dtype_name", "dtype_from_name"]

_PLAIN_DTYPES = tuple(
    np.dtype(d) for d in (np.float16, np.float32, np.float64, np.int8, np.int16, np.int32, np.int64, np.uint8,
                          np.uint16, np.bool_))
_BF16: Optional[np.dtype] = None


def bfloat16(load: bool = True) -> Optional[np.dtype]:
    """numpy's bfloat16 (``ml_dtypes.bfloat16``); None where ml_dtypes is not installed.

    ``load=False``: None also while nothing has imported ml_dtypes (no numpy
    array can be bfloat16 before it is), so that a dtype check costs no import.
    """
    global _BF16
    if _BF16 is None and (load or "ml_dtypes" in sys.modules):
        try:  # ml_dtypes gives numpy a bfloat16; it comes with TensorFlow.
            import ml_dtypes
        except ImportError:  # pragma: no cover - depends on the install
            return None
        _BF16 = np.dtype(ml_dtypes.bfloat16)
    return _BF16


def is_bfloat16(dtype: Any) -> bool:
    """Whether ``dtype`` is numpy's bfloat16, without importing ml_dtypes (``dtype == None`` would be float64's
    test: numpy reads None as float64)."""
    bf16 = bfloat16(load=False)
    return bf16 is not None and dtype == bf16


def supported_dtypes(load: bool = True) -> Tuple[np.dtype, ...]:
    """The dtypes collectives take: the plain numpy ones and bfloat16 (:func:`bfloat16`, same ``load``)."""
    bf16 = bfloat16(load)
    return _PLAIN_DTYPES + ((bf16,) if bf16 is not None else ())


def __getattr__(name: str) -> Any:
    """``BFLOAT16`` and ``SUPPORTED_DTYPES``, with ml_dtypes imported when they are first asked for."""
    if name == "BFLOAT16":
        return bfloat16()
    if name == "SUPPORTED_DTYPES":
        return supported_dtypes()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

Restore = Callable[[np.ndarray], Any]


def framework_of(x: Any) -> str:
    """Return "torch", "tensorflow" or "numpy" for a tensor-like object, by its type's module."""
    module = type(x).__module__ or ""
    if module.startswith("torch"):
        return "torch"
    if module.startswith(("tensorflow", "keras", "tf_keras")):
        return "tensorflow"
    return "numpy"


def check_dtype(dtype: np.dtype) -> np.dtype:
    """Return ``dtype`` if collectives support it, else raise TypeError listing what is supported."""
    dtype = np.dtype(dtype)
    if dtype not in _PLAIN_DTYPES and not is_bfloat16(dtype):
        names = ", ".join(sorted(str(d) for d in supported_dtypes()))
        raise TypeError(f"dtype {dtype} is not supported by hpctrain collectives; supported: {names}")
    return dtype


_NAMES: dict = {}


def dtype_name(dtype: np.dtype) -> str:
    """Return ``str(dtype)`` ("float32", "bfloat16"), remembered per dtype (``str`` of a dtype is slow)."""
    name = _NAMES.get(dtype)
    if name is None:
        name = _NAMES[dtype] = str(dtype)
    return name


def dtype_from_name(name: str) -> np.dtype:
    """Return the supported dtype whose ``str()`` is ``name`` (e.g. "bfloat16", "float32")."""
    for dtype in supported_dtypes(load=name == "bfloat16"):
        if str(dtype) == name:
            return dtype
    raise TypeError(f"unknown dtype name {name!r}")


def to_numpy(x: Any) -> Tuple[np.ndarray, Restore]:
    """Return a C-contiguous numpy view (or copy) of ``x`` and a function that converts a result back.

    The restore function turns a numpy result into the type of ``x``: a torch
    tensor on the same device, a TensorFlow tensor, or a numpy array.

    Cost: zero-copy for contiguous numpy arrays and CPU torch tensors; one
    device-to-host copy for CUDA tensors; one copy for TensorFlow tensors.
    """
    kind = framework_of(x)
    if kind == "torch":
        return _torch_to_numpy(x)
    if kind == "tensorflow":
        return _tf_to_numpy(x)
    arr = _c_array(x)
    check_dtype(arr.dtype)
    return arr, _identity


def _c_array(x: Any) -> np.ndarray:
    """Return ``x`` as a C-contiguous array without copying when it already is one (0-d stays 0-d)."""
    arr = np.asarray(x)
    return arr if arr.flags.c_contiguous else np.array(arr, order="C")


def _identity(arr: np.ndarray) -> np.ndarray:
    return arr


def _torch_to_numpy(x: Any) -> Tuple[np.ndarray, Restore]:
    import torch

    if x.is_sparse:
        raise TypeError("sparse torch tensors are not supported by collectives; call .to_dense() first")
    device = x.device
    t = x.detach()
    if t.device.type != "cpu":
        t = t.to("cpu")
    t = t.contiguous()
    if t.dtype == torch.bfloat16:
        if bfloat16() is None:
            raise TypeError("bfloat16 needs the ml_dtypes package (pip install ml_dtypes)")
        arr = t.view(torch.int16).numpy().view(bfloat16())
    else:
        try:
            arr = t.numpy()
        except TypeError as exc:
            raise TypeError(f"torch dtype {t.dtype} is not supported by hpctrain collectives") from exc
    check_dtype(arr.dtype)

    def restore(result: np.ndarray) -> Any:
        result = _c_array(result)
        if is_bfloat16(result.dtype):
            out = torch.from_numpy(result.view(np.int16)).view(torch.bfloat16)
        else:
            out = torch.from_numpy(result)
        return out if device.type == "cpu" else out.to(device, non_blocking=False)

    return arr, restore


def _tf_to_numpy(x: Any) -> Tuple[np.ndarray, Restore]:
    import tensorflow as tf

    if isinstance(x, tf.IndexedSlices):
        raise TypeError("tf.IndexedSlices are not supported by collectives; "
                        "use tf.convert_to_tensor() to densify, or allgather values and indices")
    if not hasattr(x, "numpy"):
        raise TypeError("TensorFlow graph tensors have no value here; call hpctrain collectives "
                        "eagerly, or from tf.function through tf.py_function")
    arr = _c_array(x.numpy())
    check_dtype(arr.dtype)

    def restore(result: np.ndarray) -> Any:
        return tf.convert_to_tensor(result)

    return arr, restore
