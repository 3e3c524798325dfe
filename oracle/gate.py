"""The regression gate's verdicts and reports (pure: no engine here).

A *case* is one corpus file replayed in one arm. It fails when a request comes back as
``corruption``, ``error`` or ``engine-crash`` (``numeric-near-tie`` too under ``strict``).
In the self-test a case may instead be *expected* to fail (a fault arm): then it passes only if
it does fail, and a fault arm that stops failing means the detector went blind.

Reports: JUnit XML (one test case per file and arm, for CI test reporters) and markdown (for a
CI job summary).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from xml.sax.saxutils import escape, quoteattr

from kvfuzz.traces import Divergence

from .report import md_cell

FAILING = ("engine-crash", "error", "corruption")
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


def junit_xml(cases: list[Case], *, suite: str = "kvfuzz-gate") -> str:
    """JUnit XML: a test case per (file, arm); failure message = verdict; text adds the command."""
    failures = sum(1 for c in cases if not c.ok and not c.error)
    errors = sum(1 for c in cases if c.error)
    skipped = sum(1 for c in cases if c.skipped)
    total = sum(c.seconds for c in cases)
    out = ['<?xml version="1.0" encoding="UTF-8"?>',
           f'<testsuites name={quoteattr(suite)} tests="{len(cases)}" failures="{failures}" errors="{errors}" '
           f'skipped="{skipped}" time="{total:.3f}">',
           f'  <testsuite name={quoteattr(suite)} tests="{len(cases)}" failures="{failures}" errors="{errors}" '
           f'skipped="{skipped}" time="{total:.3f}">']
    for c in cases:
        head = (f'    <testcase classname={quoteattr("kvfuzz.gate." + c.arm)} name={quoteattr(c.name)} '
                f'file={quoteattr(c.source)} time="{c.seconds:.3f}"')
        body = (f"{c.verdict_text()}\n\nfile: {c.source}\narm: {c.arm} "
                f"[{', '.join(c.toggles) or 'no toggles'}]\nreplay: {c.replay_command}")
        if c.skipped:
            out.append(head + f'>\n      <skipped message={quoteattr(c.skipped)}/>\n    </testcase>')
        elif c.error:
            out.append(head + f'>\n      <error message={quoteattr(c.error)}>{escape(body)}</error>\n    </testcase>')
        elif not c.ok:
            kind = "kvfuzz.blind" if c.expect_fail else "kvfuzz.divergence"
            out.append(head + f'>\n      <failure message={quoteattr(c.verdict_text())} type="{kind}">'
                       f'{escape(body)}</failure>\n    </testcase>')
        else:
            out.append(head + f'>\n      <system-out>{escape(body)}</system-out>\n    </testcase>')
    out += ["  </testsuite>", "</testsuites>", ""]
    return "\n".join(out)


def markdown_summary(cases: list[Case], *, title: str = "kvfuzz regression gate", header: str = "") -> str:
    bad = [c for c in cases if not c.ok]
    lines = [f"## {title}: {'FAILED' if bad else 'passed'}", ""]
    if header:
        lines += [header, ""]
    n_pass = sum(1 for c in cases if c.ok and not c.skipped)
    n_skip = sum(1 for c in cases if c.skipped)
    lines += [f"{len(cases)} case(s): {n_pass} as expected, {len(bad)} not, {n_skip} skipped.", ""]
    lines += ["| result | file | arm | verdict |", "| --- | --- | --- | --- |"]
    for c in sorted(cases, key=lambda c: (c.ok, c.source, c.arm)):
        mark = {"pass": "✅ pass", "detected": "✅ detected", "skipped": "⏭ skipped", "FAIL": "❌ FAIL",
                "BLIND": "❌ BLIND", "error": "❌ error"}[c.status]
        lines.append(f"| {mark} | `{md_cell(c.name)}` | `{md_cell(c.arm)}` | {md_cell(c.verdict_text())} |")
    if bad:
        lines += ["", "Replay a failing case:", ""]
        for c in bad:
            lines += ["```", c.replay_command, "```"]
    return "\n".join(lines) + "\n"
