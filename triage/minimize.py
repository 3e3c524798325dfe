"""Shrink a finding to the smallest trace that still shows the same bug.

The signature kept is *(class, victim)*: the victim request keeps its verdict class and, on a
step-exact engine (whose runs record vLLM's post-conditions), its first broken post-condition
or none, so that with two causes on, a witness of one never shrinks into a witness of the
other. A candidate is kept when the signature reproduces in at least ``m`` of ``k`` replays
(``Acceptance``, triage/reduce.py).

Passes, repeated until nothing changes or the budget is spent:

1. events: ProbDD (or ddmin) over requests (a send and its cancels together, the victim always
   stays), then over the events of no request (adapter lifecycle, prefix-cache resets), then
   each remaining cancel alone;
2. adapters: each LoRA request to the base model, then all adapters unified to one;
3. engine: fewer LoRA slots / LoRA off when no adapter is left (these restart the engine);
4. numbers: max_tokens, shared prefix, prompt length and every event's clock, each bisected
   towards its smallest value.

Replays go through a ``Replayer`` (triage/probe.py): the in-process engine or a server.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, TypeGuard, TypeVar

from pydantic import ValidationError

from kvfuzz.oracle.check import ENGINE
from kvfuzz.traces import (CancelEvent, EngineConfig, Finding, GenPrompt, MinimizedFrom, Minimization, Sampling,
                           SendEvent, TokenPrompt, Trace)
from kvfuzz.traces.finding import DIVERGENT_CLASSES
from kvfuzz.traces.trace import ADAPTER_EVENT_TYPES, Event

from .probe import Probe, Replayer
from .reduce import Acceptance, accepts, ddmin, default_acceptance, probdd, shrink_int

T = TypeVar("T")
# Rounds of all passes; later rounds catch what earlier changes enabled.
MAX_ROUNDS = 3


@dataclass(frozen=True)
class Target:
    """What must keep happening: ``victim`` gets class ``cls`` in arm ``arm`` (run with
    ``toggles``)."""

    cls: str
    victim: str
    arm: str = "default"
    toggles: tuple[str, ...] = ()
    # With ``named``: the victim's first broken post-condition (oracle/postconditions.py
    # ``origin``; None: none) must stay what it was.
    broke: str | None = None
    named: bool = False

    @property
    def signature(self) -> str:
        return f"{self.cls}:{self.victim}"

    def holds(self, cls: str | None, broke: str | None) -> bool:
        """Whether a replay whose victim got ``cls`` and first broke ``broke`` shows the target."""
        return cls == self.cls and (not self.named or broke == self.broke)

    @property
    def words(self) -> str:
        """The signature, with the victim's name where it is part of the target."""
        return self.signature + (f" ({self.broke or 'no post-condition broken'})" if self.named else "")


def choose_target(finding: Finding, victim: str | None = None, *, named: bool = False) -> Target:
    """The finding's most severe class and, among its victims, the one that diverged most
    often (then the earliest sent): the request a maintainer will look at first. ``named``:
    its first broken post-condition is part of the target."""
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
    # Begin with the numbers pass: the structure passes already ran on this trace
    # (``resumes_at_numbers``), and repeating them can spend the budget again.
    numbers_first: bool = False


@dataclass
class Result:
    trace: Trace
    # Every trace that was accepted, in order (the original first): verification walks
    # back through them if the last one does not reproduce again.
    accepted: list[Trace]
    replays: int
    passes: list[str]
    stopped: str | None


