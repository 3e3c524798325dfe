"""The checker: histories + references in, one verdict per request per arm out.

Pure functions over recorded data (Jepsen-style: record first, check afterwards), so the same
checker serves the in-process engine, a managed server, a URL, and finding files replayed
years later.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field

from kvfuzz.traces import Divergence, EventRecord, History, RequestRecord, Scoring, SendEvent, Trace
from kvfuzz.traces.history import StopAtFlip
from kvfuzz.traces.finding import DIVERGENT_CLASSES, SEVERITY

from .diff import Comparison, compare, early_stop_comparison, margin_at, prompt_drifts, teacher_drifts
from .liveness import Stall, stalls
from .noise import NoiseBounds, default_bounds
from .postconditions import origin
from .stats import wilson

ENGINE = "<engine>"  # pseudo request id for an engine crash that hit no live request


@dataclass
class RunVerdict:
    cls: str
    comparison: Comparison | None = None
    detail: str | None = None
    # Teacher forcing: the largest drift over the run and how many positions exceeded the bound.
    teacher: float | None = None
    teacher_over: int | None = None
    evidence: tuple[str, ...] = ()


def _pair_shift(cmp: Comparison) -> float | None:
    """How far the two tokens' logit difference moved between the reference and the run, at
    least: the reference's margin of its token over the runner-up plus the run's margin of its
    token over its runner-up (each top-1/top-2, so a lower bound when the other token was not
    the runner-up). Noise of size d moves it by at most about d."""
    if cmp.ref_margin is None:
        return None
    return cmp.ref_margin + (cmp.run_margin or 0.0)


def classify_run(send: SendEvent, ref: RequestRecord | None, rec: RequestRecord | None, hist: History,
                 bounds: NoiseBounds, scoring: Scoring | None = None) -> RunVerdict:
    """One run of one request against its reference. A differing token is
    ``numeric-near-tie`` only when every piece of evidence calls it noise (docs/oracle.md):
    the pair shift at the flip, the drift of the logprobs before it and, when the run was
    scored by teacher forcing, the drift at every position of the run, each within its bound."""
    finished = rec is not None and (rec.finish_reason is not None or rec.cancelled)
    if hist.crashed and not finished:
        return RunVerdict("engine-crash", detail=hist.crash_detail)
    if rec is None:
        return RunVerdict("error", detail="request has no record in the history")
    if rec.error:
        return RunVerdict("error", detail=rec.error)
    if ref is None:
        return RunVerdict("error", detail="no reference output")
    cmp = compare(ref, rec, send.max_tokens)
    prompt = _prompt_broken(ref, rec, bounds)
    if cmp.kind == "same" and prompt is None:
        return RunVerdict("ok", cmp)
    race = reloaded_while_running(hist, rec)
    if race is not None:
        return RunVerdict("unconstrained", cmp, detail=race)
    if cmp.kind == "prefix":
        if _stopped_early(ref, rec, cmp.compared):
            # The run chose end-of-sequence where the reference chose a token: that is a
            # different token (just not one in token_ids), judged by the same rule.
            cmp = early_stop_comparison(ref, rec, cmp.compared)
        elif prompt is None:
            why = "cancelled" if rec.cancelled else f"ended after {cmp.compared} tokens ({rec.finish_reason})"
            return RunVerdict("truncation", cmp, detail=why)
    if cmp.kind != "diverged" and prompt is not None:
        return RunVerdict("corruption", cmp, detail=prompt, evidence=("prompt",))
    got = "end of sequence" if cmp.got_token is None else str(cmp.got_token)
    if cmp.ref_token is None:
        return RunVerdict("corruption", cmp, evidence=("stop",),
                          detail=f"token {cmp.first_divergence}: the reference stopped there ({ref.finish_reason}), "
                                 f"the run went on with {got} after the same tokens: a stop rule was not applied")
    head = f"token {cmp.first_divergence}: reference {cmp.ref_token}, got {got}"
    drifts = teacher_drifts(rec, scoring) if scoring is not None else None
    teacher = max(drifts) if drifts else None
    over = sum(d > bounds.teacher for d in drifts) if drifts else None

    corrupt: list[tuple[str, str]] = []
    shift = _pair_shift(cmp)
    if shift is None:
        corrupt.append(("margin", "reference margin unknown"))
    elif math.isnan(shift):  # every token masked: no margin, so no evidence of noise
        corrupt.append(("margin", "the logprobs at the flip are NaN (no margin to call it noise)"))
    elif shift >= bounds.near_tie:
        parts = f"reference margin {cmp.ref_margin:.3g}" + (
            f" + the run's own margin {cmp.run_margin:.3g}" if cmp.run_margin is not None else "")
        corrupt.append(("margin", f"the pair shift {shift:.3g} >= {bounds.near_tie:.3g} ({parts})"))
    if cmp.prefix_drift is not None and cmp.prefix_drift > bounds.drift:
        corrupt.append(("drift", f"the logprobs before it had drifted by {cmp.prefix_drift:.3g} "
                                 f"(> {bounds.drift:.3g})"))
    if prompt is not None:
        corrupt.append(("prompt", prompt))
    if teacher is not None and teacher > bounds.teacher:
        corrupt.append(("teacher", f"teacher-forced alone on a clean cache, the run's own tokens differ by up to "
                                   f"{teacher:.3g} at {over} of {len(drifts or [])} positions (> {bounds.teacher:.3g})"))
    if corrupt:
        runner_up = "" if cmp.got_token is None or cmp.ref_runner_up in (None, cmp.got_token) else \
            f"; {cmp.got_token} was not even the reference's runner-up ({cmp.ref_runner_up})"
        return RunVerdict("corruption", cmp, detail=f"{head}: not noise: " + "; ".join(w for _, w in corrupt)
                          + runner_up, teacher=teacher, teacher_over=over, evidence=tuple(k for k, _ in corrupt))
    noise = [f"pair shift {shift:.3g} < {bounds.near_tie:.3g}"]
    if cmp.prefix_drift is not None:
        noise.append(f"drift {cmp.prefix_drift:.3g} <= {bounds.drift:.3g}")
    noise.append(f"teacher-forced drift {teacher:.3g} <= {bounds.teacher:.3g}" if teacher is not None
                 else "not scored by teacher forcing")
    return RunVerdict("numeric-near-tie", cmp, detail=f"{head}: noise by every measure: " + ", ".join(noise),
                      teacher=teacher, teacher_over=over)


def with_liveness(v: RunVerdict, stall: Stall | None) -> RunVerdict:
    """A run's verdict with its liveness judged too (oracle/liveness.py): a stalled request is
    ``stall`` unless its tokens are already worse. The stall's witness replaces the token
    comparison, which would otherwise read as the finding's first differing token."""
    if stall is None or SEVERITY[v.cls] <= SEVERITY["stall"]:
        return v
    return RunVerdict("stall", detail=stall.describe(), evidence=("liveness",))


