"""Bug buckets as data (issue 30): what a bucket's key is, a finding's membership of a bucket,
and a campaign's bucket. The rule that matches keys is in oracle/buckets.py; the triage that
measures them in triage/campaign.py; docs/oracle.md "Buckets" says why the key is what it is.

A key holds only evidence that is stable across witnesses of one cause: the class, what makes
it disappear among kvfuzz's own switches (the explaining toggle, fix, arm or control:
``explained_by``; None = nothing does, a candidate vLLM bug), an engine crash's kind, and, per
engine mechanism whose removal was actually tried, whether the divergence disappeared or
persisted. A mechanism not tried is absent, never a difference. Since rule 5, an unexplained
key also names the first of vLLM's post-conditions broken on the victim's own state (``broke``:
harness/postconditions.py records them, oracle/postconditions.py names them); where both keys
name one, it decides. The minimized shape and the
schedule ablations (concurrency, cancels: properties of the witness, not the cause) are kept in
the bucket's description, outside the key.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from collections.abc import Container, Iterable, Mapping
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from .history import SELF_ONLY_BREAKS

if TYPE_CHECKING:
    from .finding import Finding
    from .history import History
    from .result import Checked

# Mechanisms whose ablation switches an engine code path off (triage/explain.py): their
# verdicts are part of a key. The schedule ablations ("concurrency", "cancels") describe how a
# witness triggers the cause and differ between witnesses of one cause (issue 30: fault P's
# two buckets); so does "numerics" (float32 instead of 16 bits changes every logit, and
# whether a witness's corrupted KV still flips a token depends on its margins: fault R in
# bfloat16 disappeared in float32 on one witness and persisted on the next). They are
# described, never keyed; 16-bit noise is told apart by its class (numeric-near-tie).
KEY_MECHANISMS: tuple[str, ...] = ("prefix-caching", "chunked-prefill", "preemption", "lora", "lora-swaps")
Outcome = Literal["disappears", "persists"]
# What one ablation replay found (traces.finding.Ablation.outcome; docs/oracle.md).
AblationOutcome = Literal["disappears", "persists", "n/a", "failed", "skipped", "moved", "flaky"]
# opened: this finding opened the bucket (fully triaged: minimized, controls, ablation);
# triaged: attributed and checked against the bucket's key, then joined it;
# assigned: assigned, not triaged (past the campaign's triage share): by its cheap pre-key or by
# one replay of the bucket's distinguishing check.
Status = Literal["opened", "triaged", "assigned"]


class _Data(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)


class BucketKey(_Data):
    cls: str = Field(alias="class")
    explained_by: str | None = None
    crash_kind: str | None = None
    # Engine mechanism (KEY_MECHANISMS) -> what removing it did; tried removals only.
    verdicts: dict[str, Outcome] = Field(default_factory=dict)
    # Rule 5: the first of vLLM's post-conditions broken on the victim's own state
    # (oracle/postconditions.py); None: not observed (no break, or not an in-process run).
    broke: str | None = None
    # Rule 5.20: an enforceable post-condition (oracle/postconditions.py ``REPAIRABLE``) -> what
    # enforcing it on every row in one replay of the witness did to the victim. Measured where a
    # key that names it meets one that does not; a key that names it implies "disappears".
    enforced: dict[str, Outcome] = Field(default_factory=dict)

    @property
    def base(self) -> tuple[str, str | None, str | None]:
        """What must be equal for two keys to be one cause at all."""
        return (self.cls, self.explained_by, self.crash_kind)

    def enforcement(self, name: str) -> Outcome | None:
        """What enforcing post-condition ``name`` did to the witness's victim: measured, or
        implied by the key's own name (its cause), or None (not tried)."""
        if name in self.enforced:
            return self.enforced[name]
        return "disappears" if self.broke == name else None

    @property
    def needs(self) -> list[str]:
        return sorted(m for m, o in self.verdicts.items() if o == "disappears")

    @property
    def not_needed(self) -> list[str]:
        return sorted(m for m, o in self.verdicts.items() if o == "persists")

    def label(self) -> str:
        what = f"explained by {self.explained_by}" if self.explained_by else "unexplained"
        if self.broke and not self.explained_by:
            what += f", broke {self.broke}"
        if self.crash_kind:
            what = f"{self.crash_kind}"
        return f"{self.cls}, {what}"

    def digest(self) -> str:
        body = "|".join([self.cls, self.explained_by or "-", self.crash_kind or "-",
                         ",".join(f"{m}={o}" for m, o in sorted(self.verdicts.items())),
                         *([self.broke] if self.broke else []),
                         *([",".join(f"enforced {n}={o}" for n, o in sorted(self.enforced.items()))]
                           if self.enforced else [])])
        return hashlib.sha256(body.encode()).hexdigest()[:10]


