"""Per-step metrics (hpctrain.observe) on every rank: straggler naming, sinks, report, the torch and Keras helpers."""
import json
import logging
import os
import tempfile
import time

import numpy as np
import pytest

from hpctrain.observe import StepMetrics

SLEEP = 0.06


def shared_dir(comm):
    """A folder every rank of this (one-machine) launch names alike: rank 0's fresh temporary folder."""
    path = tempfile.mkdtemp(prefix="observe-") if comm.rank == 0 else None
    return comm.broadcast_object(path, root=0)


def straggling_run(comm, log_dir, steps=8, interval=4):
    """Steps of a little work and one all-reduce; the last rank (of 2 or more) sleeps SLEEP in each step first."""
    metrics = StepMetrics(comm, log_dir, samples_per_step=16, interval=interval, straggler_steps=3)
    x = np.arange(4096, dtype=np.float32)
    for _ in range(steps):
        if comm.size > 1 and comm.rank == comm.size - 1:
            time.sleep(SLEEP)
        y = comm.allreduce(x * 2)
        assert y[1] == 2 * comm.size
        metrics.mark()
    metrics.close()
    return metrics


@pytest.mark.timeout(60)
def test_a_rank_that_sleeps_is_named_a_straggler_on_every_rank(comm, caplog):
    with caplog.at_level(logging.WARNING, logger="hpctrain.observe"):
        m = straggling_run(comm, None)
    assert m.step == 8 and m.latest["step"] == 8
    slow = comm.size - 1
    if comm.size == 1:
        assert m.stragglers == [] and not caplog.records
        return
    # The sleeping rank's own work holds its sleep; the others wait for it in the all-reduce, blocked.
    if comm.rank == slow:
        assert m.latest["busy_s"] >= SLEEP * 0.9, m.latest
    else:
        assert m.latest["exposed_comm_s"] >= SLEEP * 0.5 and m.latest["busy_s"] < SLEEP / 2, m.latest
    assert [e["rank"] for e in m.stragglers] == [slow], m.stragglers
    assert m.stragglers[0]["step_last"] - m.stragglers[0]["step_first"] == 2
    assert m.stragglers[0]["ratio"] >= 1.5
    warned = [r.getMessage() for r in caplog.records]
    if comm.rank == 0:
        assert len(warned) == 1 and f"rank {slow} is a straggler" in warned[0], warned
    else:
        assert warned == []


@pytest.mark.timeout(60)
def test_rank_0_writes_csv_jsonl_and_tensorboard_and_the_report_draws_them(comm):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from hpctrain.observe.report import read_run, write_report

    folder = shared_dir(comm)
    m = straggling_run(comm, folder, steps=7, interval=3)
    comm.barrier()
    if comm.rank != 0:
        assert list(m.rows) == []
        return
    run = read_run(folder)
    assert [int(r["step"]) for r in run["steps"]] == list(range(1, 8))
    assert [r["step"] for r in m.rows] == list(range(1, 8))
    for row, mine in zip(run["steps"], m.rows):
        assert row["samples"] == 16 * comm.size
        assert row["step_s_max"] >= row["step_s"] > 0
        assert row["bytes_per_rank"] == 4096 * 4               # one float32 all-reduce of 4096 per step
        assert row["slowest_rank"] == mine["slowest_rank"]
        if comm.size > 1:
            assert row["slowest_rank"] == comm.size - 1 and row["busy_spread"] >= 1.5
    with open(os.path.join(folder, "steps.jsonl")) as f:
        lines = [json.loads(line) for line in f]
    assert [r["step"] for r in lines] == list(range(1, 8))
    # windows of 3, 3 and the last 1 step: one row per rank each; a resource sample (at most one a second)
    # in every rank's first window, and in a later one only where a second has passed (no repeated samples)
    assert len(run["ranks"]) == 3 * comm.size
    assert sorted({r["rank"] for r in run["ranks"]}) == list(range(comm.size))
    sampled = [r for r in run["ranks"] if r["rss_bytes"] is not None]
    assert {r["rank"] for r in sampled if r["step_first"] == 1} == set(range(comm.size)), run["ranks"]
    assert all(r["rss_bytes"] > 10 * 2**20 and r["cpu_percent"] >= 0 for r in sampled)
    assert len(run["stragglers"]) == (1 if comm.size > 1 else 0)
    acc = EventAccumulator(os.path.join(folder, "tensorboard"))
    acc.Reload()
    events = acc.Scalars("steps/step_s")
    assert [e.step for e in events] == list(range(1, 8))
    np.testing.assert_allclose([e.value for e in events], [r["step_s"] for r in lines], rtol=1e-6)
    assert len(acc.Scalars(f"ranks/busy_s_mean/rank{comm.size - 1}")) == 3
    written = write_report(folder)
    for name in ("step_time.png", "throughput.png", "communication.png", "rank_spread.png", "resources.png"):
        path = os.path.join(folder, name)
        assert path in written
        import matplotlib.image
        assert matplotlib.image.imread(path).shape[0] > 100
    summary = open(os.path.join(folder, "summary.md")).read()
    assert "| 7 |" in summary
    if comm.size > 1:
        assert f"- rank {comm.size - 1}:" in summary


