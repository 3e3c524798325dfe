"""Self-contained HTML pages: a finding's report with its pictures, a campaign's progress
(``OUT/campaign.html``) and a gate run's cases (``OUT/gate.html``).

Self-contained means one file a browser opens from disk or a CI artifact store: pictures are
inline SVG, the style sheet is inline, there is no script, no font, no CDN and nothing else to
fetch. Pages are written with ``atomic_write_text`` (a reader never sees half a page).
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass
from html import escape
from pathlib import Path
from typing import Any

from .style import CLASS_STYLE
from .report import Bullets, Code, Heading, Para, Report, Table
from kvfuzz.traces import Finding, KvfuzzError, atomic_write_text, load_finding

from .deps import PLOTS_HINT, have_matplotlib
from .buckets import count_text
from .data import BucketView, campaign_view, divergence_data, gate_view, grid_data, schedule_data

log = logging.getLogger("kvfuzz.present")

CSS = """
body{font-family:-apple-system,"Segoe UI",Helvetica,Arial,sans-serif;margin:24px auto;max-width:1100px;
color:#212121;line-height:1.45;padding:0 16px}
h1{font-size:1.5em;border-bottom:1px solid #ddd;padding-bottom:.3em}h2{font-size:1.25em;margin-top:1.6em;
border-bottom:1px solid #eee;padding-bottom:.2em}h3{font-size:1.05em}
table{border-collapse:collapse;margin:.6em 0;font-size:.9em}th,td{border:1px solid #ddd;padding:3px 8px;
text-align:left;vertical-align:top}th{background:#f6f8fa}td.r{text-align:right}
code,pre{font-family:SFMono-Regular,Consolas,Menlo,monospace;font-size:.88em;background:#f6f8fa}
pre{padding:10px;overflow-x:auto;white-space:pre-wrap}code{padding:1px 4px;border-radius:3px}
figure{margin:1em 0}figcaption{font-size:.85em;color:#555}svg.plot{max-width:100%;height:auto;display:block}
.c-corruption,.c-engine-crash,.c-error,.s-FAIL,.s-BLIND,.s-error{color:#c62828;font-weight:bold}
.c-numeric-near-tie{color:#b26a00;font-weight:bold}.c-stall{color:#00838f;font-weight:bold}.c-ok,.s-pass,.s-detected{color:#2e7d32}
.c-truncation,.c-unconstrained,.s-skipped{color:#757575}.muted{color:#757575;font-size:.9em}
.row{display:flex;flex-wrap:wrap;gap:12px}.row figure{flex:1 1 480px}
"""


@dataclass
class Picture:
    name: str  # file stem: schedule, schedule-original, divergence, controls
    title: str
    caption: str
    fig: Any


def page(title: str, body: str, *, refresh: int | None = None) -> str:
    meta = f'<meta http-equiv="refresh" content="{refresh}">' if refresh else ""
    return (f'<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">{meta}'
            f'<meta name="viewport" content="width=device-width, initial-scale=1">'
            f"<title>{escape(title)}</title><style>{CSS}</style></head>\n<body>\n{body}\n</body></html>\n")


def figure_html(pic: Picture, prefix: str) -> str:
    from .draw import svg_text

    return (f'<figure id="{escape(pic.name)}">{svg_text(pic.fig, prefix, title=pic.title)}'
            f"<figcaption>{escape(pic.caption)}</figcaption></figure>")


# -- the report document as HTML -----------------------------------------------------------------


def _segs(segs: list[tuple[str, str]]) -> str:
    out = []
    for text, style in segs:
        t = escape(text)
        if style == "code":
            out.append(f"<code>{t}</code>")
        elif style == "b":
            out.append(f"<b>{t}</b>")
        elif style in CLASS_STYLE:
            out.append(f'<span class="c-{style}">{t}</span>')
        else:
            out.append(t)
    return "".join(out)


def report_html(report: Report) -> str:
    """The report's blocks (present/report.py's document model) as HTML, headings demoted by
    none: the page's own title is the report's level-1 heading."""
    out: list[str] = []
    for b in report.blocks:
        if isinstance(b, Heading):
            out.append(f"<h{b.level}>{escape(b.text)}</h{b.level}>")
        elif isinstance(b, Para):
            out.append(f"<p>{_segs(b.segs)}</p>")
        elif isinstance(b, Table):
            head = "" if all(not c for c in b.columns) else \
                "<tr>" + "".join(f"<th>{escape(c)}</th>" for c in b.columns) + "</tr>"
            rows = []
            for row in b.rows:
                cells = []
                for i, c in enumerate(row):
                    cls = []
                    if i in b.right:
                        cls.append("r")
                    if b.class_col == i and c.split(" ")[0] in CLASS_STYLE:
                        cls.append(f"c-{c.split(' ')[0]}")
                    attr = f' class="{" ".join(cls)}"' if cls else ""
                    cells.append(f"<td{attr}>{escape(c)}</td>")
                rows.append("<tr>" + "".join(cells) + "</tr>")
            out.append(f"<table>{head}{''.join(rows)}</table>")
        elif isinstance(b, Bullets):
            out.append("<ul>" + "".join(f"<li>{escape(i)}</li>" for i in b.items) + "</ul>")
        elif isinstance(b, Code):
            out.append(f"<pre><code>{escape(b.text)}</code></pre>")
    return "\n".join(out)


# -- a finding -----------------------------------------------------------------------------------


def original_of(finding: Finding, source: Path | None) -> Finding | None:
    """The finding a minimized one came from, when its file (``provenance.minimized_from.file``,
    relative to the campaign directory or the finding's) can still be read."""
    info = finding.provenance.minimized_from
    rel = info.file if info is not None else None
    if not isinstance(rel, str) or not rel:
        return None
    p = Path(rel)
    bases = [] if p.is_absolute() else [source.parent, source.parent.parent] if source is not None else []
    for cand in [p] if p.is_absolute() else [b / p for b in bases] + [p]:
        try:
            if cand.is_file():
                return load_finding(cand)
        except Exception:  # an unreadable original only costs its picture
            return None
    return None


def finding_pictures(finding: Finding, source: Path | None = None) -> list[Picture]:
    """The pictures of a finding (matplotlib figures): its schedule, the original's schedule
    with what the minimizer kept, the divergence, the controls and ablation grid."""
    from . import draw

    pics: list[Picture] = []
    s = schedule_data(finding)
    if s is not None:
        over = "engine steps" if s.unit == "step" else "milliseconds"
        pics.append(Picture("schedule", "Schedule", f"Each request over {over}: tall = prefill, thin = decode; send, "
                            "first token, finish, cancel, preemptions, prefix hits; adapter loads/unloads/reloads as "
                            "dashed lines; the victim boxed.", draw.schedule_figure(s)))
    original = original_of(finding, source) if finding.minimization is not None else None
    if original is not None:
        kept = {e.request_id for e in finding.trace.sends}
        so = schedule_data(original, kept=kept)
        if so is not None:
            pics.append(Picture("schedule-original", "Schedule of the original finding",
                                "The finding before minimization; highlighted: the requests the minimizer kept.",
                                draw.schedule_figure(so)))
    d = divergence_data(finding)
    if d is not None:
        pics.append(Picture("divergence", "Divergence", "Per generated position: the chosen token's logprob and the "
                            "top-1/top-2 margin, run against reference, with the noise bounds the finding was judged "
                            f"with ({d.bounds.describe()}); the teacher-forced drift where the run was scored.",
                            draw.divergence_figure(d)))
    g = grid_data(finding)
    if len(g.rows) > 1:  # one arm alone says nothing the summary does not
        pics.append(Picture("controls", "Controls and ablation", "Rows: the finding's arms, its control arms, and each "
                            "mechanism the causal ablation took away; a cell: did the victim diverge there.",
                            draw.grid_figure(g)))
    return pics


def write_plots(finding: Finding, directory: Path, source: Path | None = None, *,
                pictures: list[Picture] | None = None) -> list[Path]:
    """Each picture as ``DIR/<name>.png`` and ``.svg``."""
    from . import draw

    out: list[Path] = []
    for pic in finding_pictures(finding, source) if pictures is None else pictures:
        out += draw.save(pic.fig, directory, pic.name)
    return out


def add_picture_links(report: Report, links: list[tuple[str, str]]) -> None:
    """A "Pictures" section (markdown images) after the summary: ``links`` = (title, path)."""
    if not links:
        return
    at = next((i for i, b in enumerate(report.blocks) if isinstance(b, Heading) and b.text == "Environment"),
              len(report.blocks))
    blocks: list[Any] = [Heading("Pictures")]
    blocks += [Para([(f"![{title}]({path})", "")]) for title, path in links]
    report.blocks[at:at] = blocks


def finding_page(finding: Finding, *, source: Path | None = None,
                 toggles_known: Mapping[str, tuple[str, str]] | None = None,
                 pictures: list[Picture] | None = None) -> str:
    """The HTML report of a finding: the pictures first, then the report document."""
    from kvfuzz.present.report import build

    report = build(finding, source=str(source) if source else "FINDING.json", toggles_known=toggles_known)
    pics = finding_pictures(finding, source) if pictures is None else pictures
    figs = "\n".join(figure_html(p, f"k{i}") for i, p in enumerate(pics))
    nav = " · ".join(f'<a href="#{escape(p.name)}">{escape(p.title)}</a>' for p in pics)
    head = report_html(Report(report.title, report.blocks[:1]))
    body = (head + (f'<p class="muted">Pictures: {nav}</p>' if nav else "") + figs
            + report_html(Report(report.title, report.blocks[1:])))
    return page(report.title, body)


# -- a campaign ----------------------------------------------------------------------------------

CAMPAIGN_PAGE = "campaign.html"
# Charts are redrawn at most this often while a campaign runs (HTML text is rewritten every
# time, cheaply): drawing takes a few hundred ms a chart, a fast campaign runs several traces a
# second, and the page must cost the campaign next to nothing.
REDRAW_S = 30.0
# A bucket's report (a second or two of drawing, once) is written while the campaign runs only
# after this long; a shorter campaign gets it from its final page (kvfuzz run's summary).
BUCKET_REPORTS_AFTER_S = 120.0
# ...and, on a loaded machine where a redraw takes seconds, at most this share of the campaign's
# time goes to charts (unchecked, redraws took 5% of a 10-minute campaign): the next redraw
# waits at least the last one's duration divided by it.
CHART_SHARE = 0.02


@dataclass
class _Cache:
    drawn_at: float = 0.0
    cost: float = 0.0  # seconds the last redraw took
    key: Any = None
    charts: str = ""
    warned: bool = False


_CACHE: dict[str, _Cache] = {}


def _bucket_table(buckets: list[BucketView], reports: Mapping[str, str | None]) -> str:
    trs = []
    for b in buckets:
        links = []
        rep = reports.get(b.id)
        if rep:
            links.append(f'<a href="{escape(rep)}">report</a>')
        if b.representative:
            links.append(f'<a href="{escape(b.representative)}">finding</a>')
        if b.case:
            links.append(f'<a href="{escape(b.case)}">regression case</a>')
        cmd = f"kvfuzz report {b.representative}" if b.representative else ""
        count = count_text(b.count, b.assigned)
        trs.append(f"<tr><td><code>{escape(b.id)}</code></td><td class=\"r\">{count}</td><td class=\"r\">"
                   f"{'' if b.first_index is None else b.first_index}</td><td>{escape(b.text)}</td><td>"
                   f"{' · '.join(links)}<br><code>{escape(cmd)}</code></td></tr>")
    return ("<table><tr><th>bucket</th><th>findings</th><th>first trace</th><th>what</th><th>links</th></tr>"
            + "".join(trs) + "</table>")


def _bucket_report(out: Path, case: str | None, *, draw: bool = True) -> str | None:
    """``buckets/<id>.html`` next to a bucket's regression case (its minimal first finding),
    written once (when ``draw``); the path relative to OUT, or None when there is none yet."""
    if not case:
        return None
    src = out / case
    html = src.with_suffix(".html")
    try:
        if html.exists() and html.stat().st_mtime >= src.stat().st_mtime:
            return str(html.relative_to(out))
        if not draw or not src.is_file() or not have_matplotlib():
            return None
        finding = load_finding(src)
        from kvfuzz.harness.toggles import catalog

        atomic_write_text(html, finding_page(finding, source=src, toggles_known=catalog()))
        return str(html.relative_to(out))
    except Exception as e:  # a report that cannot be drawn costs its link, never the campaign
        log.warning("kvfuzz: no HTML report for %s: %s", src, e)
        return None


def campaign_html(out: Path, state: Mapping[str, Any] | Any, *, charts: str = "", reports: Mapping[str, str | None]
                  | None = None) -> str:
    v = campaign_view(state)
    reports = reports or {}
    rate = v.traces / v.seconds if v.seconds else 0.0
    classes = ", ".join(f'<span class="c-{escape(c)}">{n} {escape(c)}</span>' for c, n in sorted(v.by_class.items()))
    status = "complete" if v.complete else "running (this page refreshes every 10 s)"
    rows = [("status", escape(status)), ("traces", f"{v.traces} ({rate:.2f}/s)"), ("seconds", f"{v.seconds:.1f}"),
            ("findings", f"{v.findings}" + (f" — {classes}" if classes else "")),
            ("bug buckets", str(len(v.buckets))), ("coverage", f"{v.coverage} scheduler-state features"),
            ("mode", escape(v.mode)), ("sources", escape(", ".join(f"{k} {n}" for k, n in sorted(v.sources.items()))))]
    if v.untriaged:
        rows.append(("untriaged findings", str(v.untriaged)))
    body = [f"<h1>kvfuzz campaign: {escape(out.resolve().name)}</h1>",
            "<table>" + "".join(f"<tr><th>{k}</th><td>{val}</td></tr>" for k, val in rows) + "</table>",
            f'<p class="muted">Updated {time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())}; state in '
            f'<a href="campaign.json">campaign.json</a>.</p>']
    body.append(charts or f'<p class="muted">No charts: they need matplotlib ({escape(PLOTS_HINT)}).</p>')
    if v.time_breakdown:
        body.append("<h2>Where the time went</h2><table><tr><th>part</th><th>seconds</th></tr>" + "".join(
            f'<tr><td>{escape(k)}</td><td class="r">{s:.1f}</td></tr>' for k, s in v.time_breakdown) + "</table>")
    bugs = [b for b in v.buckets if not b.near_tie]
    ties = [b for b in v.buckets if b.near_tie]
    body.append("<h2>Bug buckets</h2>")
    body.append(_bucket_table(bugs, reports) if bugs else "<p>No bug bucket.</p>" if v.buckets else "<p>No bucket yet.</p>")
    if ties:
        # Apart from the bugs: a flipped near tie is expected of 16-bit numerics.
        body.append("<h2>Near-tie buckets</h2><p class=\"muted\">A flipped near tie: expected of 16-bit numerics, "
                    "not a bug there; suspect in float32 (docs/oracle.md).</p>")
        body.append(_bucket_table(ties, reports))
    if v.finding_files:
        shown = v.finding_files[-100:]
        more = len(v.finding_files) - len(shown)
        note = f'<p class="muted">the last 100 of {len(v.finding_files)}</p>' if more else ""
        items = "".join(f'<li><a href="{escape(f)}">{escape(f)}</a></li>' for f in shown)
        body.append(f"<h2>Findings</h2>{note}<ul>{items}</ul>")
    return page(f"kvfuzz campaign {out.resolve().name}", "\n".join(body), refresh=None if v.complete else 10)


def _campaign_charts(v: Any) -> str:
    from . import draw

    figs = [Picture("progress", "traces and findings over time", "Traces run and findings written against the "
                    "campaign's seconds.", draw.progress_figure(v)),
            Picture("coverage", "coverage against traces", "Distinct scheduler-state features (coverage buckets) "
                    "against traces run.", draw.coverage_figure(v))]
    html = '<div class="row">' + "".join(figure_html(p, f"c{i}") for i, p in enumerate(figs)) + "</div>"
    if v.time_breakdown:
        html += figure_html(Picture("time", "where the time went", "Seconds per part of the campaign, as "
                                    "campaign.json records them.",
                                    draw.breakdown_figure(v.time_breakdown, title="where the time went")), "c9")
    return html


def write_campaign_page(out: Path | str, state: Mapping[str, Any] | Any, *, final: bool = False) -> None:
    """``OUT/campaign.html``: counts and buckets every call, charts redrawn at most every
    ``REDRAW_S`` seconds while running (always at the end), each bucket's report once."""
    out = Path(out)
    cache = _CACHE.setdefault(str(out.resolve()), _Cache())
    try:
        v = campaign_view(state)
        # Nothing is drawn in a campaign's first REDRAW_S seconds unless it ends: a short
        # campaign (or a test's) pays for text only.
        done = final or v.complete
        draw_now = (done or v.seconds >= REDRAW_S) and have_matplotlib()
        reports = {b.id: _bucket_report(out, b.case, draw=draw_now and (done or v.seconds >= BUCKET_REPORTS_AFTER_S))
                   for b in v.buckets}
        if draw_now:
            key = (v.progress[:-1], v.findings, len(v.buckets), v.time_breakdown)
            now = time.monotonic()
            wait = max(REDRAW_S, cache.cost / CHART_SHARE)
            due = final or v.complete or not cache.charts or (key != cache.key and now - cache.drawn_at >= wait) \
                or now - cache.drawn_at >= 6 * wait
            if due:
                cache.charts, cache.key = _campaign_charts(v), key
                cache.drawn_at = time.monotonic()
                cache.cost = cache.drawn_at - now
        atomic_write_text(out / CAMPAIGN_PAGE, campaign_html(out, state, charts=cache.charts, reports=reports))
    except Exception as e:  # the page is a convenience: the campaign never stops for it
        if not cache.warned:
            cache.warned = True
            log.warning("kvfuzz: could not write %s: %s", out / CAMPAIGN_PAGE, e)


# -- a gate run ----------------------------------------------------------------------------------

GATE_PAGE = "gate.html"


def _gate_findings(out: Path) -> dict[tuple[str, str], Path]:
    """(case source, arm) -> the finding the gate saved for it (``OUT/findings``)."""
    found: dict[tuple[str, str], Path] = {}
    for p in sorted((out / "findings").glob("*.json")):
        try:
            gate = load_finding(p).provenance.gate
        except (KvfuzzError, OSError):
            continue
        if gate is not None:
            found[(gate.source, str(gate.arm))] = p
    return found


def gate_html(out: Path, data: Mapping[str, Any], *, chart: str = "", reports: Mapping[tuple[str, str], str]
              | None = None) -> str:
    what, complete, cases = gate_view(data)
    reports = reports or {}
    counts: dict[str, int] = {}
    for c in cases:
        counts[c.status] = counts.get(c.status, 0) + 1
    summary = ", ".join(f'<span class="s-{escape(s)}">{n} {escape(s)}</span>' for s, n in sorted(counts.items()))
    body = [f"<h1>kvfuzz {escape(what)}: {len(cases)} case(s)</h1>",
            f"<p>{summary or 'no case ran'}" + ("" if complete else " — <b>incomplete</b>: the run stopped early")
            + '. Results in <a href="gate.json">gate.json</a>.</p>',
            chart or f'<p class="muted">No chart: it needs matplotlib ({escape(PLOTS_HINT)}).</p>',
            "<table><tr><th>result</th><th>file</th><th>arm</th><th>verdict</th><th>seconds</th><th>report</th></tr>"]
    for c in cases:
        rep = reports.get((c.source, c.arm))
        link = f'<a href="{escape(rep)}">report</a>' if rep else ""
        body.append(f'<tr><td class="s-{escape(c.status)}">{escape(c.status)}</td><td>{escape(c.name)}</td><td>'
                    f"{escape(c.arm)}</td><td>{escape(c.verdict)}<br><code>{escape(c.replay)}</code></td>"
                    f'<td class="r">{c.seconds:.1f}</td><td>{link}</td></tr>')
    body.append("</table>")
    return page(f"kvfuzz {what}", "\n".join(body))


def write_gate_page(out: Path | str) -> None:
    """``OUT/gate.html`` from ``OUT/gate.json``, with a report page for each finding the gate
    saved. Never raises."""
    out = Path(out)
    try:
        data = json.loads((out / "gate.json").read_text(encoding="utf-8"))
        what, _, cases = gate_view(data)
        chart, reports = "", {}
        if have_matplotlib():
            from . import draw

            if cases:
                chart = figure_html(Picture("cases", "cases", "Each case's seconds, coloured by its result.",
                                            draw.gate_figure(cases, what)), "g0")
            for key, p in _gate_findings(out).items():
                html = p.with_suffix(".html")
                try:
                    if not html.exists() or html.stat().st_mtime < p.stat().st_mtime:
                        from kvfuzz.harness.toggles import catalog

                        atomic_write_text(html, finding_page(load_finding(p), source=p, toggles_known=catalog()))
                    reports[key] = str(html.relative_to(out))
                except Exception as e:
                    log.warning("kvfuzz: no HTML report for %s: %s", p, e)
        atomic_write_text(out / GATE_PAGE, gate_html(out, data, chart=chart, reports=reports))
    except Exception as e:
        log.warning("kvfuzz: could not write %s: %s", out / GATE_PAGE, e)


__all__ = ["CAMPAIGN_PAGE", "GATE_PAGE", "Picture", "add_picture_links", "campaign_html", "finding_page",
           "finding_pictures", "gate_html", "original_of", "page", "report_html", "write_campaign_page",
           "write_gate_page", "write_plots"]