class BucketDescription(_Data):
    """What the bucket's first (minimized, explained) finding showed: for people, not matching."""

    needs: list[str] = Field(default_factory=list)  # every mechanism whose removal removed it
    not_needed: list[str] = Field(default_factory=list)
    not_tried: list[str] = Field(default_factory=list)  # skipped by the time box
    measured: bool = False  # an ablation ran at all
    requests: int = 0
    events: list[str] = Field(default_factory=list)
    text: str = ""


class MechanismCheck(_Data):
    """One check replay: the finding without ``mechanism`` (``kind`` "removed"), or with the
    post-condition ``mechanism`` enforced (``kind`` "enforced", rule 5.20), judged on ``victim``."""

    mechanism: str
    kind: Literal["removed", "enforced"] = "removed"
    victim: str | None = None
    outcome: AblationOutcome
    detail: str | None = None
    # The key verdict it gave (``oracle.buckets.verdicts_of``); None: none (moved, flaky, failed,
    # or a milder divergence). Lets a later pass of the same trace reuse the replay.
    verdict: Outcome | None = None

    @property
    def words(self) -> str:
        return f"with {self.mechanism} enforced" if self.kind == "enforced" else f"without {self.mechanism}"


class Rewitness(_Data):
    """Rule 5.22: a bucket's own witness, whose minimization had not finished, minimized further
    and ablated again by a later finding's triage (the split that finding would have opened
    rested on that witness's "disappears"). The campaign makes it the bucket's regression case
    and lets its verdicts replace the bucket's on the mechanisms it measured."""

    bucket: str
    case: str  # the smaller witness, relative to OUT (``rewitnessed/<bucket>.json``)
    verdicts: dict[str, Outcome] = Field(default_factory=dict)
    description: BucketDescription
    requests: tuple[int, int] = (0, 0)  # the witness's requests before and after
    tokens: tuple[int, int] = (0, 0)  # its prompt and generated tokens before and after


class BucketMembership(_Data):
    """A finding's place in a campaign's bucket (``Finding.buckets``)."""

    bucket: str
    key: BucketKey
    status: Status
    # Set on the finding that opened the bucket: its description.
    description: BucketDescription | None = None
    # How it was matched, in words ("pre-key", "replay: prefix-caching disappears", ...).
    how: str = ""
    # Verdicts this finding's triage measured on *other* buckets' own witnesses (bucket id ->
    # mechanism -> outcome): the merge check's other direction (the existing witness replayed
    # under the new one's verdicts). The campaign adds them to those buckets' keys.
    evidence: dict[str, dict[str, Outcome]] = Field(default_factory=dict)
    # The same for enforced post-conditions (rule 5.20; bucket id -> post-condition -> outcome).
    enforced: dict[str, dict[str, Outcome]] = Field(default_factory=dict)
    # The replays that checked this finding against buckets (merge check, assignment), each
    # with its outcome and why, kept even when they gave no verdict (moved, failed): the
    # reason a finding joined or did not is readable after the campaign.
    checks: list[MechanismCheck] = Field(default_factory=list)
    # Rule 5.22: the mechanisms on which this finding's key differed from the bucket's when it
    # joined anyway: each "disappears" there was measured on a witness whose minimization did
    # not finish, and the campaign's budget left no box to finish it (``unsettled``).
    unsettled: list[str] = Field(default_factory=list)
    # Rule 5.22: the bucket witness this finding's triage minimized further (see ``Rewitness``).
    rewitness: Rewitness | None = None


class ReleaseRange(_Data):
    """Where a bucket's findings reproduce among vLLM's releases (``kvfuzz bisect OUT/``): one
    bisection's verdict and transition (``BisectRecord``), and the findings that gave it."""

    verdict: str
    first_bad: str | None = None
    last_good: str | None = None
    first_good: str | None = None
    last_bad: str | None = None
    searched: tuple[str, str] | None = None  # the oldest and newest release searched
    findings: list[str] = Field(default_factory=list)  # the files bisected, relative to OUT

    @property
    def conclusive(self) -> bool:
        """A range that tells a bug: it reproduced somewhere and the search ended."""
        return self.verdict in ("reproduces in every release", "regression", "fixed")

    def same(self, other: "ReleaseRange") -> bool:
        return (self.verdict, self.first_bad, self.first_good) == (other.verdict, other.first_bad, other.first_good)

    @property
    def label(self) -> str:
        span = f" {self.searched[0]}–{self.searched[1]}" if self.searched else ""
        if self.verdict == "regression":
            return f"first bad {self.first_bad} (last good {self.last_good})"
        if self.verdict == "fixed":
            return f"first good {self.first_good} (last bad {self.last_bad})"
        if self.verdict == "reproduces in every release":
            return f"every release{span}"
        return f"{self.verdict}{span}"