@pytest.mark.timeout(60)
def test_ranks_that_mark_different_numbers_of_steps_get_an_error_naming_them_not_a_hang(comm):
    if comm.size == 1:
        pytest.skip("needs two ranks to disagree")
    m = StepMetrics(comm, None, interval=2, resources=False)
    m.mark()
    with pytest.raises(RuntimeError, match="marked different steps") as err:
        if comm.rank == 0:
            m.mark()            # its window is full: it gathers steps 1-2
        else:
            m.close()           # the others stop after step 1: they gather a window of 1
    others = ", ".join(f"rank {r}: steps 1-1" for r in range(1, comm.size))
    assert f"(rank 0: steps 1-2, {others})" in str(err.value), str(err.value)
    m.close()


@pytest.mark.timeout(120)
def test_torch_track_steps_counts_each_optimizer_step_once_with_bytes_and_the_compression_ratio(comm):
    import torch

    import hpctrain.compression as hc
    import hpctrain.torch as ht

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64, bias=False), torch.nn.Linear(64, 8, bias=False))
    numel = sum(p.numel() for p in model.parameters())
    opt = ht.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01),
                                  named_parameters=model.named_parameters(), compression=hc.get("fp16"),
                                  compression_policy=hc.Policy(min_numel=0))
    # what a copy or an unpickling does: torch then wraps the class's step to run the step hooks
    opt.__setstate__(opt.__dict__.copy())
    mine = []
    opt.register_step_post_hook(lambda *args: mine.append(1))
    metrics = ht.track_steps(opt, samples_per_step=8, interval=3)
    for _ in range(5):
        opt.zero_grad()
        model(torch.randn(8, 64)).sum().backward()
        opt.step()
    metrics.close()
    assert metrics.step == 5 and len(mine) == 5      # one step, one mark and one run of the user's hook
    opt.step()                                   # the hook is gone after close()
    assert metrics.step == 5
    # fp16 sends 2 of float32's 4 bytes for every parameter the policy compresses (here all of them)
    assert metrics.latest["compression_ratio"] == pytest.approx(2.0)
    if comm.size > 1:
        assert metrics.latest["bytes"] >= numel * 2
    assert metrics.postfix()["samples/s"]


