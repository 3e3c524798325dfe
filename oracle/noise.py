"""Noise bounds: how far batch-order floating-point noise can move a temperature-0 run's
logprobs, per dtype, device and model — the line between ``numeric-near-tie`` and
``corruption`` (oracle/check.py, docs/oracle.md "Noise bounds").

Three bounds, each for one piece of evidence:

- ``near_tie`` — the *pair shift* at the first differing token: the reference's margin of its
  token over the run's, plus the run's margin of its token over the reference's (each a
  top-1/top-2 margin, so a lower bound). Noise flips a near tie into a near tie; a shift above
  the bound is not noise.
- ``drift`` — the chosen token's logprob, run vs reference, at the positions before the flip
  (decode vs decode).
- ``teacher`` — the run's own tokens scored by the request alone on a clean cache (teacher
  forcing), compared with the run's decode logprobs at every position, before and after the
  flip. Noise stays within it everywhere; wrong KV moves many positions.

A bound comes from a calibration profile measured on the user's own device (``kvfuzz
calibrate``): the largest value measured, times ``HEADROOM``, and never below the dtype's
resolution. Without a profile, the per-dtype defaults below apply (and the finding says so).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace

from kvfuzz.traces import Finding, RequestRecord, Scoring
from kvfuzz.traces.calibration import CalibrationProfile, ContextNoise

from .diff import prompt_drifts, teacher_drifts

# Bounds are the measured maxima times this: a profile's requests are a sample, and the
# largest value a sample shows underestimates the largest noise a campaign meets.
HEADROOM = 4.0

DTYPES = ("float32", "bfloat16", "float16")
_ALIASES = {"fp32": "float32", "float": "float32", "bf16": "bfloat16", "fp16": "float16", "half": "float16"}
# Significand bits (with the implicit one).
_BITS = {"float32": 24, "bfloat16": 8, "float16": 11}


def dtype_name(dtype: str | None) -> str:
    d = (dtype or "auto").lower().removeprefix("torch.")
    return _ALIASES.get(d, d)


def resolution(dtype: str) -> float:
    """One step (ulp) of a logit between 16 and 32 in ``dtype``: bfloat16 0.125, float16
    0.0156, float32 1.9e-6. Batch order moves 16-bit logits by whole steps, so no bound may
    be finer than two of them (each of two tokens' logits one step)."""
    return 2.0 ** (5 - _BITS[dtype_name(dtype)])


@dataclass(frozen=True)
class NoiseBounds:
    dtype: str
    near_tie: float
    drift: float
    teacher: float
    # Where they came from: "profile", "default" (no profile matched) — plus any override.
    source: str = "default"
    profile: str | None = None
    overrides: tuple[str, ...] = ()

    def floor(self) -> float:
        return 2 * resolution(self.dtype)

    def with_overrides(self, **values: float | None) -> "NoiseBounds":
        given = {k: float(v) for k, v in values.items() if v is not None}
        if not given:
            return self
        return replace(self, near_tie=given.get("near_tie", self.near_tie), drift=given.get("drift", self.drift),
                       teacher=given.get("teacher", self.teacher), overrides=tuple(sorted({*self.overrides, *given})))

    def describe(self) -> str:
        where = f"calibration profile {self.profile}" if self.profile else f"the {self.dtype} defaults"
        over = f", overridden: {', '.join(self.overrides)}" if self.overrides else ""
        return (f"noise bounds from {where}{over}: pair shift < {self.near_tie:.3g}, drift <= {self.drift:.3g}, "
                f"teacher-forced drift <= {self.teacher:.3g} nats")

    def to_json(self) -> dict:
        d = asdict(self)
        d["overrides"] = list(self.overrides)
        return d


# Per-dtype defaults, used when no calibration profile matches (``--no-calibrate``, or the
# replay commands, which do not calibrate): the measured maxima on this project's CPU machine
# and embedded model (docs/benchmarks.md, "Calibration"), times HEADROOM, rounded up.
DEFAULTS: dict[str, dict[str, float]] = {
    "float32": {"near_tie": 1e-3, "drift": 1e-3, "teacher": 1e-3},
    "bfloat16": {"near_tie": 0.5, "drift": 0.25, "teacher": 0.5},
    "float16": {"near_tie": 0.0625, "drift": 0.0625, "teacher": 0.0625},
}


def default_bounds(dtype: str | None) -> NoiseBounds:
    """The defaults for ``dtype``; an unknown or "auto" dtype gets the widest (16-bit noise
    must never be called corruption)."""
    d = dtype_name(dtype)
    if d not in DEFAULTS:
        v = DEFAULTS["bfloat16"]
        return NoiseBounds(dtype="bfloat16", near_tie=v["near_tie"], drift=v["drift"], teacher=v["teacher"],
                           source="default (dtype unknown: widest)")
    v = DEFAULTS[d]
    return NoiseBounds(dtype=d, near_tie=v["near_tie"], drift=v["drift"], teacher=v["teacher"])


def finding_bounds(finding: Finding) -> NoiseBounds:
    """The noise bounds a finding was judged with (``Finding.bounds``); files written before
    there were bounds recorded only ``near_tie``."""
    used = finding.bounds
    base = default_bounds(finding.trace.engine.dtype)
    if used is None:
        return base
    values = {k: v for k in ("near_tie", "drift", "teacher") if (v := getattr(used, k)) is not None}
    if set(values) == {"near_tie"}:  # an older finding: one threshold for margin and drift
        values["drift"] = values["near_tie"]
    return replace(base, **values, source=used.source if used.source is not None else base.source,
                   profile=used.profile, overrides=tuple(used.overrides))


def bounds_from(profile: CalibrationProfile, headroom: float = HEADROOM) -> NoiseBounds:
    """The bounds a profile gives: the measured maxima times ``headroom``, each at least two
    steps of the dtype's resolution."""
    floor = 2 * resolution(profile.key.dtype)
    ctx = profile.contexts
    shift = max([c.max_dmargin for c in ctx] + [s for c in ctx for s in c.flip_shifts] + [0.0])
    drift = max([c.max_dlogprob for c in ctx] + [0.0])
    # One bound for every comparison of a prefill: with a decode (teacher forcing) or with a
    # prefill of the same prompt in another batch (prompt logprobs).
    teacher = max([c.max_teacher for c in ctx] + [c.max_prompt for c in ctx] + [profile.prefill_vs_decode])
    return NoiseBounds(dtype=profile.key.dtype, near_tie=max(floor, headroom * shift),
                       drift=max(floor, headroom * drift), teacher=max(floor, headroom * teacher),
                       source="profile", profile=profile.id)


def measure_context(name: str, references: dict[str, RequestRecord], runs: dict[str, RequestRecord],
                    scorings: dict[str, Scoring], *, prefix_hit_requests: int = 0, chunked_requests: int = 0,
                    preempted_requests: int = 0) -> ContextNoise:
    """How far each request's run in one batch context moved from the same request alone
    (``references``), and from its own tokens scored alone (``scorings``). Pure: kvfuzz
    calibrate records, this measures."""
    ctx = ContextNoise(name=name, prefix_hit_requests=prefix_hit_requests, chunked_requests=chunked_requests,
                       preempted_requests=preempted_requests)
    for rid, run in runs.items():
        ref = references.get(rid)
        if ref is None:
            continue
        ctx.requests += 1
        n = min(len(ref.token_ids), len(run.token_ids))
        for i in range(n):
            if i >= len(ref.logprobs) or i >= len(run.logprobs) or len(ref.logprobs[i]) < 2 or len(run.logprobs[i]) < 2:
                break
            (_, rl), (rt2, rl2) = ref.logprobs[i][0], ref.logprobs[i][1]
            (_, gl), (gt2, gl2) = run.logprobs[i][0], run.logprobs[i][1]
            if ref.token_ids[i] != run.token_ids[i]:
                ctx.flips += 1
                ctx.flip_margins.append(rl - rl2)
                ctx.flip_shifts.append((rl - rl2) + (gl - gl2))
                break
            ctx.positions += 1
            ctx.max_dlogprob = max(ctx.max_dlogprob, abs(rl - gl))
            if rt2 == gt2:
                ctx.max_dmargin = max(ctx.max_dmargin, abs((rl - rl2) - (gl - gl2)))
        ctx.max_prompt = max([ctx.max_prompt, *prompt_drifts(ref, run)])
        scoring = scorings.get(rid)
        if scoring is not None:
            ctx.max_teacher = max([ctx.max_teacher, *teacher_drifts(run, scoring)])
    return ctx
