"""The storages of committed state (hpctrain/checkpoint/storage.py), step by named step, in one process.

The file storage is read back by the checkpoint restore (a different module), so what it commits is what a
resumed job finds; the memory storage keeps what elastic mode goes back to.
"""
import os

import numpy as np
import pytest

from hpctrain.checkpoint.layout import read_entries
from hpctrain.checkpoint.state import encode
from hpctrain.checkpoint.storage import FileStorage, MemoryStorage


def part_of(values):
    tensors, tree = encode({"w": values}, copy=False)
    return [("replicated.safetensors", tensors, tree, True)]


def meta(step):
    return {"step": step, "shard_of_rank": [None], "replicated": ["w"], "sharded": []}


def test_file_storage_commits_aborts_prunes_and_what_it_commits_restores(tmp_path):
    storage = FileStorage(str(tmp_path / "ckpt"))
    storage.prepare()
    for step in (1, 2, 3):
        storage.begin(step)
        receipt = storage.write_part(step, part_of(np.full(4, float(step))), meta(step))
        storage.commit(step, 1, [receipt])
    assert storage.list() == [1, 2, 3]
    with pytest.raises(FileExistsError, match="step-000000002 exists already"):
        storage.begin(2)
    storage.begin(4)
    storage.write_part(4, part_of(np.zeros(4)), meta(4))
    assert storage.list() == [1, 2, 3] and os.path.isdir(storage.partial(4))     # written, not committed
    storage.abort(4)
    assert not os.path.exists(storage.partial(4))
    storage.begin(5)                       # (a crash here leaves a partial step; prepare() removes it)
    FileStorage(storage.directory).prepare()
    assert not os.path.exists(storage.partial(5))
    storage.prune(2)
    assert storage.list() == [2, 3]
    state = {"w": np.zeros(4)}
    entries = read_entries(storage.location(3), 3, state, 0)
    np.testing.assert_array_equal(entries["w"][1], np.full(4, 3.0))


def test_memory_storage_keeps_the_newest_commits_and_refuses_a_second_commit_of_a_step():
    storage = MemoryStorage(kept=2)
    for step in (1, 2, 3):
        storage.save(step, {"step": step})
    assert storage.list() == [2, 3] and storage.read(3) == {"step": 3}
    with pytest.raises(KeyError):
        storage.read(1)
    with pytest.raises(FileExistsError, match="commit 3 exists already"):
        storage.begin(3)
    storage.begin(4)
    storage.write_part(4, {"step": 4})
    storage.abort(4)
    assert storage.list() == [2, 3]
    storage.remove(3)
    assert storage.list() == [2]
