"""Bug buckets as data: a bucket's key, a finding's membership of a bucket, a campaign's
bucket. The policy that keys and places a finding is oracle/buckets.py; docs/oracle.md
"Buckets" says why the key is what it is.
"""

from __future__ import annotations

import hashlib
import logging
from dataclasses import dataclass, field
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

if TYPE_CHECKING:
    from .finding import Finding
    from .result import Checked

log = logging.getLogger("kvfuzz.traces")

# Mechanisms whose ablation switches an engine code path off (triage/explain.py): what a
# minimal witness needs among them is part of an unnamed key. The schedule ablations
# ("concurrency", "cancels") and "numerics" describe how a witness reaches the cause, not the
# cause, and are kept in the description only.
KEY_MECHANISMS: tuple[str, ...] = ("prefix-caching", "chunked-prefill", "preemption", "lora", "lora-swaps")
Outcome = Literal["disappears", "persists"]
# What one ablation replay found (traces.finding.Ablation.outcome; docs/oracle.md).
AblationOutcome = Literal["disappears", "persists", "n/a", "failed", "skipped", "moved", "flaky"]
# opened: this finding opened the bucket (its witness minimized to the key's victim);
# triaged: its key was complete and equal to the bucket's;
# assigned: its key came from the recorded run alone (the triage budget was spent).
Status = Literal["opened", "triaged", "assigned"]


class _Data(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)
    # Fields an older kvfuzz wrote, read and ignored.
    retired: ClassVar[tuple[str, ...]] = ()

    @model_validator(mode="before")
    @classmethod
    def _drop_retired(cls, data: Any) -> Any:
        if isinstance(data, dict) and any(n in data for n in cls.retired):
            return {k: v for k, v in data.items() if k not in cls.retired}
        return data


class BucketKey(_Data):
    cls: str = Field(alias="class")
    explained_by: str | None = None
    crash_kind: str | None = None
    # What the crash said, without what varies between witnesses of one cause (numbers,
    # addresses): ClusterFuzz's crash state, from the recorded run.
    crash_state: str | None = None
    # The first harmful post-condition of vLLM's bookkeeping broken on the victim's own state
    # (traces.history.BREAKS); None: none observed.
    broke: str | None = None
    # Unexplained, unnamed keys only: engine mechanism -> what removing it did to a minimal
    # witness's victim. Only "disappears" (the cause needs it) is compared: on a minimal witness,
    # a mechanism absent or present but not needed says the same about the cause.
    verdicts: dict[str, Outcome] = Field(default_factory=dict)
    # Unexplained, unnamed, and no minimal witness was measured (the confirmation's replays or
    # the triage budget ran out): its own bucket, which never takes a confirmed finding.
    provisional: bool = False
    retired = ("enforced",)

    @property
    def base(self) -> tuple[str, str | None, str | None, str | None, str | None]:
        """Everything but the confirmation: keys equal on it are related."""
        return (self.cls, self.explained_by, self.crash_kind, self.crash_state, self.broke)

    @property
    def needs(self) -> list[str]:
        return sorted(m for m, o in self.verdicts.items() if o == "disappears")

    @property
    def confirmable(self) -> bool:
        """Whether the recorded run leaves the key incomplete: unexplained, unnamed, no crash."""
        return self.explained_by is None and self.crash_kind is None and self.broke is None

    def label(self) -> str:
        if self.crash_kind:
            return f"{self.cls}, {self.crash_kind}" + (f": {self.crash_state}" if self.crash_state else "")
        what = f"explained by {self.explained_by}" if self.explained_by else "unexplained"
        if self.broke and not self.explained_by:
            what += f", broke {self.broke}"
        if self.confirmable:
            what += ", provisional" if self.provisional else f", needs {', '.join(self.needs) or 'none'}"
        return f"{self.cls}, {what}"

    def digest(self) -> str:
        body = "|".join([*(part or "-" for part in self.base), ",".join(self.needs),
                         "provisional" if self.provisional else ""])
        return hashlib.sha256(body.encode()).hexdigest()[:10]

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, BucketKey):
            return NotImplemented
        return self.digest() == other.digest()

    def __hash__(self) -> int:
        return hash(self.digest())


