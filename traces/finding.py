"""The finding: a trace, the runs that exposed a divergence, the references, and the verdicts.

Findings are what kvfuzz hands to people: attached to bug reports, replayed by ``kvfuzz
replay`` and ``kvfuzz gate``, minimized by ``kvfuzz minimize``. They are plain JSON data.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable
from typing import Any, Final, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from .buckets import AblationOutcome, BucketMembership

from .history import History, RequestRecord, Scoring
from .provenance import Attribution, BoundsUsed, CrashInfo, Provenance, migrate_notes
from .trace import Trace

# Version 3: crash, provenance, bounds, attribution and reproduced_in are typed
# fields; versions 1 and 2 kept them in ``notes`` and are migrated on load.
FINDING_SCHEMA_VERSION: Final = 3
FINDING_SCHEMA_VERSIONS = (1, 2, 3)

# Verdict classes, most severe first. "ok", "truncation" and "unconstrained" are verdicts, not
# divergences. "unconstrained": the schedule allows any output for this request (its adapter was
# reloaded in place while it ran; docs/oracle.md, "Adapter lifecycle"). "stall": the request
# waited longer than vLLM's scheduler allows while others were served (docs/oracle.md,
# "Liveness"); a wrong output is worse than a late one, a hang (engine-crash) worse than both.
DivergenceClass = Literal["engine-crash", "error", "corruption", "stall", "numeric-near-tie", "unconstrained",
                          "truncation", "ok"]
DIVERGENT_CLASSES: tuple[str, ...] = ("engine-crash", "error", "corruption", "stall", "numeric-near-tie")
SEVERITY: dict[str, int] = {c: i for i, c in enumerate(["engine-crash", "error", "corruption", "stall",
                                                        "numeric-near-tie", "unconstrained", "truncation", "ok"])}


class _Data(BaseModel):
    model_config = ConfigDict(extra="forbid", ser_json_inf_nan="constants", populate_by_name=True)


def _drop(data: Any, names: Iterable[str]) -> Any:
    """Fields written by findings of an older kvfuzz that nothing reads any more: ignored."""
    if isinstance(data, dict) and any(n in data for n in names):
        return {k: v for k, v in data.items() if k not in names}
    return data


class Environment(_Data):
    kvfuzz_version: str
    vllm_version: str | None = None
    torch_version: str | None = None
    python: str | None = None
    platform: str | None = None
    device: str = "cpu"
    engine: Literal["inprocess", "server", "url"] = "inprocess"
    model: str | None = None
    model_hash: str | None = None
    toggles: list[str] = Field(default_factory=list)
    engine_flags: dict[str, Any] = Field(default_factory=dict)


class Divergence(_Data):
    """One request's verdict across the runs of one arm."""

    request_id: str
    # "class" is a Python keyword; it is the JSON name.
    class_: DivergenceClass = Field(alias="class")
    arm: str = "default"
    # Index of the first generated token that differs from the reference (None: no token diff).
    first_divergence: int | None = None
    runs_diverged: int = 0
    runs: int = 0
    # Reference top-1 minus top-2 logprob at the first divergent position.
    margin: float | None = None
    # Largest |logprob difference| (nats) of the same tokens before that position (a near tie
    # flipped after a drift above the noise bound is corruption, not noise).
    drift: float | None = None
    # The run's own top-1/top-2 margin there: noise flips a near tie into a near tie.
    run_margin: float | None = None
    # Teacher forcing (traces.history.Scoring): the largest |run logprob - the same token scored
    # alone on a clean cache| over the run, and at how many positions it exceeded the bound.
    teacher_drift: float | None = None
    teacher_over: int | None = None
    # The evidence that decided the class: "margin", "drift", "teacher", "control:<name>";
    # empty for a numeric-near-tie (every piece called it noise).
    evidence: list[str] = Field(default_factory=list)
    # Distinct token sequences observed across runs (over the compared span).
    variants: int = 1
    # Wilson 95% interval of the divergence rate runs_diverged / runs.
    rate_low: float | None = None
    rate_high: float | None = None
    # Toggle that explains it (toggle attribution); None = unexplained.
    explained_by: str | None = None
    detail: str | None = None
    # The first of vLLM's post-conditions broken on this request's own state in a diverged run
    # (oracle/postconditions.py; in-process runs only): evidence of the cause, in the bucket key.
    broke: str | None = None

    @model_validator(mode="before")
    @classmethod
    def _legacy(cls, data: Any) -> Any:
        return _drop(data, ("later", "repair"))


class ControlResult(_Data):
    """A control arm re-run of the finding (serialized, batch-invariant, ...)."""

    name: str
    reproduced: bool
    available: bool = True
    detail: str | None = None
    divergences: list[Divergence] = Field(default_factory=list)
    # Every request's verdict in the control (ok ones too), the runs and
    # the toggles it ran with, and the trace it replayed (e.g. the serialized schedule).
    verdicts: list[Divergence] = Field(default_factory=list)
    runs: int = 0
    toggles: list[str] = Field(default_factory=list)
    trace: Trace | None = None