class Bucket(_Data):
    """One bucket of a campaign (``CampaignState.bug_buckets``)."""

    id: str
    key: BucketKey
    description: BucketDescription = Field(default_factory=BucketDescription)
    count: int = 0
    assigned: int = 0  # of count: assigned, not triaged
    first_index: int | None = None
    representative: str | None = None  # the opening finding's file, relative to OUT
    case: str | None = None  # OUT/buckets/<id>.json, the regression case for `kvfuzz gate`
    listing: str | None = None  # OUT/buckets/<id>.findings.json: every finding of the bucket
    report: str | None = None  # the command that shows the representative
    findings: list[str] = Field(default_factory=list)
    merged_from: list[str] = Field(default_factory=list)
    # Of count: findings that joined on a split left unsettled (rule 5.22, ``unsettled``): a
    # possible second cause a maintainer settles with `kvfuzz minimize` + `kvfuzz explain`.
    unsettled: int = 0
    # The previous text key of campaigns written before issue 30 (kept, never matched on).
    prekey: str | None = None
    # ``kvfuzz bisect OUT/``: the release range its bisected findings agree on, and the bucket it
    # was split from when their ranges disagreed (two bugs under one key).
    releases: ReleaseRange | None = None
    split_from: str | None = None

    @property
    def near_tie(self) -> bool:
        return self.key.cls == "numeric-near-tie"

    @property
    def text(self) -> str:
        return self.description.text or self.key.label()


class SecondCauses(_Data):
    """Rule 5.19's record over a campaign, read from its findings' enforced replays: the
    later-break names a replay confirmed as a second cause, and how often one was refuted
    (enforcing the first break left the victim right, or wrong with no new name;
    ``Divergence.second_cause``). Kept in the campaign state and sent with each Ray task, so a
    resumed campaign, and every worker, lists and triages by what was committed, not by what
    one process happened to replay."""

    confirmed: list[str] = Field(default_factory=list)  # sorted, each once
    refuted: dict[str, int] = Field(default_factory=dict)

    def note(self, finding: "Finding") -> None:
        """Add what the enforced replay showed on ``finding``'s victims (those replayed)."""
        for d in finding.divergences:
            if d.repair is None or d.later is None:
                continue
            second = d.second_cause
            if second is None:
                self.refuted[d.later] = self.refuted.get(d.later, 0) + 1
            elif second not in self.confirmed:
                self.confirmed = sorted([*self.confirmed, second])


@dataclass
class Triaged:
    """What a campaign's triage returns for one trace (triage/campaign.py): the check, the
    finding's bucket memberships, and what happened (clean / joined / assigned / opened / triaged /
    deferred: a Ray task's finding that agreed with no bucket before the traces below it were
    committed, placed by its pre-key and run again at the commit point)."""

    checked: "Checked"
    buckets: list[BucketMembership] = field(default_factory=list)
    status: str = "clean"

    @property
    def finding(self) -> "Finding | None":
        return self.checked.finding

    @property
    def histories(self) -> "list[History]":
        return self.checked.histories


# -- the rule's pure part (oracle/buckets.py says why; the fuzzer merges with it too) ------------
def conflicts(a: BucketKey, b: BucketKey) -> list[str]:
    """Engine mechanisms tried on both keys whose removal went different ways, and (rule 5.20)
    enforced post-conditions whose enforcement did (a key's own name counts as enforced and
    gone: a victim that broke nothing and stays wrong with that name enforced on every row is
    not that name's; faults AM + AE, where AM's unnamed victims took AE's `worker-adapter`)."""
    out = [m for m in set(a.verdicts) & set(b.verdicts) if a.verdicts[m] != b.verdicts[m]]
    names = {*a.enforced, *b.enforced, *filter(None, (a.broke, b.broke))}
    out += [f"enforced {n}" for n in names
            if None not in (a.enforcement(n), b.enforcement(n)) and a.enforcement(n) != b.enforcement(n)]
    return sorted(out)