@pytest.mark.timeout(180)
def test_keras_step_metrics_callback_marks_every_batch_and_logs_the_comm_share(comm):
    import keras

    import hpctrain.tensorflow.keras as hk

    import hpctrain.compression as hc

    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(4)])
    model.compile(optimizer=hk.DistributedOptimizer(keras.optimizers.SGD(0.01), compression="fp16",
                                                    compression_policy=hc.Policy(min_numel=0)), loss="mse")
    seen = []

    class Logs(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            seen.append(dict(logs))

    x, y = np.random.default_rng(0).normal(size=(40, 8)), np.zeros((40, 4))
    cb = hk.StepMetricsCallback(samples_per_step=10, interval=2)
    model.fit(x, y, batch_size=10, epochs=2, verbose=0, callbacks=[cb, Logs()])
    assert cb.metrics.step == 8
    assert len(seen) == 8 and all(0 <= s["comm_share"] <= 1 and s["samples_per_s"] > 0 for s in seen)
    # fp16 sends 2 of float32's 4 bytes (read from the optimizer's compression_stats)
    assert cb.metrics.latest["compression_ratio"] == pytest.approx(2.0)
    if comm.size > 1:
        assert cb.metrics.latest["bytes"] >= (8 * 4 + 4) * 2    # the gradients all-reduced every step


def merged_trace(comm, folder):
    """Write the ranks' timelines with write_trace and return rank 0's parsed file (None on other ranks)."""
    from hpctrain.observe import write_trace

    comm.timeline.stop()
    path = os.path.join(folder, "trace.json")
    written = write_trace(comm, path)
    comm.timeline.clear()
    if comm.rank != 0:
        assert written is None
        return None
    assert written == path
    with open(path) as f:
        return json.load(f)


def spans(trace, rank, cat=None):
    return [e for e in trace["traceEvents"] if e["ph"] == "X" and e["pid"] == rank and (cat is None or e["cat"] == cat)]


@pytest.mark.timeout(60)
def test_timeline_has_every_ranks_collectives_with_their_phases_and_fusion_buffers(comm):
    folder = shared_dir(comm)
    tl = comm.timeline
    tl.clear()
    tl.start()
    x = np.arange(4096, dtype=np.float32)
    comm.allreduce(x)
    comm.allreduce_async(x).wait()
    comm.grouped_allreduce([x[:100], x[:300].astype(np.float64), x[:50]])
    tl.stop()
    comm.allreduce(x)                    # not recorded: the timeline is off
    tl.start()
    comm.broadcast(x, root=comm.size - 1)
    comm.allreduce(x, algorithm="ring")
    trace = merged_trace(comm, folder)
    if trace is None:
        return
    assert {e["pid"] for e in trace["traceEvents"]} == set(range(comm.size))
    names = {e["pid"]: e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "process_name"}
    assert names == {r: f"rank {r}" for r in range(comm.size)}
    per_rank = {r: spans(trace, r, "collective") for r in range(comm.size)}
    for r, calls in per_rank.items():
        assert [c["name"] for c in calls] == ["allreduce", "allreduce", "grouped_allreduce", "broadcast",
                                              "allreduce"], calls
        assert [c["args"]["bytes"] for c in calls] == [16384, 16384, (100 + 300 + 50) * 8, 16384, 16384]
        assert calls[0]["args"]["dtype"] == "float32" and calls[0]["args"]["algorithm"]
        assert calls[-1]["args"]["algorithm"] == "ring"
        phases = spans(trace, r, "collective phase")
        for c in calls:
            inside = [p for p in phases if p.get("args", {}).get("seq") == c["args"]["seq"] and p["name"] != "queued"]
            assert [p["name"] for p in inside] == ["waiting for peers", "transfer and reduce"], inside
            for p in inside:
                assert c["ts"] - 1 <= p["ts"] and p["ts"] + p["dur"] <= c["ts"] + c["dur"] + 1
        # the ring's own phases, inside its transfer (none on one rank: nothing to send)
        ring = [p for p in phases if p["name"].startswith("ring ")]
        assert [p["name"] for p in ring] == ([] if comm.size == 1 else
                                             ["ring reduce-scatter (transfer, reduce)", "ring all-gather (transfer)"])
        for p in ring:
            assert calls[-1]["ts"] - 1 <= p["ts"] and p["ts"] + p["dur"] <= calls[-1]["ts"] + calls[-1]["dur"] + 1
        fused = spans(trace, r, "fusion")
        assert sum(f["args"]["tensors"] for f in fused) == 3 and {f["args"]["dtype"] for f in fused} == \
            {"float32", "float64"}
        tids = {e["tid"] for e in trace["traceEvents"] if e["name"] == "thread_name" and e["pid"] == r}
        assert {e["tid"] for e in spans(trace, r)} <= tids
    # Clocks aligned: no rank's wait for its peers ends before another rank has started that collective.
    for i in range(5):
        starts = [per_rank[r][i]["ts"] for r in range(comm.size)]
        for r in range(comm.size):
            seq = per_rank[r][i]["args"]["seq"]
            wait = [p for p in spans(trace, r, "collective phase") if p.get("args", {}).get("seq") == seq
                    and p["name"] == "waiting for peers"][0]
            assert wait["ts"] + wait["dur"] >= max(starts) - 5000, (i, r, wait, starts)   # 5 ms: barrier spread


@pytest.mark.timeout(60)
def test_timeline_splits_the_shared_memory_allreduce_into_copies_fences_and_its_reduction(comm):
    from hpctrain.comm.backends.mpi.direct import DIRECT_MIN_BYTES_OVERSUBSCRIBED

    folder = shared_dir(comm)
    small = np.arange(1 << 18, dtype=np.float32) % 7 + comm.rank          # 1 MiB: through the arena
    large = np.ones(DIRECT_MIN_BYTES_OVERSUBSCRIBED // 4, dtype=np.float32) * (comm.rank + 1)
    shared = comm.shared_empty(small.size, np.float32)      # reduced where it lies, without the arena
    shared[...] = small
    comm.timeline.clear()
    comm.timeline.start()
    got_small = comm.allreduce(small, op="sum", algorithm="shm")
    got_large = comm.allreduce(large, op="sum", algorithm="shm")
    comm.allreduce(shared, op="sum", algorithm="shm", inplace=True)
    n = comm.size
    np.testing.assert_array_equal(got_small, sum(np.arange(1 << 18, dtype=np.float32) % 7 + r for r in range(n)))
    assert (got_large == n * (n + 1) / 2).all()
    np.testing.assert_array_equal(shared, got_small)
    trace = merged_trace(comm, folder)
    if trace is None:
        return
    arena = ["shm copy in", "shm fence (waiting for peers)", "shm reduce (reading the peers' memory)",
             "shm fence (waiting for peers)", "shm copy out"]
    direct = ["direct address exchange (waiting for peers)", "direct reduce (copies from and to the peers' memory)",
              "direct barrier (waiting for peers)"]
    for r in range(n):
        calls = spans(trace, r, "collective")
        assert [(c["name"], c["args"]["algorithm"]) for c in calls] == [("allreduce", "shm")] * 3, calls
        phases = [p for p in spans(trace, r, "collective phase") if p["name"].startswith(("shm ", "direct "))]
        inside = [[p["name"] for p in sorted(phases, key=lambda p: p["ts"])
                   if c["ts"] - 1 <= p["ts"] and p["ts"] + p["dur"] <= c["ts"] + c["dur"] + 1] for c in calls]
        if n == 1:              # one rank: nothing to share, no phases
            assert inside == [[], [], []], inside
            continue
        assert inside[0] == arena, inside[0]
        # the direct copies where this node allows cross-memory attach, else the arena
        assert inside[1] in (arena, direct), inside[1]
        assert inside[2] == ["shm fence (waiting for peers)", "shm reduce (reading the peers' memory)",
                             "shm copy to the peers", "shm fence (waiting for peers)"], inside[2]
        assert len(phases) == sum(len(i) for i in inside)


@pytest.mark.timeout(120)
def test_timeline_marks_forward_backward_step_compression_and_checkpoint_saves_of_torch(comm):
    import torch

    import hpctrain.compression as hc
    import hpctrain.torch as ht
    from hpctrain.checkpoint import CheckpointManager

    folder = shared_dir(comm)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8))
    opt = ht.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01),
                                  named_parameters=model.named_parameters(), compression=hc.get("fp16"),
                                  compression_policy=hc.Policy(min_numel=0))
    hooks = ht.trace_forward(model)
    manager = CheckpointManager(os.path.join(folder, "ckpt"))
    comm.timeline.start()
    for step in (1, 2):
        opt.zero_grad()
        model(torch.randn(8, 64)).sum().backward()
        opt.step()
    manager.save(2, {"model": model})
    manager.close()
    for h in hooks:
        h.remove()
    trace = merged_trace(comm, folder)
    if trace is None:
        return
    for r in range(comm.size):
        got = spans(trace, r)
        count = {name: sum(e["name"] == name for e in got) for name in
                 ("forward", "backward", "synchronize gradients", "optimizer step", "compress", "decompress",
                  "checkpoint save")}
        assert count == {"forward": 2, "backward": 2, "synchronize gradients": 2, "optimizer step": 2,
                         "compress": 2, "decompress": 2, "checkpoint save": 1}, count
        order = [e["name"] for e in sorted(got, key=lambda e: e["ts"]) if e["cat"] == "torch"]
        assert order == ["forward", "backward", "synchronize gradients", "optimizer step"] * 2, order