def _prompt_broken(ref: RequestRecord, rec: RequestRecord, bounds: NoiseBounds) -> str | None:
    """Why the run's prompt logprobs are not the reference's (requests that asked for them), or
    None. Both are prefills of one prompt: calibration measures that pair into the teacher
    bound (oracle/noise.py ``bounds_from``)."""
    drifts = prompt_drifts(ref, rec)
    if not drifts or max(drifts) <= bounds.teacher:
        return None
    worst = max(range(len(drifts)), key=drifts.__getitem__)
    over = sum(d > bounds.teacher for d in drifts)
    return (f"the prompt logprobs differ from the reference's by up to {drifts[worst]:.3g} (prompt position "
            f"{worst + 1}; {over} of {len(drifts)} positions > {bounds.teacher:.3g})")


def stop_at_flip(send: SendEvent, request_id: str, ref: RequestRecord, bounds: NoiseBounds) -> StopAtFlip:
    """Where a run of ``request_id`` (``send`` or a completion of it) is corruption whatever
    else it records: a token other than the reference's at a position whose reference margin
    alone reaches the near-tie bound (or is unknown), or going on where the reference stopped.
    The pair shift there is at least that margin, and nothing recorded later (teacher forcing
    scores only near ties) can make it noise; a replay that reads only this request's class may
    stop there (``Engine.replay(settled=...)``)."""
    tokens = ref.token_ids[: send.max_tokens]
    decided = []
    for i in range(len(tokens)):
        m = margin_at(ref, i)
        decided.append(m is None or math.isnan(m) or m >= bounds.near_tie)
    stopped = (ref.finish_reason == "stop" and not ref.cancelled and ref.error is None
               and len(tokens) == len(ref.token_ids))
    return StopAtFlip(request=request_id, tokens=tokens, decided=decided, stopped=stopped)


