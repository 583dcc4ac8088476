"""tf.data input sharded across ranks exactly as :class:`hpctrain.data.DistributedSampler` shards it."""
from __future__ import annotations

from typing import Any, Optional

import numpy as np
import tensorflow as tf

from ..data import DistributedSampler

__all__ = ["distributed_dataset"]


def distributed_dataset(data: Any, batch_size: int, sampler: Optional[DistributedSampler] = None, *,
                        shuffle: bool = True, seed: int = 0, drop_last: bool = False,
                        drop_remainder: bool = False) -> tf.data.Dataset:
    """Return a ``tf.data.Dataset`` of this rank's batches of ``data``, one epoch per iteration.

    ``data`` is an array or a tuple/dict of arrays (numpy or tensors) with the
    same first dimension, as for ``tf.data.Dataset.from_tensor_slices``.  Each
    iteration over the dataset (Keras iterates once per epoch) takes the
    sampler's indices for its current epoch, ``sampler.indices()``, cut into
    batches of ``batch_size`` in order, and then moves the sampler to the next
    epoch (``set_epoch(epoch + 1)``), so every epoch is shuffled anew.  The
    split is the torch side's: a torch ``DataLoader(sampler=DistributedSampler
    (n, seed=s))`` and this dataset with the same seed give each rank the same
    samples in the same order.

    Args:
        data: the whole data set (every rank holds it; each reads its share).
        batch_size: per-rank batch size.
        sampler: a :class:`DistributedSampler` to follow (for example one
            restored from a checkpoint); default: a new one over ``len(data)``
            with ``shuffle``, ``seed`` and ``drop_last``.
        drop_remainder: drop this rank's last batch when it is smaller.

    The dataset's length is known (Keras shows progress and stops at the
    end of an epoch) unless the sampler was restored in the middle of an epoch.
    Pass ``shuffle=False`` to ``model.fit``: the dataset shuffles itself, and
    Keras warns on every rank about any ``tf.data.Dataset`` fitted with its
    default ``shuffle=True``.

    Cost: one ``tf.gather`` per batch from the in-memory arrays; the arrays
    become constants of the input pipeline (keep them under 2 GB, or shard
    files instead).
    """
    if not isinstance(batch_size, (int, np.integer)) or batch_size < 1:
        raise ValueError(f"batch_size must be a positive int, got {batch_size!r}")
    tensors = tf.nest.map_structure(tf.convert_to_tensor, data)
    sizes = {int(t.shape[0]) for t in tf.nest.flatten(tensors)}
    if len(sizes) != 1:
        raise ValueError(f"the arrays of data have different first dimensions: {sorted(sizes)}")
    n = sizes.pop()
    if sampler is None:
        sampler = DistributedSampler(n, shuffle=shuffle, seed=seed, drop_last=drop_last)
    elif sampler.num_samples != n:
        raise ValueError(f"the sampler is over {sampler.num_samples} samples, data has {n}")

    def batches():
        idx = np.asarray(sampler.indices(), dtype=np.int64)
        stop = len(idx) - len(idx) % batch_size if drop_remainder else len(idx)
        for start in range(0, stop, batch_size):
            yield idx[start:start + batch_size]
        sampler.set_epoch(sampler.epoch + 1)

    index_batches = tf.data.Dataset.from_generator(batches, output_signature=tf.TensorSpec([None], tf.int64))
    if sampler.state_dict(samples_seen=0)["consumed"] == 0:
        # At an epoch's start every epoch has len(sampler) samples: tell Keras how many batches (a
        # sampler resumed in the middle of an epoch has a shorter first epoch, so it stays unknown).
        per_rank = len(sampler)
        index_batches = index_batches.apply(tf.data.experimental.assert_cardinality(
            per_rank // batch_size if drop_remainder else -(-per_rank // batch_size)))
    return index_batches.map(lambda idx: tf.nest.map_structure(lambda t: tf.gather(t, idx), tensors),
                             num_parallel_calls=tf.data.AUTOTUNE, deterministic=True)
