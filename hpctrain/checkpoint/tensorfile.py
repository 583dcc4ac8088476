"""Write and read safetensors files, streaming, with a CRC-32 of every byte written.

The safetensors layout (https://github.com/huggingface/safetensors): an 8-byte
little-endian header length ``H``, ``H`` bytes of JSON (per tensor: dtype,
shape, ``data_offsets`` relative to the end of the header; plus an optional
``__metadata__`` map of strings), then the raw little-endian tensor bytes.  It
holds data only, so reading it can never run code.  Files written here load
with the ``safetensors`` package and the other way round.

Writing streams every array from its own memory in chunks (no second copy of
the state), computes the CRC-32 of the file as it goes and fsyncs before it
returns.  Reading takes one read of the whole file, checks its size and CRC
against what the manifest recorded, validates the header (offsets in bounds,
contiguous, sizes matching dtype x shape) and returns numpy views of that one
buffer.  :func:`encode_tensors`/:func:`decode_tensors` are the same layout and
checks on bytes in memory (the in-memory and peer copies of elastic commits,
:mod:`hpctrain.checkpoint.peer_storage`), so every store of committed state
has one encoding.  Cost: one pass over the bytes each way, plus the CRC-32
(zlib-ng's, with carry-less multiplication where the CPU has it; the
standard library's zlib, the same checksum, where zlib-ng is not installed).
"""
from __future__ import annotations

import json
import os
import struct
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Dict, Iterator, Mapping, Optional, Tuple

import numpy as np

try:
    from zlib_ng.zlib_ng import crc32
except ImportError:     # (the same CRC-32, several times slower)
    from zlib import crc32

__all__ = ["write_tensors", "read_tensors", "encode_tensors", "decode_tensors", "CorruptFileError", "DTYPES",
           "crc32"]

# safetensors dtype name -> numpy dtype; BF16 travels as uint16 bit patterns.
DTYPES = {"BOOL": np.bool_, "U8": np.uint8, "I8": np.int8, "U16": np.uint16, "I16": np.int16,
          "U32": np.uint32, "I32": np.int32, "U64": np.uint64, "I64": np.int64, "F16": np.float16,
          "BF16": np.uint16, "F32": np.float32, "F64": np.float64}
_NAME_OF = {np.dtype(v): k for k, v in DTYPES.items() if k != "BF16"}
_CHUNK = 64 << 20
_MAX_HEADER = 100 << 20


class CorruptFileError(ValueError):
    """A checkpoint file does not match its manifest or is not a valid safetensors file."""


def dtype_name(arr: np.ndarray) -> str:
    """Return the safetensors dtype name of a numpy array (raise TypeError for others)."""
    try:
        return _NAME_OF[arr.dtype.newbyteorder("=")]
    except KeyError:
        raise TypeError(f"numpy dtype {arr.dtype} cannot be stored in a checkpoint") from None


def _header(tensors: Mapping[str, Tuple[np.ndarray, str]], metadata: Optional[Mapping[str, str]]) -> bytes:
    """The 8-byte length and the JSON header of a safetensors layout of ``tensors`` (padded to 8 bytes)."""
    header: Dict[str, object] = {}
    if metadata:
        header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    offset = 0
    for name, (arr, dt) in tensors.items():
        if dt not in DTYPES or np.dtype(DTYPES[dt]).itemsize != arr.dtype.itemsize:
            raise TypeError(f"tensor {name!r}: dtype {dt} does not match array dtype {arr.dtype}")
        header[name] = {"dtype": dt, "shape": list(arr.shape), "data_offsets": [offset, offset + arr.nbytes]}
        offset += arr.nbytes
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)
    return struct.pack("<Q", len(blob)) + blob


