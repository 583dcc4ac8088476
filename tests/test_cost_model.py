"""The all-reduce cost model against a step-by-step walk of each algorithm's messages, and auto's use of it.

The walk (written here, independently of hpctrain.collectives.cost_model)
plays every step of the ring, the hierarchical form and recursive doubling
on ``n`` nodes of ``k`` ranks, counting per step the bytes that cross each
node's link; the model's latency coefficient must be the number of steps
that send over a link and its bandwidth coefficient the bytes of the
busiest link, summed over steps.
"""
import math
from dataclasses import replace

import numpy as np
import pytest

from hpctrain.collectives import registry
from hpctrain.collectives.cost_model import LinkModel, hierarchical_cost, predict, terms
from hpctrain.collectives.doubling import DOUBLING_MAX_BYTES
from hpctrain.comm.life.runtime import Config

LAYOUTS = [(2, 1), (2, 2), (3, 2), (4, 4), (8, 2), (5, 3)]
S = 3 * 2 ** 20


def node(rank, k):
    return rank // k


def busiest(sends, k, n):
    """Bytes on the busiest link, one direction, for one step: ``sends`` is [(src, dst, bytes)]."""
    out, into = [0.0] * n, [0.0] * n
    for src, dst, size in sends:
        if node(src, k) != node(dst, k):
            out[node(src, k)] += size
            into[node(dst, k)] += size
    return max(out + into)


def walk_ring(n, k, s):
    p = n * k
    steps = [[(r, (r + 1) % p, s / p) for r in range(p)] for _ in range(2 * (p - 1))]
    return crossing(steps, k, n)


def crossing(steps, k, n):
    """(steps that send over a link, bytes of the busiest link summed over the steps)."""
    loads = [busiest(step, k, n) for step in steps]
    return sum(1 for x in loads if x > 0), sum(loads)


def walk_hierarchical(n, k, s):
    # k rings (one per segment of s / k bytes) over the n nodes, all stepping together; rank j of node i
    # is rank i * k + j.
    steps = [[(i * k + j, ((i + 1) % n) * k + j, s / k / n) for i in range(n) for j in range(k)]
             for _ in range(2 * (n - 1))]
    return crossing(steps, k, n)


def walk_tree(n, k, s):
    p = n * k
    rounds = [[(r, r ^ (1 << b), s) for r in range(p) if r ^ (1 << b) < p] for b in range(math.ceil(math.log2(p)))]
    return crossing(rounds, k, n)


@pytest.mark.parametrize("n, k", LAYOUTS)
@pytest.mark.parametrize("algorithm, walk", [("ring", walk_ring), ("hierarchical", walk_hierarchical),
                                             ("tree", walk_tree)])
def test_latency_and_link_terms_match_a_walk_of_the_messages(algorithm, walk, n, k):
    if algorithm == "tree" and (n & (n - 1) or k & (k - 1)):
        pytest.skip("recursive doubling as modelled needs powers of two")
    steps, link_bytes = walk(n, k, S)
    a, b, _ = terms(algorithm, S, n, k)
    assert a == steps
    assert b == pytest.approx(link_bytes, rel=1e-12)


def test_predict_adds_the_three_terms():
    m = LinkModel(alpha=2e-5, beta=8e-10, gamma=1e-10)
    a, b, c = terms("hierarchical", S, 3, 2)
    assert predict(m, "hierarchical", S, 3, 2) == pytest.approx(a * 2e-5 + b * 8e-10 + c * 1e-10)


def where(config, nodes=2, per_node=2, reforms=False):
    return registry.Where(backend="mpi", size=nodes * per_node, num_nodes=nodes, shared_memory="", config=config,
                          reforms=reforms)


def test_auto_across_nodes_follows_the_model_unless_a_crossover_is_set():
    slow = replace(Config(), link_gbit=1.0, link_latency_us=50.0, memory_gbps=10.0)
    for nbytes in (1024, 64 * 1024, 2 ** 20, 64 * 2 ** 20):
        model = LinkModel.from_config(slow)
        expected = "hierarchical" if hierarchical_cost(model, nbytes, 2, 2) < 1.0 else "native"
        assert registry.choose("allreduce", where(slow), nbytes).name == expected
    # On slow links the hierarchical form sends a third less per link: the model takes it for large
    # buffers, and the library call (one message over the link, against two) for tiny ones.
    assert registry.choose("allreduce", where(slow), 64 * 2 ** 20).name == "hierarchical"
    assert registry.choose("allreduce", where(slow), 1024).name == "native"
    measured = replace(slow, hierarchical_min_bytes=2 ** 30)        # a crossover from `hpctrain tune`
    assert registry.choose("allreduce", where(measured), 64 * 2 ** 20).name == "native"
    one_node = replace(slow, hierarchical_min_bytes=0)
    assert registry.choose("allreduce", where(one_node, nodes=1), 64 * 2 ** 20).name != "hierarchical"