def removal_conflicts(a: BucketKey, b: BucketKey) -> list[str]:
    """The mechanisms whose removal went different ways on ``a`` and ``b``, when they are all
    that keeps the keys apart (same base, names that agree, no enforcement conflict); else
    none. What rule 5.21 re-measures on a smaller witness before a bucket opens over them:
    ``a`` without those verdicts agrees with ``b`` (``agrees`` decides, not a copy of it)."""
    out = conflicts(a, b)
    if a.explained_by is not None or any(c.startswith("enforced ") for c in out):
        return []
    rest = a.model_copy(update={"verdicts": {m: v for m, v in a.verdicts.items() if m not in out}})
    return out if agrees(rest, b) else []


def unsettled(key: BucketKey, bucket: BucketKey, *, key_minimal: Container[str], bucket_minimal: bool) -> list[str]:
    """Rule 5.22: the mechanisms that alone keep ``key`` from ``bucket`` (``removal_conflicts``)
    when, on every one of them, the side whose removal made the divergence disappear was
    measured on a witness whose minimization did not finish; else none. ``key_minimal``: the
    mechanisms whose verdict in ``key`` was measured on a minimal witness; ``bucket_minimal``:
    whether the bucket's own witness is minimal. "Persists" shows the cause acting without the
    mechanism, whatever the witness; "disappears" on a large witness may only show its schedule
    hanging on it (fault AJ's 9-request witness, rule 5.21), so such a split is evidence of a
    second cause only once that side is minimal. Only between keys that name the same
    post-condition, or none: a name one side broke and the other did not is evidence that no
    witness's schedule makes (faults Y + P in bfloat16 at 68acb5f: P's unminimized 18-request
    witness, named ``map-entry-orphaned``, joined Y's unnamed bucket here and lent it the name)."""
    if key.broke != bucket.broke:
        return []
    split = removal_conflicts(key, bucket)
    for m in split:
        if (m in key_minimal) if key.verdicts[m] == "disappears" else bucket_minimal:
            return []
    return split


def breaks_agree(a: str | None, b: str | None) -> bool:
    """No evidence of two causes in two post-condition names: equal, or one side not observed —
    unless the observed one harms only its own request (rule 5.14, ``SELF_ONLY_BREAKS``: faults
    AJ and AH on at once, where AJ's unnamed victims joined AH's `worker-seq-len` bucket on
    verdicts both causes share)."""
    if a is None or b is None:
        return (a or b) not in SELF_ONLY_BREAKS
    return a == b


def same_break(a: BucketKey, b: BucketKey) -> bool:
    """``breaks_agree`` on two keys' names."""
    return breaks_agree(a.broke, b.broke)


def agrees(a: BucketKey, b: BucketKey) -> bool:
    if a.base != b.base:
        return False
    # An explained key is decided by its explanation (a deterministic A/B of one toggle).
    if a.explained_by is not None:
        return True
    # Rule 5: where both witnesses broke a post-condition, that decides (what the cause did to
    # the engine's state; the ablation verdicts measure how the witness's schedule reached it).
    if a.broke is not None and b.broke is not None:
        return a.broke == b.broke
    if not same_break(a, b):
        return False  # rule 5.14: a self-only name never takes an unnamed victim
    return not conflicts(a, b)


def union(a: BucketKey, b: BucketKey) -> BucketKey:
    """``a`` with the verdicts only ``b`` tried, and ``b``'s broken post-condition if ``a``
    has none (the evidence of an agreeing key joins)."""
    if a.explained_by is not None:
        return a
    return a.model_copy(update={"verdicts": {**b.verdicts, **a.verdicts}, "broke": a.broke or b.broke,
                                "enforced": {**b.enforced, **a.enforced}})


def with_evidence(key: BucketKey, verdicts: Mapping[str, Outcome],
                  enforced: Mapping[str, Outcome] | None = None) -> BucketKey:
    """``key`` with verdicts (and rule 5.20's enforcements) measured on its bucket's own
    witness, where it had none."""
    if key.explained_by is not None or not (verdicts or enforced):
        return key
    return key.model_copy(update={"verdicts": {**verdicts, **key.verdicts},
                                  "enforced": {**(enforced or {}), **key.enforced}})


def live(buckets: Mapping[str, Bucket], merges: Mapping[str, str]) -> list[Bucket]:
    """The buckets not merged into another, earliest first."""
    return sorted((b for i, b in buckets.items() if i not in merges),
                  key=lambda b: (b.first_index if b.first_index is not None else 1 << 40, b.id))


def resolve(bid: str, merges: Mapping[str, str]) -> str:
    """The bucket a (possibly merged) bucket id lives on in."""
    seen = set()
    while bid in merges and bid not in seen:
        seen.add(bid)
        bid = merges[bid]
    return bid


