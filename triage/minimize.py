"""Shrink a finding to the smallest trace that still shows the same bug: the victim keeps its class
and, on a step-exact engine, its first broken post-condition (so that with two causes on, a witness
of one never shrinks into the other's) in ``m`` of ``k`` replays (``Acceptance``).

Passes, repeated until nothing changes or the budget is spent: requests (a send with its cancels),
then the events of no request (ProbDD or ddmin), each cancel, adapters, LoRA engine settings (an
engine restart), then the numbers (per-request state, lengths, every event's clock).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, TypeGuard, TypeVar

from pydantic import ValidationError

from kvfuzz.oracle.check import ENGINE
from kvfuzz.traces import (DIVERGENT_CLASSES, At, CancelEvent, EngineConfig, Finding, GenPrompt, MinimizedFrom,
                           Minimization, Sampling, SendEvent, TokenPrompt, Trace)
from kvfuzz.traces.trace import ADAPTER_EVENT_TYPES, Event

from .probe import Probe, Replayer
from .reduce import Acceptance, accepts, ddmin, default_acceptance, probdd, shrink_int

T = TypeVar("T")
# Rounds of all passes; later rounds catch what earlier changes enabled.
MAX_ROUNDS = 3


@dataclass(frozen=True)
class Target:
    """What must keep happening: ``victim`` gets class ``cls`` in arm ``arm`` (run with ``toggles``)
    and, when ``named``, first breaks post-condition ``broke`` (None: none)."""

    cls: str
    victim: str
    arm: str = "default"
    toggles: tuple[str, ...] = ()
    broke: str | None = None
    named: bool = False

    @property
    def signature(self) -> str:
        return f"{self.cls}:{self.victim}"

    def holds(self, cls: str | None, broke: str | None) -> bool:
        return cls == self.cls and (not self.named or broke == self.broke)


def choose_target(finding: Finding, victim: str | None = None, *, named: bool = False) -> Target:
    """The target: the finding's leading divergence (``Finding.leading``; among ``victim``'s if given)."""
    divs = [d for d in finding.divergences if d.class_ in DIVERGENT_CLASSES]
    if victim is not None:
        divs = [d for d in divs if d.request_id == victim]
        if not divs:
            known = sorted({d.request_id for d in finding.divergences})
            raise ValueError(f"request {victim!r} did not diverge in this finding (victims: {', '.join(known)})")
    best = finding.leading(divs)
    if best is None:
        raise ValueError("the finding has no divergence to minimize")
    toggles = finding.arms.get(best.arm)
    if toggles is None:
        toggles = next((h.toggles for h in finding.runs if h.arm == best.arm), list(finding.trace.engine.toggles))
    return Target(cls=best.class_, victim=best.request_id, arm=best.arm, toggles=tuple(toggles),
                  broke=best.broke if named else None, named=named)


class BudgetExhausted(Exception):
    pass


class NotReproduced(Exception):
    """The finding's signature does not reproduce here, so there is nothing to minimize."""


@dataclass
class Budget:
    max_replays: int | None = 400
    max_seconds: float | None = None


@dataclass
class Options:
    acceptance: Acceptance = field(default_factory=Acceptance)
    budget: Budget = field(default_factory=Budget)
    strategy: Literal["probdd", "ddmin"] = "probdd"
    # Which clock to shrink: the in-process engine schedules by step, a server by offset_ms.
    clock: Literal["step", "offset"] = "step"
    # Try engine settings that need an engine restart (fewer LoRA slots, LoRA off).
    engine: bool = True
    # Begin with the numbers pass: the structure passes already ran (``resumes_at_numbers``).
    numbers_first: bool = False


@dataclass
class Result:
    trace: Trace
    # Every accepted trace, the original first: verification walks back through them.
    accepted: list[Trace]
    replays: int
    passes: list[str]
    stopped: str | None


def _rebuild(trace: Trace, events: Iterable[Event] | None = None) -> Trace | None:
    """A validated copy (with new events), or None if the result is not a valid trace."""
    data = trace.model_dump(mode="json")
    if events is not None:
        data["events"] = [(e.fitted() if isinstance(e, SendEvent) else e).model_dump(mode="json") for e in events]
    try:
        return Trace.model_validate(data)
    except ValidationError:
        return None


