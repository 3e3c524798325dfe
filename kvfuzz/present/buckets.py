"""A campaign's bug buckets for people: one row per bucket (count, first trace,
representative, explanation, needs, report command), near-tie buckets in a section of their
own so 16-bit noise never reads as a bug. Used by the closing table of ``kvfuzz run``
(kvfuzz/cli/display.py), the live panel, ``kvfuzz report OUT`` and the campaign page. The
findings themselves are behind each bucket, listed in ``OUT/buckets/<id>.findings.jsonl``."""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvfuzz.oracle.buckets import words
from kvfuzz.traces import Finding
from kvfuzz.traces.buckets import Bucket, BucketMembership, buckets_from_state, live, related
from kvfuzz.traces.errors import BadInput


def needs_text(b: Bucket) -> str:
    """What a bucket needs, for its row: the description's, else the key's."""
    if b.description.measured:
        return words(b.description.needs) or "none of the mechanisms tried"
    return words(b.key.needs) or "not measured"


@dataclass(frozen=True)
class BucketRow:
    id: str
    cls: str
    count: int
    assigned: int  # of count: keyed from the recorded run alone
    first_index: int | None
    representative: str | None
    explanation: str
    needs: str
    report: str
    listing: str | None
    # Buckets whose key differs only in what the confirmation measured: perhaps one cause.
    related: tuple[str, ...] = ()
    # Its key is incomplete (not attributed, or not confirmed): findings the budget left unsorted.
    provisional: bool = False

    @property
    def near_tie(self) -> bool:
        return self.cls == "numeric-near-tie"


def rows(buckets: Mapping[str, Bucket]) -> list[BucketRow]:
    """One row per bucket, most findings first."""
    out = []
    every = live(buckets)
    for b in every:
        k = b.key
        if k.explained_by:
            why = f"explained by {k.explained_by}"
        elif k.crash_kind:
            why = k.crash_kind
        elif k.provisional:
            why = "provisional: not attributed or not confirmed (the triage budget was spent)" + (
                f"; broke {k.broke}" if k.broke else "")
        else:
            why = "unexplained: candidate vLLM bug" + (f"; broke {k.broke}" if k.broke else "")
        if b.releases is not None:
            why += f"; reproduces: {b.releases.label}"
        if b.split_from is not None:
            why += f"; split from {b.split_from} by release range"
        shown = b.case or b.representative
        out.append(BucketRow(b.id, k.cls, b.count, b.assigned, b.first_index, b.representative, why, needs_text(b),
                             f"kvfuzz report {shown}" if shown else "", b.listing,
                             tuple(r.id for r in related(b, every)), k.provisional))
    out.sort(key=lambda r: (-r.count, r.first_index if r.first_index is not None else 1 << 40, r.id))
    return out


def count_text(count: int, assigned: int, *, short: bool = False) -> str:
    """A bucket's findings: how many, and of them how many were keyed from their recorded run
    alone (the triage budget was spent)."""
    return f"{count}" + (f" ({assigned} assigned" + ("" if short else ": triage budget spent") + ")" if assigned else "")


def sections(rs: Iterable[BucketRow]) -> tuple[list[BucketRow], list[BucketRow]]:
    """(bugs, near ties): near-tie buckets apart."""
    rs = list(rs)
    return [r for r in rs if not r.near_tie], [r for r in rs if r.near_tie]


def summary_line(rs: list[BucketRow], findings: int) -> str:
    bugs, ties = sections(rs)
    unexplained = sum(1 for r in bugs if r.explanation.startswith("unexplained"))
    provisional = sum(1 for r in bugs if r.provisional)
    line = (f"{findings} finding(s) in {len(bugs)} bug bucket(s)" + (f" and {len(ties)} near-tie bucket(s)" if ties else "")
            + "; findings listed per bucket in OUT/buckets/<id>.findings.jsonl")
    if unexplained:
        line += (f". {unexplained} bucket(s) UNEXPLAINED by any toggle — candidate vLLM bug(s): report them "
                 "(docs/findings.md)")
    if provisional:
        line += (f". {provisional} provisional bucket(s): findings the triage budget left unsorted (`kvfuzz minimize` "
                 "and `kvfuzz explain` on one sort it; a longer campaign sorts more)")
    return line


