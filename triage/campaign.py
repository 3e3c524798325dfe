"""How much triage each finding of a campaign gets: one bug, one bucket (docs/oracle.md
"Buckets").

Every trace runs once. A finding is attributed to toggles (the clean arm re-run), which gives
its prekeys (oracle/buckets.py). A finding whose prekeys are all known joins those buckets
cheaply: its trace and verdicts, linked, no minimization. One with a new prekey opens a bucket
and is triaged fully, time-boxed: confirmation runs (the trace up to K times, to measure the
rate), control arms, minimization, the full causal ablation, and a copy of the minimal finding
as the bucket's regression case (``OUT/buckets/<id>.json``, for ``kvfuzz gate``).

Repeats of a duplicate are skipped on a step-exact engine, where they are identical (the
in-process replay is deterministic: tests/test_engine.py); wall-clock engines confirm every
divergent trace. Time spent on findings of known buckets is capped at ``share`` of the
campaign so far: beyond it, a finding is recorded untriaged (listed, replayable, never dropped).
Untriaged findings add no triage time, so the share falls back under the cap as the campaign
goes on and a later finding is attributed again: a second bug that keeps recurring is delayed,
not lost.

A new bucket's triage is time-boxed: ``minimize_seconds`` (--minimize-seconds), and at most
``NEW_BUCKET_SHARE`` of the campaign's budget when it has one (never below
``MIN_NEW_BUCKET_BOX_S``), so a 10-minute campaign that
finds a bug keeps fuzzing most of its time (issue 18: >= 0.7x the clean traces/min). Control
arms run on the minimized finding (triage/finish.py), inside the box. What the
box cuts short is marked (a partial minimization, ablations "skipped"); `kvfuzz minimize` and
`kvfuzz explain` finish it from the finding file.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from kvfuzz.oracle.buckets import CHEAP_MECHANISMS, bucket_id, describe, prekeys
from kvfuzz.driver.recovery import Recovering
from kvfuzz.driver.session import Session
from kvfuzz.driver.settings import CampaignSettings
from kvfuzz.traces import Finding, Trace
from kvfuzz.traces.result import Checked

from .attribution import explain_guarded
from .explain import explain
from .finish import finish_finding

# A campaign spends at most this share of its time on findings of buckets it already has...
KNOWN_BUCKET_SHARE = 0.1
# ...and at most this share of its budget on triaging any one new bucket. Together they keep a
# campaign with one bug fuzzing >= 75% of its time (issue 18 asks >= 0.7x the clean rate).
NEW_BUCKET_SHARE = 0.15
# ...but never less than this: a one-minute campaign (the README's) still minimizes its bug.
MIN_NEW_BUCKET_BOX_S = 30.0


@dataclass
class CampaignTriage:
    session: Session
    guard: Recovering
    arms: dict[str, list[str]]
    out: Path
    confirm_runs: int = 3
    runs_fixed: bool = False
    attribute: bool = True
    minimize: bool = True
    controls: bool = True
    ablate: bool = True
    minimize_seconds: float = 120.0
    share: float = KNOWN_BUCKET_SHARE
    budget_s: float | None = None  # the campaign's --budget, if any
    status: Callable[[str], None] = lambda _m: None
    # prekey -> bucket id, restored from campaign.json on --resume (``restore``).
    known: dict[str, str] = field(default_factory=dict)
    known_seconds: float = 0.0
    started: float = field(default_factory=time.monotonic)

    def restore(self, buckets: dict[str, dict]) -> None:
        self.known.update({b["prekey"]: i for i, b in buckets.items() if "prekey" in b})

    def __call__(self, trace: Trace) -> Checked:
        runs = self.confirm_runs if self.runs_fixed else 1
        checked = self.guard.check(trace, runs=runs, arms=self.arms)
        f = checked.finding
        if f is None:
            return checked
        if f.worst_class() == "engine-crash":
            # Not repeated nor minimized: each replay could crash the engine again (and a hang
            # costs the trace deadline each time).
            return self._file(checked, f, prekeys(f), full=False)
        if self.known and self.over_share:
            f.notes["triage"] = (f"untriaged: findings of known buckets already took {self.share:.0%} of the "
                                 f"campaign's time (kvfuzz replay / minimize / explain it)")
            return checked
        t0 = time.monotonic()
        if self.attribute:
            checked = explain_guarded(self.guard, checked, runs=runs)
            f = checked.finding or f
        keys = prekeys(f, self._cheap_needs(f) if self._unexplained(f) else None)
        new = [k for k in keys if k not in self.known]
        if not new:
            if not self.session.step_exact and not self.runs_fixed and self.confirm_runs > 1:
                checked = self._confirm(checked)
            self.known_seconds += time.monotonic() - t0
            return self._file(checked, checked.finding or f, keys, full=False)
        return self._triage(checked, keys)

    # -- a new bucket: everything ------------------------------------------------------------------
    @property
    def new_bucket_box(self) -> float:
        """Seconds one new bucket's triage may take."""
        if self.budget_s is None:
            return self.minimize_seconds
        return min(self.minimize_seconds, max(MIN_NEW_BUCKET_BOX_S, NEW_BUCKET_SHARE * self.budget_s))

    def _triage(self, checked: Checked, keys: list[str]) -> Checked:
        deadline = time.monotonic() + self.new_bucket_box
        if not self.runs_fixed and self.confirm_runs > 1:
            self.status("new bucket: confirming the rate")
            checked = self._confirm(checked)
        finding = checked.finding
        assert finding is not None
        small = finding
        if self.minimize or self.controls:
            self.status(f"finding {finding.id}: " + ("minimizing" if self.minimize else "control arms"))
            # Minimization gets half of what is left; the ablation of the (small) result the rest.
            left = max(1.0, 0.5 * (deadline - time.monotonic()))
            small = finish_finding(self.session, finding, out=self.out, do_minimize=self.minimize,
                                   controls=self.controls, max_seconds=left)
        if self.ablate:
            self.status(f"finding {small.id}: causal ablation")
            small.explanation = explain(self.session, small, deadline=deadline)
        self.status("fuzzing")
        return self._file(dataclasses.replace(checked, finding=small), small, keys, full=True)

    def _confirm(self, checked: Checked) -> Checked:
        """The same trace up to ``confirm_runs`` times in every arm it ran in: the rate."""
        rec = self.session.confirm(checked.recording, self.confirm_runs)
        again = self.session.verdicts_of(rec, carry=checked.finding)
        if self.attribute and checked.finding is not None and checked.finding.attribution is not None:
            again = explain_guarded(self.guard, again, runs=self.confirm_runs)
        return again

    # -- buckets -------------------------------------------------------------------------------------
    def _file(self, checked: Checked, finding: Finding, keys: list[str], *, full: bool) -> Checked:
        entries = []
        for k in keys:
            bid = bucket_id(k)
            first = k not in self.known
            entry = {"id": bid, "prekey": k, "first": first}
            if first:
                entry["key"] = describe(k, finding)
                self.known[k] = bid
            entries.append(entry)
        finding.notes["buckets"] = entries
        finding.bucket = entries[0]["id"] if entries else None
        if not full and entries:
            finding.notes["triage"] = "duplicate of a known bucket: not minimized"
        return dataclasses.replace(checked, finding=finding)

    def _unexplained(self, f: Finding) -> bool:
        worst = f.worst_class()
        return any(d.class_ == worst and d.explained_by is None for d in f.divergences)

    def _cheap_needs(self, f: Finding) -> list[str]:
        """For an unexplained finding (no toggle explains it): the cheap ablations it needs, on
        the trace as found (three replays, no engine restart)."""
        ex = explain(self.session, f, mechanisms=list(CHEAP_MECHANISMS))
        return ex.needs

    @property
    def over_share(self) -> bool:
        return self.known_seconds > self.share * max(1.0, time.monotonic() - self.started)


def build_triage(settings: CampaignSettings, session: Session, guard: Recovering, out: Path, *,
                 status: Callable[[str], None] = lambda _m: None) -> CampaignTriage:
    """The one way a campaign's triage is made (``kvfuzz run``, each Ray worker, ``kvfuzz bench``)."""
    t = settings.triage
    return CampaignTriage(session, guard, settings.arms, out, confirm_runs=settings.session.runs,
                          runs_fixed=t.runs_fixed, attribute=t.attribute, minimize=t.minimize, controls=t.controls,
                          ablate=t.ablate, minimize_seconds=t.minimize_seconds, budget_s=t.budget_s, status=status)