class Minimizer:
    def __init__(self, target: Target, run_once: Callable[[Trace], bool], options: Options | None = None,
                 clock: Callable[[], float] = time.monotonic):
        self.target = target
        self.run_once = run_once
        self.opts = options or Options()
        self._clock = clock
        self.replays = 0
        self.passes: list[str] = []
        self.engine_changes: dict[str, list[Any]] = {}
        self._cache: dict[str, bool] = {}
        self._t0 = 0.0
        self.accepted: list[Trace] = []
        self.longest = 0.0  # the longest candidate replay so far (seconds)

    def keeps(self, cand: Trace | None) -> TypeGuard[Trace]:
        """Whether ``cand`` (None: not a valid trace) still shows the target."""
        if cand is None:
            return False
        key = cand.trace_id()
        if key in self._cache:
            return self._cache[key]
        if self.target.victim not in {c for s in cand.sends for c in s.completion_ids} and self.target.victim != ENGINE:
            return False
        b = self.opts.budget
        if b.max_replays is not None and self.replays >= b.max_replays:
            raise BudgetExhausted(f"replay budget of {b.max_replays} spent")
        # Start a candidate only if it and the final verification (each as long as the longest replay) fit.
        if b.max_seconds is not None and self._clock() - self._t0 + 2 * self.longest >= b.max_seconds:
            raise BudgetExhausted(f"time budget of {b.max_seconds:g} s spent")

        def once() -> bool:
            self.replays += 1
            t0 = self._clock()
            try:
                return self.run_once(cand)
            finally:
                self.longest = max(self.longest, self._clock() - t0)

        kept, _ = accepts(once, self.opts.acceptance)
        self._cache[key] = kept
        if kept:
            self.accepted.append(cand)
        return kept

    def _note(self, n0: int, text: str) -> None:
        """Record a pass's outcome and the replays it spent (since ``n0``)."""
        k = self.replays - n0
        self.passes.append(f"{text} ({k} replay{'' if k == 1 else 's'})")

    def run(self, trace: Trace) -> Result:
        self._t0 = self._clock()
        self.accepted = [trace]
        self._cache[trace.trace_id()] = True
        cur = trace
        stopped = None
        try:
            if self.opts.numbers_first:
                cur = self.numbers_pass(cur)
            for rnd in range(MAX_ROUNDS):
                before = cur.trace_id()
                for structure_pass in (self.events_pass, self.lifecycle_pass, self.cancels_pass, self.adapters_pass):
                    cur = structure_pass(cur)
                if self.opts.engine:
                    changed = self.engine_pass(cur)
                    if changed is not cur:
                        cur = self.events_pass(changed)
                # The numbers pass is the expensive one: after the first round, only when the
                # structure (requests, cancels, adapters, engine) changed again.
                if (rnd == 0 and not self.opts.numbers_first) or cur.trace_id() != before:
                    cur = self.numbers_pass(cur)
                if cur.trace_id() == before:
                    break
        except BudgetExhausted as e:
            stopped = str(e)
            cur = self.accepted[-1]
        cur = _tidy(cur, use_step=self.opts.clock == "step")
        return Result(trace=cur, accepted=self.accepted, replays=self.replays, passes=self.passes, stopped=stopped)

    def _drop(self, trace: Trace, items: Sequence[T], key: Callable[[int, Event], T | None]) -> Trace:
        """``trace`` without the events of as many ``items`` as the target allows (``key``: an event's item)."""

        def without(keep: list[T]) -> Trace | None:
            drop = set(items) - set(keep)
            return _rebuild(trace, [e for i, e in enumerate(trace.events) if key(i, e) not in drop])

        kept = (probdd if self.opts.strategy == "probdd" else ddmin)(items, lambda sub: self.keeps(without(sub)))
        out = without(kept) if len(kept) < len(items) else trace
        assert out is not None
        return out

    def events_pass(self, trace: Trace) -> Trace:
        # The victim's send (a completion of n is its send's).
        victim = self.target.victim if self.target.victim == ENGINE else trace.send(self.target.victim).request_id
        others = [s.request_id for s in trace.sends if s.request_id != victim]
        if not others:
            return trace
        n0 = self.replays
        out = self._drop(trace, others, lambda i, e: e.request_id if isinstance(e, (SendEvent, CancelEvent)) else None)
        self._note(n0, f"{self.opts.strategy}: {len(trace.sends)} -> {len(out.sends)} requests")
        return out

    def lifecycle_pass(self, trace: Trace) -> Trace:
        """Drop the events of no request (adapter lifecycle, prefix-cache resets) the target does not need."""
        idx = [i for i, e in enumerate(trace.events) if not isinstance(e, (SendEvent, CancelEvent))]
        if not idx:
            return trace
        n0 = self.replays
        out = self._drop(trace, idx, lambda i, e: i)
        left = sum(1 for e in out.events if not isinstance(e, (SendEvent, CancelEvent)))
        what = "adapter events" if all(isinstance(trace.events[i], ADAPTER_EVENT_TYPES) for i in idx) else "events"
        self._note(n0, f"lifecycle: {len(idx)} -> {left} {what}")
        return out

    def cancels_pass(self, trace: Trace) -> Trace:
        n0, before, removed = self.replays, len(trace.cancels), 0
        for j in [j for j, e in enumerate(trace.events) if isinstance(e, CancelEvent)]:
            i = j - removed  # its index in the current trace
            if self.keeps(cand := _rebuild(trace, trace.events[:i] + trace.events[i + 1:])):
                trace, removed = cand, removed + 1
        if before:
            self._note(n0, f"cancels: {before} -> {len(trace.cancels)}")
        return trace

    def adapters_pass(self, trace: Trace) -> Trace:
        before = sorted({s.adapter for s in trace.sends if s.adapter})
        if not before:
            return trace
        n0 = self.replays
        for i, e in enumerate(trace.events):
            if isinstance(e, SendEvent) and e.adapter is not None and self.keeps(cand := _edit(trace, i, adapter=None)):
                trace = cand
        used = [s.adapter for s in trace.sends if s.adapter]
        if len(set(used)) > 1:
            # Prefer the adapter most requests already use; the others become it.
            for keep in sorted(set(used), key=lambda a: (-used.count(a), a)):
                cand = _rebuild(trace, [e.model_copy(update={"adapter": keep}) if isinstance(e, SendEvent) and e.adapter
                                        else e for e in trace.events])
                if self.keeps(cand):
                    trace = cand
                    break
        after = sorted({s.adapter for s in trace.sends if s.adapter})
        self._note(n0, f"adapters: {before} -> {after or 'base model only'}")
        return trace

    def engine_pass(self, trace: Trace) -> Trace:
        lora = trace.engine.lora
        old: bool | int
        if lora.enabled and not any(s.adapter for s in trace.sends):
            name, old, update = "enabled", True, {"enabled": False, "adapters": {}}
        elif lora.enabled and lora.max_loras > 1:
            name, old, update = "max_loras", lora.max_loras, {"max_loras": 1}
        else:
            return trace
        n0 = self.replays
        engine = trace.engine.model_copy(update={"lora": lora.model_copy(update=update)})
        cand = _rebuild(trace.model_copy(update={"engine": engine}))
        if kept := self.keeps(cand):
            self.engine_changes.setdefault(f"lora.{name}", [old, update[name]])[1] = update[name]
            trace = cand
        if kept or self.replays > n0:
            changes = ", ".join(f"{k} {a} -> {b}" for k, (a, b) in self.engine_changes.items())
            self._note(n0, f"engine: {changes or 'unchanged'}")
        return trace

    def numbers_pass(self, trace: Trace) -> Trace:
        n0, before, cur = self.replays, _sizes(trace), trace

        def put(i: int, **update: Any) -> bool:
            """Whether event ``i`` with ``update`` still shows the target (then it is kept)."""
            nonlocal cur
            if kept := self.keeps(cand := _edit(cur, i, **update)):
                cur = cand
            return kept

        for i, rid in [(i, e.request_id) for i, e in enumerate(trace.events) if isinstance(e, SendEvent)]:
            s = cur.send(rid)
            # Per-request state: all of it, else one field at a time, back to vLLM's default.
            if not s.sampling.is_default and not put(i, sampling=Sampling()):
                for f in s.sampling.fields_set():
                    put(i, sampling=cur.send(rid).sampling.model_copy(update={f: Sampling.model_fields[f].default}))
            if s.priority:
                put(i, priority=0)
            shrink_int(cur.send(rid).max_tokens, 1, lambda v: put(i, max_tokens=v))
            g = cur.send(rid).prompt
            if isinstance(g, GenPrompt) and g.prefix_len and not put(i, prompt=GenPrompt(length=g.length, seed=g.seed)):
                shrink_int(g.prefix_len, 1, lambda v: put(i, prompt=g.model_copy(update={"prefix_len": v})))
            p = cur.send(rid).prompt
            if isinstance(p, GenPrompt):
                shrink_int(p.length, max(1, p.prefix_len), lambda v: put(i, prompt=p.model_copy(update={"length": v})))
            else:
                shrink_int(len(p.token_ids), 1, lambda v: put(i, prompt=TokenPrompt(token_ids=p.token_ids[:v])))
        # Clocks: all shifted so the first event is at 0 (one candidate), then each event as early as it keeps.
        mps, use_step = cur.engine.ms_per_step, self.opts.clock == "step"
        first = min((_when(e, use_step, mps) for e in cur.events if e.at.after_tokens is None), default=0)
        if first > 0:
            shifted = [e.model_copy(update={"at": _at(e.at, _when(e, use_step, mps) - first, use_step, mps)})
                       if e.at.after_tokens is None else e for e in cur.events]
            if self.keeps(cand := _rebuild(cur, shifted)):
                cur = cand
        for i in range(len(cur.events)):
            ev = cur.events[i]
            if isinstance(ev, CancelEvent) and ev.at.after_tokens is not None:
                shrink_int(ev.at.after_tokens, 0, lambda v: put(i, at=ev.at.model_copy(update={"after_tokens": v})))
            else:
                lo = int(_when(cur.send(ev.request_id), use_step, mps)) if isinstance(ev, CancelEvent) else 0
                shrink_int(int(_when(ev, use_step, mps)), lo, lambda v: put(i, at=_at(ev.at, v, use_step, mps)))
        self._note(n0, f"numbers: {before} -> {_sizes(cur)}")
        return cur


