"""Buckets: one key, one bucket, compared by equality (pure). docs/oracle.md "Buckets" states the
rule; the data is in traces/buckets.py; the interventions ``decide`` asks for run in triage/.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Literal, get_args

from kvfuzz.traces import Divergence, Finding
from kvfuzz.traces.buckets import KEY_MECHANISMS, Bucket, BucketDescription, BucketKey, Outcome, ReleaseRange
from kvfuzz.traces.finding import DIVERGENT_CLASSES, MECHANISM_WORDS, Explanation
from kvfuzz.traces.history import SELF_ONLY_BREAKS

# The ablations cheap enough for every unexplained finding (no engine restart).
CHEAP_MECHANISMS = ("concurrency", "cancels", "lora")

# What triage can run for a finding, each a replay or a few (``Executor``, triage/executor.py).
Intervention = Literal["attribute", "float32-control", "confirm", "minimize"]
INTERVENTIONS: frozenset[str] = frozenset(get_args(Intervention))


@dataclass(frozen=True)
class Facts:
    """What one key of a finding rests on so far."""

    key: BucketKey
    victim: str | None = None
    attributed: bool = True  # no arm left whose re-run could change ``explained_by``
    class_settled: bool = True  # not a 16-bit near tie waiting for its float32 control
    confirmed: bool = False  # the bounded confirmation ran; ``key`` holds its outcome
    witness: bool = False  # a witness minimized to ``victim`` exists (the bucket's case, if it opens)
    allowed: frozenset[str] = INTERVENTIONS  # what the settings and the budget let run now


@dataclass(frozen=True)
class Run:
    intervention: Intervention
    victim: str | None = None


@dataclass(frozen=True)
class Join:
    key: BucketKey


@dataclass(frozen=True)
class Open:
    key: BucketKey


def decide(facts: Facts, buckets: Mapping[str, Bucket]) -> Run | Join | Open:
    """The next step for one key: an intervention it still needs and may run, else the bucket
    its key equals (join), else a new bucket (open) once its witness is minimized, if it may be."""
    can = facts.allowed
    if not facts.attributed and "attribute" in can:
        return Run("attribute")
    if not facts.class_settled and "float32-control" in can:
        return Run("float32-control", facts.victim)
    key = facts.key
    if not facts.attributed:
        key = key.model_copy(update={"provisional": True, "verdicts": {}})
    # A near tie is never confirmed: 16-bit noise has no cause; its float32 control decides its class.
    elif key.confirmable and key.cls != "numeric-near-tie" and not facts.confirmed:
        if "confirm" in can:
            return Run("confirm", facts.victim)
        key = key.model_copy(update={"provisional": True, "verdicts": {}})
    if key.digest() in buckets:
        return Join(key)
    if not facts.witness and key.crash_kind is None and "minimize" in can:
        return Run("minimize", facts.victim)
    return Open(key)


def keys_of(finding: Finding) -> list[BucketKey]:
    """The finding's keys from its record: one per explaining toggle, and one per first harmful
    break among its unexplained victims (none: no break) — most severe class only."""
    worst = finding.worst_class()
    if worst not in DIVERGENT_CLASSES:
        return []
    if worst == "engine-crash":
        crash = finding.crash
        return [BucketKey(cls=worst, crash_kind=crash.kind if crash is not None else "died",
                          crash_state=crash_state(crash.detail) if crash is not None else None)]
    divs = [d for d in finding.divergences if d.class_ == worst]
    keys = [BucketKey(cls=worst, explained_by=e) for e in sorted({d.explained_by for d in divs if d.explained_by})]
    open_ = [d for d in divs if not d.explained_by]
    names: list[str | None] = [*sorted({d.broke for d in open_ if d.broke})]
    # A victim that broke nothing beside victims that did is theirs when one of those breaks can
    # harm other requests; when every one harms only its own request, it is another cause's.
    if open_ and (not names or (all(n in SELF_ONLY_BREAKS for n in names) and any(d.broke is None for d in open_))):
        names.append(None)
    keys += [BucketKey(cls=worst, broke=n) for n in names]
    return keys


def crash_state(detail: str) -> str | None:
    """What a crash said (the exception and its message, after "raised"), its numbers and
    addresses replaced: one cause's crashes differ in those, two causes' rarely in nothing else."""
    text = detail.split(" raised ", 1)[-1].strip().splitlines()
    if not text:
        return None
    return re.sub(r"0x[0-9a-fA-F]+|\d+", lambda m: "0x?" if m[0].startswith("0x") else "N", text[0])[:200] or None


def same_key_victims(finding: Finding, cls: str, broke: str | None) -> list[Divergence]:
    """The finding's unexplained divergences of class ``cls`` whose victims broke ``broke``
    (None: nothing): the victims one unexplained key speaks for."""
    return [d for d in finding.divergences if d.class_ == cls and d.explained_by is None and d.broke == broke]


def victim_of(finding: Finding, key: BucketKey) -> str | None:
    """The request a key's interventions judge: the leading victim it speaks for (None: an
    explained key, whose witness keeps the minimizer's own choice)."""
    if key.explained_by is not None or key.crash_kind is not None:
        return None
    lead = finding.leading(same_key_victims(finding, key.cls, key.broke))
    return lead.request_id if lead is not None else None


