"""The one executor of triage's interventions (``oracle.buckets.Intervention``), under one budget
read from one injectable clock. Each intervention is cut at what is left (and at
``--minimize-seconds``); when nothing is left, the policy places findings by what their recorded
run says, provisional where it cannot complete them (docs/oracle.md "Buckets").
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from kvfuzz.driver.recovery import Recovering
from kvfuzz.driver.session import Session
from kvfuzz.driver.settings import TriageSettings
from kvfuzz.oracle.buckets import INTERVENTIONS
from kvfuzz.oracle.controls import escalate, primary_arm
from kvfuzz.traces import Finding
from kvfuzz.traces.buckets import KEY_MECHANISMS
from kvfuzz.traces.io import finding_path
from kvfuzz.traces.result import Checked

from .attribution import explain_finding, explain_guarded
from .controls import float32_control
from .explain import explain
from .finish import add_controls, minimize
from .minimize import NotReproduced

# Triage's credit at the start of a campaign, so a short campaign still completes its first key
# (its share is TriageSettings.share, --triage-share).
TRIAGE_FLOOR_S = 10.0
# The confirmation's minimization replays (the ablation of the witness comes after them).
CONFIRM_REPLAYS = 64
# Of a witness intervention (``Executor.witness``): the share its minimization may take (the
# ablation and the control arms keep the rest).
MINIMIZE_PART = 0.6


@dataclass
class Budget:
    """Seconds triage may still spend: ``floor + share x (time since start) - spent``, never
    past ``end_after`` seconds from the start (the campaign's --budget)."""

    share: float = field(default_factory=lambda: TriageSettings().share)
    floor: float = TRIAGE_FLOOR_S
    end_after: float | None = None
    clock: Callable[[], float] = time.monotonic
    started: float | None = None
    spent: float = 0.0

    def start(self) -> None:
        if self.started is None:
            self.started = self.clock()

    def left(self) -> float:
        now = self.clock()
        since = now - (self.started if self.started is not None else now)
        left = self.floor + self.share * since - self.spent
        return left if self.end_after is None else min(left, self.end_after - since)

    @contextmanager
    def charged(self) -> Iterator[None]:
        t0 = self.clock()
        try:
            yield
        finally:
            self.spent += self.clock() - t0


@dataclass
class Executor:
    session: Session
    guard: Recovering
    settings: TriageSettings = field(default_factory=TriageSettings)
    budget: Budget = field(default_factory=Budget)
    status: Callable[[str], None] = lambda _m: None
    # Seconds each kind of intervention took so far: one is not started when what is left of the
    # budget is less than the longest of its last few (cut short, it would spend time for nothing).
    costs: dict[str, list[float]] = field(default_factory=dict)

    def allowed(self) -> frozenset[str]:
        """The interventions the settings switch on and the budget can pay for."""
        s = self.settings
        left = self.budget.left()
        on = {"attribute": s.attribute, "float32-control": s.controls, "confirm": s.minimize and s.ablate,
              "minimize": s.minimize}
        return frozenset(k for k in INTERVENTIONS if on[k] and left > 0 and left >= max(self.costs.get(k, [0.0])[-5:]))

    @contextmanager
    def _running(self, kind: str) -> Iterator[None]:
        t0 = self.budget.spent
        with self.budget.charged():
            yield
        self.costs.setdefault(kind, []).append(self.budget.spent - t0)

    def attribute(self, checked: Checked, first: Sequence[str]) -> Checked:
        """The arms that tell which toggle explains each divergence, re-run."""
        with self._running("attribute"):
            return explain_guarded(self.guard, checked, first=first)

    def float32_control(self, finding: Finding) -> Finding:
        """A 16-bit near tie replayed in float32: corruption there is corruption."""
        self.status(f"finding {finding.id}: float32 control (a 16-bit near tie)")
        arm, toggles = primary_arm(finding)
        with self._running("float32-control"):
            got = float32_control(self.session, finding, toggles=toggles,
                                  runs=max(1, sum(1 for h in finding.runs if h.arm == arm)))
        return escalate(finding.model_copy(update={"controls": [*finding.controls, got]}))

    def witness(self, finding: Finding, victim: str | None, *, confirm: bool = False) -> Finding | None:
        """``finding`` minimized to ``victim``, then ablated, within what is left of the budget.
        ``confirm``: at most ``CONFIRM_REPLAYS`` replays, ablated on the key's mechanisms only; None
        when the victim's signature did not reproduce. Else a new bucket's witness, with its
        control arms as far as the budget reaches (unminimized when it does not reproduce)."""
        self.status(f"finding {finding.id}: " + ("confirming (minimize, then ablate)" if confirm
                                                 else "minimizing a new bucket's witness"))
        seconds = max(1.0, min(self.budget.left(), self.settings.minimize_seconds))
        with self._running("confirm" if confirm else "minimize"):
            deadline = time.monotonic() + seconds
            try:
                with self.session.scoring("all"):
                    small = minimize(self.session, finding, victim=victim,
                                     max_replays=CONFIRM_REPLAYS if confirm else None,
                                     max_seconds=MINIMIZE_PART * seconds, recorded_here=True,
                                     original_path=str(finding_path(Path("findings"), finding)))
            except NotReproduced as e:
                self.status(f"finding {finding.id}: not minimized ({e})")
                if confirm:
                    return None
                small = finding.model_copy(deep=True)
            else:
                if finding.attribution is not None:
                    small = explain_finding(self.session, small)
            if confirm or self.settings.ablate:
                # ``victim`` where the witness shows it diverging, else the witness's own choice.
                kept = victim if victim in {d.request_id for d in small.divergences} else None
                small.explanation = explain(self.session, small, victim=kept, deadline=deadline,
                                            mechanisms=list(KEY_MECHANISMS) if confirm else None)
            if self.settings.controls and not confirm:
                small = add_controls(self.session, small, deadline=deadline)
        return small


def minimal(f: Finding) -> bool:
    """Whether ``f``'s minimization ran to its end and was verified (a 1-minimal witness) and its
    ablation of the key's mechanisms was not cut short."""
    m, ex = f.minimization, f.explanation
    if m is None or m.stopped is not None or not m.verified or ex is None:
        return False
    return not any(a.outcome == "skipped" for a in ex.ablations if a.mechanism in KEY_MECHANISMS)