def engine_diff(a: EngineConfig, b: EngineConfig) -> dict[str, list[Any]]:
    """Engine settings that differ, as {"lora.max_loras": [2, 1], ...}."""

    def flat(d: dict[str, Any], pre: str = "") -> dict[str, Any]:
        out: dict[str, Any] = {}
        for k, v in d.items():
            out.update(flat(v, f"{pre}{k}.") if isinstance(v, dict) and k != "adapters" else {f"{pre}{k}": v})
        return out

    fa, fb = flat(a.model_dump(mode="json")), flat(b.model_dump(mode="json"))
    return {k: [fa.get(k), fb.get(k)] for k in sorted(set(fa) | set(fb)) if fa.get(k) != fb.get(k)}


def _sizes(trace: Trace) -> str:
    return (f"{sum(s.prompt.length for s in trace.sends)} prompt + "
            f"{sum(s.max_tokens for s in trace.sends)} generated tokens")


def _edit(trace: Trace, i: int, **update: Any) -> Trace | None:
    """``trace`` with event ``i`` updated (None: not a valid trace)."""
    return _rebuild(trace, [*trace.events[:i], trace.events[i].model_copy(update=update), *trace.events[i + 1:]])


def _when(e: Event, use_step: bool, mps: float) -> float:
    return e.at.step_or(mps) if use_step else e.at.offset_or(mps)