def reloaded_while_running(hist: History, rec: RequestRecord) -> str | None:
    """The lifecycle contract's one ambiguous case (docs/oracle.md, "Adapter lifecycle"): the
    request's own adapter was reloaded (vLLM's ``load_inplace``: new weights under the same
    adapter id) after the request was admitted and before it finished. The engine may then
    serve its remaining tokens with either weights, switching at any step, so every output is
    legal and no reference can judge it. Returns why, or None."""
    if rec.adapter is None:
        return None
    admitted = False
    for e in hist.events:
        if e.kind == "send" and e.request_id == rec.request_id:
            admitted = True
        elif admitted and e.kind == "reload-adapter" and e.adapter == rec.adapter and _before_end(e, rec):
            when = f"step {e.actual_step}" if e.actual_step is not None else f"{e.actual_offset_ms or 0:.0f} ms"
            return (f"adapter {rec.adapter!r} was reloaded in place at {when} while this request ran: any output is "
                    f"legal (vLLM's load_inplace swaps the weights under the running request's adapter id)")
    return None


def _before_end(e: EventRecord, rec: RequestRecord) -> bool:
    end_step = rec.finished_step if rec.finished_step is not None else rec.cancel_step
    end_ms = rec.finished_ms if rec.finished_ms is not None else rec.cancel_ms
    if e.actual_step is not None and end_step is not None:
        return e.actual_step <= end_step
    if e.actual_offset_ms is not None and end_ms is not None:
        return e.actual_offset_ms <= end_ms
    return True  # never ended (the engine crashed): the reload may have reached it


def _stopped_early(ref: RequestRecord, rec: RequestRecord, n: int) -> bool:
    """An uncancelled run that finished on a stop condition before the reference did."""
    return (not rec.cancelled and rec.finish_reason == "stop" and len(ref.token_ids) > n
            and rec.error is None)


@dataclass
class _Acc:
    send: SendEvent
    verdicts: list[RunVerdict] = field(default_factory=list)
    sequences: list[tuple[int, ...]] = field(default_factory=list)
    broke: str | None = None


