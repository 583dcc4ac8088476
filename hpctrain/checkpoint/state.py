"""Turn a training state into tensors plus a JSON tree, and load it back into the live objects.

What a state entry may be, and how it is saved and restored:

* anything with ``state_dict()`` and ``load_state_dict()`` (torch modules,
  optimizers, LR schedulers, ``GradScaler``, :class:`hpctrain.data.DistributedSampler`,
  :class:`~hpctrain.checkpoint.RNGState`): its state dict is saved and handed
  back to ``load_state_dict``;
* objects with a ``variables`` list (Keras 3 models and optimizers,
  ``tf.Module``) and ``tf.train.Checkpoint`` objects: the variable values,
  assigned back in order (shapes must match; see :func:`variables_of`);
* a numpy array or torch tensor: copied back into the same object, in place;
* plain values (None, bool, int, float, str, and lists, tuples and dicts of
  them, of arrays and of tensors): the entry of the state dict is replaced.

Inside a tree, tensors and arrays go to the tensor file under a generated name
and the JSON holds a reference to it; tuples and dicts with non-string keys are
tagged, so the tree comes back with the same types.  Nothing else is accepted:
saving raises ``TypeError`` naming the path of the offending value, so a
checkpoint never needs pickle to load.
"""
from __future__ import annotations

import json
import sys
from typing import Any, Callable, Dict, List, Mapping, Optional, Tuple

import numpy as np

from .hostcopy import HostCopier
from .tensorfile import CorruptFileError, decode_tensors, dtype_name, encode_tensors

__all__ = ["encode", "decode", "snapshot_entry", "load_entry", "variables_of", "pack", "packable", "unpack"]

_TENSOR, _TUPLE, _DICT, _VARS = "$tensor", "$tuple", "$dict", "$variables"
_TREE = "hpctrain.part"     # (the metadata key of a packed tree)


def _torch():
    return sys.modules.get("torch")


def _is_torch_tensor(x) -> bool:
    t = _torch()
    return t is not None and isinstance(x, t.Tensor)


def variables_of(obj: Any) -> Optional[List[Any]]:
    """Return the variables an entry is saved as, in a fixed order, or None if it is not that kind.

    A Keras 3 model or optimizer, or a ``tf.Module``: its ``variables`` list
    (of a Keras 2 optimizer, ``tf-keras``: what its ``variables()`` method returns).
    A ``tf.train.Checkpoint``: every variable reachable from it (models,
    optimizers, plain ``tf.Variable`` attributes), in the breadth-first order
    of TensorFlow's own checkpoint traversal, which depends only on the
    object graph.
    """
    if isinstance(obj, (dict, list, tuple)):
        return None
    tf = sys.modules.get("tensorflow")
    if tf is not None and isinstance(obj, tf.train.Checkpoint):
        return [x for x in tf.train.TrackableView(obj).descendants()
                if hasattr(x, "assign") and hasattr(x, "numpy") and hasattr(x, "shape")]
    variables = getattr(obj, "variables", None)
    if callable(variables) and type(obj).__module__.startswith(("tf_keras.", "keras.")):
        return list(variables())            # (a Keras 2 optimizer, tf-keras: a method)
    if variables is None or callable(variables):
        return None
    return list(variables)


def snapshot_entry(obj: Any) -> Tuple[str, Any]:
    """Return (kind, value) for one top-level entry: what is saved for it."""
    if callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None)):
        return "state_dict", obj.state_dict()
    if isinstance(obj, (np.ndarray,)) or _is_torch_tensor(obj):
        return "array", obj
    variables = variables_of(obj)
    if variables is not None:
        return "variables", {_VARS: [np.asarray(v.numpy()) for v in variables]}
    return "value", obj