def verdicts_of(explanation: Explanation | None) -> dict[str, Outcome]:
    """The key's part of an ablation: engine mechanisms whose removal was tried and judged. A
    removal counts as "disappears" only when the victim stopped diverging altogether; one that
    left a milder divergence (corruption in bfloat16 -> a near tie in float32) says nothing."""
    if explanation is None:
        return {}
    out: dict[str, Outcome] = {}
    for a in explanation.ablations:
        if a.mechanism not in KEY_MECHANISMS:
            continue
        if a.outcome == "persists":
            out[a.mechanism] = "persists"
        elif a.outcome == "disappears" and a.victim_class not in DIVERGENT_CLASSES:
            out[a.mechanism] = "disappears"
    return out


def words(mechanisms: Iterable[str]) -> str:
    return ", ".join(MECHANISM_WORDS.get(m, m) for m in mechanisms)


def describe(key: BucketKey, finding: Finding) -> BucketDescription:
    """The bucket's description, as measured on its witness: what it needs, how many requests
    it has and which kinds of events remain."""
    ex, t = finding.explanation, finding.trace
    kinds = {"send": bool(t.sends), "cancel": bool(t.cancels), "adapter": any(s.adapter for s in t.sends),
             "shared-prefix": any(getattr(s.prompt, "prefix_len", 0) for s in t.sends),
             "reset-prefix-cache": bool(t.resets)}
    events = sorted(k for k, present in kinds.items() if present)
    measured = ex is not None and bool(ex.needs or ex.not_needed)
    d = BucketDescription(needs=list(ex.needs) if ex else [], not_needed=list(ex.not_needed) if ex else [],
                          not_tried=list(ex.skipped) if ex else [], measured=measured,
                          requests=len(t.sends), events=events)
    if not measured:
        needs = "not measured"
    else:
        needs = words(d.needs) or "none of the mechanisms tried"
        if d.not_tried:
            needs += f" (not tried: {words(d.not_tried)})"
    d.text = f"{key.label()}; needs: {needs}; {d.requests} request(s) ({', '.join(events)})"
    return d


def split_by_release(bucket: Bucket, ranges: Mapping[str, ReleaseRange]) -> list[Bucket]:
    """``bucket`` after its findings were bisected (``ranges``: finding file -> its range): one
    bucket when every conclusive range agrees, else one per distinct range — findings whose
    bisections disagree are two bugs, whatever their key says. The group of the bucket's
    representative (else the first) keeps the id; the others become ``<id>.r2``, ``<id>.r3``,
    ... with the same key. Findings not bisected, or whose bisection concluded nothing, stay
    with the bucket (a range says nothing about them)."""
    by_range: dict[tuple[str, str | None, str | None], ReleaseRange] = {}
    for f, r in ranges.items():
        if r.conclusive:
            g = by_range.setdefault((r.verdict, r.first_bad, r.first_good), r.model_copy(update={"findings": []}))
            g.findings.append(f)
    groups = list(by_range.values())
    if not groups:
        return [bucket]
    keep = next((g for g in groups if bucket.representative in g.findings or bucket.case in g.findings), groups[0])
    others = [g for g in groups if g is not keep]
    moved = {f for g in others for f in g.findings}
    out = [bucket.model_copy(update={"releases": keep, "findings": [f for f in bucket.findings if f not in moved],
                                     "count": bucket.count - sum(f in bucket.findings for f in moved)})]
    for n, g in enumerate(others, start=2):
        out.append(Bucket(id=f"{bucket.id}.r{n}", key=bucket.key, description=bucket.description,
                          count=len(g.findings), findings=list(g.findings), representative=g.findings[0],
                          releases=g, split_from=bucket.id))
    return out

