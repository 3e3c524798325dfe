"""The regression gate's reports: JUnit XML (one test case per file and arm, for CI test
reporters) and markdown (for a CI job summary), drawn from the cases oracle/gate.py judged."""

from __future__ import annotations

from xml.sax.saxutils import escape, quoteattr

from kvfuzz.oracle.gate import Case

from .report import md_cell


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