def _bodies(tensors: Mapping[str, Tuple[np.ndarray, str]]) -> Iterator[memoryview]:
    """Each tensor's bytes, C order, little-endian, as one flat byte view (a copy only where it must be)."""
    for arr, _ in tensors.values():
        flat = np.ascontiguousarray(arr).reshape(-1)
        if flat.dtype.byteorder == ">":
            flat = flat.astype(flat.dtype.newbyteorder("<"))
        yield memoryview(flat.view(np.uint8))


def write_tensors(path: str, tensors: Mapping[str, Tuple[np.ndarray, str]],
                  metadata: Optional[Mapping[str, str]] = None) -> Tuple[int, int]:
    """Write ``{name: (array, dtype name)}`` to ``path`` and fsync it; return (size in bytes, CRC-32).

    Arrays are written in C order, little-endian; non-contiguous arrays are
    copied chunk by chunk.
    """
    head = _header(tensors, metadata)
    size, running = len(head), _Checksum()
    with open(path, "wb") as f:
        f.write(head)
        running.add(head)
        for raw in _bodies(tensors):
            for start in range(0, len(raw), _CHUNK):
                piece = raw[start:start + _CHUNK]
                f.write(piece)
                running.add(piece)
            size += len(raw)
        f.flush()
        crc = running.value()
        os.fsync(f.fileno())
    return size, crc


def encode_tensors(tensors: Mapping[str, Tuple[np.ndarray, str]], metadata: Optional[Mapping[str, str]] = None,
                   into: Optional[np.ndarray] = None, checksum: bool = True,
                   allocate: Optional[Callable[[int], np.ndarray]] = None) -> Tuple[np.ndarray, Optional[int]]:
    """The bytes :func:`write_tensors` would write, as one uint8 array, and their CRC-32 (one copy, one pass).

    ``into``: a uint8 buffer to write them into when it is large enough (the
    result is then a view of its first bytes): reusing one saves the page
    faults of fresh memory, as much again as the copy.  ``checksum=False``:
    None for the CRC-32 (the caller computes it, :func:`crc32`, later).
    ``allocate(size)``: where the bytes go when ``into`` is too small or None
    (a uint8 array of at least ``size``; default: fresh memory).
    """
    head = _header(tensors, metadata)
    bodies = list(_bodies(tensors))
    size = len(head) + sum(len(b) for b in bodies)
    if into is not None and into.size >= size:
        out = into[:size]
    else:
        out = allocate(size)[:size] if allocate is not None else np.empty(size, dtype=np.uint8)
    out[:len(head)] = np.frombuffer(head, dtype=np.uint8)
    pos = len(head)
    for raw in bodies:
        out[pos:pos + len(raw)] = np.frombuffer(raw, dtype=np.uint8)
        pos += len(raw)
    return out, crc32(out) if checksum else None


class _Checksum:
    """A running CRC-32 whose large pieces are hashed on a helper thread, overlapping the file I/O.

    crc32 releases the GIL while it hashes, so hashing chunk k runs while the
    caller writes (or reads) chunk k+1; pieces are hashed in order.  The
    caller must not modify a piece until :meth:`value` has returned.
    """

    _BIG = 1 << 20

    def __init__(self):
        self._crc = 0
        self._pool = None
        self._last = None

    def add(self, piece) -> None:
        if len(piece) < self._BIG:
            if self._last is not None:
                self._crc = self._last.result()
                self._last = None
            self._crc = crc32(piece, self._crc)
            return
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="hpctrain-crc")
        prev = self._last

        def crc(prev=prev, base=None):
            start = prev.result() if prev is not None else self._crc
            return crc32(piece, start)

        self._last = self._pool.submit(crc)

    def value(self) -> int:
        if self._last is not None:
            self._crc = self._last.result()
            self._last = None
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
        return self._crc


