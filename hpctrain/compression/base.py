"""The compressor protocol, error-feedback memory and the choice of which tensors to compress.

A compressor works on one flat float32 buffer at a time:

* ``compress(x, slot) -> (payload, ctx)``: ``payload`` is a list of numpy
  arrays, exactly what goes on the wire; ``ctx`` stays on this rank (shapes,
  indices shared by all ranks, ...) and is never sent.
* ``decompress(payload, ctx) -> x_hat``: a dense float32 buffer of the input's
  length.

How the payloads of the ranks are combined is declared by ``communication``:

* ``"allreduce"``: payloads can be summed element by element
  (``decompress(sum_r p_r) = sum_r decompress(p_r)``: fp16, bf16, random-k
  with indices shared by all ranks).  One fused all-reduce carries them.
* ``"allgather"``: every rank needs every payload (top-k, QSGD, sign
  methods, ...).  One all-gather carries all of one step's payloads; each is
  decompressed, the buffers are summed in rank order and ``finish`` turns
  the sum into the result (the mean, or a majority vote).
* ``"custom"``: the compressor runs its own collectives (PowerSGD's two
  all-reduces), see :class:`hpctrain.compression.powersgd.PowerSGD`.

Error feedback (Seide et al. 2014; Karimireddy et al. 2019, "Error Feedback
Fixes SignSGD"): before compression the residual ``e`` of the last step is
added, ``c = g + e``; after it, ``e' = c - decompress(compress(c))`` is kept.
So ``sent + e' = c`` exactly: nothing a rank computed is lost, it is only
delayed.  Memory: one float32 buffer per compressed tensor.

A :class:`Slot` is the per-tensor state a compressor keeps between steps (its
step counter, the residual, PowerSGD's ``Q``, DGC's velocities); the slots are
what ``state_dict()`` saves.  Random choices come from
:meth:`Slot.rng`: seeded by (seed, tensor, step) and, when private, the rank,
so a run is reproducible and a test can recompute any rank's payload.
"""
from __future__ import annotations

import fnmatch
import zlib
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np

__all__ = ["Compressor", "Slot", "Policy", "DEFAULT_SKIP_PATTERNS"]

DEFAULT_SKIP_PATTERNS = ("*bias*", "*norm*", "*bn*", "*ln_*", "*embeddings_layer_norm*")


@dataclass
class Slot:
    """What a compressor keeps for one tensor between steps.

    Attributes:
        key: the tensor's name (unique within one optimizer).
        shape: the tensor's shape (PowerSGD views it as a matrix).
        rank: this rank in the communicator the tensor is reduced over.
        step: how many times this tensor was compressed before this call.
        arrays: named float32 buffers (``"residual"``, ``"q"``, ...).
    """

    key: str
    shape: Tuple[int, ...]
    rank: int = 0
    step: int = 0
    arrays: Dict[str, np.ndarray] = field(default_factory=dict)

    def rng(self, seed: int, shared: bool) -> np.random.Generator:
        """Random numbers for this tensor and step; ``shared``: the same on every rank."""
        words = [int(seed) & 0xFFFFFFFF, self.step, zlib.crc32(self.key.encode())]
        if not shared:
            words.append(self.rank + 1)
        return np.random.default_rng(words)

    def array(self, name: str, n: int) -> np.ndarray:
        """The buffer ``name`` of ``n`` float32 zeros, created on first use."""
        a = self.arrays.get(name)
        if a is None or a.size != n:
            a = self.arrays[name] = np.zeros(n, dtype=np.float32)
        return a


