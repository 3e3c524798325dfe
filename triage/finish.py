"""Minimization and control arms with the acceptance and clock of a session's engine: what a
campaign's witnesses (triage/executor.py) and ``kvfuzz minimize`` use."""

from __future__ import annotations

import functools
from typing import Literal

from kvfuzz.oracle.controls import reproducing_arms
from kvfuzz.driver.session import Session
from kvfuzz.traces import Finding
from kvfuzz.traces.errors import BadInput

from .controls import IsolatedCheck, run_controls
from .minimize import Budget, Options, minimize_finding
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