def candidates(key: BucketKey, buckets: Iterable[Bucket]) -> list[Bucket]:
    """The buckets ``key`` agrees with, in the order given (earliest first)."""
    return [b for b in buckets if agrees(key, b.key)]


def name_unearned(key: BucketKey, bucket: BucketKey, checked: Iterable[str]) -> bool:
    """Rule 5.7: ``key`` names a post-condition that ``bucket`` (unnamed) never showed, and a
    check among ``checked`` gave it no verdict (moved, flaky, failed), or it has none at all —
    so joining would lend the bucket a name on no evidence (faults Y + P on Ray: P's witnesses
    read persists, moved, moved against Y's bucket, and every later P finding joined by name)."""
    if key.broke is None or bucket.broke is not None:
        return False
    if bucket.enforced.get(key.broke) == "disappears":
        return False  # rule 5.20: the bucket's own witness is right with the name enforced
    return not key.verdicts or any(m not in key.verdicts for m in checked)


def mergeable(buckets: Mapping[str, Bucket], merges: Mapping[str, str]) -> tuple[str, str] | None:
    """(keep, gone): the first pair of live buckets whose keys agree; the later one goes."""
    alive = live(buckets, merges)
    for i, a in enumerate(alive):
        for b in alive[i + 1:]:
            if agrees(a.key, b.key) and not name_unearned(a.key, b.key, b.key.verdicts) \
                    and not name_unearned(b.key, a.key, a.key.verdicts):  # rule 5.7
                return a.id, b.id
    return None



# -- campaigns and findings written before issue 30 ------------------------------------------------
def _old_key(prekey: str, old: dict[str, Any] | None) -> BucketKey:
    """``class|explained_by`` / ``class|unexplained|cheap-needs`` / ``engine-crash|kind``."""
    parts = prekey.split("|")
    cls = parts[0]
    if cls == "engine-crash":
        return BucketKey(cls=cls, crash_kind=parts[1] if len(parts) > 1 else "died")
    explained = parts[1] if len(parts) > 1 and parts[1] != "unexplained" else None
    verdicts: dict[str, Outcome] = {}
    for m in (old or {}).get("needs") or []:
        if m in KEY_MECHANISMS:
            verdicts[m] = "disappears"
    for m in (old or {}).get("not_needed") or []:
        if m in KEY_MECHANISMS:
            verdicts[m] = "persists"
    return BucketKey(cls=cls, explained_by=explained, verdicts=verdicts)


def _old_description(old: dict[str, Any] | None) -> BucketDescription:
    old = old or {}
    shape = old.get("shape") or {}
    return BucketDescription(needs=list(old.get("needs") or []), not_needed=list(old.get("not_needed") or []),
                             measured=old.get("needs") is not None, requests=int(shape.get("requests", 0)),
                             events=list(shape.get("events") or []), text=str(old.get("text") or ""))


def memberships_from_notes(entries: list[dict[str, Any]]) -> list[BucketMembership]:
    """A finding's old ``notes["buckets"]`` ([{id, prekey, first, key?}]) as memberships."""
    out = []
    for e in entries:
        key = _old_key(str(e.get("prekey", "?")), e.get("key"))
        out.append(BucketMembership(bucket=str(e["id"]), key=key, status="opened" if e.get("first") else "triaged",
                                    description=_old_description(e.get("key")) if e.get("key") else None,
                                    how="pre-key (written before issue 30)"))
    return out


def bucket_from_state(bid: str, data: dict[str, Any]) -> Bucket:
    """A bucket as campaign.json keeps it: today's model, or the old dict (prekey, key, ...)."""
    if "id" in data and isinstance(data.get("key"), dict) and "class" in data["key"]:
        return Bucket.model_validate(data)
    old = data.get("key") if isinstance(data.get("key"), dict) else None
    prekey = str(data.get("prekey") or "?")
    return Bucket(id=bid, key=_old_key(prekey, old), description=_old_description(old),
                  count=int(data.get("count", 0)), first_index=data.get("first_index"),
                  representative=data.get("representative"), case=data.get("case"), report=data.get("report"),
                  findings=list(data.get("findings") or []), prekey=prekey)


__all__ = ["KEY_MECHANISMS", "Bucket", "ReleaseRange", "BucketDescription", "BucketKey", "BucketMembership", "MechanismCheck", "Rewitness", "Status", "Triaged", "agrees",
           "breaks_agree", "bucket_from_state", "candidates", "conflicts", "live", "memberships_from_notes", "mergeable", "name_unearned", "resolve",
           "same_break", "union", "unsettled", "with_evidence"]
