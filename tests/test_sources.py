"""The fresh / mutant source bandit (fuzzer/sources.py): pure logic, no engine."""

import json
import random

from kvfuzz.fuzzer.sources import SOURCES, SourceBandit


def _run(bandit: SourceBandit, yields: dict[str, int], n: int, rng: random.Random) -> list[str]:
    picks = []
    for _ in range(n):
        s = bandit.choose(rng)
        bandit.update(s, yields[s])
        picks.append(s)
    return picks


def test_the_bandit_moves_to_the_source_that_yields_novelty():
    for productive in SOURCES:
        other = next(s for s in SOURCES if s != productive)
        picks = _run(SourceBandit(), {productive: 4, other: 0}, 60, random.Random(1))
        assert picks[20:].count(productive) >= 32, picks


def test_the_bandit_forgets_a_source_that_stopped_paying_off():
    b, rng = SourceBandit(), random.Random(2)
    _run(b, {"fresh": 4, "mutant": 0}, 40, rng)
    later = _run(b, {"fresh": 0, "mutant": 4}, 60, rng)
    assert later[30:].count("mutant") >= 24, later


def test_neither_source_is_starved():
    picks = _run(SourceBandit(), {"fresh": 4, "mutant": 0}, 300, random.Random(3))
    assert picks.count("mutant") >= 5


def test_seed_replays_do_not_count_and_rewards_are_capped():
    b = SourceBandit()
    b.update("seed", 50)
    assert b.stats == {s: [0.0, 0.0] for s in SOURCES}
    b.update("fresh", 50)
    assert b.stats["fresh"] == [1.0, 1.0]  # 50 novel buckets count as one success, not 12.5
    b.update("mutant", 1)
    assert b.stats["fresh"] == [0.9, 0.9] and b.stats["mutant"] == [0.25, 1.0]


def test_the_state_round_trips_through_json_and_draws_the_same():
    b = SourceBandit()
    _run(b, {"fresh": 3, "mutant": 1}, 17, random.Random(4))
    copy = SourceBandit.from_json(json.loads(json.dumps(b.to_json())))
    assert copy.stats == b.stats
    assert [b.choose(random.Random(k)) for k in range(50)] == [copy.choose(random.Random(k)) for k in range(50)]
