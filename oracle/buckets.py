"""Buckets: one root cause, one bucket (pure).

ClusterFuzz buckets crashes by their stack; kvfuzz buckets a divergence by what explains it.
A finding's **prekeys** are what a campaign can compute for every finding cheaply, after the
toggle attribution it runs anyway: for each divergent request of the finding's worst class,
``class | explaining toggle`` — or ``class | unexplained | the cheap ablations it needs`` when
no toggle explains it (a candidate vLLM bug: requests one at a time, cancels removed, adapters
removed; three replays). A finding whose prekeys are all known joins those buckets cheaply; one
with a new prekey opens a bucket and is triaged fully (controls, minimization, the full
ablation), which gives the bucket its **description**: the class, the explanation, the
mechanisms the minimal finding needs, and its shape (requests, which event kinds remain).

Known limits (docs/oracle.md "Buckets"): matching uses the prekey only, so two root causes
explained by the same toggle (or, unexplained, needing the same cheap mechanisms) share a
bucket; one root cause whose findings are explained by different toggles (a fault and a fix
that both touch it) gets two; the description is measured on the bucket's first finding.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable

from kvfuzz.traces import Finding
from kvfuzz.traces.finding import DIVERGENT_CLASSES, MECHANISM_WORDS, SEVERITY

# The ablations cheap enough for every unexplained finding (no engine restart).
CHEAP_MECHANISMS = ("concurrency", "cancels", "lora")


def prekeys(finding: Finding, cheap_needs: Iterable[str] | None = None) -> list[str]:
    """``class|explained_by`` for each divergent request of the worst class; unexplained ones
    carry the cheap ablations they need (``cheap_needs``), sorted."""
    worst = finding.worst_class()
    if worst not in DIVERGENT_CLASSES:
        return []
    if worst == "engine-crash":
        kind = finding.crash.kind if finding.crash is not None else "died"
        return [f"engine-crash|{kind}"]
    needs = ",".join(sorted(cheap_needs or ())) or "-"
    keys = {f"{worst}|{d.explained_by}" if d.explained_by else f"{worst}|unexplained|{needs}"
            for d in finding.divergences if d.class_ == worst}
    return sorted(keys)


def bucket_id(prekey: str) -> str:
    return hashlib.sha256(prekey.encode()).hexdigest()[:10]


def shape(finding: Finding) -> dict:
    """The (minimal) trace's shape: how many requests, and which kinds of events remain."""
    t = finding.trace
    kinds = {"send"} if t.sends else set()
    if t.cancels:
        kinds.add("cancel")
    if any(s.adapter for s in t.sends):
        kinds.add("adapter")
    if any(getattr(s.prompt, "prefix_len", 0) for s in t.sends):
        kinds.add("shared-prefix")
    return {"requests": len(t.sends), "events": sorted(kinds)}


def describe(prekey: str, finding: Finding) -> dict:
    """The bucket's key, as measured on its first finding (minimized and explained)."""
    cls, _, rest = prekey.partition("|")
    explained = rest.split("|", 1)[0]
    ex = finding.explanation
    key = {"class": cls, "explained_by": explained, "needs": ex.needs if ex else None,
           "not_needed": ex.not_needed if ex else None, "shape": shape(finding)}
    if ex is None or (ex.skipped and not (ex.needs or ex.not_needed)):
        needs = "not measured"  # no ablation, or the triage time box ran out first
    else:
        needs = ", ".join(MECHANISM_WORDS.get(m, m) for m in ex.needs) or "none of the mechanisms tried"
        if ex.skipped:
            needs += f" (not tried: {', '.join(MECHANISM_WORDS.get(m, m) for m in ex.skipped)})"
    s = key["shape"]
    key["text"] = (f"{cls}, {'explained by ' + explained if explained != 'unexplained' else 'unexplained'}; "
                   f"needs: {needs}; {s['requests']} request(s) ({', '.join(s['events'])})")
    return key


def severity_order(prekeys_: Iterable[str]) -> list[str]:
    return sorted(prekeys_, key=lambda k: (SEVERITY.get(k.split("|", 1)[0], 99), k))
