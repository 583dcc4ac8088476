"""Pipeline schedules: order, memory bound and makespan, checked by simulating every stage together."""
import pytest

from hpctrain.parallel import bubble_fraction, schedule
from hpctrain.parallel.schedule import Action, gpipe, one_f_one_b


def simulate(name, p, m, f=1.0, b=1.0):
    """Run all stages' action lists with their message dependencies; return (makespan, peak in flight per stage).

    F(i) on stage s needs F(i) done on s-1; B(i) on s needs B(i) done on s+1
    and its own F(i).  A stage runs its actions strictly in list order.  A
    deadlocked schedule makes no progress and fails the test.
    """
    lists = [schedule(name, p, m, s) for s in range(p)]
    pos, clock, done = [0] * p, [0.0] * p, {}
    peak, held = [0] * p, [0] * p
    while any(pos[s] < len(lists[s]) for s in range(p)):
        progressed = False
        for s in range(p):
            if pos[s] == len(lists[s]):
                continue
            kind, i = lists[s][pos[s]]
            dep = ("F", i, s - 1) if kind == "F" and s > 0 else ("B", i, s + 1) if kind == "B" and s < p - 1 else None
            if dep is not None and dep not in done:
                continue
            start = max(clock[s], done.get(dep, 0.0))
            clock[s] = done[(kind, i, s)] = start + (f if kind == "F" else b)
            held[s] += 1 if kind == "F" else -1
            peak[s] = max(peak[s], held[s])
            pos[s] += 1
            progressed = True
        assert progressed, f"{name} deadlocks at p={p}, m={m}: positions {pos}"
    return max(clock), peak


@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
@pytest.mark.parametrize("p", [1, 2, 3, 4])
@pytest.mark.parametrize("m", [1, 2, 3, 4, 8, 16])
def test_every_micro_batch_once_forward_before_backward_and_the_ideal_makespan(name, p, m):
    for s in range(p):
        acts = schedule(name, p, m, s)
        assert sorted(a for a in acts if a.kind == "F") == [("F", i) for i in range(m)]
        assert sorted(a for a in acts if a.kind == "B") == [("B", i) for i in range(m)]
        assert all(acts.index(("F", i)) < acts.index(("B", i)) for i in range(m))
    makespan, peak = simulate(name, p, m)
    # equal unit stages: busy time 2m per stage, so 1 - 2m / makespan is the bubble (p-1)/(m+p-1)
    assert makespan == 2 * (m + p - 1)
    assert 1 - 2 * m / makespan == pytest.approx(bubble_fraction(p, m))
    if name == "gpipe":
        assert peak == [m] * p
    else:
        # 1F1B: at most p - s in flight, and one more on the first stage of several
        assert peak == [min(m, p - s + (s == 0 and p > 1)) for s in range(p)]


def test_bad_schedules_are_refused():
    with pytest.raises(ValueError, match="unknown pipeline schedule 'zigzag'"):
        schedule("zigzag", 2, 2, 0)
    with pytest.raises(ValueError, match="stage 2 outside 0..1"):
        schedule("gpipe", 2, 2, 2)
    with pytest.raises(ValueError, match="at least one"):
        schedule("1f1b", 2, 0, 0)


def test_one_micro_batch_makes_gpipe_and_1f1b_the_same_schedule():
    """(The rank files' pipeline tests run one micro-batch with GPipe only, on the strength of this.)"""
    for p in range(1, 6):
        for s in range(p):
            assert one_f_one_b(p, 1, s) == gpipe(p, 1, s) == [Action("F", 0), Action("B", 0)]
