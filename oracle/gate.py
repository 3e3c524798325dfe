"""The regression gate's verdicts and reports (pure: no engine here).

A *case* is one corpus file replayed in one arm. It fails when a request comes back as
``corruption``, ``stall``, ``error`` or ``engine-crash`` (``numeric-near-tie`` too under ``strict``).
In the self-test a case may instead be *expected* to fail (a fault arm): then it passes only if
it does fail, and a fault arm that stops failing means the detector went blind.

Its reports (JUnit XML, the markdown job summary) are drawn in kvfuzz/present/gate.py.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvfuzz.traces import Divergence

FAILING = ("engine-crash", "error", "corruption", "stall")
FAILING_STRICT = (*FAILING, "numeric-near-tie")


def failing_verdicts(verdicts: list[Divergence], *, strict: bool = False) -> list[Divergence]:
    classes = FAILING_STRICT if strict else FAILING
    return [v for v in verdicts if v.class_ in classes]


@dataclass
class Case:
    """One corpus file in one arm, and what came of it."""

    source: str  # file path as given
    name: str  # trace name or file stem
    arm: str
    toggles: list[str]
    expect_fail: bool = False  # self-test fault arm: must fail
    verdicts: list[Divergence] = field(default_factory=list)
    skipped: str | None = None  # why the case did not run (e.g. GPU-only toggle)
    error: str | None = None  # bad input / infrastructure failure for this case
    replay_command: str = ""
    seconds: float = 0.0
    strict: bool = False

    @property
    def failures(self) -> list[Divergence]:
        return failing_verdicts(self.verdicts, strict=self.strict)

    @property
    def diverged(self) -> bool:
        return bool(self.failures)

    @property
    def ok(self) -> bool:
        """Did the case meet its expectation (clean passes, fault arm fails)?"""
        if self.skipped:
            return True
        if self.error:
            return False
        return self.diverged == self.expect_fail

    @property
    def status(self) -> str:
        if self.skipped:
            return "skipped"
        if self.error:
            return "error"
        if self.expect_fail:
            return "detected" if self.diverged else "BLIND"
        return "FAIL" if self.diverged else "pass"

    def verdict_text(self) -> str:
        if self.skipped:
            return f"skipped: {self.skipped}"
        if self.error:
            return f"error: {self.error}"
        bad = self.failures
        if self.expect_fail and not bad:
            return (f"fault arm {self.arm} no longer produces a divergence on {self.name}: the detector went "
                    f"blind (or the trace no longer reaches the fault's code path)")
        if not bad:
            near = [v for v in self.verdicts if v.class_ == "numeric-near-tie"]
            return "no divergence" + (f" ({len(near)} numeric near-tie(s), not failing)" if near else "")
        parts = [f"{v.request_id}: {v.class_} in {v.runs_diverged}/{v.runs} runs"
                 + (f", first divergent token {v.first_divergence}" if v.first_divergence is not None else "")
                 + (f", margin {v.margin:.3g}" if v.margin is not None else "")
                 # A small margin alone reads like noise: say what decided (docs/oracle.md).
                 + (f", teacher-forced drift {v.teacher_drift:.3g}" if v.teacher_drift is not None else "")
                 + (f", evidence: {'+'.join(v.evidence)}" if v.evidence else "")
                 + (f" ({v.detail})" if v.detail and v.class_ != "corruption" else "")
                 for v in bad]
        return "; ".join(parts)
