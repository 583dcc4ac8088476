"""Describe a collective call compactly so ranks can check that they agree before running it.

Each rank encodes its call as ``key`` (what must be equal on every rank) and
``text`` (what a person reads in the error).  One rank, or every rank, compares
the keys (:func:`judge`); any difference, or an invalid argument on any rank,
becomes one message that lists every rank's call, raised on every rank.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Optional, Sequence, Tuple

from ...errors import format_ranks

__all__ = ["Call", "judge", "DESC_BYTES", "encoded"]

DESC_BYTES = 512  # fixed size of an encoded call on the wire


@dataclass(slots=True)
class Call:
    """One rank's collective call.

    ``free_dim0`` marks calls whose first dimension may differ per rank
    (allgather, alltoall).  ``layout`` summarises a list of tensors (grouped
    calls): their count and a checksum of their dtypes and shapes.  ``error``
    holds this rank's validation error, if its arguments were invalid.
    """

    kind: str
    seq: int
    dtype: str = ""
    shape: Tuple[int, ...] = ()
    op: Optional[str] = None
    root: Optional[int] = None
    algorithm: Optional[str] = None
    free_dim0: bool = False
    layout: Optional[str] = None
    error: str = ""

    def at(self, seq: int) -> "Call":
        """Return the same call with sequence number ``seq`` (calls are never modified in place)."""
        return Call(self.kind, seq, self.dtype, self.shape, self.op, self.root, self.algorithm, self.free_dim0,
                    self.layout, self.error)

    def key(self) -> str:
        """Return what must be identical on every rank."""
        shape = self.shape[1:] if self.free_dim0 else self.shape
        return (f"{self.kind}|{self.dtype}|{shape}|{self.op}|{self.root}|{self.algorithm}|{self.layout}"
                f"|{bool(self.error)}")

    def text(self) -> str:
        """Return the call as a person would write it, e.g. ``allreduce(float32[4,3], op=sum)``."""
        args = []
        if self.dtype:
            args.append(f"{self.dtype}[{','.join(str(d) for d in self.shape)}]")
        for name in ("op", "root", "algorithm", "layout"):
            value = getattr(self, name)
            if value is not None:
                args.append(f"{name}={value}")
        text = f"{self.kind}({', '.join(args)})"
        return f"{text}: INVALID: {self.error}" if self.error else text

    def encode(self) -> bytes:
        """Return ``key NUL text`` as at most DESC_BYTES bytes (the text is cut if needed)."""
        raw = (self.key() + "\0" + self.text()).encode()
        return raw[:DESC_BYTES]


_ENCODED: dict = {}      # a call's fields but seq -> (hash of its key, encode()); a loop repeats a few calls


def encoded(call: Call) -> Tuple[int, bytes]:
    """Return ``(call_hash(call.key()), call.encode())``, computed once per distinct call (the seq does not enter)."""
    fields = (call.kind, call.dtype, call.shape, call.op, call.root, call.algorithm, call.free_dim0, call.layout,
              call.error)
    hit = _ENCODED.get(fields)
    if hit is None:
        if len(_ENCODED) > 4096:
            _ENCODED.clear()
        hit = _ENCODED[fields] = (call_hash(call.key()), call.encode())
    return hit


def call_hash(key: str) -> int:
    """Return a signed 64-bit hash of a call's key (equal keys, equal hashes; others differ with odds 2**-64)."""
    return int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(), "little", signed=True)


def judge(descs: Sequence[bytes], where: str, seq: int, world_ranks: Optional[Sequence[int]] = None) -> str:
    """Return "" when all encoded calls agree and are valid, else the error message listing every rank's call.

    Args:
        descs: the encoded call of each rank, in rank order.
        where: the communicator's name, for the message.
        seq: the call's sequence number on that communicator.
        world_ranks: world rank of each rank, when ``where`` is a sub-communicator.
    """
    keys, texts = [], []
    for d in descs:
        key, _, text = bytes(d).rstrip(b"\0").decode(errors="replace").partition("\0")
        keys.append(key)
        texts.append(text)
    if len(set(keys)) == 1:
        if not keys[0].endswith("|True"):
            return ""
        # every rank made the same call with the same invalid argument: say what is wrong, not "disagree"
        call, _, error = texts[0].partition(": INVALID: ")
        return f"invalid argument to {call} (collective call #{seq} on {where}, the same on every rank): {error}"
    groups: dict = {}
    for rank, text in enumerate(texts):
        groups.setdefault(text, []).append(rank)
    lines = [f"ranks of {where} disagree on collective call #{seq} "
             f"(or one of them passed invalid arguments):"]
    for text, ranks in sorted(groups.items(), key=lambda kv: kv[1][0]):
        label = format_ranks(ranks)
        if world_ranks is not None:
            label += f" (world {format_ranks([world_ranks[r] for r in ranks])})"
        lines.append(f"  {label}: {text}")
    return "\n".join(lines)
