"""DistributedSampler: disjoint, complete, equal shares; reshuffles per epoch; resumes mid-epoch at any world size."""
import pytest

from hpctrain.data import DistributedSampler


def shares(n, N, **kw):
    return [DistributedSampler(n, num_replicas=N, rank=r, **kw) for r in range(N)]


@pytest.mark.parametrize("N", [1, 2, 3, 4])
@pytest.mark.parametrize("n", [0, 1, 7, 12, 13])
@pytest.mark.parametrize("drop_last", [False, True])
def test_shares_cover_the_data(n, N, drop_last):
    if drop_last and n < N:
        with pytest.raises(ValueError, match="leaves no data"):
            DistributedSampler(n, num_replicas=N, rank=0, drop_last=True)
        return
    samplers = shares(n, N, seed=3, drop_last=drop_last)
    got = [s.indices() for s in samplers]
    assert all(len(g) == len(samplers[0]) == len(got[0]) for g in got)
    flat = [i for g in got for i in g]
    if drop_last:
        assert len(flat) == n - n % N and len(set(flat)) == len(flat)
    else:
        assert set(flat) == set(range(n)) and len(flat) == -(-n // N) * N
    assert [list(s) for s in samplers] == got


def test_epochs_reshuffle_the_same_way_everywhere():
    a, b = DistributedSampler(50, num_replicas=2, rank=0, seed=1), DistributedSampler(50, num_replicas=2, rank=0, seed=1)
    first = a.indices()
    a.set_epoch(1)
    b.set_epoch(1)
    assert a.indices() == b.indices() != first
    assert DistributedSampler(10, shuffle=False, num_replicas=2, rank=1).indices() == [1, 3, 5, 7, 9]


@pytest.mark.parametrize("N_after", [1, 2, 3, 4])
def test_resume_mid_epoch_at_any_world_size(N_after):
    n, N = 23, 2
    before = shares(n, N, seed=9)
    for s in before:
        s.set_epoch(4)
    iters = [iter(s) for s in before]
    seen = [[next(it) for _ in range(5)] for it in iters]
    state = before[0].state_dict()
    assert state == {"epoch": 4, "seed": 9, "num_samples": n, "consumed": 10}
    after = shares(n, N_after, seed=9)
    for s in after:
        s.load_state_dict(state)
    rest = [i for s in after for i in s.indices()]
    done = [i for g in seen for i in g]
    assert set(done) | set(rest) == set(range(n))        # nothing lost
    assert len(rest) == -(-(n - 10) // N_after) * N_after  # the rest, padded for the new world
    if N_after == N:
        fresh = shares(n, N, seed=9)
        for s in fresh:
            s.set_epoch(4)
        full = [s.indices() for s in fresh]
        assert [seen[r] + after[r].indices() for r in range(N)] == full   # exactly the uninterrupted order


def test_bad_state_is_refused():
    s = DistributedSampler(10, num_replicas=1, rank=0, seed=1)
    with pytest.raises(ValueError, match="num_samples=11"):
        s.load_state_dict({"epoch": 0, "seed": 1, "num_samples": 11, "consumed": 0})
    with pytest.raises(ValueError, match="rank"):
        DistributedSampler(10, num_replicas=2, rank=2)

def test_advance_counts_trained_samples_not_prefetched_ones():
    s = DistributedSampler(40, num_replicas=2, rank=0, seed=2)
    it = iter(s)
    first = [next(it) for _ in range(12)]          # a loader prefetched 12 indices ...
    s.advance(4)                                    # ... but only 4 were trained on
    state = s.state_dict()
    assert state["consumed"] == 8
    resumed = DistributedSampler(40, num_replicas=2, rank=0, seed=2)
    resumed.load_state_dict(state)
    assert resumed.indices()[:8] == first[4:12]
    with pytest.raises(ValueError, match=">= 0"):
        s.advance(-1)
    s.set_epoch(1)
    assert s.state_dict()["consumed"] == 0


def test_a_data_set_is_taken_as_torch_takes_it():
    """DistributedSampler(dataset) as with torch's sampler: the data set's length is what counts."""
    data = list(range(23))
    assert DistributedSampler(data, num_replicas=3, rank=2, seed=4).indices() == \
        DistributedSampler(23, num_replicas=3, rank=2, seed=4).indices()
    with pytest.raises(TypeError, match="data set"):
        DistributedSampler(object(), num_replicas=1, rank=0)