def _at(at: At, v: float, use_step: bool, mps: float) -> At:
    """``at`` moved to ``v`` on the clock shrunk; the other clock, if set, follows."""
    if use_step:
        return at.model_copy(update={"step": int(v), "offset_ms": None if at.offset_ms is None else int(v) * mps})
    return at.model_copy(update={"offset_ms": float(v), "step": None if at.step is None else int(v // mps)})


def _tidy(trace: Trace, *, use_step: bool = True) -> Trace:
    """Events in time order for reading (sorting by (time, position) keeps the replay order
    of equal times; relative cancels are placed right after their send)."""
    mps = trace.engine.ms_per_step
    pos = {e.request_id: i for i, e in enumerate(trace.events) if isinstance(e, SendEvent)}

    def key(i: int) -> tuple[float, float]:
        e = trace.events[i]
        if isinstance(e, CancelEvent) and e.at.step is None and e.at.offset_ms is None:  # relative (after_tokens)
            return (_when(trace.events[pos[e.request_id]], use_step, mps), pos[e.request_id] + 0.5)
        return (_when(e, use_step, mps), float(i))

    return _rebuild(trace, [trace.events[i] for i in sorted(range(len(trace.events)), key=key)]) or trace


def resumes_at_numbers(done: Minimization | None) -> bool:
    """Whether ``done`` (a finding's minimization) was cut between its structure and numbers passes."""
    if done is None or done.stopped is None:
        return False
    return (any(p.startswith(("probdd:", "ddmin:")) for p in done.passes)
            and not any(p.startswith("numbers:") for p in done.passes))


def minimize_finding(replayer: Replayer, finding: Finding, *, victim: str | None = None,
                     options: Options | None = None, runs: int | None = None,
                     original_path: str | None = None, recorded_here: bool = False) -> Finding:
    """``finding`` minimized through ``replayer``, re-recorded and linked to the original. Raises
    NotReproduced when its target does not reproduce here. ``recorded_here``: its runs were recorded
    by this replayer (a campaign's triage), so on a step-exact one they show whether it reproduces."""
    target = choose_target(finding, victim, named=replayer.step_exact)
    opts = options or Options(acceptance=default_acceptance(replayer.step_exact),
                              clock="step" if replayer.step_exact else "offset")
    if resumes_at_numbers(finding.minimization):
        opts = dataclasses.replace(opts, numbers_first=True)
    probe = Probe(replayer, target)
    mini = Minimizer(target, probe, opts)
    t0 = time.monotonic()
    # A step-exact replay of a finding recorded here would give its recorded runs again.
    d = next((d for d in finding.divergences if d.request_id == target.victim and d.arm == target.arm), None)
    recorded = (recorded_here and replayer.step_exact and d is not None and d.runs > 0
                and d.runs_diverged == d.runs and target.holds(d.class_, d.broke))
    kept, spent = (True, 0) if recorded else accepts(lambda: probe(finding.trace), opts.acceptance)
    mini.replays += spent
    if not kept:
        words = target.signature + (f" ({target.broke or 'no post-condition broken'})" if target.named else "")
        raise NotReproduced(f"signature {words} (arm {target.arm!r}) did not reproduce in "
                            f">= {opts.acceptance.min_hits} of {opts.acceptance.repeats} replays")
    result = mini.run(finding.trace)

    # Verify from scratch, with as many runs as the original arm had. A flaky last step falls back to the
    # previous accepted trace, unless the budget is spent (each step is ``runs`` replays: it would overrun).
    runs = runs or max(1, sum(1 for h in finding.runs if h.arm == target.arm))
    need = opts.acceptance.needed(runs)
    final = None
    passes = list(result.passes)
    cut = result.stopped is not None and result.trace is not finding.trace
    for n, cand in enumerate([result.trace] if cut else [result.trace, *reversed(result.accepted)]):
        checked = replayer.check(cand, runs=runs, arms={target.arm: list(target.toggles)})
        mini.replays += runs
        v = next((d for d in checked.verdicts if d.request_id == target.victim and d.arm == target.arm), None)
        if (v is not None and target.holds(v.class_, v.broke) and v.runs_diverged >= need
                and checked.finding is not None):
            final = checked.finding
            if n:
                passes.append(f"verification: the result did not reproduce {need} of {runs} times; "
                              f"fell back {n} accepted step(s)")
            break
        if cand is finding.trace:
            break
    verified = final is not None
    if final is None:  # report the original, unverified
        final = finding.model_copy(deep=True)
        passes.append(f"verification: the result did not reproduce {need} of {runs} times and the budget was spent; "
                      "the original is kept" if cut else
                      f"verification: nothing reproduced {need} of {runs} times, not even the original")
    original = finding.id or finding.compute_id()
    final.minimization = Minimization(
        original=original, original_requests=len(finding.trace.sends), requests=len(final.trace.sends),
        original_events=len(finding.trace.events), events=len(final.trace.events), replays=mini.replays,
        signature=target.signature, arm=target.arm, toggles=list(target.toggles), repeats=opts.acceptance.repeats,
        min_hits=opts.acceptance.min_hits, reference_runs=probe.reference_runs, verified=verified,
        seconds=round(time.monotonic() - t0, 2), passes=passes, stopped=result.stopped,
        engine_changes=engine_diff(finding.trace.engine, final.trace.engine))
    final.inherit(finding, drop_notes=("minimize",))
    final.provenance = final.provenance.model_copy(update={
        "minimized_to": None, "minimized_from": MinimizedFrom(id=original, file=original_path)})
    final.id = final.compute_id()
    return final