def _rebuild(trace: Trace, events: Iterable[Event] | None = None, engine: EngineConfig | None = None) -> Trace | None:
    """A validated copy with new events / engine, or None if the result is not a valid trace."""
    data = trace.model_dump(mode="json")
    if events is not None:
        data["events"] = [(e.fitted() if isinstance(e, SendEvent) else e).model_dump(mode="json") for e in events]
    if engine is not None:
        data["engine"] = engine.model_dump(mode="json")
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

    def _check_budget(self) -> None:
        b = self.opts.budget
        if b.max_replays is not None and self.replays >= b.max_replays:
            raise BudgetExhausted(f"replay budget of {b.max_replays} spent")
        # A candidate starts only if it and the verification replay after the last one (each
        # about as long as the longest replay so far) end within the budget.
        if b.max_seconds is not None and self._clock() - self._t0 + 2 * self.longest >= b.max_seconds:
            raise BudgetExhausted(f"time budget of {b.max_seconds:g} s spent")

    def keeps(self, cand: Trace | None) -> TypeGuard[Trace]:
        """Whether ``cand`` (None: not a valid trace) still shows the target."""
        if cand is None:
            return False
        key = cand.trace_id()
        if key in self._cache:
            return self._cache[key]
        if self.target.victim not in {c for s in cand.sends for c in s.completion_ids} and self.target.victim != ENGINE:
            return False
        self._check_budget()

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
                cur = self.events_pass(cur)
                cur = self.lifecycle_pass(cur)
                cur = self.cancels_pass(cur)
                cur = self.adapters_pass(cur)
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

    # -- pass 1: events --------------------------------------------------------------------------
    def _reduce(self, trace: Trace, items: Sequence[T], keeping: Callable[[list[T]], Trace | None]) -> Trace:
        """``trace`` with the fewest of ``items`` (``keeping`` builds the candidate) that still keeps."""
        reduce = probdd if self.opts.strategy == "probdd" else ddmin
        kept = reduce(items, lambda sub: self.keeps(keeping(sub)))
        out = keeping(kept) if len(kept) < len(items) else trace
        assert out is not None
        return out

    def events_pass(self, trace: Trace) -> Trace:
        # The victim's send (a completion of n is its send's).
        victim = self.target.victim if self.target.victim == ENGINE else trace.send(self.target.victim).request_id
        others = [s.request_id for s in trace.sends if s.request_id != victim]
        if not others:
            return trace

        def with_requests(keep: list[str]) -> Trace | None:
            # Events of no request (adapter lifecycle, resets) stay: the lifecycle pass tries them.
            ids = set(keep) | {victim}
            return _rebuild(trace, [e for e in trace.events
                                    if not isinstance(e, (SendEvent, CancelEvent)) or e.request_id in ids])

        n0 = self.replays
        out = self._reduce(trace, others, with_requests)
        self.passes.append(f"{self.opts.strategy}: {len(trace.sends)} -> {len(out.sends)} requests "
                           f"({_n(self.replays - n0)})")
        return out

    def lifecycle_pass(self, trace: Trace) -> Trace:
        """The events of no request (adapter lifecycle, prefix-cache resets, any later kind) the
        divergence does not need, removed (a candidate that leaves a send on an unbound adapter
        name is not a valid trace and is never replayed)."""
        idx = [i for i, e in enumerate(trace.events) if not isinstance(e, (SendEvent, CancelEvent))]
        if not idx:
            return trace

        def keeping(keep: list[int]) -> Trace | None:
            drop = set(idx) - set(keep)
            return _rebuild(trace, [e for i, e in enumerate(trace.events) if i not in drop])

        n0 = self.replays
        out = self._reduce(trace, idx, keeping)
        left = sum(1 for e in out.events if not isinstance(e, (SendEvent, CancelEvent)))
        what = "adapter events" if all(isinstance(trace.events[i], ADAPTER_EVENT_TYPES) for i in idx) else "events"
        self.passes.append(f"lifecycle: {len(idx)} -> {left} {what} ({_n(self.replays - n0)})")
        return out

    def cancels_pass(self, trace: Trace) -> Trace:
        n0, before = self.replays, len(trace.cancels)
        i = 0
        while i < len(trace.events):
            if isinstance(trace.events[i], CancelEvent):
                cand = _rebuild(trace, trace.events[:i] + trace.events[i + 1:])
                if self.keeps(cand):
                    trace = cand
                    continue
            i += 1
        if before:
            self.passes.append(f"cancels: {before} -> {len(trace.cancels)} ({_n(self.replays - n0)})")
        return trace

    # -- pass 2: adapters ------------------------------------------------------------------------
    def adapters_pass(self, trace: Trace) -> Trace:
        if not any(s.adapter for s in trace.sends):
            return trace
        n0 = self.replays
        before = sorted({s.adapter for s in trace.sends if s.adapter})
        for s in list(trace.sends):
            if s.adapter is not None and self.keeps(cand := _replace_send(trace, s.request_id, adapter=None)):
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
        self.passes.append(f"adapters: {before or 'none'} -> {after or 'base model only'} "
                           f"({_n(self.replays - n0)})")
        return trace

    # -- pass 3: engine settings -----------------------------------------------------------------
    def engine_pass(self, trace: Trace) -> Trace:
        lora = trace.engine.lora
        change: tuple[str, Any, Any, dict[str, Any]]
        if not lora.enabled:
            return trace
        if not any(s.adapter for s in trace.sends):
            change = ("lora.enabled", True, False, {"enabled": False, "adapters": {}})
        elif lora.max_loras > 1:
            change = ("lora.max_loras", lora.max_loras, 1, {"max_loras": 1})
        else:
            return trace
        key, old, new, update = change
        n0, start = self.replays, trace
        cand = _rebuild(trace, engine=trace.engine.model_copy(update={"lora": lora.model_copy(update=update)}))
        if self.keeps(cand):
            self.engine_changes.setdefault(key, [old, new])[1] = new
            trace = cand
        if trace is not start or self.replays > n0:
            changes = ", ".join(f"{k} {a} -> {b}" for k, (a, b) in self.engine_changes.items())
            self.passes.append(f"engine: {changes or 'unchanged'} ({_n(self.replays - n0)})")
        return trace

    # -- pass 4: numbers -------------------------------------------------------------------------
    def numbers_pass(self, trace: Trace) -> Trace:
        n0 = self.replays
        before = _sizes(trace)
        box = [trace]

        def attempt(rid: str, **update: Any) -> bool:
            cand = _replace_send(box[0], rid, **update)
            if self.keeps(cand):
                box[0] = cand
                return True
            return False

        for rid in [s.request_id for s in trace.sends]:
            s = box[0].send(rid)
            # Per-request state: all of it, else one field at a time, back to vLLM's default.
            if not s.sampling.is_default and not attempt(rid, sampling=Sampling()):
                for name in s.sampling.fields_set():
                    now = box[0].send(rid).sampling
                    attempt(rid, sampling=now.model_copy(update={name: Sampling.model_fields[name].default}))
            if s.priority:
                attempt(rid, priority=0)
            s = box[0].send(rid)
            shrink_int(s.max_tokens, 1, lambda v: attempt(rid, max_tokens=v))
            s = box[0].send(rid)
            if isinstance(s.prompt, GenPrompt) and s.prompt.prefix_len:
                g = s.prompt
                if not attempt(rid, prompt=GenPrompt(length=g.length, seed=g.seed)):
                    shrink_int(g.prefix_len, 1, lambda v: attempt(
                        rid, prompt=g.model_copy(update={"prefix_len": v})))
            s = box[0].send(rid)
            p = s.prompt
            if isinstance(p, GenPrompt):
                shrink_int(p.length, max(1, p.prefix_len), lambda v: attempt(
                    rid, prompt=p.model_copy(update={"length": v})))
            else:
                shrink_int(len(p.token_ids), 1, lambda v: attempt(
                    rid, prompt=TokenPrompt(token_ids=p.token_ids[:v])))
        box[0] = self._timing(box[0])
        self.passes.append(f"numbers: {before} -> {_sizes(box[0])} ({_n(self.replays - n0)})")
        return box[0]

    def _timing(self, trace: Trace) -> Trace:
        mps = trace.engine.ms_per_step
        use_step = self.opts.clock == "step"
        # Shift everything so the first event is at time 0 (one candidate), then each event
        # towards its earliest possible time, in trace order.
        timed = [e for e in trace.events if e.at.after_tokens is None]
        first = min((_when(e, use_step, mps) for e in timed), default=0)
        if first > 0:
            cand = _rebuild(trace, [_at_time(e, _when(e, use_step, mps) - first, use_step, mps)
                                    if e.at.after_tokens is None else e for e in trace.events])
            if self.keeps(cand):
                trace = cand
        for idx in range(len(trace.events)):
            ev = trace.events[idx]
            box = [trace]

            def put(new_ev: Event, idx: int = idx) -> bool:
                cand = _rebuild(box[0], box[0].events[:idx] + [new_ev] + box[0].events[idx + 1:])
                if self.keeps(cand):
                    box[0] = cand
                    return True
                return False

            if isinstance(ev, CancelEvent) and ev.at.after_tokens is not None:
                shrink_int(ev.at.after_tokens, 0, lambda v: put(
                    ev.model_copy(update={"at": ev.at.model_copy(update={"after_tokens": v})})))
            else:
                lo = int(_when(box[0].send(ev.request_id), use_step, mps)) if isinstance(ev, CancelEvent) else 0
                shrink_int(int(_when(ev, use_step, mps)), lo, lambda v: put(_at_time(ev, v, use_step, mps)))
            trace = box[0]
        return trace


