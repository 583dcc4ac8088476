"""A sampler whose shares follow the world's size: after a re-forming, the epoch's unseen samples are re-dealt.

Rule (for ``n`` samples, ``N`` ranks, epoch ``e``): the epoch's order is a
permutation ``P`` of ``range(n)`` (seeded by ``seed + e``, or the identity
without shuffling); after ``p`` samples of the epoch have been consumed by the
world, the rest ``R = P[p:]`` is dealt round-robin, rank ``r`` taking
``R[r::N]``, cut to ``len(R) // N`` samples each so that every rank runs the
same number of batches (as ``drop_last``: the last ``len(R) % N`` are left out
of this epoch; with ``drop_last=False`` ``R`` is first padded to a multiple
of ``N`` with its own head, repeated, as torch's DistributedSampler and
Horovod's ElasticSampler do, so those few are seen twice instead).  When
every rank has run ``b`` batches of ``B`` samples, the world has consumed
exactly ``R[:b B N]``, a prefix: :meth:`ElasticSampler.record_batch`
adds ``B N`` to ``p``.  A re-formed world of ``N'`` ranks deals ``P[p:]`` anew,
so no sample of the epoch is skipped or seen twice, whatever the sizes.
"""
from __future__ import annotations

from typing import Any, Dict, Iterator, Optional

import numpy as np

__all__ = ["ElasticSampler"]


class ElasticSampler:
    """Indices of this rank's share of a data set of ``length`` samples (module docstring for the rule).

    Put it in the elastic state (``TorchState(model, opt, sampler=sampler)``)
    so that a re-forming restores its progress; ``set_epoch`` at each epoch's
    start, ``record_batch`` after each step.  Works as a torch DataLoader's
    ``sampler`` (it has ``__iter__`` and ``__len__``); the rank and size are
    read from the world at each ``__iter__``.

    Args:
        length: samples in the data set (or the data set itself: its ``len``).
        shuffle: deal a permutation seeded by ``seed + epoch`` (else in order).
        seed: the seed, the same on every rank.
        comm: the communicator to shard over (default: the world, followed across re-formings).
        drop_last: leave the last ``len(R) % N`` samples out (default), or pad (module docstring).
    """

    def __init__(self, length, shuffle: bool = True, seed: int = 0, comm=None, drop_last: bool = True):
        self.length = length if isinstance(length, int) else len(length)
        self.shuffle, self.seed, self.comm, self.drop_last = bool(shuffle), int(seed), comm, bool(drop_last)
        self.epoch = 0
        self.processed = 0          # samples of this epoch the world has consumed (a prefix of the order)

    def _where(self):
        from ..world import comm_or_world

        comm = comm_or_world(self.comm)
        return comm.rank, comm.size

    def order(self) -> np.ndarray:
        """This epoch's order of all samples."""
        if not self.shuffle:
            return np.arange(self.length, dtype=np.int64)
        return np.random.RandomState((self.seed + self.epoch) % 2 ** 32).permutation(self.length).astype(np.int64)

    def indices(self) -> np.ndarray:
        """This rank's remaining indices of the epoch, in order."""
        rank, size = self._where()
        rest = self.order()[self.processed:]
        each = len(rest) // size if self.drop_last else -(-len(rest) // size)
        if not self.drop_last and len(rest):
            rest = np.resize(rest, each * size)       # (the head again, cyclically)
        return rest[rank::size][:each]

    def __iter__(self) -> Iterator[int]:
        return iter(self.indices().tolist())

    def __len__(self) -> int:
        left, size = self.length - self.processed, self._where()[1]
        return left // size if self.drop_last else -(-left // size)

    def set_epoch(self, epoch: int) -> None:
        """Start epoch ``epoch`` (its own order, nothing consumed)."""
        self.epoch, self.processed = int(epoch), 0

    def record_batch(self, batch_size: int) -> None:
        """Every rank consumed ``batch_size`` more samples of its share (call after each step, on every rank)."""
        self.processed = min(self.length, self.processed + int(batch_size) * self._where()[1])

    def state_dict(self) -> Dict[str, Any]:
        """Epoch and progress (what a commit and a checkpoint keep)."""
        return {"epoch": self.epoch, "processed": self.processed, "length": self.length, "seed": self.seed,
                "shuffle": self.shuffle}

    def load_state_dict(self, state: Dict[str, Any], strict: Optional[bool] = True) -> None:
        """Go back to ``state`` (from :meth:`state_dict`); the data set's length and seed must match."""
        for key in ("length", "seed", "shuffle"):
            if key in state and state[key] != getattr(self, key):
                raise ValueError(f"ElasticSampler: the saved {key} {state[key]!r} differs from this sampler's "
                                 f"{getattr(self, key)!r}")
        self.epoch, self.processed = int(state["epoch"]), int(state["processed"])
