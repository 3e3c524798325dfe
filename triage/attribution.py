"""Attribution re-runs: replay a diverged trace in the clean arm (and, when an arm differs
from clean by several toggles, in each single-toggle arm) so every divergence says which
toggle explains it, or that none does. The reasoning is pure (oracle/attribution.py)."""

from __future__ import annotations

from collections.abc import Iterable

from kvfuzz.harness.toggles import clean_set, unreachable
from kvfuzz.oracle import divergent
from kvfuzz.oracle.attribution import CLEAN, attribute, plan, singles_needed
from kvfuzz.driver.recovery import Recovering
from kvfuzz.driver.session import Session
from kvfuzz.traces import Attribution, Finding, Trace
from kvfuzz.traces.result import Checked, Recording


def explain_toggles(session: Session, checked: Checked, *, runs: int | None = None,
                    first: Iterable[str] = ()) -> Checked:
    """``checked`` with every divergence's ``explained_by`` filled in (re-running arms as needed).
    ``first``: toggles whose single arms run before the others (a campaign's known
    explanations); the rest run only for divergences none of those reproduces. A divergence
    one of them reproduces is explained by it without asking whether another toggle alone
    would reproduce it too (asking would rerun every other candidate's arm on each finding,
    tens of seconds each)."""
    if not divergent(checked.verdicts):
        return checked
    rec = checked.recording
    clean = clean_set(session.device)
    inert = unreachable({*clean, *(t for ts in rec.arms.values() for t in ts)}, rec.trace.engine)
    extra = plan({v.arm for v in divergent(checked.verdicts)}, rec.arms, clean, inert)
    # The clean arm first; the single-toggle arms (``first``'s, then the rest) only when they can
    # still change an answer.
    clean_arm = {k: v for k, v in extra.items() if k == CLEAN}
    singles = {k: v for k, v in extra.items() if k not in clean_arm}
    wanted = set(first)
    early = {k: v for k, v in singles.items() if k.split(":", 1)[-1] in wanted}
    added: list[str] = []
    for batch in (clean_arm, early, {k: v for k, v in singles.items() if k not in early}):
        if batch and (batch is clean_arm or singles_needed(checked.verdicts, rec.arms, clean, inert)):
            checked = _recorded(session, rec, batch, runs)
            rec = checked.recording  # with the teacher-forced scorings of the new runs
            added += batch
    verdicts = attribute(checked.verdicts, rec.arms, clean, inert)
    return Checked(rec, verdicts, session.finding_of(
        rec, verdicts, attribution=Attribution(clean=list(clean), added_arms=sorted(added))))


def _recorded(session: Session, rec: Recording, arms: dict[str, list[str]], runs: int | None) -> Checked:
    more = session.record(rec.trace, runs=runs, arms=arms)
    # A new recording: rec.arms may be the caller's arm map, reused for the next trace.
    every = {**rec.arms, **arms}
    return session.verdicts_of(Recording(
        trace=rec.trace, histories=[*rec.histories, *more.histories], references=rec.references,
        environment=rec.environment.model_copy(update={"toggles": sorted({t for ts in every.values() for t in ts})}),
        arms=every, scores=[*rec.scores, *more.scores]))


def explain_guarded(guard: Recovering, checked: Checked, *, first: Iterable[str] = ()) -> Checked:
    """``explain_toggles`` inside the campaign's crash guard: an engine that dies or hangs in
    an attribution re-run makes the trace an engine-crash finding, as in its first run."""
    return guard.rerun(checked, lambda: explain_toggles(guard.session, checked, first=first))


def check_attributed(session: Session, trace: Trace, *, runs: int | None = None,
                     arms: dict[str, list[str]] | None = None) -> Checked:
    """``session.check`` and, when anything diverged, ``explain_toggles``."""
    return explain_toggles(session, session.check(trace, runs=runs, arms=arms), runs=runs)


def explain_finding(session: Session, finding: Finding) -> Finding:
    """``finding`` with its divergences attributed (re-running arms as needed), keeping its
    minimization, controls and notes: what a minimized finding gets when its original was
    attributed, since minimization replays only the finding's own arm."""
    rec = Recording(trace=finding.trace, histories=list(finding.runs), references=dict(finding.references),
                    environment=finding.environment, arms=dict(finding.arms))
    # One run per arm on a step-exact engine: its repeats are identical.
    checked = explain_toggles(session, Checked(rec, list(finding.verdicts), finding),
                              runs=1 if session.step_exact else None)
    new = checked.finding
    if new is None:
        return finding
    new.minimization, new.controls = finding.minimization, list(finding.controls)
    new.inherit(finding)
    new.id = new.compute_id()
    return new