@pytest.mark.timeout(120)
def test_keras_timeline_callback_splits_every_train_step_into_its_phases(comm):
    import keras

    import hpctrain.tensorflow.keras as hk

    def trained(callbacks):
        keras.utils.set_random_seed(0)
        model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(4)])
        model.compile(optimizer=hk.DistributedOptimizer(keras.optimizers.SGD(0.01)), loss="mse")
        x = np.random.default_rng(comm.rank).normal(size=(30, 8))
        y = np.zeros((30, 4))
        model.fit(x, y, batch_size=10, epochs=1, verbose=0)      # its step traced without the marks
        comm.timeline.clear()
        comm.timeline.start()
        model.fit(x, y, batch_size=10, epochs=2, verbose=0, callbacks=callbacks)
        comm.timeline.stop()
        events = comm.timeline.trace_events(comm.rank, 0.0, 0.0)
        comm.timeline.clear()
        assert model.optimizer._hpctrain_marks is None
        model.fit(x, y, batch_size=10, epochs=1, verbose=0)      # the marks stay in the graph, inert
        return model, events

    plain, plain_events = trained([hk.TimelineCallback()])              # one span a batch, no marks
    assert [e["name"] for e in plain_events if e.get("cat") == "keras"] == ["train step"] * 6
    model, events = trained([hk.TimelineCallback(split_steps=True)])
    reference, _ = trained([])
    for got, want in zip(model.get_weights(), reference.get_weights()):     # the marks change nothing
        np.testing.assert_array_equal(got, want)
    keras_spans = [e for e in events if e.get("cat") == "keras"]
    steps = [e for e in keras_spans if e["name"] == "train step"]
    assert [e["args"]["batch"] for e in steps] == [0, 1, 2] * 2
    phases = ["forward", "backward", "synchronize gradients", "optimizer step"]
    for step in steps:
        inside = sorted((e for e in keras_spans if e["name"] != "train step" and step["ts"] <= e["ts"] and
                         e["ts"] + e["dur"] <= step["ts"] + step["dur"] + 0.01), key=lambda e: e["ts"])
        assert [e["name"] for e in inside] == phases, inside
        ends = [step["ts"]] + [e["ts"] + e["dur"] for e in inside]          # one after the other, no gap
        assert [e["ts"] for e in inside] == pytest.approx(ends[:-1], abs=0.01)
        assert ends[-1] == pytest.approx(step["ts"] + step["dur"], abs=0.01)
    assert len([e for e in keras_spans if e["name"] in phases]) == 4 * len(steps)
    reductions = [e for e in events if e.get("cat") == "collective" and e["name"] == "grouped_allreduce"]
    syncs = [e for e in keras_spans if e["name"] == "synchronize gradients"]
    if comm.size > 1:   # the gradient all-reduce of each step lies inside that step's synchronize span
        assert len(reductions) == 6
        for sync, red in zip(syncs, reductions):
            assert sync["ts"] <= red["ts"] and red["ts"] + red["dur"] <= sync["ts"] + sync["dur"] + 0.01
