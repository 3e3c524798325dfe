"""Judging control arms (pure): which arm a finding shows in most, whether a control's
verdicts reproduce the finding's signature, whether serialization held. The replays
themselves are triage's (triage/controls.py, where the arms are explained)."""

from __future__ import annotations

import math

from kvfuzz.traces import ControlResult, Divergence, Finding, History, Trace
from kvfuzz.traces.finding import DIVERGENT_CLASSES, SEVERITY

SERIALIZED = "serialized"
BATCH_INVARIANT = "batch-invariant"
# A 16-bit finding replayed in float32: the same schedule (step-exact, every request runs to
# max_tokens), 1000x less batch-order noise.
FLOAT32 = "float32"


def signature_of(finding: Finding) -> tuple[str, set[str]]:
    """(worst class, its victims): what a control must show to count as reproducing."""
    worst = finding.worst_class()
    return worst, {d.request_id for d in finding.divergences if d.class_ == worst}


def primary_arm(finding: Finding) -> tuple[str, list[str]]:
    """The arm in which the finding's signature shows most (ties: the first arm listed)."""
    worst, victims = signature_of(finding)
    scores: dict[str, float] = {}
    for d in finding.divergences:
        if d.class_ == worst and d.request_id in victims:
            scores[d.arm] = scores.get(d.arm, 0.0) + d.runs_diverged / max(1, d.runs)
    arm = max(scores, key=lambda a: (scores[a], -list(finding.arms).index(a) if a in finding.arms else 0),
              default=next(iter(finding.arms), "default"))
    toggles = finding.arms.get(arm)
    if toggles is None:
        toggles = next((h.toggles for h in finding.runs if h.arm == arm), list(finding.trace.engine.toggles))
    return arm, list(toggles)


def serialization_overlaps(h: History) -> list[tuple[str, str]]:
    """Pairs of requests that were live at the same time (empty: serialization held)."""
    spans: list[tuple[float, float, str]] = []
    use_steps = all(r.sent_step is not None for r in h.requests.values())
    for r in h.requests.values():
        start: float | None
        end: float | None
        if use_steps:
            start, end = r.sent_step, r.finished_step if r.finished_step is not None else r.cancel_step
        else:
            start, end = r.sent_ms, r.finished_ms if r.finished_ms is not None else r.cancel_ms
        if start is None:
            continue
        spans.append((float(start), float(end if end is not None else math.inf), r.request_id))
    spans.sort()
    out = []
    for i, (s1, e1, a) in enumerate(spans):
        for s2, _, b in spans[i + 1:]:
            if s2 > e1:  # sorted by start: nobody later overlaps a either
                break
            out.append((a, b))
    return out


def control_result(name: str, verdicts: list[Divergence], finding: Finding, *, runs: int, toggles: list[str],
                   trace: Trace | None, note: str | None = None) -> ControlResult:
    worst, victims = signature_of(finding)
    mine = [v for v in verdicts if v.request_id in victims]
    same = sorted(v.request_id for v in mine if v.class_ == worst)
    other = sorted(f"{v.request_id} ({v.class_})" for v in mine if v.class_ in DIVERGENT_CLASSES and v.class_ != worst)
    if same:
        detail = f"reproduces: {', '.join(same)} {worst}"
    elif other:
        detail = f"diverges differently: {', '.join(other)}"
    else:
        detail = f"does not reproduce: {', '.join(sorted(victims))} clean"
    if note:
        detail += f"; {note}"
    return ControlResult(name=name, reproduced=bool(same), available=True, detail=detail,
                         divergences=[v for v in verdicts if v.class_ in DIVERGENT_CLASSES],
                         verdicts=sorted(verdicts, key=lambda v: (SEVERITY[v.class_], v.request_id)),
                         runs=runs, toggles=toggles, trace=trace)


def reproducing_arms(finding: Finding) -> list[str]:
    """Every arm (the finding's own and its controls) in which the signature reproduced."""
    worst, victims = signature_of(finding)
    arms = [a for a in finding.arms
            if any(d.arm == a and d.class_ == worst and d.request_id in victims for d in finding.divergences)]
    return arms + [c.name for c in finding.controls if c.available and c.reproduced]


def escalate(finding: Finding) -> Finding:
    """Re-file a ``numeric-near-tie`` as ``corruption`` when the float32 control reproduces its
    request as corruption: 16-bit batch-order noise vanishes in float32, an allocator or
    scheduler fault does not. (Never the other way: a corruption stays one.)"""
    f32 = next((c for c in finding.controls if c.name == FLOAT32 and c.available), None)
    if f32 is None:
        return finding
    hit = {v.request_id for v in f32.verdicts if v.class_ == "corruption"}

    def up(d: Divergence) -> Divergence:
        if d.class_ != "numeric-near-tie" or d.request_id not in hit:
            return d
        return d.model_copy(update={"class_": "corruption", "evidence": [*d.evidence, f"control:{FLOAT32}"],
                                    "detail": f"{d.detail}; but the float32 control reproduces it as corruption "
                                              f"(16-bit noise would vanish there)"})

    divergences = [up(d) for d in finding.divergences]
    if divergences == finding.divergences:
        return finding
    new = finding.model_copy(update={"divergences": divergences, "verdicts": [up(v) for v in finding.verdicts]})
    new.reproduced_in = reproducing_arms(new)
    new.id = new.compute_id()
    return new
