"""CheckpointManager on every rank of a launch: round trips, layout on disk, errors, corruption, pruning.

References are independent of the code under test: deep copies of the state
taken before saving, and the files read back with the ``safetensors`` package.
"""
import copy
import json
import logging
import os
import time

import numpy as np
import pytest
import torch
from safetensors.numpy import load_file

from hpctrain.checkpoint import CheckpointError, CheckpointManager, RNGState, Sharded
from hpctrain.data import DistributedSampler


def _trained(seed=0, steps=3):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.BatchNorm1d(5), torch.nn.ReLU(),
                                torch.nn.Linear(5, 2))
    opt = torch.optim.Adam([{"params": model[0].parameters()}, {"params": model[3].parameters(), "lr": 3e-3}],
                           lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    for _ in range(steps):
        opt.zero_grad()
        model(torch.randn(8, 6)).pow(2).mean().backward()
        opt.step()
        sched.step()
    return model, opt, sched


def _flat(sd):
    """Every tensor and number of a nested state dict, as a sorted list of (path, value)."""
    out = []

    def walk(x, path):
        if isinstance(x, dict):
            for k in sorted(x, key=str):
                walk(x[k], f"{path}/{k}")
        elif isinstance(x, (list, tuple)):
            for i, v in enumerate(x):
                walk(v, f"{path}[{i}]")
        elif isinstance(x, torch.Tensor):
            out.append((path, x.detach().clone()))
        else:
            out.append((path, x))
    walk(sd, "")
    return out


def _assert_same(a, b):
    fa, fb = _flat(a), _flat(b)
    assert [p for p, _ in fa] == [p for p, _ in fb]
    for (p, x), (_, y) in zip(fa, fb):
        if isinstance(x, torch.Tensor):
            assert x.dtype == y.dtype and torch.equal(x, y), p
        elif isinstance(x, np.ndarray):
            assert np.array_equal(x, y), p
        else:
            assert x == y, p


@pytest.mark.parametrize("async_save", [True, False])
def test_round_trip_restores_every_kind_of_state_bit_for_bit(comm, ckdir, async_save):
    model, opt, sched = _trained()
    sampler = DistributedSampler(50, seed=3)
    sampler.set_epoch(2)
    arr = np.arange(12, dtype=np.float32).reshape(3, 4) + comm.rank * 0   # replicated
    half = torch.linspace(0, 1, 7, dtype=torch.bfloat16)
    mine = np.full(3, comm.rank, dtype=np.int64)                           # rank-specific
    state = {"model": model, "opt": opt, "sched": sched, "sampler": sampler, "arr": arr, "half": half,
             "epoch": 4, "meta": {"name": "run", "sizes": (1, 2), 7: None},
             "rng": Sharded(RNGState()), "mine": Sharded(mine)}
    torch.manual_seed(100 + comm.rank)
    np.random.seed(100 + comm.rank)
    expect = {"model": copy.deepcopy(model.state_dict()), "opt": copy.deepcopy(opt.state_dict()),
              "sched": copy.deepcopy(sched.state_dict()), "sampler": sampler.state_dict(),
              "arr": arr.copy(), "half": half.clone(), "mine": mine.copy()}
    manager = CheckpointManager(ckdir, async_save=async_save)
    assert manager.save(7, state)
    # Training goes on at once: the checkpoint must hold the values at save time.
    for p in model.parameters():
        p.data.add_(1.0)
    arr += 1
    mine += 1
    half.add_(1)
    expected_draws = (torch.rand(3), np.random.rand(3))
    manager.wait()
    assert manager.latest_step() == 7
    opt.zero_grad()
    model(torch.randn(8, 6)).sum().backward()
    opt.step()
    sched.step()
    sampler.set_epoch(9)
    state["epoch"], state["meta"] = 0, None

    assert manager.restore(state) == 7
    _assert_same(model.state_dict(), expect["model"])
    _assert_same(opt.state_dict(), expect["opt"])
    _assert_same(sched.state_dict(), expect["sched"])
    assert sampler.state_dict() == expect["sampler"]
    assert np.array_equal(arr, expect["arr"]) and np.array_equal(mine, expect["mine"])
    assert torch.equal(half, expect["half"]) and half.dtype == torch.bfloat16
    assert state["epoch"] == 4 and state["meta"] == {"name": "run", "sizes": (1, 2), 7: None}
    draws = (torch.rand(3), np.random.rand(3))
    assert torch.equal(draws[0], expected_draws[0]) and np.array_equal(draws[1], expected_draws[1])


def test_replicated_state_is_written_once_and_shards_by_their_owner(comm, ckdir):
    model, _, _ = _trained()
    shard = comm.rank // 2     # ranks 2k and 2k+1 hold the same shard, as pipeline-stage replicas would
    stage = np.full(4, shard, dtype=np.float64)
    manager = CheckpointManager(ckdir, async_save=False)
    manager.save(1, {"model": model, "stage": Sharded(stage, shard=shard)})
    comm.barrier()
    step_dir = manager.step_dir(1)
    shards = sorted({r // 2 for r in range(comm.size)})
    files = sorted(os.listdir(step_dir))
    assert files == sorted(["manifest.json", "replicated.safetensors"]
                           + [f"shard-{s}.safetensors" for s in shards])
    manifest = json.load(open(os.path.join(step_dir, "manifest.json")))
    assert manifest["step"] == 1 and manifest["world_size"] == comm.size
    assert manifest["shard_of_rank"] == [r // 2 for r in range(comm.size)]
    for fname, info in manifest["files"].items():
        assert os.path.getsize(os.path.join(step_dir, fname)) == info["size"]
    # The files are plain safetensors: the reference library reads them.
    rep = load_file(os.path.join(step_dir, "replicated.safetensors"))
    weights = sorted(v.tobytes() for v in rep.values())
    assert all(p.detach().numpy().tobytes() in weights for p in model.state_dict().values())
    for s in shards:
        (only,) = load_file(os.path.join(step_dir, f"shard-{s}.safetensors")).values()
        assert np.array_equal(only, np.full(4, s, dtype=np.float64))
    stage[:] = -1
    assert manager.restore({"model": model, "stage": Sharded(stage, shard=shard)}) == 1
    assert np.array_equal(stage, np.full(4, shard, dtype=np.float64))


def test_an_error_on_one_rank_is_raised_on_every_rank_and_nothing_is_committed(comm, ckdir):
    manager = CheckpointManager(ckdir, async_save=True)
    manager.save(1, {"x": np.ones(3)})
    bad = comm.size - 1
    value = (lambda: 0) if comm.rank == bad else np.ones(3)
    with pytest.raises(CheckpointError) as err:
        manager.save(2, {"x": Sharded(value)})
        manager.wait()
    assert f"rank {bad}" in str(err.value) and "not data" in str(err.value)
    comm.barrier()
    assert manager.all_steps() == [1]
    assert not any(n.endswith(".partial") for n in os.listdir(ckdir))


def test_ranks_saving_different_steps_get_an_error_naming_them(comm, ckdir):
    if comm.size == 1:
        pytest.skip("needs two ranks to disagree")
    manager = CheckpointManager(ckdir)
    with pytest.raises(ValueError, match=r"ranks 1-|rank 1:"):
        manager.save(5 if comm.rank == 0 else 6, {"x": np.ones(2)})
    assert manager.all_steps() == []


def _damage(path: str, damage: str) -> None:
    """Damage the checkpoint directory ``path`` as a failing disk or an editor would."""
    data = os.path.join(path, "replicated.safetensors")
    if damage == "flip":
        with open(data, "r+b") as f:
            f.seek(os.path.getsize(data) - 100)
            byte = f.read(1)
            f.seek(-1, 1)
            f.write(bytes([byte[0] ^ 0x10]))
    elif damage == "truncate":
        os.truncate(data, os.path.getsize(data) - 8)
    elif damage == "manifest":
        with open(os.path.join(path, "manifest.json"), "w") as f:
            f.write('{"format": ')
    else:                                                 # a shard file lost
        shard = max(n for n in os.listdir(path) if n.startswith("shard-"))
        os.remove(os.path.join(path, shard))


@pytest.mark.parametrize("damage", ["flip", "truncate", "manifest"])
def test_a_damaged_checkpoint_is_skipped_for_the_previous_one(comm, ckdir, damage, caplog):
    x = np.zeros(1000)
    manager = CheckpointManager(ckdir, keep=5)
    for step in (1, 2):
        x[:] = step
        manager.save(step, {"x": x})
    manager.wait()
    if comm.rank == 0:
        _damage(manager.step_dir(2), damage)
        os.makedirs(manager.step_dir(3) + ".partial")   # a save that died half-way is never a candidate
    comm.barrier()
    x[:] = -1
    with caplog.at_level(logging.WARNING, logger="hpctrain"):
        assert manager.restore({"x": x}) == 1
    assert np.all(x == 1)
    if comm.rank == 0:
        assert "step-000000002" in caplog.text and "not usable" in caplog.text
    assert manager.all_steps() == [1]                     # the refused one is set aside, not deleted
    assert os.path.isdir(os.path.join(ckdir, "refused", "step-000000002"))
    x[:] = 2
    manager.save(2, {"x": x})                             # so training on saves step 2 again
    manager.wait()
    x[:] = 0
    assert manager.restore({"x": x}) == 2 and np.all(x == 2)


@pytest.mark.parametrize("damage", ["flip", "truncate", "manifest", "missing shard"])
def test_when_every_checkpoint_is_bad_restore_raises_unless_told_to_start_fresh(comm, ckdir, damage, caplog):
    x, mine = np.zeros(1000), np.zeros(4)
    manager = CheckpointManager(ckdir, keep=5)
    for step in (1, 2):
        x[:], mine[:] = step, comm.rank
        manager.save(step, {"x": x, "mine": Sharded(mine)})
    manager.wait()
    if comm.rank == 0:
        for step in (1, 2):
            _damage(manager.step_dir(step), damage)
    comm.barrier()
    with pytest.raises(CheckpointError) as err:
        manager.restore({"x": x, "mine": Sharded(mine)})
    text = str(err.value)
    assert "none of the 2 checkpoint(s)" in text and "start_fresh_if_invalid" in text, text
    assert "step-000000001:" in text and "step-000000002:" in text and "rank" in text, text
    assert manager.all_steps() == [1, 2]                  # nothing moved or deleted without the opt-in
    x[:] = -1
    with caplog.at_level(logging.WARNING, logger="hpctrain"):
        assert manager.restore({"x": x, "mine": Sharded(mine)}, start_fresh_if_invalid=True) is None
    assert np.all(x == -1) and manager.all_steps() == []
    if comm.rank == 0:                                    # it says so, and where the refused ones are
        assert "starting from scratch as asked" in caplog.text and "refused" in caplog.text, caplog.text
    assert sorted(os.listdir(os.path.join(ckdir, "refused"))) == ["step-000000001", "step-000000002"]
    for step in (1, 2):                                   # the run from scratch saves the same steps again
        x[:] = 10 + step
        manager.save(step, {"x": x, "mine": Sharded(mine)})
    manager.wait()
    x[:] = 0
    assert manager.restore({"x": x, "mine": Sharded(mine)}) == 2 and np.all(x == 12)


@pytest.mark.parametrize("edit, expected", [
    (lambda m: m.update(step=7), "field 'step' is 7, but the directory step-000000001 is the checkpoint of step 1"),
    (lambda m: m.update(format="other/2"), "field 'format' is 'other/2', expected 'hpctrain-checkpoint/1'"),
    (lambda m: m.pop("files"), "lacks the field 'files'"),
    (lambda m: m.update(world_size="two"), "field 'world_size' is 'two', expected a whole number"),
    (lambda m: m["files"].pop("replicated.safetensors"), "has no size and crc32 for replicated.safetensors"),
])
def test_an_edited_manifest_is_refused_naming_the_field(comm, ckdir, edit, expected):
    manager = CheckpointManager(ckdir)
    manager.save(1, {"x": np.ones(3)})
    manager.wait()
    if comm.rank == 0:
        path = os.path.join(manager.step_dir(1), "manifest.json")
        with open(path) as f:
            manifest = json.load(f)
        edit(manifest)
        with open(path, "w") as f:
            json.dump(manifest, f)
    comm.barrier()
    with pytest.raises(CheckpointError) as err:
        manager.restore({"x": np.zeros(3)})
    assert expected in str(err.value), str(err.value)


def test_keep_prunes_old_checkpoints_after_the_new_one_commits(comm, ckdir):
    manager = CheckpointManager(ckdir, keep=2, every_steps=3)
    saved = [s for s in range(1, 11) if manager.save(s, {"x": np.full(2, s)})]
    manager.wait()
    assert saved == [3, 6, 9]
    assert manager.all_steps() == [6, 9]
    x = np.zeros(2)
    assert manager.restore({"x": x}) == 9 and np.all(x == 9)
    assert manager.restore({"x": x}, step=6) == 6 and np.all(x == 6)


@pytest.mark.parametrize("verify", ["warn", "off"])
def test_an_asynchronous_save_is_committed_once_written_without_another_save_or_wait(comm, ckdir, verify):
    # Before, the commit waited for the next save() or wait(): a job that saved once an epoch and died in
    # the next epoch lost that epoch too.  Every rank writes (a shard each), so rank 0 awaits them all.
    manager = CheckpointManager(ckdir, verify_replicas=verify)
    mine = np.full(1000, float(comm.rank))
    state = {"w": np.arange(1000.0), "mine": Sharded(mine)}
    assert manager.save(5, state)
    deadline = time.monotonic() + 20
    while manager.latest_step() != 5 and time.monotonic() < deadline:     # nothing collective in between
        time.sleep(0.01)
    committed = manager.latest_step() == 5
    files = sorted(os.listdir(manager.step_dir(5))) if committed else []
    verdicts = comm.allgather_object((committed, files))
    manager.wait()                       # (the collective confirmation: no error, nothing done twice)
    assert all(c for c, _ in verdicts), verdicts
    assert files == ["manifest.json", "replicated.safetensors"] + sorted(
        f"shard-{r}.safetensors" for r in range(comm.size)), files      # the ranks' markers are gone
    back = {"w": np.zeros(1000), "mine": Sharded(np.zeros(1000))}
    assert manager.restore(back) == 5
    assert np.array_equal(back["w"], state["w"]) and np.array_equal(back["mine"].obj, mine)


def test_restore_without_checkpoints_returns_none_and_wrong_state_is_refused(comm, ckdir):
    manager = CheckpointManager(ckdir)
    x = np.zeros(3)
    assert manager.restore({"x": x}) is None
    manager.save(1, {"x": x})
    manager.wait()
    with pytest.raises(CheckpointError, match="has no entry 'y'"):
        manager.restore({"y": x})
    with pytest.raises(CheckpointError, match="shape"):
        manager.restore({"x": np.zeros(4)})


def test_replicas_that_differ_are_reported_with_their_ranks(comm, ckdir, caplog):
    if comm.size == 1:
        pytest.skip("needs two ranks to differ")
    differs = np.full(2, comm.rank % 2)
    manager = CheckpointManager(ckdir, verify_replicas="warn")
    with caplog.at_level(logging.WARNING, logger="hpctrain"):
        manager.save(1, {"same": np.ones(2), "differs": differs})
        manager.wait()
    if comm.rank == 0:
        assert "entry 'differs' differs between" in caplog.text and "'same'" not in caplog.text
    strict = CheckpointManager(ckdir, verify_replicas="error")
    with pytest.raises(CheckpointError, match="entry 'differs' differs"):
        strict.save(2, {"differs": differs})
        strict.wait()
    assert strict.all_steps() == [1]


def test_keras_model_and_optimizer_round_trip(comm, ckdir):
    os.environ.setdefault("KERAS_BACKEND", "tensorflow")
    import keras

    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3), keras.layers.Dense(1)])
    opt = keras.optimizers.Adam(1e-2)
    model.compile(optimizer=opt, loss="mse")
    x, y = np.random.default_rng(0).normal(size=(16, 4)), np.ones((16, 1))
    model.fit(x, y, epochs=2, batch_size=8, verbose=0)
    expect_model = [v.numpy().copy() for v in model.variables]
    expect_opt = [v.numpy().copy() for v in opt.variables]
    manager = CheckpointManager(ckdir)
    manager.save(2, {"model": model, "opt": opt})
    model.fit(x, y, epochs=1, batch_size=8, verbose=0)
    manager.wait()
    assert manager.restore({"model": model, "opt": opt}) == 2
    assert all(np.array_equal(v.numpy(), e) for v, e in zip(model.variables, expect_model))
    assert all(np.array_equal(v.numpy(), e) for v, e in zip(opt.variables, expect_opt))


def test_a_signal_on_one_rank_makes_every_rank_save_the_same_step(comm, ckdir):
    import signal

    from hpctrain.checkpoint import on_preemption

    old = {s: signal.getsignal(s) for s in (signal.SIGUSR2, signal.SIGTERM)}
    try:
        manager = CheckpointManager(ckdir, every_steps=100)
        on_preemption(manager, exit=False)
        mine = Sharded(comm.rank * 10)       # a plain per-rank value
        saved = []
        for step in range(1, 8):
            if step == 4 and comm.rank == comm.size - 1:
                os.kill(os.getpid(), signal.SIGUSR2)
            if manager.save(step, {"x": np.full(2, step), "mine": mine}):
                saved.append(step)
            if step == 4:
                assert manager.preempted
        assert saved == [4] and manager.all_steps() == [4]     # saved once, at the step of the signal
        x, mine = np.zeros(2), Sharded(None)
        assert manager.restore({"x": x, "mine": mine}) == 4
        assert np.all(x == 4) and mine.obj == comm.rank * 10
    finally:
        for s, h in old.items():
            signal.signal(s, h)


def test_tf_train_checkpoint_round_trip(comm, ckdir):
    os.environ.setdefault("KERAS_BACKEND", "tensorflow")
    import keras
    import tensorflow as tf

    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3), keras.layers.Dense(1)])
    opt = keras.optimizers.SGD(1e-2, momentum=0.9)
    model.compile(optimizer=opt, loss="mse")
    x, y = np.random.default_rng(0).normal(size=(16, 4)), np.ones((16, 1))
    model.fit(x, y, epochs=2, batch_size=8, verbose=0)
    epoch = tf.Variable(2, dtype=tf.int64)
    ckpt = tf.train.Checkpoint(model=model, optimizer=opt, epoch=epoch)
    everything = lambda: [v.numpy().copy() for v in model.variables + opt.variables] + [epoch.numpy()]  # noqa: E731
    expect = everything()
    manager = CheckpointManager(ckdir)
    manager.save(2, {"ckpt": ckpt})
    model.fit(x, y, epochs=1, batch_size=8, verbose=0)
    epoch.assign(3)
    manager.wait()
    assert not all(np.array_equal(a, b) for a, b in zip(everything(), expect))
    assert manager.restore({"ckpt": ckpt}) == 2
    assert all(np.array_equal(a, b) for a, b in zip(everything(), expect))