class Compressor:
    """Base class: the identity (``none``); subclasses override ``compress``/``decompress``.

    Args:
        error_feedback: keep the compression error and add it back next step
            (default: the class's ``default_error_feedback``).
        seed: seeds every random choice (same on all ranks).
    """

    name = "none"
    communication = "allreduce"
    default_error_feedback = False
    policy_exempt = False       # True: compress every float tensor, whatever the Policy says
    keeps_state = False         # True: a step's payload depends on earlier steps (buffers, choices seeded by the step)

    def __init__(self, error_feedback: Optional[bool] = None, seed: int = 0):
        self.error_feedback = self.default_error_feedback if error_feedback is None else bool(error_feedback)
        self.seed = int(seed)
        self.slots: Dict[str, Slot] = {}

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self._describe()})"

    @property
    def carries_state(self) -> bool:
        """Whether a step's payload depends on earlier steps (error feedback, or the class's ``keeps_state``):
        then the compressor's ``state_dict()`` is part of what a restart needs."""
        return self.error_feedback or self.keeps_state

    def _describe(self) -> str:
        return f"error_feedback={self.error_feedback}"

    # -- the protocol --------------------------------------------------------
    def compress(self, x: np.ndarray, slot: Slot) -> Tuple[List[np.ndarray], Any]:
        """Return (payload arrays, local context) for the flat float32 buffer ``x``."""
        return [x], None

    def decompress(self, payload: Sequence[np.ndarray], ctx: Any, n: int) -> np.ndarray:
        """Return the dense float32 buffer of ``n`` values that ``payload`` stands for."""
        return np.asarray(payload[0], dtype=np.float32).reshape(n)

    def finish(self, total: np.ndarray, nranks: int, op: str) -> np.ndarray:
        """Turn the sum of all ranks' decompressed buffers into the result: ``total / N`` for avg."""
        if op == "avg" and nranks > 1:
            total /= np.float32(nranks)
        return total

    def payload_bytes(self, payload: Sequence[np.ndarray]) -> int:
        """Bytes of one payload on the wire."""
        return int(sum(np.asarray(p).nbytes for p in payload))

    # -- error feedback ------------------------------------------------------
    def compensate(self, x: np.ndarray, slot: Slot) -> np.ndarray:
        """Return ``x + residual`` (a new buffer) when error feedback is on, else ``x``."""
        if not self.error_feedback:
            return x
        return x + slot.array("residual", x.size)

    def remember(self, compensated: np.ndarray, sent: np.ndarray, slot: Slot) -> None:
        """Keep ``residual = compensated - sent`` (what this rank's payload did not carry)."""
        if self.error_feedback:
            np.subtract(compensated, sent, out=slot.array("residual", compensated.size))

    def slot(self, key: str, shape: Tuple[int, ...], rank: int) -> Slot:
        """The slot of tensor ``key`` (created on first use; its shape must not change)."""
        s = self.slots.get(key)
        if s is None:
            s = self.slots[key] = Slot(key, tuple(shape), rank)
        elif s.shape != tuple(shape):
            raise ValueError(f"{self.name}: tensor {key!r} changed shape from {s.shape} to {tuple(shape)}")
        s.rank = rank
        return s

    # -- checkpointing -------------------------------------------------------
    def state_dict(self) -> Dict[str, Any]:
        """The per-tensor state (steps and buffers) as plain values and numpy arrays; rank-specific."""
        return {"name": self.name, "slots": {k: {"shape": list(s.shape), "step": s.step,
                                                   "arrays": {n: a.copy() for n, a in s.arrays.items()}}
                                               for k, s in self.slots.items()}}

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned (for a compressor of the same kind)."""
        if state.get("name") != self.name:
            raise ValueError(f"this state belongs to compressor {state.get('name')!r}, not {self.name!r}")
        self.slots = {}
        for key, s in state["slots"].items():
            slot = Slot(key, tuple(int(d) for d in s["shape"]), step=int(s["step"]))
            slot.arrays = {n: np.array(a, dtype=np.float32) for n, a in s["arrays"].items()}
            self.slots[key] = slot


class Policy:
    """Which tensors get compressed: large enough and not matched by a skip pattern.

    Biases and normalisation parameters are small and sensitive, so by default
    they stay dense (names matched case-insensitively against
    ``DEFAULT_SKIP_PATTERNS``), as does every tensor under ``min_numel``
    elements (the payload overhead and the latency of a collective dominate
    there).

    Args:
        min_numel: tensors with fewer elements stay dense (default 1024).
        skip: fnmatch patterns of names that stay dense.
        only: if given, only names matching one of these patterns are compressed.
    """

    def __init__(self, min_numel: int = 1024, skip: Sequence[str] = DEFAULT_SKIP_PATTERNS,
                 only: Optional[Sequence[str]] = None):
        if int(min_numel) < 0:
            raise ValueError(f"min_numel must be >= 0, got {min_numel}")
        self.min_numel, self.skip = int(min_numel), tuple(p.lower() for p in skip)
        self.only = None if only is None else tuple(p.lower() for p in only)

    def __repr__(self) -> str:
        return f"Policy(min_numel={self.min_numel}, skip={self.skip}, only={self.only})"

    def compress(self, name: str, numel: int) -> bool:
        """Whether the tensor ``name`` of ``numel`` elements is compressed."""
        lowered = name.lower()
        if numel < self.min_numel or any(fnmatch.fnmatchcase(lowered, p) for p in self.skip):
            return False
        return self.only is None or any(fnmatch.fnmatchcase(lowered, p) for p in self.only)
