"""Assemble a Finding from a recording and its verdicts."""

from __future__ import annotations

import datetime as _dt

from kvfuzz.traces import Divergence, Environment, Finding, History, RequestRecord, Trace

from .check import Thresholds, divergent


def make_finding(trace: Trace, histories: list[History], references: dict[str, RequestRecord],
                 verdicts: list[Divergence], environment: Environment,
                 arms: dict[str, list[str]] | None = None, thresholds: Thresholds | None = None) -> Finding:
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
    # The threshold the verdicts were judged with, so a report can say which side a margin fell.
    f.notes["oracle"] = {"near_tie": (thresholds or Thresholds()).near_tie_for(trace.engine.dtype),
                         "dtype": trace.engine.dtype}
    f.id = f.compute_id()
    return f