class BucketDescription(_Data):
    """What the bucket's first (minimized, explained) finding showed: for people, not matching."""

    needs: list[str] = Field(default_factory=list)  # every mechanism whose removal removed it
    not_needed: list[str] = Field(default_factory=list)
    not_tried: list[str] = Field(default_factory=list)  # skipped by the budget
    measured: bool = False  # an ablation ran at all
    requests: int = 0
    events: list[str] = Field(default_factory=list)
    text: str = ""


class BucketMembership(_Data):
    """A finding's place in a campaign's bucket (``Finding.buckets``)."""

    bucket: str
    key: BucketKey
    status: Status
    # Set on the finding that opened the bucket: its description.
    description: BucketDescription | None = None
    # How its key was made, in words ("recorded run", "minimal witness ablated", ...).
    how: str = ""
    # The request whose divergence the key speaks for.
    victim: str | None = None
    retired = ("evidence", "enforced", "checks", "unsettled", "rewitness")


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
        return self.verdict in ("reproduces in every release", "regression", "fixed", "regression, then fixed")

    @property
    def label(self) -> str:
        span = f" {self.searched[0]}–{self.searched[1]}" if self.searched else ""
        if self.verdict == "regression":
            return f"first bad {self.first_bad} (last good {self.last_good})"
        if self.verdict == "fixed":
            return f"first good {self.first_good} (last bad {self.last_bad})"
        if self.verdict == "regression, then fixed":
            return f"first bad {self.first_bad}, first good {self.first_good}"
        if self.verdict == "reproduces in every release":
            return f"every release{span}"
        return f"{self.verdict}{span}"


class Bucket(_Data):
    """One bucket of a campaign (``CampaignState.bug_buckets``)."""

    id: str
    key: BucketKey
    description: BucketDescription = Field(default_factory=BucketDescription)
    count: int = 0
    assigned: int = 0  # of count: keyed from the recorded run alone
    first_index: int | None = None
    representative: str | None = None  # the opening finding's file, relative to OUT
    case: str | None = None  # OUT/buckets/<id>.json: its witness, the regression case for `kvfuzz gate`
    listing: str | None = None  # OUT/buckets/<id>.findings.jsonl: every finding of the bucket
    report: str | None = None  # the command that shows the representative
    findings: list[str] = Field(default_factory=list)
    # ``kvfuzz bisect OUT/``: the release range its bisected findings agree on, and the bucket it
    # was split from when their ranges disagreed (two bugs under one key).
    releases: ReleaseRange | None = None
    split_from: str | None = None
    retired = ("merged_from", "unsettled", "prekey")

    @property
    def near_tie(self) -> bool:
        return self.key.cls == "numeric-near-tie"

    @property
    def text(self) -> str:
        return self.description.text or self.key.label()


@dataclass
class Triaged:
    """A campaign's triage of one trace (triage/campaign.py): the check, the finding's bucket
    memberships, and the witness (regression case) of each bucket it opens."""

    checked: "Checked"
    buckets: list[BucketMembership] = field(default_factory=list)
    cases: "dict[str, Finding]" = field(default_factory=dict)


def live(buckets: Mapping[str, Bucket]) -> list[Bucket]:
    """A campaign's buckets, earliest first."""
    return sorted(buckets.values(), key=lambda b: (b.first_index if b.first_index is not None else 1 << 40, b.id))


def related(bucket: Bucket, buckets: Iterable[Bucket]) -> list[Bucket]:
    """The other buckets whose key differs from ``bucket``'s only in what the confirmation
    measured (needs, provisional): perhaps one cause, shown together, never merged."""
    return [b for b in buckets if b.id != bucket.id and b.key.base == bucket.key.base and b.key != bucket.key]


def buckets_from_state(raw: Mapping[str, Any], source: str = "campaign.json") -> dict[str, Bucket]:
    """``CampaignState.bug_buckets`` as campaign.json (or a live state) holds them. Buckets an
    older kvfuzz keyed by text (no ``id``) cannot be made exact: they are not read (one warning
    naming ``source``); the file's findings stay as they are."""
    if any(isinstance(b, Mapping) and "id" not in b for b in raw.values()):
        log.warning("kvfuzz: warning: %s: its bug buckets were written by an older kvfuzz (text keys) and are not "
                    "read; its findings are kept, its buckets are not carried over", source)
        return {}
    return {bid: b if isinstance(b, Bucket) else Bucket.model_validate(b) for bid, b in raw.items()}