class Minimization(_Data):
    original: str | None = None
    original_requests: int = 0
    requests: int = 0
    replays: int = 0
    signature: str | None = None
    # What was kept and how it was judged (triage/minimize.py).
    original_events: int = 0
    events: int = 0
    arm: str | None = None
    toggles: list[str] = Field(default_factory=list)
    # k-of-m acceptance: a candidate is kept when the signature reproduces in >= min_hits of
    # repeats replays (1 of 1 on the deterministic in-process engine).
    repeats: int = 1
    min_hits: int = 1
    # Engine runs spent on references for candidates (each request alone on a clean cache).
    reference_runs: int = 0
    seconds: float = 0.0
    # The minimized trace reproduced the signature when replayed again from scratch.
    verified: bool = False
    # Engine settings the minimizer changed (field -> [original, minimized]).
    engine_changes: dict[str, Any] = Field(default_factory=dict)
    # One line per pass, e.g. "ddmin: 10 -> 3 requests (14 candidates)".
    passes: list[str] = Field(default_factory=list)
    stopped: str | None = None  # why it stopped early (budget), None when it ran to the end


class Ablation(_Data):
    """The finding replayed with one engine mechanism taken away (triage/explain.py)."""

    mechanism: str  # prefix-caching, chunked-prefill, preemption, concurrency, cancels, lora, lora-swaps, numerics
    change: str  # what was changed, in words
    # disappears: the victim no longer diverges that way (the mechanism is needed);
    # persists: it still does; n/a: the trace does not use it; failed: the replay could not run;
    # skipped: the triage time box ran out first (kvfuzz explain FINDING runs it in full);
    # moved: the victim no longer corrupts, but another request that corrupted with it in the
    # finding still does (the removal changed which request the cause hit: no evidence);
    # flaky: it disappeared, but the victim does not reliably diverge with nothing removed
    # either (fewer than all of its runs, or a control replay): no evidence.
    outcome: AblationOutcome
    victim_class: str | None = None
    detail: str | None = None


class Explanation(_Data):
    """Causal ablation (``kvfuzz explain``): which engine mechanisms a finding needs. It points
    a maintainer at a subsystem: "needs: prefix caching, KV pressure; does not need: chunked
    prefill, cancels"."""

    victim: str
    cls: str
    arm: str
    ablations: list[Ablation] = Field(default_factory=list)
    replays: int = 0
    seconds: float = 0.0

    @property
    def needs(self) -> list[str]:
        return [a.mechanism for a in self.ablations if a.outcome == "disappears"]

    @property
    def not_needed(self) -> list[str]:
        return [a.mechanism for a in self.ablations if a.outcome == "persists"]

    @property
    def skipped(self) -> list[str]:
        return [a.mechanism for a in self.ablations if a.outcome == "skipped"]

    def summary(self) -> str:
        words = MECHANISM_WORDS
        if self.skipped and not (self.needs or self.not_needed):
            return "not ablated: the triage time box ran out (kvfuzz explain FINDING)"
        needs = ", ".join(words.get(m, m) for m in self.needs) or "none of the mechanisms tried"
        other = ", ".join(words.get(m, m) for m in self.not_needed)
        left = ", ".join(words.get(m, m) for m in self.skipped)
        return (f"needs: {needs}" + (f"; does not need: {other}" if other else "")
                + (f"; not tried (time box): {left}" if left else ""))


class VersionResult(_Data):
    """One release probed by ``kvfuzz bisect`` (triage/bisect.py): the finding replayed K times
    in that release's environment."""

    version: str
    # bad: reproduced (k >= the threshold); good: not reproduced; unavailable: the release's
    # environment cannot be built; error: the replay itself failed (infrastructure); masked:
    # another crash ended every run first. The last three are never read as good or bad.
    status: Literal["bad", "good", "unavailable", "error", "masked"]
    k: int = 0  # runs in which a victim request diverged
    runs: int = 0  # K
    # Wilson 95% interval of k / runs (None when nothing ran).
    rate_low: float | None = None
    rate_high: float | None = None
    seconds: float = 0.0  # the replay's wall time (building the environment not counted)
    order: int = 0  # 1 = probed first
    vllm: str | None = None  # the vLLM the replay reported running
    detail: str | None = None


class BisectRecord(_Data):
    """``kvfuzz bisect``: in which vLLM releases the finding reproduces (docs/bisect.md)."""

    versions: list[str]  # the releases searched, ascending (probed or not)
    results: list[VersionResult] = Field(default_factory=list)  # probed only, ascending
    verdict: Literal["reproduces in every release", "reproduces in no release", "regression", "fixed",
                     "regression, then fixed", "inconclusive"]
    detail: str | None = None
    first_bad: str | None = None  # regression: the oldest bad release after the last good one
    last_good: str | None = None
    first_good: str | None = None  # fix: the oldest good release after the last bad one
    last_bad: str | None = None
    # Releases between the two sides of the transition that could not be probed (the
    # transition may lie in one of them).
    gap: list[str] = Field(default_factory=list)
    exhaustive: bool = False  # every release in the range was probed
    runs: int = 0
    min_rate: float = 0.0  # --min-rate
    min_hits: int = 1  # bad when k >= min_hits = max(1, ceil(min_rate * runs))
    arms: str = "vanilla"  # --arms as given (vanilla: vLLM as shipped)
    with_: list[str] = Field(default_factory=list, alias="with")
    without: list[str] = Field(default_factory=list)
    engine: Literal["inprocess", "server"] = "inprocess"
    device: str = "cpu"
    dtype: str | None = None
    source: str | None = None
    seconds: float = 0.0
    created: str | None = None
    kvfuzz_version: str | None = None

    def result(self, version: str) -> VersionResult | None:
        return next((r for r in self.results if r.version == version), None)