def broken_counts(coverage: Mapping[str, int]) -> list[tuple[str, int]]:
    """(post-condition, traces that broke it), from a campaign's coverage's ``broke:`` features."""
    return sorted((k.removeprefix("broke:"), n) for k, n in coverage.items() if k.startswith("broke:"))


def broken_line(coverage: Mapping[str, int]) -> str | None:
    """The campaign's post-condition breaks, or None: a break is a bookkeeping bug in vLLM even
    on traces whose outputs all matched."""
    broke = broken_counts(coverage)
    if not broke:
        return None
    return ("vLLM post-conditions broken in fuzzed runs (its KV bookkeeping disagreed with itself, even where "
            "no output differed; docs/oracle.md \"Broken post-conditions\"): "
            + ", ".join(f"{name} in {n} trace(s)" for name, n in broke))


def rich_tables(rs: list[BucketRow]) -> list[Any]:
    """Rich tables: the bug buckets, then the near-tie buckets (16-bit numerics, not bugs)."""
    from rich.table import Table
    from rich.text import Text

    from kvfuzz.present.style import CLASS_STYLE

    out = []
    for title, part in (("bug buckets (one root cause each; regression cases in OUT/buckets/)", sections(rs)[0]),
                        ("near-tie buckets (a flipped near tie: expected of 16-bit numerics, not a bug there; suspect in float32)", sections(rs)[1])):
        if not part:
            continue
        table = Table(title=title, header_style="bold")
        for col in ("bucket", "findings", "first trace", "explanation", "needs", "report"):
            table.add_column(col, overflow="fold")
        for r in part:
            count = count_text(r.count, r.assigned)
            why = Text(f"{r.cls}, {r.explanation}" + (f"; related: {', '.join(r.related)}" if r.related else ""),
                       style=CLASS_STYLE.get(r.cls, ""))
            table.add_row(r.id, count,
                          "?" if r.first_index is None else str(r.first_index), why, r.needs, r.report or "-")
        out.append(table)
    return out


def markdown(rs: list[BucketRow], findings: int) -> str:
    lines = [summary_line(rs, findings), ""]
    for title, part in (("Bug buckets", sections(rs)[0]), ("Near-tie buckets (a flipped near tie: 16-bit noise, suspect in float32)", sections(rs)[1])):
        if not part:
            continue
        lines += [f"## {title}", "", "| bucket | findings | first trace | explanation | needs | report |",
                  "|---|---|---|---|---|---|"]
        for r in part:
            rel = f"; related: {', '.join(r.related)}" if r.related else ""
            lines.append(f"| `{r.id}` | {count_text(r.count, r.assigned, short=True)} | "
                         f"{'' if r.first_index is None else r.first_index} | {r.cls}, {r.explanation}{rel} | {r.needs} | "
                         f"`{r.report}` |")
        lines.append("")
    return "\n".join(lines)


def membership_text(m: BucketMembership) -> str:
    """One bucket membership in words: the bucket's description, how the finding joined it."""
    what = {"opened": "this finding opened it (its witness is the bucket's case)",
            "triaged": "its key equals the bucket's",
            "assigned": "keyed from its recorded run alone (the triage budget was spent)"}[m.status]
    text = m.description.text if m.description else m.key.label()
    return f"{text}; {what}" + (f"; key from: {m.how}" if m.how else "") + (f"; victim {m.victim}" if m.victim else "")


def finding_lines(finding: Finding) -> list[str]:
    """A finding's bucket memberships in words, for its report (``kvfuzz report FILE``)."""
    return [f"Bucket {m.bucket} — {membership_text(m)}." for m in finding.buckets]


def load_campaign(path: Path) -> tuple[list[BucketRow], int]:
    """``OUT`` or ``OUT/campaign.json``: its bucket rows and finding count (old campaigns too)."""
    file = path / "campaign.json" if path.is_dir() else path
    try:
        data = json.loads(file.read_text(encoding="utf-8"))
        buckets = buckets_from_state(data.get("bug_buckets") or {}, str(file))
    except (OSError, ValueError, TypeError, KeyError) as e:
        raise BadInput(f"not a readable campaign state ({str(e).splitlines()[0] if str(e) else type(e).__name__})",
                       source=str(file)) from None
    return rows(buckets), int(data.get("findings", 0))


__all__ = ["BucketRow", "broken_counts", "broken_line", "count_text", "finding_lines", "membership_text", "load_campaign", "markdown", "rich_tables", "rows", "sections", "summary_line"]
