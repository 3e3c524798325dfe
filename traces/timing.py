"""Where a campaign's time goes: a ledger of exclusive seconds per phase, and the
typed breakdown ``campaign.json`` and the closing summary carry.

Spans nest: a reference computed inside triage counts as a reference, not as triage (each
span's time is its own minus its children's), so the phases add up to the time the ledger saw.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager

from pydantic import BaseModel, ConfigDict

# Phase names (the ledger's keys, the breakdown's ``<name>_s`` fields).
ENGINE_START = "engine_start"
FUZZED = "fuzzed_runs"
CONFIRM = "confirmation_runs"
REF_COMPUTED = "references_computed"
REF_STORE = "references_from_store"
REF_VERIFY = "references_verified"
# The fuzzed run waiting for a reference the reference engine computes (harness/refengine.py).
REF_WAIT = "references_waited"
SCORES = "scores"
TRIAGE = "triage"
GENERATION = "generation_feedback_files"
# The phases in which the fuzzed engine runs (``TimeBreakdown.busy_share``).
BUSY = (FUZZED, CONFIRM, REF_COMPUTED, REF_VERIFY, SCORES, TRIAGE)
PHASES = (ENGINE_START, FUZZED, CONFIRM, REF_COMPUTED, REF_STORE, REF_VERIFY, REF_WAIT, SCORES, TRIAGE, GENERATION)
SECONDS = tuple(f"{p}_s" for p in PHASES) + ("wall_s",)


class TimeBreakdown(BaseModel):
    """Seconds per phase (exclusive) and the reference store's counts, for one campaign."""

    model_config = ConfigDict(extra="forbid")

    engine_start_s: float = 0.0
    fuzzed_runs_s: float = 0.0
    confirmation_runs_s: float = 0.0
    references_computed_s: float = 0.0
    references_from_store_s: float = 0.0
    references_verified_s: float = 0.0
    # Waiting for the reference engine (``--reference-engines 1``): the references it computes
    # cost the fuzzed engine only this.
    references_waited_s: float = 0.0
    scores_s: float = 0.0
    triage_s: float = 0.0
    generation_feedback_files_s: float = 0.0
    # Wall time the ledger covered; ``other_s`` is what no phase claimed (calibration, start-up).
    wall_s: float = 0.0
    references_computed: int = 0
    references_from_store: int = 0
    # Hits served by an entry another worker (or an earlier campaign) wrote.
    references_shared: int = 0
    references_verified: int = 0
    # Of references_computed, those the reference engine computed.
    references_ahead: int = 0

    @property
    def other_s(self) -> float:
        return max(0.0, self.wall_s - sum(getattr(self, f"{p}_s") for p in PHASES))

    @property
    def busy_share(self) -> float:
        """The share of the wall the fuzzed engine spent running something: its fuzzed runs,
        confirmations, the references and scorings it computed itself, triage's replays (and
        the oracle beside them). Not its start, store reads, waiting for the reference engine,
        generation or files: a reference engine is worth what it moves from the first group
        to the second."""
        return self.share(*BUSY)

    @property
    def hit_rate(self) -> float:
        n = self.references_computed + self.references_from_store
        return self.references_from_store / n if n else 0.0

    def share(self, *phases: str) -> float:
        return sum(getattr(self, f"{p}_s") for p in phases) / self.wall_s if self.wall_s > 0 else 0.0

    def plus(self, other: "TimeBreakdown") -> "TimeBreakdown":
        a, b = self.model_dump(), other.model_dump()
        return TimeBreakdown(**{k: round(a[k] + b[k], 3) if isinstance(a[k], float) else a[k] + b[k] for k in a})

    def state_parts(self) -> tuple[dict[str, float], dict[str, float]]:
        """campaign.json's ``time`` (seconds only: the campaign page charts it) and
        ``reference_store`` (counts and the hit rate)."""
        d = self.model_dump()
        counts = {k: v for k, v in d.items() if k not in SECONDS}
        return {k: d[k] for k in SECONDS}, {**counts, "hit_rate": round(self.hit_rate, 3)}

    @classmethod
    def from_state(cls, time: dict[str, float], store: dict[str, float]) -> "TimeBreakdown":
        return cls(**time, **{k: int(v) for k, v in store.items() if k != "hit_rate"})

    def minus(self, other: "TimeBreakdown") -> "TimeBreakdown":
        """What happened between ``other`` (an earlier breakdown of the same ledger) and this one."""
        a, b = self.model_dump(), other.model_dump()
        return TimeBreakdown(**{k: round(a[k] - b[k], 3) if isinstance(a[k], float) else a[k] - b[k] for k in a})


class Ledger:
    """Exclusive seconds per phase, and counters. One per session (a Ray worker has its own)."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {p: 0.0 for p in PHASES}
        self.counts: dict[str, int] = {}
        self._stack: list[list[float]] = []  # per open span: [child seconds]
        self.started = time.monotonic()
        # Set by the campaign loop before each trace: the trace's first replay is its fuzzed run;
        # later replays of it (attribution, minimization) are triage's.
        self.fresh = False

    @contextmanager
    def span(self, phase: str) -> Iterator[None]:
        t0 = time.monotonic()
        self._stack.append([0.0])
        try:
            yield
        finally:
            (child,) = self._stack.pop()
            dt = time.monotonic() - t0
            self.seconds[phase] = self.seconds.get(phase, 0.0) + dt - child
            if self._stack:
                self._stack[-1][0] += dt

    def count(self, name: str, n: int = 1) -> None:
        self.counts[name] = self.counts.get(name, 0) + n

    def take_fresh(self) -> bool:
        """True once per trace: whether this replay is the trace's fuzzed run."""
        fresh, self.fresh = self.fresh, False
        return fresh

    def breakdown(self) -> TimeBreakdown:
        s, c = self.seconds, self.counts
        return TimeBreakdown(**{f"{p}_s": round(s.get(p, 0.0), 3) for p in PHASES},
                             wall_s=round(time.monotonic() - self.started, 3),
                             references_computed=c.get("references_computed", 0),
                             references_from_store=c.get("references_from_store", 0),
                             references_shared=c.get("references_shared", 0),
                             references_verified=c.get("references_verified", 0),
                             references_ahead=c.get("references_ahead", 0))


__all__ = ["PHASES", "Ledger", "TimeBreakdown"]
