"""A campaign's triage: each trace runs once; a finding's keys are placed by the policy
(``oracle.buckets.decide``), which asks for interventions that the executor runs under one
budget (triage/executor.py). docs/oracle.md "Buckets" states the rule.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from functools import cached_property
from pathlib import Path

from kvfuzz.driver.recovery import Recovering
from kvfuzz.driver.session import Session
from kvfuzz.driver.settings import CampaignSettings, TriageSettings
from kvfuzz.harness.toggles import clean_set, unreachable
from kvfuzz.oracle.attribution import plan
from kvfuzz.oracle.buckets import Facts, Open, Run, decide, describe, keys_of, verdicts_of, victim_of
from kvfuzz.traces import Finding, Trace
from kvfuzz.traces.buckets import Bucket, BucketKey, BucketMembership, Triaged
from kvfuzz.traces.finding import DIVERGENT_CLASSES
from kvfuzz.traces.result import Checked

from .attribution import explain_guarded
from .executor import Budget, Executor, minimal


@dataclass
class KeyState:
    """One key of a finding, and what triage measured for it."""

    key: BucketKey
    victim: str | None
    confirmed: bool = False
    witness: Finding | None = None
    how: str = "recorded run"


@dataclass
class FindingTriage:
    """One finding's triage so far: what the policy decides from."""

    checked: Checked
    attributed: bool
    class_settled: bool
    keys: list[KeyState] = field(default_factory=list)

    @property
    def finding(self) -> Finding:
        assert self.checked.finding is not None
        return self.checked.finding

    def rekey(self) -> None:
        f = self.finding
        self.keys = [KeyState(k, victim_of(f, k)) for k in keys_of(f)]

    def facts(self, ks: KeyState, allowed: frozenset[str]) -> Facts:
        return Facts(key=ks.key, victim=ks.victim, attributed=self.attributed, class_settled=self.class_settled,
                     confirmed=ks.confirmed, witness=ks.witness is not None, allowed=allowed)


@dataclass
class CampaignTriage:
    session: Session
    guard: Recovering
    arms: dict[str, list[str]]
    out: Path
    settings: TriageSettings = field(default_factory=TriageSettings)
    status: Callable[[str], None] = lambda _m: None
    # The campaign's buckets (id -> bucket): in-process the campaign state's own (``restore``),
    # on Ray the ones committed below the task's index.
    known: Mapping[str, Bucket] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.budget = Budget(share=self.settings.share, end_after=self.settings.budget_s)
        self.executor = Executor(self.session, self.guard, self.settings, self.budget, self.status)

    def restore(self, buckets: Mapping[str, Bucket]) -> None:
        """Share the campaign's buckets (the campaign adds to them as findings are recorded)."""
        self.known = buckets

    @cached_property
    def clean(self) -> list[str]:
        """The device's clean arm (every applicable fix): what an arm's toggles differ from."""
        return list(clean_set(self.session.device))

    def __call__(self, trace: Trace) -> Triaged:
        self.budget.start()
        # Teacher forcing only where it can change a class; witnesses are scored in full.
        with self.session.scoring("near-ties"):
            checked = self.guard.check(trace, runs=self.session.settings.runs if self.settings.runs_fixed else 1,
                                       arms=self.arms)
        if checked.finding is None:
            return Triaged(checked)
        t = self._start(checked)
        # The campaign files the finding with ``members`` (fuzzer/campaign.py ``record_finding``).
        members, cases = self._place(t)
        self.status("fuzzing")
        return Triaged(t.checked, members, cases)

    def _start(self, checked: Checked) -> FindingTriage:
        f = checked.finding
        assert f is not None
        crash = f.worst_class() == "engine-crash"
        rec = checked.recording
        inert = unreachable({*self.clean, *(t for ts in rec.arms.values() for t in ts)}, rec.trace.engine)
        diverged = {d.arm for d in f.divergences if d.class_ in DIVERGENT_CLASSES}
        attributed = crash or not self.settings.attribute or not plan(diverged, rec.arms, self.clean, inert)
        if attributed and not crash and self.settings.attribute:
            checked = explain_guarded(self.guard, checked)  # no re-run: the record tells
        t = FindingTriage(checked, attributed=attributed, class_settled=not self._near_tie_16(checked.finding))
        t.rekey()
        return t

    def _near_tie_16(self, f: Finding | None) -> bool:
        return (f is not None and self.settings.controls and f.worst_class() == "numeric-near-tie"
                and f.trace.engine.dtype in ("bfloat16", "float16"))

    def _place(self, t: FindingTriage) -> tuple[list[BucketMembership], dict[str, Finding]]:
        members: list[BucketMembership] = []
        cases: dict[str, Finding] = {}
        i = 0
        while i < len(t.keys):
            ks = t.keys[i]
            d = decide(t.facts(ks, self.executor.allowed()), self.known)
            if isinstance(d, Run):
                if self._run(d, t, ks):
                    members, cases, i = [], {}, 0  # the finding changed: its keys are new
                continue
            how = ks.how
            if not t.attributed:
                how = "provisional: not attributed (the triage budget was spent)"
            elif d.key.provisional and not ks.confirmed:
                how = "provisional: not confirmed (the triage budget was spent)"
            elif not t.class_settled:
                how += "; its float32 control did not run (the triage budget was spent)"
            assigned = not t.attributed or d.key.provisional or not t.class_settled
            opened = isinstance(d, Open)
            witness = ks.witness or t.finding
            members.append(BucketMembership(bucket=d.key.digest(), key=d.key, victim=ks.victim, how=how,
                                            status="opened" if opened else "assigned" if assigned else "triaged",
                                            description=describe(d.key, witness) if opened else None))
            if opened:
                cases[d.key.digest()] = witness
            i += 1
        return members, cases

    def _run(self, d: Run, t: FindingTriage, ks: KeyState) -> bool:
        """Run ``d`` for key ``ks`` of ``t``; whether the finding itself changed (re-keyed)."""
        ex = self.executor
        if d.intervention == "attribute":
            first = sorted({x for b in self.known.values() if b.key.explained_by
                            for x in b.key.explained_by.split("+")})
            checked = ex.attribute(t.checked, first)
            t.checked = checked if checked.finding is not None else replace(checked, finding=t.finding)
            t.attributed = True
            t.class_settled = not self._near_tie_16(t.finding)
            t.rekey()
            return True
        if d.intervention == "float32-control":
            t.checked = replace(t.checked, finding=ex.float32_control(t.finding))
            t.class_settled = True
            t.rekey()
            return True
        if d.intervention == "confirm":
            small = ex.witness(t.finding, d.victim, confirm=True)
            ks.confirmed = True
            if small is not None and minimal(small):
                ks.key = ks.key.model_copy(update={"verdicts": verdicts_of(small.explanation)})
                ks.witness, ks.how = small, "minimal witness ablated"
            else:
                ks.key = ks.key.model_copy(update={"provisional": True})
                ks.witness = small or t.finding
                ks.how = "provisional: the confirmation " + ("did not reproduce" if small is None else
                                                             "did not reach a minimal, fully ablated witness")
            return False
        ks.witness = ex.witness(t.finding, d.victim)
        return False


def build_triage(settings: CampaignSettings, session: Session, guard: Recovering, out: Path, *,
                 status: Callable[[str], None] = lambda _m: None) -> CampaignTriage:
    """The one way a campaign's triage is made (``kvfuzz run``, each Ray worker, ``kvfuzz bench``)."""
    return CampaignTriage(session, guard, settings.arms, out, settings=settings.triage, status=status)