def engine_diff(a: EngineConfig, b: EngineConfig) -> dict[str, list[Any]]:
    """Engine settings that differ, as {"lora.max_loras": [2, 1], ...}."""

    def flat(d: dict[str, Any], pre: str = "") -> dict[str, Any]:
        out: dict[str, Any] = {}
        for k, v in d.items():
            if isinstance(v, dict) and k != "adapters":
                out.update(flat(v, f"{pre}{k}."))
            else:
                out[f"{pre}{k}"] = v
        return out

    fa, fb = flat(a.model_dump(mode="json")), flat(b.model_dump(mode="json"))
    return {k: [fa.get(k), fb.get(k)] for k in sorted(set(fa) | set(fb)) if fa.get(k) != fb.get(k)}


def _n(k: int) -> str:
    return f"{k} replay{'' if k == 1 else 's'}"


def _sizes(trace: Trace) -> str:
    prompt = sum(s.prompt.length for s in trace.sends)
    gen = sum(s.max_tokens for s in trace.sends)
    return f"{prompt} prompt + {gen} generated tokens"


def _replace_send(trace: Trace, rid: str, **update: Any) -> Trace | None:
    events = [e.model_copy(update=update) if isinstance(e, SendEvent) and e.request_id == rid else e
              for e in trace.events]
    return _rebuild(trace, events)


