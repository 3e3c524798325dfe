"""``kvfuzz report FILE``: an issue-ready report of a finding (rich in the terminal,
markdown with --markdown or -o)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from kvfuzz.cli.app import app, console
from kvfuzz.traces import atomic_write_text, load_finding


@app.command("report")
def report_cmd(
    file: Annotated[Path, typer.Argument(help="Finding file (JSON).")],
    out: Annotated[Optional[Path], typer.Option("--out", "-o", help="Write the markdown report to this file.")] = None,
    as_markdown: Annotated[bool, typer.Option("--markdown", help="Print markdown instead of the terminal view.")] = False,
) -> None:
    """Render a finding as an issue-ready report: verdicts, minimal trace, tokens around the
    first divergence, control arms, toggles and the replay command."""
    from kvfuzz.harness.toggles import catalog
    from kvfuzz.oracle.report import build, to_markdown, to_rich

    finding = load_finding(file)
    report = build(finding, source=str(file), toggles_known=catalog())
    if out is not None:
        atomic_write_text(out, to_markdown(report))
        console.print(f"wrote {out}")
        return
    if as_markdown:
        typer.echo(to_markdown(report), nl=False)
        return
    for r in to_rich(report):
        console.print(r)
