"""Data sharding for data-parallel training, shared by the PyTorch and TensorFlow adapters.

:class:`DistributedSampler` gives each rank a disjoint share of the sample
indices of an epoch.  It works as the ``sampler=`` of a torch ``DataLoader``
(which needs only ``__iter__`` and ``__len__``) and also hands out plain
index lists (:meth:`DistributedSampler.indices`) for ``tf.data`` or any other
loader, so both frameworks split a data set the same way for the same seed.
"""
from __future__ import annotations

from typing import Dict, Iterator, List, Optional

import numpy as np

__all__ = ["DistributedSampler"]


class DistributedSampler:
    """Split ``range(num_samples)`` across ranks, reshuffled every epoch, resumable mid-epoch.

    The epoch's global order is ``G = permutation(num_samples)`` drawn from
    ``numpy.random.default_rng(seed + epoch)`` (or ``range`` without
    shuffling), then made a multiple of the world size N: padded by repeating
    its first elements (default) or cut (``drop_last=True``).  Rank ``r``
    takes ``G[r::N]``, so every rank gets ``len(G) / N`` samples and together
    they cover every sample once (plus at most N-1 repeats when padded).

    Resuming: :meth:`state_dict` records the epoch and how many samples of
    ``G`` all ranks have consumed together (``samples_seen * N``).
    :meth:`load_state_dict` continues from there, also with a different world
    size: the rest of ``G`` is dealt out to the new ranks (padded again when it
    does not divide evenly).  Cost: O(num_samples) per epoch to draw ``G``.

    Args:
        num_samples: the data set (anything with ``len()``, as torch's
            ``DistributedSampler(dataset)`` takes) or its size.
        shuffle: reshuffle every epoch (``set_epoch``).
        seed: base seed; must be the same on every rank.
        drop_last: cut the epoch to a multiple of the world size instead of padding.
        num_replicas, rank: override the world size and rank (default: the
            initialized world; a world of one before ``hpctrain.init()``).
    """

    def __init__(self, num_samples, shuffle: bool = True, seed: int = 0, drop_last: bool = False,
                 num_replicas: Optional[int] = None, rank: Optional[int] = None):
        if not isinstance(num_samples, (int, np.integer)):
            if not hasattr(num_samples, "__len__"):
                raise TypeError(f"DistributedSampler takes a data set (with len()) or its size, got a "
                                f"{type(num_samples).__name__}")
            num_samples = len(num_samples)
        if num_samples < 0:
            raise ValueError(f"num_samples must be a non-negative int, got {num_samples!r}")
        if num_replicas is None or rank is None:
            from .world import is_initialized, world

            comm = world() if is_initialized() else None
            num_replicas = (comm.size if comm else 1) if num_replicas is None else num_replicas
            rank = (comm.rank if comm else 0) if rank is None else rank
        if num_replicas < 1 or not 0 <= rank < num_replicas:
            raise ValueError(f"need 0 <= rank < num_replicas, got rank={rank}, num_replicas={num_replicas}")
        if drop_last and num_samples < num_replicas:
            raise ValueError(f"drop_last with {num_samples} samples and {num_replicas} ranks leaves no data")
        self.num_samples, self.shuffle, self.seed, self.drop_last = int(num_samples), shuffle, int(seed), drop_last
        self.num_replicas, self.rank = int(num_replicas), int(rank)
        self.epoch = 0
        self._start = 0          # samples of the epoch's global order consumed before this run
        self._yielded = 0        # indices this rank handed out since the (re)start
        self._trained: Optional[int] = None   # samples this rank reported with advance()

    def set_epoch(self, epoch: int) -> None:
        """Start epoch ``epoch`` (changes the shuffle; call it before iterating, on every rank)."""
        self.epoch, self._start, self._yielded, self._trained = int(epoch), 0, 0, None

    def _global_order(self) -> np.ndarray:
        n, N = self.num_samples, self.num_replicas
        if self.shuffle:
            order = np.random.default_rng(self.seed + self.epoch).permutation(n)
        else:
            order = np.arange(n)
        if self.drop_last:
            return order[:n - n % N]
        return _pad(order, N) if n else order

    def indices(self) -> List[int]:
        """Return this rank's indices for the rest of the current epoch, as a list of ints."""
        rest = self._global_order()[self._start:]
        if rest.size and rest.size % self.num_replicas:
            rest = _pad(rest, self.num_replicas)
        return rest[self.rank::self.num_replicas].tolist()

    def __iter__(self) -> Iterator[int]:
        self._yielded = 0
        for i in self.indices():
            self._yielded += 1
            yield i

    def __len__(self) -> int:
        rest = max(len(self._global_order()) - self._start, 0)
        return -(-rest // self.num_replicas)

    def advance(self, samples: int) -> None:
        """Record that this rank has trained on ``samples`` more samples of the epoch.

        Once called, :meth:`state_dict` counts these instead of the indices the
        iterator handed out, which run ahead of training when a loader
        prefetches: call it after every step and a checkpoint resumes exactly
        at the first sample not yet trained on.
        """
        if samples < 0:
            raise ValueError(f"samples must be >= 0, got {samples}")
        self._trained = (self._trained or 0) + int(samples)

    def state_dict(self, samples_seen: Optional[int] = None) -> Dict[str, int]:
        """Return the position in the epoch as plain ints (JSON-safe).

        Args:
            samples_seen: samples this rank has trained on since the epoch
                (re)started; default: how many indices the iterator handed out.
                Pass it (or call :meth:`advance` every step) when a loader
                prefetches ahead of training.
        """
        if samples_seen is not None:
            seen = int(samples_seen)
        else:
            seen = self._yielded if self._trained is None else self._trained
        return {"epoch": self.epoch, "seed": self.seed, "num_samples": self.num_samples,
                "consumed": self._start + seen * self.num_replicas}

    def load_state_dict(self, state: Dict[str, int]) -> None:
        """Continue the epoch recorded by :meth:`state_dict` (any world size)."""
        if int(state["num_samples"]) != self.num_samples or int(state["seed"]) != self.seed:
            raise ValueError(f"sampler state is for num_samples={state['num_samples']} seed={state['seed']}, "
                             f"this sampler has num_samples={self.num_samples} seed={self.seed}")
        self.epoch, self._yielded, self._trained = int(state["epoch"]), 0, None
        self._start = min(int(state["consumed"]), len(self._global_order()))


def _pad(order: np.ndarray, n: int) -> np.ndarray:
    """Repeat the start of ``order`` (cyclically) until its length is a multiple of ``n``."""
    extra = -len(order) % n
    return np.concatenate([order, np.resize(order, extra)]) if extra else order

