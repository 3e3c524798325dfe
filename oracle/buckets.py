"""Buckets: one root cause, one bucket (pure). The rule, its evidence and its known limits are
in docs/oracle.md "Buckets"; the data in traces/buckets.py; the replays in triage/campaign.py.

ClusterFuzz buckets crashes by their stack; kvfuzz buckets a divergence by what explains it. A
finding's **keys** (one per distinct key among its worst-class divergences) hold only evidence
that one cause cannot split: the class; what among kvfuzz's switches makes it disappear (the
explaining toggle, fix, arm or control; none: a candidate vLLM bug); and, for an unexplained
finding, which engine mechanisms' *tried* removal made it disappear or not. Two keys
**agree** when that base is equal and no engine mechanism tried on both went different ways:
"not tried" never counts as a difference, and the minimized shape and the schedule ablations
(concurrency, cancels), which measure the witness rather than the cause, are not compared.
Rule 5: where both keys name the post-condition of vLLM's bookkeeping that broke first on the
victim (oracle/postconditions.py), the names decide, and the verdicts are not compared.

A finding joins the earliest bucket whose key agrees with its own. For an unexplained finding
the evidence comes from replays chosen here (``next_check``): first a mechanism on which the
candidate buckets differ (it tells them apart), then the mechanisms the candidate needs and
those it does not (the new witness replayed under the bucket's ablation verdicts). Buckets whose keys come to agree
(their evidence grows as findings join) merge, the later into the earlier; findings follow.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from kvfuzz.oracle.attribution import candidates as attribution_candidates
from kvfuzz.traces import Divergence, Finding
from kvfuzz.traces.buckets import (KEY_MECHANISMS, Bucket, BucketDescription, BucketKey, Outcome, ReleaseRange, agrees,
                                   breaks_agree, candidates, conflicts, live, mergeable, name_unearned, resolve, union)
from kvfuzz.traces.finding import DIVERGENT_CLASSES, MECHANISM_WORDS, SEVERITY, Explanation

# The ablations cheap enough for every unexplained finding (no engine restart).
CHEAP_MECHANISMS = ("concurrency", "cancels", "lora")
# Replays an unexplained finding may spend on matching a bucket (each is one replay).
MAX_CHECKS = 3


def keys_of(finding: Finding, verdicts: Mapping[str, Outcome] | None = None) -> list[BucketKey]:
    """The finding's keys: one per (class, explaining toggle) among its worst-class
    divergences; unexplained ones carry ``verdicts``. Sorted, most severe first."""
    worst = finding.worst_class()
    if worst not in DIVERGENT_CLASSES:
        return []
    if worst == "engine-crash":
        # The typed crash info (traces/provenance.py) says how: a hang, a death, a worker's death.
        return [BucketKey(cls=worst, crash_kind=finding.crash.kind if finding.crash is not None else "died")]
    worst_divs = [d for d in finding.divergences if d.class_ == worst]
    explained = sorted({d.explained_by for d in worst_divs if d.explained_by})
    keys = [BucketKey(cls=worst, explained_by=e) for e in explained]
    open_ = [d for d in worst_divs if not d.explained_by]
    # Unexplained: one key per post-condition broken on a victim (rule 5). A victim on which
    # none broke adds no key of its own when another did (same finding, same ablation: the
    # break is the better evidence of the two).
    # Rule 5.19: a victim whose named break, enforced in a replay, left it diverging with another
    # harmful break has a second cause, which keys on its own too (faults AL + AI).
    names = sorted({d.broke for d in open_ if d.broke} | {n for d in open_ if (n := d.second_cause)})
    broke: list[str | None] = [*names] or ([None] if open_ else [])
    if names and not any(breaks_agree(None, n) for n in names) and any(d.broke is None for d in open_):
        # Rule 5.16: a victim that broke nothing agrees with none of the names beside it (all
        # self-only, rule 5.14: their cause harmed only the requests that broke them), so it is
        # another cause's: a key of its own (faults AK + AJ at 9368d84: AJ's victims sat in
        # findings named by AK alone).
        broke.append(None)
    keys += [BucketKey(cls=worst, verdicts=dict(verdicts or {}), broke=b) for b in broke]
    # Named keys before an unnamed one: past the share a finding is assigned by its first key.
    return sorted(keys, key=lambda k: (k.explained_by is not None, k.explained_by or "", k.broke is None,
                                       k.broke or ""))


def verdicts_of(explanation: Explanation | None) -> dict[str, Outcome]:
    """The key's part of an ablation: engine mechanisms whose removal was tried and judged.

    A removal counts as "disappears" only when the victim stopped diverging altogether. One
    that left a milder divergence (corruption in bfloat16 -> a flipped near tie in float32)
    is ambiguous: the token still flips, and whether float32 calls it a near tie depends on the
    witness's margin. It is left out of the key, like a removal not tried (issue 30, found on
    fault R after the rule was frozen: one cause split on "needs: 16-bit numerics")."""
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


def same_key_victims(finding: Finding, cls: str, broke: str | None) -> list[Divergence]:
    """The finding's unexplained divergences of class ``cls`` whose victims broke ``broke``
    (None: broke nothing), or whose second cause it names (rule 5.19): the victims one
    unexplained key speaks for (rule 5.6)."""
    return [d for d in finding.divergences if d.class_ == cls and d.explained_by is None
            and (d.broke == broke or (broke is not None and d.second_cause == broke))]


def victim_of(finding: Finding, key: BucketKey) -> str | None:
    """The request whose replays give ``key`` its verdicts: the leading victim among those it
    speaks for (``same_key_victims``). None: an explained key, or no such victim (the default
    target). Rule 5.6: a finding that two causes hit (faults Y + P) was measured on Y's victim
    while its key carried the name P broke on another, and joined Y's bucket with P's name."""
    if key.explained_by is not None:
        return None
    lead = finding.leading(same_key_victims(finding, key.cls, key.broke))
    return lead.request_id if lead is not None else None


def same_name(key: BucketKey, buckets: Iterable[Bucket]) -> list[Bucket]:
    """The buckets named by the post-condition ``key`` names (none for an unnamed key): rule 5
    takes them first, before an earlier unnamed bucket the key also agrees with."""
    return [b for b in buckets if key.broke is not None and b.key.broke == key.broke]


def prekey_candidates(finding: Finding, buckets: Iterable[Bucket], clean: Iterable[str] = (),
                      inert: Iterable[str] = ()) -> list[Bucket]:
    """Without attribution (past the triage share): the buckets of the finding's worst class
    that could explain it, i.e. unexplained ones (of the post-condition it broke, where both
    broke one) and those explained by a toggle by which an
    arm it diverged in differs from ``clean`` (the device's clean arm): a fault it turned on,
    or a fix it left off — the CPU LoRA bug's bucket is explained by a fix that the vanilla arm
    leaves off (issue 30: a finding of it past the budget opened a second bucket). ``inert``:
    toggles the finding's engine never reaches, which explain nothing."""
    worst = finding.worst_class()
    clean = list(clean)
    differs = {t for d in finding.divergences if d.class_ == worst
               for t in attribution_candidates(finding.arms.get(d.arm, []), clean, inert)}
    # Rule 5: an unexplained bucket whose witness broke another post-condition than every one
    # this finding broke is another cause (the finding's own run recorded them: no replay).
    # Rule 5.14: a self-only name and no name are two causes (``breaks_agree``, as in ``agrees``).
    names: set[str | None] = {d.broke for d in finding.divergences if d.class_ == worst and d.broke} or {None}
    return [b for b in buckets if b.key.cls == worst
            and (b.key.explained_by in differs if b.key.explained_by is not None
                 else any(breaks_agree(n, b.key.broke) for n in names))]


def next_check(key: BucketKey, cands: list[Bucket], tried: Iterable[str] = ()) -> str | None:
    """The next engine mechanism to replay ``key``'s witness without: one on which the
    candidates differ (it tells them apart), else one the first candidate needs, else one it
    does not need (its ablation verdicts, replayed on the new witness: a second cause that
    needs more than the bucket's, e.g. KV pressure besides prefix caching, disagrees only
    there). None: nothing left to check."""
    done = set(key.verdicts) | set(tried)
    seen: dict[str, set[str]] = {}
    for b in cands:
        for m, o in b.key.verdicts.items():
            seen.setdefault(m, set()).add(o)
    for m in KEY_MECHANISMS:
        if m not in done and len(seen.get(m, ())) > 1:
            return m
    if cands:
        for m in [*cands[0].key.needs, *cands[0].key.not_needed]:
            if m not in done:
                return m
    return None


def shape(finding: Finding) -> tuple[int, list[str]]:
    """The (minimal) trace's shape: how many requests, and which kinds of events remain."""
    t = finding.trace
    kinds = {"send"} if t.sends else set()
    if t.cancels:
        kinds.add("cancel")
    if any(s.adapter for s in t.sends):
        kinds.add("adapter")
    if any(getattr(s.prompt, "prefix_len", 0) for s in t.sends):
        kinds.add("shared-prefix")
    return len(t.sends), sorted(kinds)


def words(mechanisms: Iterable[str]) -> str:
    return ", ".join(MECHANISM_WORDS.get(m, m) for m in mechanisms)


def describe(key: BucketKey, finding: Finding, *, triaged: bool = True) -> BucketDescription:
    """The bucket's description, as measured on its first finding (minimized and explained)."""
    ex = finding.explanation
    requests, events = shape(finding)
    measured = ex is not None and bool(ex.needs or ex.not_needed)
    d = BucketDescription(needs=list(ex.needs) if ex else [], not_needed=list(ex.not_needed) if ex else [],
                          not_tried=list(ex.skipped) if ex else [], measured=measured, requests=requests,
                          events=events)
    if not measured:
        needs = "not measured"  # no ablation, or the triage time box ran out first
    else:
        needs = words(d.needs) or "none of the mechanisms tried"
        if d.not_tried:
            needs += f" (not tried: {words(d.not_tried)})"
    tail = "" if triaged else " (not triaged: past the campaign's triage share)"
    d.text = f"{key.label()}; needs: {needs}; {requests} request(s) ({', '.join(events)}){tail}"
    return d


def needs_text(b: Bucket) -> str:
    """What a bucket needs, for its row: the description's, else the key's evidence."""
    d = b.description
    if d.measured:
        return words(d.needs) or "none of the mechanisms tried"
    return words(b.key.needs) or "not measured"


def severity_order(buckets: Iterable[Bucket]) -> list[Bucket]:
    return sorted(buckets, key=lambda b: (SEVERITY.get(b.key.cls, 99), -b.count, b.id))


__all__ = ["CHEAP_MECHANISMS", "MAX_CHECKS", "agrees", "candidates", "conflicts", "describe", "keys_of", "live",
           "mergeable", "name_unearned", "needs_text", "next_check", "prekey_candidates", "resolve", "same_key_victims",
           "same_name", "severity_order", "shape", "union", "verdicts_of", "victim_of"]


def split_by_release(bucket: Bucket, ranges: Mapping[str, ReleaseRange]) -> list[Bucket]:
    """``bucket`` after its findings were bisected (``ranges``: finding file -> its range): one
    bucket when every conclusive range agrees, else one per distinct range — findings whose
    bisections disagree are two bugs, whatever their key says. The group of the bucket's
    representative (else the first) keeps the id; the others become ``<id>.r2``, ``<id>.r3``,
    ... with the same key. Findings not bisected, or whose bisection concluded nothing, stay
    with the bucket (a range says nothing about them). Pure."""
    groups: list[ReleaseRange] = []
    for f, r in ranges.items():
        if not r.conclusive:
            continue
        same = next((g for g in groups if g.same(r)), None)
        if same is None:
            groups.append(r.model_copy(update={"findings": [f]}))
        else:
            same.findings.append(f)
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
