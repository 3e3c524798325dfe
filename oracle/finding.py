"""Assemble a Finding from a recording and its verdicts."""

from __future__ import annotations

import datetime as _dt
from collections.abc import Sequence

from kvfuzz.traces import BoundsUsed, Divergence, Environment, Finding, History, RequestRecord, Scoring, Trace

from .check import divergent
from .noise import NoiseBounds, default_bounds


def make_finding(trace: Trace, histories: list[History], references: dict[str, RequestRecord],
                 verdicts: list[Divergence], environment: Environment,
                 arms: dict[str, list[str]] | None = None, bounds: NoiseBounds | None = None,
                 scores: Sequence[Scoring] = ()) -> Finding:
    f = Finding(
        trace=trace,
        environment=environment,
        references={k: v for k, v in references.items() if any(s.request_id == k for s in trace.sends)},
        runs=histories,
        divergences=divergent(verdicts),
        verdicts=verdicts,
        arms=arms or {h.arm: list(h.toggles) for h in histories},
        created=_dt.datetime.now(_dt.timezone.utc).replace(microsecond=0).isoformat(),
    )
    f.scores = list(scores)
    # The bounds the verdicts were judged with and where they came from (a calibration profile
    # or the dtype's defaults), so a report can say which side each piece of evidence fell.
    f.bounds = BoundsUsed.model_validate((bounds or default_bounds(trace.engine.dtype)).to_json())
    f.id = f.compute_id()
    return f
