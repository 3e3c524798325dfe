"""``kvfuzz report FILE``: an issue-ready report of a finding (rich in the terminal,
markdown with --markdown or -o, a self-contained HTML page with --html, the pictures as PNG and
SVG with --plots), or with --upstream a page that reads as a vLLM GitHub issue (docs/upstream/)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated, Optional

import typer

from kvfuzz.cli.app import app, console, err_console
from kvfuzz.traces import atomic_write_text, load_finding


@app.command("report")
def report_cmd(
    file: Annotated[Path, typer.Argument(help="Finding file (JSON), or a campaign's OUT directory / campaign.json "
                                              "(one row per bug bucket).")],
    out: Annotated[Optional[Path], typer.Option("--out", "-o", help="Write the markdown report to this file.")] = None,
    as_markdown: Annotated[bool, typer.Option("--markdown", help="Print markdown instead of the terminal view.")] = False,
    html: Annotated[Optional[Path], typer.Option("--html", help="Write a self-contained HTML report with the pictures "
                                                                "(inline SVG; needs kvfuzz[plots]).")] = None,
    plots: Annotated[Optional[Path], typer.Option("--plots", help="Write each picture as PNG and SVG into this "
                                                                  "directory (for a GitHub issue); the markdown report "
                                                                  "links them. Needs kvfuzz[plots].")] = None,
    upstream: Annotated[bool, typer.Option("--upstream", help="A page that reads as a vLLM GitHub issue (markdown; "
                                                              "-o to write it): environment, what goes wrong, the "
                                                              "standalone script of `kvfuzz export`, expected vs "
                                                              "actual, and for a known bug its mechanism, releases, "
                                                              "upstream status and suggested fix (docs/upstream/). "
                                                              "A finding or trace file.")] = False,
    bug: Annotated[Optional[str], typer.Option("--bug", help="With --upstream: the known bug to describe (its id, "
                                                             "or its regression trace's name; default: matched by "
                                                             "the trace's name).")] = None,
) -> None:
    """Render a finding as an issue-ready report: verdicts, minimal trace, tokens around the
    first divergence, control arms, toggles and the replay command; with --html / --plots, the
    schedule, divergence and controls pictures."""
    from kvfuzz.harness.toggles import catalog
    from kvfuzz.present.report import build, to_markdown, to_rich

    if upstream or bug is not None:
        _upstream_report(file, out, bug, others=html is not None or plots is not None or as_markdown,
                         upstream=upstream)
        return
    if html is not None or plots is not None:
        from kvfuzz.present.draw import require

        require()  # exit 2, one line with the install command
    # Status lines stay off stdout when stdout is the markdown.
    say = err_console if as_markdown and out is None else console
    if file.is_dir() or file.name == "campaign.json":
        _campaign_report(file, out, as_markdown)
        return
    finding = load_finding(file)
    report = build(finding, source=str(file), toggles_known=catalog())
    pictures = None
    if html is not None or plots is not None:
        from kvfuzz.present.pages import finding_pictures

        pictures = finding_pictures(finding, file)  # drawn once for both
    if plots is not None:
        from kvfuzz.present.pages import add_picture_links, write_plots

        written = write_plots(finding, plots, source=file, pictures=pictures)
        base = out.parent if out is not None else Path(".")
        pngs = [p for p in written if p.suffix == ".png"]
        add_picture_links(report, [(p.stem, Path(os.path.relpath(p, base)).as_posix()) for p in pngs])
        say.print(f"wrote {len(written)} picture files to {plots} ({', '.join(p.name for p in pngs)} and .svg)",
                      markup=False, highlight=False)
    if html is not None:
        from kvfuzz.present.pages import finding_page

        atomic_write_text(html, finding_page(finding, source=file, toggles_known=catalog(), pictures=pictures))
        say.print(f"wrote {html}", markup=False, highlight=False)
    if out is not None:
        atomic_write_text(out, to_markdown(report))
        console.print(f"wrote {out}")
        return
    if as_markdown:
        typer.echo(to_markdown(report), nl=False)
        return
    if html is not None or plots is not None:
        return
    for r in to_rich(report):
        console.print(r)


def _upstream_report(file: Path, out: Optional[Path], bug: Optional[str], *, others: bool, upstream: bool) -> None:
    """``--upstream``: the vLLM issue page of a finding or trace (kvfuzz.present.upstream)."""
    from kvfuzz.present.upstream import build_page
    from kvfuzz.traces import BadInput

    if not upstream:
        raise BadInput("needs --upstream", field="--bug")
    if others:
        raise BadInput("--upstream writes markdown only: drop --html, --plots and --markdown", field="--upstream")
    if file.is_dir() or file.name == "campaign.json":
        raise BadInput("--upstream takes one finding or trace file, not a campaign", source=str(file))
    text, src, record = build_page(file, bug=bug)
    if out is None:
        typer.echo(text, nl=False)
        return
    atomic_write_text(out, text)
    what = f"known bug {record.id}" if record is not None else "no known bug: mechanism not yet diagnosed"
    console.print(f"wrote {out} ({what})", markup=False, highlight=False, soft_wrap=True)


def _campaign_report(path: Path, out: Optional[Path], as_markdown: bool) -> None:
    """A campaign speaks in buckets: one row per bucket, near-tie buckets apart."""
    from kvfuzz.present.buckets import load_campaign, markdown, rich_tables, summary_line

    rows, findings = load_campaign(path)
    if out is not None or as_markdown:
        text = markdown(rows, findings)
        if out is not None:
            atomic_write_text(out, text)
            console.print(f"wrote {out}", markup=False, highlight=False)
        else:
            print(text)
        return
    for t in rich_tables(rows):
        console.print(t)
    console.print(summary_line(rows, findings), markup=False, highlight=False, soft_wrap=True)