def check(trace: Trace, histories: list[History], references: dict[str, RequestRecord],
          bounds: NoiseBounds | None = None, scores: Sequence[Scoring] = ()) -> list[Divergence]:
    """Verdicts for every request of ``trace`` in every arm present in ``histories``, with the
    teacher-forced ``scores`` of diverged runs where there are any."""
    th = bounds or default_bounds(trace.engine.dtype)
    scored = {(s.arm, s.run_index, s.request_id): s for s in scores}
    by_arm: dict[str, list[History]] = defaultdict(list)
    for h in histories:
        by_arm[h.arm].append(h)
    out: list[Divergence] = []
    for arm, hs in by_arm.items():
        # One verdict per completion: every child of a send's ``n`` is judged by its reference.
        accs = {cid: _Acc(s) for s in trace.sends for cid in s.completion_ids}
        crash_only: list[History] = []
        for h in hs:
            touched = False
            stalled = stalls(trace, h)  # in-process histories only: servers record no steps
            for rid, acc in accs.items():
                rec = h.requests.get(rid)
                ref = references.get(acc.send.request_id)
                v = classify_run(acc.send, ref, rec, h, th, scored.get((h.arm, h.run_index, rid)))
                v = with_liveness(v, stalled.get(rid))
                touched |= v.cls == "engine-crash"
                acc.verdicts.append(v)
                if acc.broke is None and v.cls in DIVERGENT_CLASSES:
                    # The run's own state first; else the reference's (a bug that fires when
                    # the request runs alone corrupts the reference instead).
                    own = origin(h.breaks, rid)
                    acc.broke = own or (origin(ref.breaks, acc.send.request_id) if ref is not None else None)
                if rec is not None and not rec.cancelled and v.cls != "engine-crash":
                    acc.sequences.append(tuple(rec.token_ids))
            if h.crashed and not touched:
                crash_only.append(h)
        for rid, acc in accs.items():
            out.append(_aggregate(rid, arm, acc, references.get(acc.send.request_id)))
        if crash_only:
            lo, hi = wilson(len(crash_only), len(hs))
            out.append(Divergence(request_id=ENGINE, class_="engine-crash", arm=arm, runs_diverged=len(crash_only),
                                  runs=len(hs), rate_low=lo, rate_high=hi,
                                  detail=crash_only[0].crash_detail))
    return out


def _aggregate(rid: str, arm: str, acc: _Acc, ref: RequestRecord | None) -> Divergence:
    vs = acc.verdicts
    worst = min(vs, key=lambda v: SEVERITY[v.cls])
    diverged = [v for v in vs if v.cls in DIVERGENT_CLASSES]
    firsts = [v.comparison.first_divergence for v in diverged
              if v.comparison is not None and v.comparison.first_divergence is not None]
    first = min(firsts) if firsts else None
    margin = drift = run_margin = None
    if first is not None:
        for v in diverged:
            if v.comparison and v.comparison.first_divergence == first:
                margin, drift, run_margin = v.comparison.ref_margin, v.comparison.prefix_drift, v.comparison.run_margin
                break
    teachers = [v.teacher for v in diverged if v.teacher is not None]
    overs = [v.teacher_over for v in diverged if v.teacher_over is not None]
    lo, hi = wilson(len(diverged), len(vs))
    cls, evidence, detail = worst.cls, list(worst.evidence), worst.detail
    if cls == "numeric-near-tie" and acc.broke is not None:
        # A harmful post-condition broke on this request's own state (oracle/postconditions.py):
        # it read KV that is not its own, however small the flipped margin. Clean vLLM breaks
        # none, so 16-bit noise is never escalated by this.
        cls, evidence = "corruption", [*evidence, f"postcondition:{acc.broke}"]
        detail = (f"{detail}; but vLLM's KV bookkeeping broke on this request's own state ({acc.broke}): "
                  f"it read KV that is not its own")
    return Divergence(
        request_id=rid, class_=cls, arm=arm, first_divergence=first, runs_diverged=len(diverged),
        runs=len(vs), margin=margin, drift=drift, run_margin=run_margin, teacher_drift=max(teachers, default=None),
        teacher_over=max(overs, default=None), evidence=evidence,
        variants=max(1, len(set(acc.sequences))), rate_low=lo, rate_high=hi, detail=detail,
        broke=acc.broke,
    )


def divergent(verdicts: list[Divergence], *, include_near_ties: bool = True) -> list[Divergence]:
    keep = set(DIVERGENT_CLASSES) - (set() if include_near_ties else {"numeric-near-tie"})
    return [v for v in verdicts if v.class_ in keep]