class Encoder:
    """Collects the tensors of one file while JSON trees are built.

    With ``copy`` every array is copied to host memory (the caller may change
    the originals at once); ``staging`` (a dict kept by the caller between
    saves) holds those copies, and a later save of the same shapes copies into
    them instead of allocating: fresh memory costs page faults on first touch,
    which would make the copy, the training stall of an asynchronous save,
    several times slower.
    """

    def __init__(self, copy: bool, staging: Optional[Dict[str, np.ndarray]] = None):
        self.copy = copy
        self.staging = staging if staging is not None else {}
        self.tensors: Dict[str, Tuple[np.ndarray, str]] = {}
        self.copies: List[Tuple[np.ndarray, np.ndarray]] = []    # (staging buffer, live array), done by encode

    def add(self, x: Any) -> Dict[str, str]:
        name = f"t{len(self.tensors)}"
        if _is_torch_tensor(x):
            torch = _torch()
            t = x.detach()
            on_host = t.device.type == "cpu" and not t.is_sparse
            t = (t.to_dense() if t.is_sparse else t).to("cpu").contiguous()
            if t.dtype == torch.bfloat16:
                arr, dt = t.view(torch.int16).numpy().view(np.uint16), "BF16"
            else:
                arr = t.numpy()
                dt = dtype_name(arr)
            kind = "torch"
        else:
            arr, kind, on_host = np.asarray(x), "numpy", True
            dt = dtype_name(arr)
        if self.copy and on_host:     # the caller may change it while the file is written
            buf = self.staging.get(name)
            if buf is None or buf.shape != arr.shape or buf.dtype != arr.dtype:
                buf = self.staging[name] = np.empty_like(arr, order="C")
            self.copies.append((buf, arr))
            arr = buf
        self.tensors[name] = (arr, dt)
        return {_TENSOR: name, "kind": kind}

    def tree(self, x: Any, path: str) -> Any:
        """Return the JSON form of ``x``; tensors go to :attr:`tensors`."""
        if x is None or isinstance(x, (bool, int, float, str)):
            return x
        if isinstance(x, np.generic):
            return self.add(np.asarray(x)) | {"scalar": True}
        if isinstance(x, np.ndarray) or _is_torch_tensor(x):
            return self.add(x)
        if isinstance(x, tuple):
            return {_TUPLE: [self.tree(v, f"{path}[{i}]") for i, v in enumerate(x)]}
        if isinstance(x, list):
            return [self.tree(v, f"{path}[{i}]") for i, v in enumerate(x)]
        if isinstance(x, Mapping):
            if all(isinstance(k, str) and not k.startswith("$") for k in x):
                return {k: self.tree(v, f"{path}.{k}") for k, v in x.items()}
            return {_DICT: [[self.tree(k, f"{path} key"), self.tree(v, f"{path}[{k!r}]")] for k, v in x.items()]}
        t = _torch()
        if t is not None and isinstance(x, (t.dtype, t.device, t.Size)):
            raise TypeError(f"cannot save {path}: {type(x).__name__} values are not supported")
        raise TypeError(f"cannot save {path}: a {type(x).__module__}.{type(x).__qualname__} is not data "
                        f"(checkpoints hold tensors, arrays, numbers, strings, lists, tuples and dicts only, "
                        f"so that loading never runs code)")


def encode(entries: Mapping[str, Any], copy: bool, staging: Optional[Dict[str, np.ndarray]] = None,
           copier: Optional[HostCopier] = None) -> Tuple[Dict[str, Tuple[np.ndarray, str]], Dict[str, Any]]:
    """Encode ``{key: object}``; return (tensors for the file, JSON tree {key: {"kind", "value"}}).

    See :class:`Encoder` for ``copy`` and ``staging``; the copies are made
    before returning, by ``copier`` (several threads) when given.
    """
    enc = Encoder(copy, staging)
    tree = {}
    for key, obj in entries.items():
        kind, value = snapshot_entry(obj)
        if kind == "variables":
            value = {_VARS: [enc.add(v) for v in value[_VARS]]}
        else:
            value = enc.tree(value, key)
        tree[key] = {"kind": kind, "value": value}
    (copier or HostCopier(1)).copy(enc.copies)
    return enc.tensors, tree


def decode(node: Any, tensors: Mapping[str, Tuple[np.ndarray, str]]) -> Any:
    """Rebuild a value from its JSON form and the file's tensors (torch tensors where they were torch)."""
    if isinstance(node, list):
        return [decode(v, tensors) for v in node]
    if not isinstance(node, dict):
        return node
    if _TENSOR in node:
        arr, dt = tensors[node[_TENSOR]]
        if node.get("scalar"):
            return arr[()]
        if node.get("kind") == "torch":
            torch = _torch()
            if torch is None:
                import torch
            t = torch.from_numpy(arr)
            return t.view(torch.bfloat16) if dt == "BF16" else t
        return arr
    if _TUPLE in node:
        return tuple(decode(v, tensors) for v in node[_TUPLE])
    if _DICT in node:
        return {_hashable(decode(k, tensors)): decode(v, tensors) for k, v in node[_DICT]}
    return {k: decode(v, tensors) for k, v in node.items()}


