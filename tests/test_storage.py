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


def test_memory_storage_encodes_at_commit_refuses_changed_bytes_and_writes_the_next_step_into_the_freed_buffer():
    """What a commit keeps is the values at write_part, not later changes; its bytes are checked on read; a value
    that is not data is held as a deep copy; after a step is removed its buffer takes the next step's bytes."""
    from hpctrain.checkpoint.tensorfile import CorruptFileError

    class Note:
        def __init__(self, v):
            self.v = v

    storage = MemoryStorage(kept=2)
    w, note = np.arange(1000, dtype=np.float32), Note(1)
    storage.save(1, {"w": w, "note": note, "nested": {"k": [1, (2.5, None)]}})
    w += 1
    note.v = 7
    got = storage.read(1)
    np.testing.assert_array_equal(got["w"], np.arange(1000, dtype=np.float32))
    assert got["note"].v == 1 and got["note"] is not note and got["nested"] == {"k": [1, (2.5, None)]}
    got["w"][:] = -1                                    # (what read gives is its own memory)
    np.testing.assert_array_equal(storage.read(1)["w"], np.arange(1000, dtype=np.float32))
    (raw1, _), _ = storage._parts[1]
    storage.save(2, {"w": w})
    storage.save(3, {"w": w * 2})                       # step 1 goes at its commit; its buffer is spare
    storage.save(4, {"w": w * 3})                       # written into step 1's buffer
    (raw3, _), _ = storage._parts[3]
    (raw4, _), _ = storage._parts[4]
    assert storage.list() == [3, 4] and np.shares_memory(raw4, raw1) and not np.shares_memory(raw3, raw4)
    np.testing.assert_array_equal(storage.read(4)["w"], w * 3)
    np.testing.assert_array_equal(storage.read(3)["w"], w * 2)
    raw4[-1] ^= 0xFF
    with pytest.raises(CorruptFileError, match="does not match its checksum"):
        storage.read(4)


@pytest.fixture
def world_of_one():
    import hpctrain

    hpctrain.shutdown()
    yield hpctrain.init("local")
    hpctrain.shutdown()


def test_peer_storage_keeps_the_newest_parts_checked_and_gives_them_back_in_their_dtypes(world_of_one):
    """The buddy copies' storage (checkpoint/peer_storage.py) encodes as the checkpoint does: bfloat16 tensors,
    numpy arrays, scalars and nested containers come back equal and of their types; a damaged copy is refused."""
    import torch

    from hpctrain.checkpoint.peer_storage import PartLost, PeerStorage
    from hpctrain.checkpoint.tensorfile import CorruptFileError

    def part(step):
        g = torch.Generator().manual_seed(step)
        return {"b0": {"exp_avg": torch.randn(7, generator=g).to(torch.bfloat16),
                       "step": torch.tensor(float(step))},
                "b1": {"count": np.arange(step, step + 3, dtype=np.int64), "lr": 0.5 * step, "ids": (1, [2, 3])}}

    storage = PeerStorage(world_of_one, kept=2)
    for step in (1, 2, 3):
        storage.save(step, part(step))
    assert storage.list() == [2, 3]
    with pytest.raises(FileExistsError, match="commit 3 exists already"):
        storage.begin(3)
    for got in (storage.read(3), storage.recover(3, world_of_one)[0]):
        want = part(3)
        assert got["b0"]["exp_avg"].dtype == torch.bfloat16
        assert torch.equal(got["b0"]["exp_avg"], want["b0"]["exp_avg"])
        assert torch.equal(got["b0"]["step"], want["b0"]["step"])
        np.testing.assert_array_equal(got["b1"]["count"], want["b1"]["count"])
        assert got["b1"]["lr"] == 1.5 and got["b1"]["ids"] == (1, [2, 3])
    got = storage.read(2)
    got["b0"]["exp_avg"].zero_()                # (what is read is a copy: the stored part stays as it was)
    assert torch.equal(storage.read(2)["b0"]["exp_avg"], part(2)["b0"]["exp_avg"])
    raw, _ = storage._parts[3][0]
    raw[len(raw) // 2] ^= 1
    with pytest.raises(CorruptFileError, match="does not match its checksum"):
        storage.read(3)
    with pytest.raises(PartLost, match=r"old rank\(s\) \[0\]"):
        storage.recover(3, world_of_one)


def test_a_bfloat16_sharded_optimizer_in_an_elastic_state_goes_back_to_its_commit(world_of_one):
    """ZeRO's state is committed through the peer storage: a bfloat16 model's moments come back bit for bit, and a
    sync leaves each rank's part as it is."""
    import torch

    import hpctrain.torch as ht
    from hpctrain.elastic import ObjectState

    torch.manual_seed(0)
    model = torch.nn.Linear(6, 3).to(torch.bfloat16)
    opt = ht.ShardedOptimizer(torch.optim.Adam(model.parameters(), lr=0.01), stage=2,
                              named_parameters=model.named_parameters())

    def step():
        opt.zero_grad()
        model(torch.randn(4, 6, dtype=torch.bfloat16)).float().pow(2).mean().backward()
        opt.step()

    step()
    state = ObjectState(optimizer=opt)

    def moments():
        return [v.clone() for _, st in sorted(opt.shard_state_dict()[1].items()) for _, v in sorted(st.items())]

    before = moments()
    step()
    step()
    moments_after_steps = moments()[0]
    state.restore()
    state.sync()            # (each rank keeps its own part: nothing of it is broadcast, and it is committed anew)
    assert state.commit_number == 2
    again = moments()
    assert len(again) == len(before) > 0 and not torch.equal(again[0], moments_after_steps)
    for a, b in zip(again, before):
        assert a.dtype == torch.bfloat16 and torch.equal(a, b)
