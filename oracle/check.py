"""The checker: histories + references in, one verdict per request per arm out.

Pure functions over recorded data (Jepsen-style: record first, check afterwards), so the same
checker serves the in-process engine, a managed server, a URL, and finding files replayed
years later.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

from kvfuzz.traces import Divergence, History, RequestRecord, SendEvent, Trace
from kvfuzz.traces.finding import DIVERGENT_CLASSES, SEVERITY

from .diff import Comparison, compare, early_stop_comparison
from .stats import wilson

ENGINE = "<engine>"  # pseudo request id for an engine crash that hit no live request


# Default near-tie thresholds (nats) per model dtype; see docs/oracle.md for the measurements
# (benchmarks/margins.py) and the reasoning. float32 is measured here; the 16-bit values
# follow from their resolution (a bf16 logit near 16-32 moves in steps of 0.125, and the vLLM
# reports show batch-order flips at exact ties and 0.125 gaps) and await a GPU re-measurement.
NEAR_TIE_DEFAULTS: dict[str, float] = {"float32": 1e-3, "bfloat16": 0.5, "float16": 0.0625}
_DTYPE_ALIASES = {"fp32": "float32", "float": "float32", "bf16": "bfloat16", "fp16": "float16",
                  "half": "float16"}


def dtype_name(dtype: str | None) -> str:
    d = (dtype or "auto").lower().removeprefix("torch.")
    return _DTYPE_ALIASES.get(d, d)


@dataclass(frozen=True)
class Thresholds:
    """A first divergence where the reference's top-1/top-2 logprob margin is below
    ``near_tie`` is floating-point noise territory (``numeric-near-tie``), above it a
    ``corruption``. ``near_tie=None`` takes the default for the engine's dtype. See
    docs/oracle.md for how the defaults were chosen."""

    near_tie: float | None = None

    def near_tie_for(self, dtype: str | None) -> float:
        if self.near_tie is not None:
            return self.near_tie
        # "auto" and unknown dtypes get the largest (most conservative) default: a 16-bit
        # model must not have its numeric noise reported as corruption.
        return NEAR_TIE_DEFAULTS.get(dtype_name(dtype), max(NEAR_TIE_DEFAULTS.values()))

    def resolve(self, dtype: str | None) -> "Thresholds":
        return Thresholds(near_tie=self.near_tie_for(dtype))


@dataclass
class RunVerdict:
    cls: str
    comparison: Comparison | None = None
    detail: str | None = None


def classify_run(send: SendEvent, ref: RequestRecord | None, rec: RequestRecord | None, hist: History,
                 th: Thresholds) -> RunVerdict:
    finished = rec is not None and (rec.finish_reason is not None or rec.cancelled)
    if hist.crashed and not finished:
        return RunVerdict("engine-crash", detail=hist.crash_detail)
    if rec is None:
        return RunVerdict("error", detail="request has no record in the history")
    if rec.error:
        return RunVerdict("error", detail=rec.error)
    if ref is None:
        return RunVerdict("error", detail="no reference output")
    near_tie = th.near_tie_for(None)
    cmp = compare(ref, rec, send.max_tokens)
    if cmp.kind == "same":
        return RunVerdict("ok", cmp)
    if cmp.kind == "prefix":
        if _stopped_early(ref, rec, cmp.compared):
            # The run chose end-of-sequence where the reference chose a token: that is a
            # different token (just not one in token_ids), judged by the same margin rule.
            cmp = early_stop_comparison(ref, rec, cmp.compared)
        else:
            why = "cancelled" if rec.cancelled else f"ended after {cmp.compared} tokens ({rec.finish_reason})"
            return RunVerdict("truncation", cmp, detail=why)
    got = "end of sequence" if cmp.got_token is None else str(cmp.got_token)
    if cmp.ref_margin is not None and cmp.ref_margin < near_tie:
        if cmp.prefix_drift is not None and cmp.prefix_drift > near_tie:
            # A near tie flipped, but the logprobs before it had already moved by more than the
            # noise the threshold allows: the run did not see the reference's context. (A small
            # KV corruption flips the nearest tie first, so this is where it shows.)
            return RunVerdict("corruption", cmp,
                              detail=f"token {cmp.first_divergence}: reference {cmp.ref_token}, got {got}; reference "
                                     f"margin {cmp.ref_margin:.3g} < {near_tie:g}, but the logprobs before it had "
                                     f"drifted by {cmp.prefix_drift:.3g} nats (> {near_tie:g}: not noise)")
        return RunVerdict("numeric-near-tie", cmp,
                          detail=f"token {cmp.first_divergence}: reference {cmp.ref_token}, got {got}; reference "
                                 f"margin {cmp.ref_margin:.3g} < {near_tie:g}")
    m = "unknown" if cmp.ref_margin is None else f"{cmp.ref_margin:.3g}"
    runner_up = "" if cmp.got_token is None or cmp.ref_runner_up in (None, cmp.got_token) else \
        f"; {cmp.got_token} was not even the reference's runner-up ({cmp.ref_runner_up})"
    return RunVerdict("corruption", cmp,
                      detail=f"token {cmp.first_divergence}: reference {cmp.ref_token}, got {got} "
                             f"(reference margin {m} >= {near_tie:g}{runner_up})")


def _stopped_early(ref: RequestRecord, rec: RequestRecord, n: int) -> bool:
    """An uncancelled run that finished on a stop condition before the reference did."""
    return (not rec.cancelled and rec.finish_reason == "stop" and len(ref.token_ids) > n
            and rec.error is None)


@dataclass
class _Acc:
    send: SendEvent
    verdicts: list[RunVerdict] = field(default_factory=list)
    sequences: list[tuple[int, ...]] = field(default_factory=list)


def check(trace: Trace, histories: list[History], references: dict[str, RequestRecord],
          thresholds: Thresholds | None = None) -> list[Divergence]:
    """Verdicts for every request of ``trace`` in every arm present in ``histories``."""
    th = (thresholds or Thresholds()).resolve(trace.engine.dtype)
    by_arm: dict[str, list[History]] = defaultdict(list)
    for h in histories:
        by_arm[h.arm].append(h)
    out: list[Divergence] = []
    for arm, hs in by_arm.items():
        accs = {s.request_id: _Acc(s) for s in trace.sends}
        crash_only: list[History] = []
        for h in hs:
            touched = False
            for rid, acc in accs.items():
                rec = h.requests.get(rid)
                v = classify_run(acc.send, references.get(rid), rec, h, th)
                touched |= v.cls == "engine-crash"
                acc.verdicts.append(v)
                if rec is not None and not rec.cancelled and v.cls != "engine-crash":
                    acc.sequences.append(tuple(rec.token_ids))
            if h.crashed and not touched:
                crash_only.append(h)
        for rid, acc in accs.items():
            out.append(_aggregate(rid, arm, acc, references.get(rid)))
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
    margin = drift = None
    if first is not None:
        for v in diverged:
            if v.comparison and v.comparison.first_divergence == first:
                margin, drift = v.comparison.ref_margin, v.comparison.prefix_drift
                break
    lo, hi = wilson(len(diverged), len(vs))
    return Divergence(
        request_id=rid, class_=worst.cls, arm=arm, first_divergence=first, runs_diverged=len(diverged),
        runs=len(vs), margin=margin, drift=drift, variants=max(1, len(set(acc.sequences))), rate_low=lo, rate_high=hi,
        detail=worst.detail,
    )


def divergent(verdicts: list[Divergence], *, include_near_ties: bool = True) -> list[Divergence]:
    keep = set(DIVERGENT_CLASSES) - (set() if include_near_ties else {"numeric-near-tie"})
    return [v for v in verdicts if v.class_ in keep]