def read_tensors(path: str, size: Optional[int] = None, crc: Optional[int] = None
                 ) -> Tuple[Dict[str, Tuple[np.ndarray, str]], Dict[str, str]]:
    """Read a safetensors file; return ({name: (array, dtype name)}, metadata).

    With ``size``/``crc`` (from the manifest) the file must match them.  Raises
    :class:`CorruptFileError` for any mismatch or malformed header.
    """
    with open(path, "rb") as f:
        actual = os.fstat(f.fileno()).st_size
        if size is not None and actual != size:
            raise CorruptFileError(f"{path}: {actual} bytes, the manifest says {size}")
        data = np.empty(actual, dtype=np.uint8)     # read straight into it: no second copy
        view = memoryview(data)
        got, running = 0, _Checksum()
        while got < actual:
            n = f.readinto(view[got:got + _CHUNK])
            if not n:
                raise CorruptFileError(f"{path}: file shrank while being read")
            running.add(view[got:got + n])
            got += n
    if crc is not None and running.value() != crc:
        raise CorruptFileError(f"{path}: CRC-32 {running.value():08x} does not match the manifest's {crc:08x}")
    return _parse(memoryview(data), path)


def decode_tensors(raw: np.ndarray, crc: int, where: str = "a committed part"
                   ) -> Tuple[Dict[str, Tuple[np.ndarray, str]], Dict[str, str]]:
    """Read the bytes :func:`encode_tensors` made; the arrays are views of ``raw``.

    Raises :class:`CorruptFileError` (naming ``where``) when the bytes do not
    match ``crc`` or are not a valid safetensors layout.
    """
    raw = np.ascontiguousarray(raw, dtype=np.uint8)
    actual = crc32(raw)
    if actual != crc:
        raise CorruptFileError(f"{where} does not match its checksum (CRC-32 {actual:08x}, "
                               f"recorded {crc:08x})")
    return _parse(memoryview(raw), where)


def _parse(data: memoryview, path: str) -> Tuple[Dict[str, Tuple[np.ndarray, str]], Dict[str, str]]:
    """Validate the header of a safetensors layout in ``data`` and return views of its tensors, and its metadata."""
    if len(data) < 8:
        raise CorruptFileError(f"{path}: too short for a safetensors header")
    (hlen,) = struct.unpack_from("<Q", data)
    if hlen > min(_MAX_HEADER, len(data) - 8):
        raise CorruptFileError(f"{path}: header length {hlen} is out of bounds")
    try:
        header = json.loads(bytes(data[8:8 + hlen]))
    except ValueError as exc:
        raise CorruptFileError(f"{path}: header is not JSON ({exc})") from None
    if not isinstance(header, dict):
        raise CorruptFileError(f"{path}: header is not a JSON object")
    metadata = header.pop("__metadata__", None) or {}
    body = memoryview(data)[8 + hlen:]
    out: Dict[str, Tuple[np.ndarray, str]] = {}
    spans = []
    for name, info in header.items():
        try:
            dt, shape, (lo, hi) = info["dtype"], [int(d) for d in info["shape"]], info["data_offsets"]
            np_dt = np.dtype(DTYPES[dt]).newbyteorder("<")
        except (KeyError, TypeError, ValueError):
            raise CorruptFileError(f"{path}: bad header entry for {name!r}: {info!r}") from None
        count = int(np.prod(shape, dtype=np.int64))
        if min(shape, default=0) < 0 or not 0 <= lo <= hi <= len(body) or hi - lo != count * np_dt.itemsize:
            raise CorruptFileError(f"{path}: tensor {name!r} has inconsistent offsets {lo}..{hi} for "
                                   f"{dt} {shape} in a body of {len(body)} bytes")
        spans.append((lo, hi))
        out[name] = (np.frombuffer(body[lo:hi], dtype=np_dt).reshape(shape), dt)
    spans.sort()
    if any(a[1] != b[0] for a, b in zip(spans, spans[1:])) or (spans and (spans[0][0] != 0
                                                                          or spans[-1][1] != len(body))):
        raise CorruptFileError(f"{path}: tensor data does not exactly cover the file body")
    return out, metadata