# How mechanisms read in reports (the names match Toggle.needs in harness/toggles).
MECHANISM_WORDS = {"prefix-caching": "prefix caching", "chunked-prefill": "chunked prefill",
                   "preemption": "KV pressure (preemption, recycled blocks)", "concurrency": "concurrent requests",
                   "cancels": "cancels", "lora": "LoRA adapters", "lora-swaps": "adapter swaps (more adapters than slots)",
                   "numerics": "16-bit numerics"}


class Finding(_Data):
    schema_version: Literal[1, 2, 3] = FINDING_SCHEMA_VERSION
    kind: Literal["finding"] = "finding"
    id: str = ""
    created: str | None = None
    trace: Trace
    environment: Environment
    references: dict[str, RequestRecord] = Field(default_factory=dict)
    runs: list[History] = Field(default_factory=list)
    divergences: list[Divergence] = Field(default_factory=list)
    # Per-request verdicts including ok/truncation, for reports.
    verdicts: list[Divergence] = Field(default_factory=list)
    arms: dict[str, list[str]] = Field(default_factory=dict)  # arm name -> toggles
    controls: list[ControlResult] = Field(default_factory=list)
    # Teacher-forced scorings of the diverged runs (the evidence behind teacher_drift).
    scores: list[Scoring] = Field(default_factory=list)
    minimization: Minimization | None = None
    explanation: Explanation | None = None
    # Which vLLM releases it reproduces in (kvfuzz bisect); older findings have none.
    bisect: BisectRecord | None = None
    # The bucket (one root cause) a campaign filed it under: oracle/buckets.py.
    bucket: str | None = None
    # Typed facts (traces/provenance.py) that code reads; schema 1/2 kept them in notes.
    crash: CrashInfo | None = None  # engine-crash findings: how it crashed
    provenance: Provenance = Field(default_factory=Provenance)
    bounds: BoundsUsed | None = None  # the noise bounds the verdicts were judged with
    attribution: Attribution | None = None  # toggle attribution ran (triage/attribution.py)
    reproduced_in: list[str] | None = None  # every arm (its own and the controls') that reproduced it
    # Its bucket memberships, one per class-worst divergence key (traces/buckets.py).
    buckets: list[BucketMembership] = Field(default_factory=list)
    # For people only: code never reads a key from it (tests/test_notes_contract.py).
    notes: dict[str, Any] = Field(default_factory=dict)

    @model_validator(mode="before")
    @classmethod
    def _migrate(cls, data: Any) -> Any:
        if isinstance(data, dict) and data.get("schema_version") != FINDING_SCHEMA_VERSION:
            data = {**migrate_notes(data), "schema_version": FINDING_SCHEMA_VERSION}
        return data

    def inherit(self, other: Finding, *, drop_notes: tuple[str, ...] = ()) -> None:
        """Take over what ``other`` (the same trace, judged before) knew and this one does
        not: a re-judged, attributed or minimized finding keeps where it came from."""
        for name in ("crash", "bounds", "attribution", "reproduced_in"):
            if getattr(self, name) is None:
                setattr(self, name, getattr(other, name))
        self.provenance = self.provenance.under(other.provenance)
        self.notes = {**{k: v for k, v in other.notes.items() if k not in drop_notes}, **self.notes}

    def signature(self) -> str:
        """What makes two findings 'the same bug' for dedup and minimization:
        the most severe class and the set of victim requests."""
        worst = min((d.class_ for d in self.divergences), key=SEVERITY.__getitem__, default="ok")
        victims = sorted({d.request_id for d in self.divergences if d.class_ == worst})
        return f"{worst}:{','.join(victims)}"

    def compute_id(self) -> str:
        body = json.dumps(
            {"trace": self.trace.trace_id(), "sig": self.signature(), "toggles": self.environment.toggles},
            sort_keys=True,
        )
        return hashlib.sha256(body.encode()).hexdigest()[:12]

    def worst_class(self) -> str:
        return min((d.class_ for d in self.divergences), key=SEVERITY.__getitem__, default="ok")

    def leading(self, divs: Iterable[Divergence]) -> Divergence | None:
        """Among ``divs`` (this finding's), the divergence a maintainer looks at first: the most
        severe, then the most often diverged, then the earliest sent (minimization's target, a
        bucket key's victim)."""
        order = {s.request_id: i for i, s in enumerate(self.trace.sends)}
        return min(divs, key=lambda d: (SEVERITY[d.class_], -(d.runs_diverged / max(1, d.runs)),
                                        order.get(d.request_id, -1)), default=None)