def test_a_world_that_re_forms_never_runs_the_library_all_reduce_across_nodes():
    # A rank killed inside Open MPI's han MPI_Allreduce across nodes leaves the survivors partial sums and no
    # error (tests/test_multinode.py shows the re-forming that replaces it); one node keeps the library call.
    slow = replace(Config(), link_gbit=1.0, link_latency_us=50.0, memory_gbps=10.0)
    model = LinkModel.from_config(slow)
    for nbytes in (8, 1024, 64 * 1024, 64 * 1024 + 8, 2 ** 20, 64 * 2 ** 20):
        plain = registry.choose("allreduce", where(slow), nbytes).name
        elastic = registry.choose("allreduce", where(slow, reforms=True), nbytes).name
        instead, cost = ("doubling", 0.9) if nbytes <= DOUBLING_MAX_BYTES else ("ring", 1.0)   # (the library's way)
        assert elastic == ("hierarchical" if hierarchical_cost(model, nbytes, 2, 2) < cost else instead), nbytes
        assert elastic == plain or (plain, elastic) == ("native", instead), nbytes
    assert registry.choose("allreduce", where(slow, nodes=1, reforms=True), 1024).name not in ("ring", "doubling")
    native = registry.lookup("allreduce", "native")
    why = native.refusal(where(slow, reforms=True), "the world")
    assert "not fault tolerant across nodes" in why and "use 'auto', 'ring' or 'hierarchical'" in why, why
    assert native.refusal(where(slow), "the world") == native.refusal(where(slow, nodes=1, reforms=True), "w") == ""


def test_small_one_node_allreduces_ride_the_check_only_while_the_node_moves_little(monkeypatch):
    """auto on one node: a small buffer is carried by the call check while every rank reading every payload
    (L * L * N bytes) stays under CARRIED_TRAFFIC_BYTES, else the library call; always when oversubscribed."""
    from hpctrain.collectives import shm

    monkeypatch.setattr(shm.os, "cpu_count", lambda: 16)
    cfg = Config()
    for ranks, nbytes in [(2, 4096), (16, 4096), (2, 65536), (8, 65536), (16, 65536), (4, 256 * 1024)]:
        expected = "shm" if ranks * ranks * nbytes <= shm.CARRIED_TRAFFIC_BYTES else "native"
        assert registry.choose("allreduce", where(cfg, nodes=1, per_node=ranks), nbytes).name == expected
    assert registry.choose("allreduce", where(cfg, nodes=1, per_node=16), 4096).name == "shm"
    assert registry.choose("allreduce", where(cfg, nodes=1, per_node=16), 65536).name == "native"
    assert registry.choose("allreduce", where(cfg, nodes=1, per_node=16), 64 << 20).name == "shm"
    monkeypatch.setattr(shm.os, "cpu_count", lambda: 2)     # 16 ranks on 2 cores
    assert registry.choose("allreduce", where(cfg, nodes=1, per_node=16), 65536).name == "shm"


def test_a_measured_choice_probes_both_ways_then_keeps_the_one_the_slowest_rank_found_faster():
    """auto's measured choice (HPCTRAIN_SHM_MIN_BYTES=0): the first call of a size class (powers of four)
    first probes hpctrain's way and the library's alternately on zeros, 2 * (TRIALS + 1) times (the first
    pair uncounted); the times are maxed over ranks, and the library is kept only where its median is under
    SWITCH_BELOW of hpctrain's; that call and every later one of the class run the winner only."""
    from hpctrain.comm.call.measured_choice import (LIBRARY, MEASURED_MAX_BYTES, OWN, SWITCH_BELOW, TRIALS,
                                               MeasuredChoice, size_class)

    assert [size_class(n) for n in (1, 4, 5, 16, 1 << 20, (1 << 20) + 1, 4 << 20)] == [0, 1, 2, 2, 10, 11, 11]
    now = [0.0]
    cost = {OWN: 2.0, LIBRARY: 1.0}          # seconds a probe of each way takes
    probed, ran = [], []
    like = ((3, 5), np.float32)

    def probe(scratch, name):
        assert scratch.shape == (3, 5) and scratch.dtype == np.float32 and not scratch.any()
        probed.append(name)
        now[0] += cost[name]

    def way(name):
        ran.append(name)
        return name

    other_rank = {}      # what a second rank measured, maxed in as the library all-reduce would

    def agree(times):
        return np.maximum(times, other_rank.get(len(times), np.zeros_like(times)))

    m = MeasuredChoice(agree, min_bytes=1000, clock=lambda: now[0])
    assert not m.applies(1000) and m.applies(1001)
    assert m.applies(MEASURED_MAX_BYTES) and not m.applies(MEASURED_MAX_BYTES + 1)    # (hpctrain's way above)
    assert m.run("allreduce", 5000, way, probe, like) == LIBRARY
    assert probed == [OWN, LIBRARY] * (TRIALS + 1) and ran == [LIBRARY]
    assert m.own_is_faster("allreduce", 5000) is False and m.own_is_faster("allreduce", 4097) is False
    probed.clear()
    assert m.run("allreduce", 4500, way, probe, like) == LIBRARY and probed == []
    # another collective is measured on its own; a library only a little faster leaves hpctrain's way
    cost.update({OWN: 1.0, LIBRARY: (1 + SWITCH_BELOW) / 2})
    assert m.run("allgather", 5000, way, probe, like) == OWN
    assert m.own_is_faster("allgather", 5000) is True and m.own_is_faster("reduce_scatter", 5000) is None
    # here hpctrain's way is faster, but the other rank found it slow there: the max over ranks decides
    cost.update({OWN: 1.0, LIBRARY: 3.0})
    other_rank[2 * TRIALS] = np.array([9.0] * TRIALS + [0.0] * TRIALS)
    assert m.run("allreduce", 1 << 20, way, probe, like) == LIBRARY
    assert m.own_is_faster("allreduce", 1 << 20) is False
