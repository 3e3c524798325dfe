"""Benchmark table: one markdown row per campaign directory (issue 30's acceptance; docs/benchmarks.md
"Buckets on faults kvfuzz has never seen (issue #30)" condenses each into a cell, its earlier
versions kept the rows: git history): traces, traces/min,
findings, bug buckets (per bucket: findings, how many assigned, explanation, the post-condition
its key names, what its minimal witness needs or "provisional"), near-tie buckets, findings with no
bucket of their own class, and the post-conditions broken in the campaign's runs (its coverage's ``broke:`` features:
how many traces broke each).

    python benchmarks/bucket_table.py OUT [OUT ...] [--label NAME=TEXT ...]

It reads only what a campaign wrote (``campaign.json``, the finding files), through the same
models ``kvfuzz report`` uses, so a row is what a user of that campaign would see.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from kvfuzz.present.buckets import broken_counts, needs_text
from kvfuzz.traces import load_finding
from kvfuzz.traces.buckets import buckets_from_state, live
from kvfuzz.traces.finding import SEVERITY


def row(out: Path, label: str) -> str:
    d = json.loads((out / "campaign.json").read_text())
    buckets = buckets_from_state(d.get("bug_buckets", {}), str(out / "campaign.json"))
    alive = sorted(live(buckets), key=lambda b: (SEVERITY.get(b.key.cls, 99), -b.count, b.id))
    bugs = [b for b in alive if not b.near_tie]
    ties = [b for b in alive if b.near_tie]
    unbucketed = 0
    for rel in d.get("finding_files", []):
        f = load_finding(out / rel)
        # Bucketless: no bucket of the finding's own (worst) class; a corruption finding filed
        # only under a near-tie key would be shown among the ties, not as a bug.
        unbucketed += not any(m.key.cls == f.worst_class() for m in f.buckets)
    secs = float(d.get("seconds") or 0)
    traces = int(d.get("traces") or 0)
    rate = f"{60 * traces / secs:.2f}" if secs else "—"
    by_class = ", ".join(f"{c} {n}" for c, n in sorted((d.get("by_class") or {}).items()))

    def cell(bs: list) -> str:
        if not bs:
            return "0"
        parts = []
        for b in bs:
            what = b.key.explained_by and f"explained by `{b.key.explained_by}`" or "unexplained"
            if b.key.crash_kind:
                parts.append(f"{b.count} {b.key.crash_kind}: {b.key.crash_state or '?'}")
                continue
            if b.key.broke:
                key = f"broke `{b.key.broke}`"
            elif b.key.provisional:
                key = "provisional"
            else:
                key = f"needs {', '.join(b.key.needs) or 'none'}" if b.key.confirmable else needs_text(b)
            parts.append(f"{b.count} ({b.assigned} assigned) {what}, {key}")
        return f"**{len(bs)}**: " + "; ".join(parts)

    broke = ", ".join(f"{name} {n}" for name, n in broken_counts(d.get("coverage") or {})) or "none"
    return (f"| {label} | {traces} | {secs:.0f} | {rate} | {d.get('findings', 0)} ({by_class}) | {cell(bugs)} | "
            f"{cell(ties)} | {unbucketed} | {broke} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("outs", nargs="+", type=Path)
    ap.add_argument("--label", action="append", default=[], help="OUT=TEXT: the row's first cell")
    a = ap.parse_args()
    labels = dict(x.split("=", 1) for x in a.label)
    print("| run | traces | s | traces/min | findings | bug buckets | near-tie buckets | no bucket | "
          "post-conditions broken (traces) |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for out in a.outs:
        if not (out / "campaign.json").is_file():
            raise SystemExit(f"{out}: no campaign.json (not a campaign directory)")
        print(row(out, labels.get(str(out), out.name)))


if __name__ == "__main__":
    main()
