"""What happens to a new finding before anyone reads it: the minimized finding with its
control arms (the original kept and linked both ways). ``kvfuzz run`` does
this for each new finding; ``kvfuzz minimize`` for a finding file."""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Literal

from kvfuzz.oracle.controls import escalate, reproducing_arms
from kvfuzz.driver.session import Session
from kvfuzz.traces import Finding, save
from kvfuzz.traces.errors import BadInput
from kvfuzz.traces.io import finding_path

from .attribution import explain_finding
from .controls import IsolatedCheck, run_controls
from .minimize import Budget, NotReproduced, Options, minimize_finding
from .reduce import Acceptance, default_acceptance


def isolated_runner(session: Session) -> IsolatedCheck:
    """How the batch-invariant control checks a trace: in a fresh child process whose session is
    built from this session's settings, so it judges by the same bounds and calibration."""
    from kvfuzz.driver.isolated import check_isolated

    return functools.partial(check_isolated, settings=session.settings)


def add_controls(session: Session, finding: Finding, *, deadline: float | None = None) -> Finding:
    """Run the control arms of ``finding`` (serialized; batch-invariant where supported); none
    starts past ``deadline`` (time.monotonic())."""
    finding.controls = run_controls(session, finding, device=session.device, isolated=isolated_runner(session),
                                    deadline=deadline)
    # Stated in the file: every arm (the finding's own and the controls) that reproduced it.
    finding.reproduced_in = reproducing_arms(finding)
    return finding


def acceptance_for(step_exact: bool, repeats: int | None = None, min_hits: int | None = None) -> Acceptance:
    """The k-of-m rule for an engine, with the user's ``-k`` / ``-m`` where given."""
    acc = default_acceptance(step_exact)
    if repeats is None and min_hits is None:
        return acc
    k = repeats if repeats is not None else acc.repeats
    m = min_hits if min_hits is not None else min(acc.min_hits, k)
    try:
        return Acceptance(k, m)
    except ValueError as e:
        raise BadInput(str(e), field="--min-hits") from None


def minimize(session: Session, finding: Finding, *, victim: str | None = None, acceptance: Acceptance | None = None,
             strategy: Literal["probdd", "ddmin"] = "probdd", max_replays: int | None = 400,
             max_seconds: float | None = None, engine: bool = True, original_path: str | None = None,
             recorded_here: bool = False) -> Finding:
    """``minimize_finding`` with the acceptance and clock of the session's engine."""
    opts = Options(acceptance=acceptance or default_acceptance(session.step_exact),
                   budget=Budget(max_replays=max_replays, max_seconds=max_seconds), strategy=strategy,
                   clock="step" if session.step_exact else "offset", engine=engine)
    return minimize_finding(session, finding, victim=victim, options=opts, original_path=original_path,
                            recorded_here=recorded_here)


def finish_finding(session: Session, finding: Finding, *, out: Path, do_minimize: bool = True,
                   controls: bool = True, max_seconds: float | None = 120.0, victim: str | None = None,
                   recorded_here: bool = False) -> Finding:
    """The minimized finding (unless disabled), attributed to toggles like its original was,
    with its control arms. The original is written to ``out/originals/`` and linked both ways;
    the returned finding is the one the campaign records.

    Controls run on the minimized finding, not on the original: on a two- or three-request
    witness they cost a fraction of what they cost on the trace as found (each arm replays it,
    serialized runs request by request), and they are what a maintainer reads. The original
    gets them only when there is nothing smaller (minimization off or not reproduced).
    ``victim``: the request minimization keeps (default: ``choose_target``'s); ``recorded_here``:
    its runs were recorded by ``session`` (``minimize_finding``)."""
    if not do_minimize:
        return escalate(add_controls(session, finding) if controls else finding)
    rel = finding_path(Path("originals"), finding)
    try:
        small = minimize(session, finding, victim=victim, max_seconds=max_seconds, original_path=str(rel),
                         recorded_here=recorded_here)
    except NotReproduced as e:
        shown = escalate(add_controls(session, finding) if controls else finding)
        shown.notes["minimize"] = f"not minimized: {e}"
        return shown
    if finding.attribution is not None:
        small = explain_finding(session, small)
    if controls:
        small = escalate(add_controls(session, small))
    finding.provenance.minimized_to = small.id
    save(finding, out / rel)
    return small
