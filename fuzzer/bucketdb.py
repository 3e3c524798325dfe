"""The bucket database: a campaign's bug buckets, their regression cases and listings under
``OUT/buckets/``. The fuzz loop files each finding here with the memberships triage gave it
(oracle/buckets.py decides them); this room only keeps them. A bucket's id is its key's digest,
so a membership names the bucket it joins or opens, and nothing is ever merged.

Files: ``OUT/buckets/<id>.json``, the case (the opening finding's witness, minimized to its own
victim, for ``kvfuzz gate OUT/buckets``); ``OUT/buckets/<id>.findings.jsonl``, the bucket then one
line per finding in it (not ``.json``: the gate reads every ``.json`` there as a case).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, MutableMapping
from pathlib import Path

from kvfuzz.traces import Finding, atomic_write_text, save
from kvfuzz.traces.buckets import Bucket, BucketDescription, BucketKey, BucketMembership


class BucketDB:
    def __init__(self, out: Path, buckets: MutableMapping[str, Bucket]) -> None:
        self.out = out
        self.buckets = buckets  # the campaign state's, written to campaign.json with it

    def file(self, index: int, finding: Finding, rel: str, memberships: list[BucketMembership],
             cases: Mapping[str, Finding] | None = None) -> None:
        """Count the finding (``rel``, its file under OUT) in each of its buckets; a bucket it
        opens gets its case: ``cases``' witness for it, else the finding."""
        for m in memberships:
            bucket = self.buckets.get(m.bucket)
            if bucket is None:
                case = self.out / "buckets" / f"{m.bucket}.json"
                save((cases or {}).get(m.bucket, finding), case)
                bucket = Bucket(id=m.bucket, key=m.key, first_index=index, representative=rel,
                                description=m.description or BucketDescription(text=m.key.label()),
                                report=f"kvfuzz report {self.out / rel}", case=str(case.relative_to(self.out)))
                self.buckets[m.bucket] = bucket
            bucket.count += 1
            bucket.assigned += m.status == "assigned"
            bucket.findings.append(rel)
            self.write(bucket.id)

    def write(self, bid: str) -> None:
        """The bucket's listing, ``OUT/buckets/<id>.findings.jsonl``."""
        b = self.buckets[bid]
        path = self.out / "buckets" / f"{bid}.findings.jsonl"
        b.listing = str(path.relative_to(self.out))
        head = {"bucket": b.model_dump(mode="json", by_alias=True, exclude={"findings"})}
        lines = [json.dumps(head, sort_keys=True)] + [json.dumps({"finding": f}) for f in b.findings]
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(path, "\n".join(lines) + "\n")


def untriaged(finding: Finding) -> list[BucketMembership]:
    """Memberships for a finding no triage placed (a checker without triage): by class and
    explanation alone."""
    worst = finding.worst_class()
    explained = sorted({d.explained_by or "" for d in finding.divergences if d.class_ == worst})
    keys = [BucketKey(cls=worst, explained_by=e or None) for e in explained] or [BucketKey(cls=worst)]
    return [BucketMembership(bucket=k.digest(), key=k, status="assigned", how="key (no triage)",
                             description=BucketDescription(text=k.label() + " (not triaged)")) for k in keys]
