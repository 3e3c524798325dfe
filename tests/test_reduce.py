"""The pure reducers (triage/reduce.py): set reduction (ProbDD, ddmin), k-of-m acceptance and
integer shrinking, on plain sets and numbers."""

import random

import pytest

from kvfuzz.triage.reduce import Acceptance, accepts, ddmin, default_acceptance, probdd, shrink_int


class Counting:
    def __init__(self, pred):
        self.pred, self.calls = pred, 0

    def __call__(self, subset):
        self.calls += 1
        return self.pred(set(subset))


@pytest.mark.parametrize("reduce", [probdd, ddmin])
@pytest.mark.parametrize("needed", [set(), {7}, {3, 11}, {0, 9, 19}])
def test_reduction_finds_exactly_the_needed_items(reduce, needed):
    keeps = Counting(lambda s: needed <= s)
    assert sorted(reduce(list(range(20)), keeps)) == sorted(needed)
    assert keeps.calls <= 120  # far fewer than the 2^20 subsets


@pytest.mark.parametrize("reduce", [probdd, ddmin])
def test_reduction_result_is_one_minimal_for_alternatives(reduce):
    # Reproduces with {2, 5} or with {8} alone: the result must be one of them, 1-minimal.
    keeps = lambda s: {2, 5} <= set(s) or 8 in set(s)  # noqa: E731
    out = set(reduce(list(range(10)), keeps))
    assert out in ({2, 5}, {8})
    assert all(not keeps(out - {x}) for x in out)


def test_accepts_stops_as_soon_as_decided():
    def seq(outcomes):
        it = iter(outcomes)
        return lambda: next(it)

    assert accepts(seq([True]), Acceptance(1, 1)) == (True, 1)
    assert accepts(seq([False]), Acceptance(1, 1)) == (False, 1)
    assert accepts(seq([True, True]), Acceptance(4, 2)) == (True, 2)
    assert accepts(seq([False, True, False, True]), Acceptance(4, 2)) == (True, 4)
    # After 3 misses, 1 replay left cannot reach 2 hits: stop.
    assert accepts(seq([False, False, False]), Acceptance(4, 2)) == (False, 3)
    assert accepts(seq([True, False, False, False]), Acceptance(4, 2)) == (False, 4)
    with pytest.raises(ValueError):
        Acceptance(2, 3)


def test_k_of_m_acceptance_rate_matches_the_binomial():
    # A candidate that reproduces with probability p is kept with P(Binomial(k, p) >= m).
    rng = random.Random(0)
    acc = Acceptance(4, 2)
    for p, expected in [(0.5, 11 / 16), (0.9, 0.9963), (0.1, 0.0523)]:
        kept = sum(accepts(lambda: rng.random() < p, acc)[0] for _ in range(4000)) / 4000
        assert abs(kept - expected) < 0.03, (p, kept)
    assert Acceptance(4, 2).needed(3) == 2 and Acceptance(1, 1).needed(3) == 3


def test_default_acceptance_by_engine():
    assert default_acceptance(step_exact=True) == Acceptance(1, 1)
    d = default_acceptance(step_exact=False)
    assert d.repeats > 1 and 1 < d.min_hits < d.repeats


def test_shrink_int():
    calls = []

    def keeps(v, threshold=37):
        calls.append(v)
        return v >= threshold

    assert shrink_int(100, 1, keeps, max_tries=10) == 37
    assert calls[0] == 1 and all(c >= 1 for c in calls)
    calls.clear()
    got = shrink_int(100, 1, keeps)  # default: a few tries, close to the smallest
    assert 37 <= got <= 45 and len(calls) <= 8
    assert shrink_int(100, 1, lambda v: True) == 1
    assert shrink_int(5, 5, lambda v: pytest.fail("nothing to shrink")) == 5
    assert shrink_int(100, 1, lambda v: v == 100) == 100