def _when(e: Event, use_step: bool, mps: float) -> float:
    return e.at.step_or(mps) if use_step else e.at.offset_or(mps)


def _at_time(ev: Event, v: float, use_step: bool, mps: float) -> Event:
    at = ev.at
    if use_step:
        upd: dict[str, Any] = {"step": int(v)}
        if at.offset_ms is not None:
            upd["offset_ms"] = float(int(v) * mps)
    else:
        upd = {"offset_ms": float(v)}
        if at.step is not None:
            upd["step"] = int(v // mps)
    return ev.model_copy(update={"at": at.model_copy(update=upd)})


def _tidy(trace: Trace, *, use_step: bool = True) -> Trace:
    """Events in time order for reading (sorting by (time, position) keeps the replay order
    of equal times; relative cancels are placed right after their send)."""
    mps = trace.engine.ms_per_step
    pos = {e.request_id: i for i, e in enumerate(trace.events) if isinstance(e, SendEvent)}

    def key(ie: tuple[int, Event]) -> tuple[float, float]:
        i, e = ie
        # Only a cancel can be relative (after_tokens: At and the events' validators).
        if (isinstance(e, CancelEvent) and e.at.after_tokens is not None
                and e.at.step is None and e.at.offset_ms is None):
            return (_when(trace.events[pos[e.request_id]], use_step, mps), pos[e.request_id] + 0.5)
        return (_when(e, use_step, mps), float(i))

    events = [e for _, e in sorted(enumerate(trace.events), key=key)]
    return _rebuild(trace, events) or trace


# -- against a replayer -----------------------------------------------------------------------


def _recorded_holds(finding: Finding, target: Target) -> bool:
    """The finding's own runs show ``target``: its victim diverged so in every run."""
    d = next((d for d in finding.divergences if d.request_id == target.victim and d.arm == target.arm), None)
    return d is not None and d.runs > 0 and d.runs_diverged == d.runs and target.holds(d.class_, d.broke)


def resumes_at_numbers(done: Minimization | None) -> bool:
    """Whether ``done`` (a finding's own minimization record) was cut by its budget after its
    structure passes and before any numbers pass: minimizing the finding again goes on there."""
    if done is None or done.stopped is None:
        return False
    return any(p.startswith(("probdd:", "ddmin:")) for p in done.passes) and \
        not any(p.startswith("numbers:") for p in done.passes)


def minimize_finding(replayer: Replayer, finding: Finding, *, victim: str | None = None,
                     options: Options | None = None, runs: int | None = None,
                     original_path: str | None = None, recorded_here: bool = False) -> Finding:
    """Minimize ``finding`` by replaying candidates through ``replayer``; return the
    minimized finding (re-recorded from scratch, linked to the original). Raises
    NotReproduced when the original signature does not reproduce here. ``recorded_here``: the
    finding's runs were recorded by this replayer (a campaign's triage); on a step-exact one
    they already show whether the original reproduces, so it is not replayed to find out."""
    target = choose_target(finding, victim, named=replayer.step_exact)
    opts = options or Options(acceptance=default_acceptance(replayer.step_exact),
                              clock="step" if replayer.step_exact else "offset")
    if resumes_at_numbers(finding.minimization):
        opts = dataclasses.replace(opts, numbers_first=True)
    probe = Probe(replayer, target)
    mini = Minimizer(target, probe, opts)
    t0 = time.monotonic()
    if recorded_here and replayer.step_exact and _recorded_holds(finding, target):
        kept, spent = True, 0  # a replay would give the recorded run again
    else:
        kept, spent = accepts(lambda: probe(finding.trace), opts.acceptance)
    mini.replays += spent
    if not kept:
        raise NotReproduced(f"signature {target.words} (arm {target.arm!r}) did not reproduce in "
                            f">= {opts.acceptance.min_hits} of {opts.acceptance.repeats} replays")
    result = mini.run(finding.trace)

    # Verify from scratch: the minimized trace must reproduce again, with as many runs as the
    # original arm had. A flaky last step falls back to the previous accepted trace, unless the
    # budget is spent (each step is ``runs`` replays: the walk would overrun the time box).
    runs = runs or max(1, sum(1 for h in finding.runs if h.arm == target.arm))
    need = opts.acceptance.needed(runs)
    final = None
    passes = list(result.passes)
    cut = result.stopped is not None and result.trace is not finding.trace
    walk = [result.trace] if cut else [result.trace, *reversed(result.accepted)]
    for n, cand in enumerate(walk):
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
        original_events=len(finding.trace.events), events=len(final.trace.events),
        replays=mini.replays, signature=target.signature, arm=target.arm, toggles=list(target.toggles),
        repeats=opts.acceptance.repeats, min_hits=opts.acceptance.min_hits,
        reference_runs=probe.reference_runs, seconds=round(time.monotonic() - t0, 2), verified=verified,
        engine_changes=engine_diff(finding.trace.engine, final.trace.engine), passes=passes,
        stopped=result.stopped,
    )
    final.inherit(finding, drop_notes=("minimize",))
    final.provenance = final.provenance.model_copy(update={
        "minimized_to": None, "minimized_from": MinimizedFrom(id=original, file=original_path)})
    final.id = final.compute_id()
    return final
