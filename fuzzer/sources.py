"""Where the next trace comes from in a feedback campaign: a fresh random trace or a mutant of a
corpus entry — chosen by a discounted Thompson-sampling bandit on each source's novelty yield.

Why a bandit: with the v2 generator producing the reported shapes directly, a fresh trace is
sometimes the more productive source (in one measurement 8 of feedback's 12 first findings
came from its fixed 20 % of fresh traces), and sometimes mutants are (the preemption fault,
deep states). A fixed split loses whichever way the campaign is going.

Each source keeps a discounted [reward, pulls] pair; every update multiplies both sources'
pairs by ``discount`` first, so the posterior forgets old evidence (a source that stopped
paying off is abandoned within ~1/(1-discount) traces, and an unused one drifts back towards
the prior and gets tried again). The reward of a trace is its novel buckets, ``scale`` of
them counting as a full success. With probability ``explore`` the source is drawn uniformly,
so neither is ever starved. All draws come from the iteration's RNG and the pairs live in
``campaign.json``: a resumed campaign makes the same choices.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

SOURCES = ("fresh", "mutant")


@dataclass
class SourceBandit:
    stats: dict[str, list[float]] = field(default_factory=lambda: {s: [0.0, 0.0] for s in SOURCES})
    discount: float = 0.9
    explore: float = 0.1
    scale: float = 4.0

    def choose(self, rng: random.Random) -> str:
        if rng.random() < self.explore:
            return rng.choice(SOURCES)
        draws = {}
        for s in SOURCES:
            reward, pulls = self.stats.get(s, [0.0, 0.0])
            draws[s] = rng.betavariate(1.0 + reward, 1.0 + max(0.0, pulls - reward))
        return max(SOURCES, key=lambda s: draws[s])

    def update(self, source: str, novel: int) -> None:
        if source not in SOURCES:
            return  # seed replays say nothing about either source
        for s in SOURCES:
            pair = self.stats.setdefault(s, [0.0, 0.0])
            pair[0] *= self.discount
            pair[1] *= self.discount
        self.stats[source][0] += min(1.0, novel / self.scale)
        self.stats[source][1] += 1.0

    def to_json(self) -> dict[str, list[float]]:
        # Unrounded: JSON floats round-trip exactly, so a resumed campaign draws the same.
        return {s: list(self.stats.get(s, [0.0, 0.0])) for s in SOURCES}

    @classmethod
    def from_json(cls, data: dict[str, list[float]] | None) -> "SourceBandit":
        b = cls()
        for s, pair in (data or {}).items():
            if s in SOURCES and len(pair) == 2:
                b.stats[s] = [float(pair[0]), float(pair[1])]
        return b