def _hashable(k):
    return tuple(_hashable(v) for v in k) if isinstance(k, list) else k


def load_entry(state: dict, key: str, kind: str, value: Any) -> None:
    """Put a decoded ``value`` back into ``state[key]`` as its ``kind`` says."""
    obj = state[key]
    if kind == "state_dict":
        obj.load_state_dict(value)
    elif kind == "array":
        if tuple(value.shape) != tuple(obj.shape):
            raise ValueError(f"state[{key!r}] has shape {tuple(obj.shape)}, the checkpoint {tuple(value.shape)}")
        if _is_torch_tensor(obj):
            with _torch().no_grad():
                obj.copy_(value if _is_torch_tensor(value) else _torch().from_numpy(np.asarray(value)))
        else:
            obj[...] = value.numpy() if _is_torch_tensor(value) else value
    elif kind == "variables":
        saved = value[_VARS]
        variables = variables_of(obj) or []
        if len(variables) != len(saved):
            raise ValueError(f"state[{key!r}] has {len(variables)} variables, the checkpoint {len(saved)}"
                             + (" (build a Keras optimizer first: optimizer.build(model.trainable_variables))"
                                if not variables else ""))
        for i, (v, s) in enumerate(zip(variables, saved)):
            if tuple(v.shape) != tuple(s.shape):
                raise ValueError(f"state[{key!r}] variable {i} ({getattr(v, 'path', getattr(v, 'name', '?'))}) "
                                 f"has shape {tuple(v.shape)}, the checkpoint {tuple(s.shape)}")
        for v, s in zip(variables, saved):
            v.assign(np.asarray(s))
    else:
        if _is_object(obj):
            raise ValueError(f"the checkpoint holds a plain value for {key!r}, but state[{key!r}] is a "
                             f"{type(obj).__name__}, which would be replaced instead of loaded: save and restore "
                             "the same kind of entry")
        state[key] = value


def _is_object(obj: Any) -> bool:
    """Whether a state entry is loaded in place (an object with a state dict or variables, an array)."""
    return (callable(getattr(obj, "load_state_dict", None)) or isinstance(obj, np.ndarray) or _is_torch_tensor(obj)
            or variables_of(obj) is not None)


def pack(tree: Dict[str, Any], into: Optional[np.ndarray] = None, checksum: bool = True,
         allocate: Optional[Callable[[int], np.ndarray]] = None) -> Tuple[np.ndarray, Optional[int]]:
    """A part (a tree of dicts, lists, numbers and arrays or tensors, any dtype) as bytes and their CRC-32.

    The checkpoint's encoding (:func:`encode`'s tree in the metadata, the
    tensors in safetensors layout, :func:`~hpctrain.checkpoint.tensorfile.encode_tensors`,
    written into ``into`` when it is large enough, else into ``allocate(size)``;
    ``checksum=False``: no CRC-32 yet, None): torch tensors come back as torch tensors of their
    dtype, bfloat16 included.  TypeError names a value that is not data.
    Cost: one copy of the tensors and one CRC-32 pass.
    """
    enc = Encoder(copy=False)
    shape = enc.tree(dict(tree), "part")
    return encode_tensors(enc.tensors, {_TREE: json.dumps(shape, separators=(",", ":"))}, into, checksum, allocate)


def packable(value: Any) -> bool:
    """Whether :func:`pack` can hold ``value`` (a walk of its tree: nothing is copied)."""
    try:
        Encoder(copy=False).tree({"value": value}, "part")
    except TypeError:
        return False
    return True


def unpack(raw: np.ndarray, crc: int) -> Dict[str, Any]:
    """The part :func:`pack` made, in memory of its own; :class:`~hpctrain.checkpoint.tensorfile.CorruptFileError`
    (a ValueError) when the bytes do not match their CRC-32 or their layout."""
    tensors, metadata = decode_tensors(np.array(raw, dtype=np.uint8, copy=True), crc)
    try:
        shape = json.loads(metadata[_TREE])
    except (KeyError, ValueError):
        raise CorruptFileError("a committed part has no readable tree in its metadata") from None
    return decode(shape, tensors)
