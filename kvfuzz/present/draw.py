"""Drawing: the dataclasses of ``kvfuzz.present.data`` as matplotlib figures, saved as PNG and SVG
(for a GitHub issue) or inlined as SVG in a self-contained HTML page.

matplotlib is the optional ``[plots]`` extra: ``require()`` raises a one-line ``BadInput``
(exit 2) naming the install command when it is missing. Only matplotlib's object API is used
(``Figure``, no pyplot): no GUI backend, no global figure state, safe inside a campaign.
"""

from __future__ import annotations

import io
import re
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from kvfuzz.traces.errors import BadInput

from .deps import PLOTS_HINT
from .data import CampaignView, DivergenceData, GateCaseView, Grid, Schedule

CLASS_COLOR = {"corruption": "#c62828", "engine-crash": "#8e24aa", "error": "#d32f2f", "numeric-near-tie": "#e69500",
               "stall": "#00838f",
               "unconstrained": "#757575", "truncation": "#757575", "ok": "#2e7d32", "—": "#757575"}
BASE_COLOR = "#607d8b"
ADAPTER_COLORS = ["#1e88e5", "#8e24aa", "#00897b", "#f4511e", "#6d4c41", "#3949ab", "#7cb342", "#d81b60"]
LIFECYCLE_COLOR = "#6a1b9a"
CELL_COLOR = {"diverged": "#ef9a9a", "near-tie": "#ffe082", "clean": "#c8e6c9", "na": "#eeeeee",
              "skipped": "#f5f5f5", "failed": "#ce93d8", "none": "#ffffff"}
STATUS_COLOR = {"pass": "#66bb6a", "detected": "#66bb6a", "skipped": "#bdbdbd", "FAIL": "#e53935", "BLIND": "#e53935",
                "error": "#8e24aa"}
REF_COLOR, RUN_COLOR = "#212121", "#d84315"

RC = {"svg.fonttype": "none", "svg.hashsalt": "kvfuzz", "font.size": 9, "axes.titlesize": 10,
      "axes.spines.top": False, "axes.spines.right": False, "legend.fontsize": 8, "legend.frameon": True,
      "legend.framealpha": 0.85, "legend.edgecolor": "#e0e0e0",
      "figure.dpi": 100}


def require() -> None:
    """Raise BadInput (exit 2) when matplotlib is missing."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise BadInput(f"pictures need matplotlib, which is not installed: {PLOTS_HINT}") from None


@contextmanager
def _style() -> Iterator[None]:
    import matplotlib

    with matplotlib.rc_context(RC):
        yield


def _figure(w: float, h: float) -> Any:
    from matplotlib.figure import Figure

    return Figure(figsize=(w, h), layout="constrained")


# -- output --------------------------------------------------------------------------------------

_ID = re.compile(r'\bid="([^"]+)"')


def svg_text(fig: Any, prefix: str, *, title: str = "") -> str:
    """The figure as an inline ``<svg>`` element: no XML prolog, ids prefixed (several
    figures share one page), scaled to the page's width."""
    buf = io.StringIO()
    with _style():
        fig.savefig(buf, format="svg", metadata={"Date": None})
    text = buf.getvalue()
    text = text[text.index("<svg"):]
    ids = set(_ID.findall(text))
    for i in sorted(ids, key=len, reverse=True):
        text = text.replace(f'id="{i}"', f'id="{prefix}-{i}"').replace(f"url(#{i})", f"url(#{prefix}-{i})") \
            .replace(f'href="#{i}"', f'href="#{prefix}-{i}"')
    text = re.sub(r'<svg([^>]*?) width="[^"]+" height="[^"]+"', r'<svg\1 class="plot" role="img"', text, count=1)
    if title:
        from html import escape

        text = text.replace(">", f"><title>{escape(title)}</title>", 1)
    return text


def save(fig: Any, directory: Path, name: str) -> list[Path]:
    """``DIR/NAME.png`` and ``DIR/NAME.svg``."""
    directory.mkdir(parents=True, exist_ok=True)
    png, svg = directory / f"{name}.png", directory / f"{name}.svg"
    png.write_bytes(png_bytes(fig))
    with _style():
        fig.savefig(svg, format="svg", metadata={"Date": None})
    return [png, svg]


def png_bytes(fig: Any, dpi: int = 100) -> bytes:
    """The figure as a PNG with a 256-colour palette (a third of the full-colour size: pictures
    attached to issues stay well under 150 KB)."""
    from PIL import Image

    buf = io.BytesIO()
    with _style():
        fig.savefig(buf, format="png", dpi=dpi, metadata={"Software": None})
    buf.seek(0)
    img = Image.open(buf).convert("RGB").quantize(colors=256, method=Image.Quantize.MEDIANCUT)
    out = io.BytesIO()
    img.save(out, format="PNG", optimize=True)
    return out.getvalue()


# -- schedule ------------------------------------------------------------------------------------


def _adapter_colors(s: Schedule) -> dict[str | None, str]:
    names = sorted({b.adapter for b in s.bars if b.adapter})
    colors: dict[str | None, str] = {None: BASE_COLOR}
    colors.update({a: ADAPTER_COLORS[i % len(ADAPTER_COLORS)] for i, a in enumerate(names)})
    return colors


def schedule_figure(s: Schedule) -> Any:
    from matplotlib.artist import Artist
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch, Rectangle

    with _style():
        n = len(s.bars)
        fig = _figure(10, 1.9 + 0.42 * max(n, 2))
        ax = fig.add_subplot()
        colors = _adapter_colors(s)
        partial = any(b.kept is False for b in s.bars)
        x0 = min([b.start for b in s.bars] + [ln.x for ln in s.lines], default=0.0)
        x1 = max([b.end for b in s.bars] + [ln.x for ln in s.lines], default=1.0)
        pad = max(1.0, 0.02 * (x1 - x0))
        for i, b in enumerate(s.bars):
            y = n - 1 - i
            alpha = 0.28 if b.kept is False else 1.0
            color = colors.get(b.adapter, BASE_COLOR)
            if partial and b.kept:
                ax.axhspan(y - 0.48, y + 0.48, color="#fff3c4", zorder=0)
            for sp in b.spans:
                if sp.kind == "prefill" or sp.kind == "to-first-token":
                    h, a = 0.62, 1.0 if sp.kind == "prefill" else 0.35
                elif sp.kind == "decode":
                    h, a = 0.36, 0.6
                else:
                    h, a = 0.08, 0.5
                ax.add_patch(Rectangle((sp.start, y - h / 2), sp.end - sp.start, h, color=color if sp.kind != "waiting"
                                       else "#9e9e9e", alpha=a * alpha, lw=0, zorder=2))
            if b.victim:
                ax.add_patch(Rectangle((b.start, y - 0.4), max(b.end - b.start, 0.3), 0.8, fill=False,
                                       ec=CLASS_COLOR.get(s.worst, "#c62828"), lw=1.8, zorder=3))
            for m in b.markers:
                style = {"send": (">", "#212121", 6, y), "first-token": ("o", "#212121", 4.5, y),
                         "finish": ("|", "#212121", 11, y), "cancel": ("X", "#d32f2f", 8, y),
                         "preempted": ("v", "#ef6c00", 8, y + 0.42), "prefix-hit": ("D", "#2e7d32", 6, y - 0.42),
                         "error": ("*", "#d32f2f", 10, y), "first-divergence": ("*", "#b71c1c", 12, y)}.get(m.kind)
                if style is None:
                    continue
                mk, c, size, yy = style
                ax.plot([m.x], [yy], marker=mk, color=c, ms=size, mfc="white" if m.kind == "first-token" else c,
                        ls="none", alpha=alpha, zorder=4)
                if m.kind == "first-divergence":
                    ax.annotate(m.note + f" (step {m.at:g})", (m.x, y + 0.3), xytext=(0, 3), textcoords="offset points",
                                fontsize=7.5, color="#b71c1c", ha="center", va="bottom", zorder=5).set_in_layout(False)
                if m.kind == "prefix-hit" and m.note:
                    ax.annotate(m.note, (m.x, yy), xytext=(5, -3), textcoords="offset points", fontsize=7,
                                color="#2e7d32", va="top", alpha=alpha, zorder=4).set_in_layout(False)
            ax.annotate(b.verdict, (b.end, y), xytext=(6, 0), textcoords="offset points", va="center", fontsize=7.5,
                        color=CLASS_COLOR.get(b.verdict, "#757575"), alpha=alpha,
                        fontweight="bold" if b.victim else "normal").set_in_layout(False)
        same: dict[float, int] = {}
        for ln in s.lines:
            k = same[ln.x] = same.get(ln.x, -1) + 1  # labels of events at one step stack upwards
            ax.axvline(ln.x, color=LIFECYCLE_COLOR, ls=(0, (4, 3)) if not ln.refused else ":", lw=1.1, zorder=1)
            right = ln.x < x0 + 0.7 * (x1 - x0)
            ax.annotate(ln.label, (ln.x, n - 0.5), xytext=(3 if right else -3, 2 + 10 * k), textcoords="offset points",
                        fontsize=7.5, color=LIFECYCLE_COLOR, va="bottom", ha="left" if right else "right",
                        annotation_clip=False).set_in_layout(False)
        ax.set_ylim(-0.7, n - 0.3 + (0.35 + 0.25 * max(same.values(), default=0) if s.lines else 0))
        ax.set_xlim(x0 - pad, x1 + pad + 0.12 * (x1 - x0))  # room for the verdict after each bar
        ax.set_yticks(range(n))
        ax.set_yticklabels([b.label + ("  ◀ victim" if b.victim else "") for b in reversed(s.bars)], fontsize=8)
        for tick, b in zip(ax.get_yticklabels(), list(reversed(s.bars))):
            if b.victim:
                tick.set_color(CLASS_COLOR.get(s.worst, "#c62828"))
                tick.set_fontweight("bold")
            elif b.kept is False:
                tick.set_color("#9e9e9e")
        ax.set_xlabel("engine step" if s.unit == "step" else "ms since the trace started")
        ax.grid(axis="x", color="#eeeeee", lw=0.8, zorder=0)
        ax.set_axisbelow(True)
        ax.set_title(s.title + (f"\n{s.note}" if s.note else ""), loc="left")
        handles: list[Artist] = [Patch(color=colors[a], label=a or "base model") for a in colors if a is None or
                   any(b.adapter == a for b in s.bars)]
        step = s.unit == "step"
        handles += [Patch(color="#9e9e9e", alpha=0.9, label="prefill (tall)" if step else "to first token"),
                    Patch(color="#9e9e9e", alpha=0.5, label="decode (thin)")]
        if step:
            handles.append(Line2D([], [], color="#9e9e9e", lw=1.5, label="waiting / preempted"))
        handles += [Line2D([], [], marker=">", color="#212121", ls="none", label="send"),
                    Line2D([], [], marker="o", mfc="white", color="#212121", ls="none", label="first token"),
                    Line2D([], [], marker="|", color="#212121", ms=9, ls="none", label="finish"),
                    Line2D([], [], marker="X", color="#d32f2f", ls="none", label="cancel"),
                    Line2D([], [], marker="v", color="#ef6c00", ls="none", label="preempted"),
                    Line2D([], [], marker="D", color="#2e7d32", ls="none", label="prefix hit (cached tokens)"),
                    Line2D([], [], marker="*", color="#b71c1c", ms=10, ls="none", label="first differing token"),
                    Patch(fill=False, ec=CLASS_COLOR.get(s.worst, "#c62828"), lw=1.8, label=f"victim ({s.worst})")]
        if s.lines:
            resets = [ln.kind == "reset-prefix-cache" for ln in s.lines]
            kinds = (["adapter load / unload / reload"] if not all(resets) else []) + (
                ["prefix-cache reset"] if any(resets) else [])
            handles.append(Line2D([], [], color=LIFECYCLE_COLOR, ls="--", label=", ".join(kinds)))
        if partial:
            handles.append(Patch(color="#fff3c4", label="kept by the minimizer"))
        fig.legend(handles=handles, loc="outside lower center", ncol=6)
    return fig


# -- divergence ----------------------------------------------------------------------------------


def _series(xs: tuple[int, ...], ys: tuple[float | None, ...]) -> tuple[list[float], list[float]]:
    import math

    return list(xs), [math.nan if y is None else y for y in ys]


def _two_tone(ax: Any, xs: tuple[int, ...], ys: tuple[float | None, ...], first: int, **kw: Any) -> None:
    """A series drawn in full up to the first differing position and faded after it (where run
    and reference continue on different tokens, so their values no longer compare)."""
    x, y = _series(xs, ys)
    cut = next((k for k, v in enumerate(x) if v > first), len(x))
    ax.plot(x[:cut], y[:cut], **kw)
    if cut < len(x):
        ax.plot(x[cut - 1 if cut else 0:], y[cut - 1 if cut else 0:], **{**kw, "label": None,
                                                                         "alpha": 0.3 * kw.get("alpha", 1.0)})


def divergence_figure(d: DivergenceData) -> Any:
    b = d.bounds
    evidence = bool(d.drift or d.teacher)
    with _style():
        fig = _figure(10, 7.6 if evidence else 5.4)
        axes = fig.subplots(3 if evidence else 2, 1, sharex=True)
        ax1, ax2 = axes[0], axes[1]
        xs = d.positions
        last = xs[-1] if xs else 0
        color = CLASS_COLOR.get(d.cls, "#c62828")
        for ax in axes:
            ax.axvspan(d.first - 0.5, last + 0.5, color="#000000", alpha=0.04, lw=0)
            ax.axvline(d.first, color=color, ls=":", lw=1.3)
            ax.grid(color="#eeeeee", lw=0.8)
            ax.set_axisbelow(True)
        x, lo = _series(xs, d.band_low)
        _, hi = _series(xs, d.band_high)
        ax1.fill_between(x, lo, hi, color="#64b5f6", alpha=0.45, lw=0,
                         label=f"noise band: reference ± drift bound {b.drift:.3g} nats ({d.dtype})")
        _two_tone(ax1, xs, d.ref_logprob, d.first, color=REF_COLOR, marker="o", ms=3, lw=1.2,
                  label="reference: the request alone, clean cache")
        _two_tone(ax1, xs, d.run_logprob, d.first, color=RUN_COLOR, marker="x", ms=4, lw=1.0, alpha=0.9,
                  label=f"run {d.run_index} of arm {d.arm}")
        ax1.set_ylabel("chosen token's logprob")
        rt = d.ref_tokens[d.first] if d.first < len(d.ref_tokens) else None
        gt = d.run_tokens[d.first] if d.first < len(d.run_tokens) else None
        # Text goes on the side of the first differing token that has room.
        left = d.first > 0.6 * last
        ax1.annotate(f"first differing token #{d.first}: reference {rt}, run {'end' if gt is None else gt}",
                     (d.first, 1.0), xycoords=("data", "axes fraction"), xytext=(-4 if left else 4, -2),
                     textcoords="offset points", va="top", ha="right" if left else "left", fontsize=8,
                     color=color).set_in_layout(False)
        ax1.legend(loc="lower left", ncol=3 if len(xs) > 40 else 2)
        # Margins and the pair shift against the near-tie bound.
        ax2.axhspan(0, b.near_tie, color="#ffca28", alpha=0.35, lw=0,
                    label=f"near-tie bound {b.near_tie:.3g}: a pair shift below it can be noise")
        _two_tone(ax2, xs, d.ref_margin, d.first, color=REF_COLOR, marker="o", ms=3, lw=1.2, label="reference margin")
        _two_tone(ax2, xs, d.run_margin, d.first, color=RUN_COLOR, marker="x", ms=4, lw=1.0, alpha=0.9,
                  label="run margin")
        if d.pair_shift is not None:
            ax2.plot([d.first, d.first], [0, d.pair_shift], color=color, lw=4, alpha=0.8, solid_capstyle="butt")
            ax2.plot([d.first], [d.pair_shift], "D", color=color, ms=6, label="pair shift at the first differing token")
            times = (f" = {d.pair_shift / b.near_tie:,.0f}x the bound" if d.pair_shift >= b.near_tie
                     else f" < the bound {b.near_tie:.3g}: within the noise")
            ref_m = d.ref_margin[d.first] if d.first < len(d.ref_margin) else None
            parts = "" if ref_m is None else f" (reference margin {ref_m:.3g} + run margin {d.pair_shift - ref_m:.3g})"
            ax2.annotate(f"pair shift {d.pair_shift:.3g}{times}{parts}", (d.first, d.pair_shift),
                         xytext=(-14 if left else 14, 34), textcoords="offset points", fontsize=8, color=color,
                         ha="right" if left else "left",
                         bbox={"boxstyle": "round,pad=0.2", "fc": "white", "ec": color, "lw": 0.6, "alpha": 0.9},
                         arrowprops={"arrowstyle": "->", "color": color, "lw": 0.8}).set_in_layout(False)
        ax2.set_ylabel("top-1 − top-2 margin (nats)")
        ax2.set_ylim(bottom=0)
        ax2.legend(loc="upper left" if left else "upper right", ncol=2)
        if evidence:
            ax3 = axes[2]
            floor = min(b.drift, b.teacher) / 100
            ax3.set_yscale("log")
            top = max([b.near_tie, b.drift, b.teacher] + [v for _, v in d.drift] + [v for _, v in d.teacher])
            ax3.axhspan(floor / 2, max(b.drift, b.teacher), color="#c8e6c9", alpha=0.5, lw=0)
            ax3.axhline(b.drift, color="#1565c0", ls="--", lw=1, label=f"drift bound {b.drift:.3g}")
            ax3.axhline(b.teacher, color="#ef6c00", ls="--", lw=1, label=f"teacher-forcing bound {b.teacher:.3g}")
            if d.drift:
                ax3.plot([i for i, _ in d.drift], [max(v, floor) for _, v in d.drift], "o", color="#1565c0", ms=4,
                         mfc="white", label="|run − reference| before the first differing token")
            if d.teacher:
                ax3.plot([i for i, _ in d.teacher], [max(v, floor) for _, v in d.teacher], "s-", color="#ef6c00",
                         ms=3.5, lw=1, label="teacher-forced |Δ| (the run's own tokens, alone)")
            ax3.set_ylim(floor / 2, top * 4)
            ax3.set_ylabel("|Δ logprob| (nats, log)")
            ax3.legend(loc="upper left", ncol=2)
            ax3.annotate(f"green: within the noise bounds ({d.dtype}); exact zeros drawn at the bottom",
                         (1.0, 0.0), xycoords="axes fraction", xytext=(-4, 4), textcoords="offset points", ha="right",
                         fontsize=7, color="#2e7d32").set_in_layout(False)
        axes[-1].set_xlabel("generated position")
        axes[-1].set_xlim(-0.8, max(last, d.first) + 0.8)
        within = d.within_bounds()
        over = [k for k, v in within.items() if v is False]
        if d.cls == "numeric-near-tie" or not over:
            verdict = "every piece of evidence within its noise bound: floating-point noise can explain it"
        else:
            words = {"pair shift": "the pair shift", "drift": "the drift before it",
                     "teacher": "the teacher-forced drift"}
            said = [words[k] for k in over]
            verdict = ("not noise: " + " and ".join([", ".join(said[:-1]), said[-1]] if len(said) > 1 else said)
                       + (" are above their bounds" if len(said) > 1 else " is above its bound"))
        fig.suptitle(f"Divergence of {d.request_id}: {d.cls} — {verdict}", x=0.01, ha="left", fontsize=10,
                     color=color)
    return fig


# -- controls and ablation -----------------------------------------------------------------------


def grid_figure(g: Grid, *, title: str = "Controls and ablation: does the victim diverge?") -> Any:
    from matplotlib.patches import Rectangle

    with _style():
        n, m = len(g.rows), len(g.columns)
        fig = _figure(min(7.5 + 1.6 * m, 14), 1.3 + 0.3 * max(n, 1))
        ax = fig.add_subplot()
        for r, row in enumerate(g.rows):
            y = n - 1 - r
            for c, cell in enumerate(row.cells):
                ax.add_patch(Rectangle((c, y), 1, 1, fc=CELL_COLOR[cell.state], ec="white", lw=1.5,
                                       hatch="//" if cell.state == "skipped" else None))
                ax.text(c + 0.5, y + 0.5, cell.text, ha="center", va="center", fontsize=7.5,
                        color="#b71c1c" if cell.state == "diverged" else "#212121")
            if r and g.rows[r - 1].group != row.group:
                ax.axhline(y + 1, color="#616161", lw=1)
            if row.note:
                note = row.note if len(row.note) <= 70 else row.note[:69] + "…"
                ax.text(m + 0.06, y + 0.5, note, ha="left", va="center", fontsize=7, color="#616161")
        ax.set_xlim(0, m + 2.4)
        ax.set_ylim(0, n)
        ax.set_yticks([n - 1 - r + 0.5 for r in range(n)])
        ax.set_yticklabels([row.label for row in g.rows], fontsize=8)
        ax.xaxis.tick_top()
        ax.set_xticks([c + 0.5 for c in range(m)])
        ax.set_xticklabels([f"victim {c}" for c in g.columns], fontsize=8)
        ax.tick_params(length=0)
        for sp in ax.spines.values():
            sp.set_visible(False)
        fig.suptitle(title, x=0.01, ha="left", fontsize=10)
        fig.supxlabel("red: diverges as in the finding · yellow: numeric near tie · green: clean · an ablation that "
                      "'disappears' names a mechanism the bug needs\nhatched: not reached (time box) · grey: n/a "
                      "(not available, or the trace does not use it)", fontsize=7, color="#616161", x=0.01, ha="left")
    return fig


# -- campaign and gate ---------------------------------------------------------------------------


def _integers(*axes: Any) -> None:
    from matplotlib.ticker import MaxNLocator

    for a in axes:
        a.set_major_locator(MaxNLocator(integer=True))


def progress_figure(v: CampaignView) -> Any:
    with _style():
        fig = _figure(7.2, 2.7)
        ax = fig.add_subplot()
        secs = [p[1] for p in v.progress]
        ax.step(secs, [p[0] for p in v.progress], where="post", color="#1e88e5", lw=1.5, label="traces")
        ax.set_xlabel("seconds")
        ax.set_ylabel("traces", color="#1e88e5")
        ax2 = ax.twinx()
        ax2.spines["right"].set_visible(True)
        ax2.step(secs, [p[3] for p in v.progress], where="post", color="#c62828", lw=1.5, label="findings")
        ax2.set_ylabel("findings", color="#c62828")
        ax2.set_ylim(bottom=0, top=max(1, max((p[3] for p in v.progress), default=0)) * 1.15)
        ax.set_ylim(bottom=0)
        _integers(ax.yaxis, ax2.yaxis)
        ax.set_title("traces and findings over time", loc="left")
        ax.grid(color="#eeeeee", lw=0.8)
    return fig


def coverage_figure(v: CampaignView) -> Any:
    with _style():
        fig = _figure(7.2, 2.7)
        ax = fig.add_subplot()
        ax.step([p[0] for p in v.progress], [p[2] for p in v.progress], where="post", color="#00897b", lw=1.5)
        ax.set_xlabel("traces")
        _integers(ax.xaxis, ax.yaxis)
        ax.set_ylabel("scheduler-state features")
        ax.set_ylim(bottom=0)
        ax.set_title("coverage against traces", loc="left")
        ax.grid(color="#eeeeee", lw=0.8)
    return fig


def breakdown_figure(items: list[tuple[str, float]], *, title: str, unit: str = "s") -> Any:
    with _style():
        fig = _figure(7.2, 0.8 + 0.28 * max(len(items), 1))
        ax = fig.add_subplot()
        names = [k for k, _ in items][::-1]
        ax.barh(names, [v for _, v in items][::-1], color="#5c6bc0")
        for y, (_, val) in enumerate(items[::-1]):
            ax.annotate(f"{val:.3g} {unit}", (val, y), xytext=(3, 0), textcoords="offset points", va="center",
                        fontsize=7.5)
        ax.set_title(title, loc="left")
        ax.tick_params(axis="y", labelsize=8)
    return fig


def gate_figure(cases: list[GateCaseView], what: str) -> Any:
    with _style():
        fig = _figure(9, 0.9 + 0.26 * max(len(cases), 1))
        ax = fig.add_subplot()
        labels = [f"{c.name} [{c.arm}]" for c in cases][::-1]
        ax.barh(labels, [c.seconds for c in cases][::-1],
                color=[STATUS_COLOR.get(c.status, "#9e9e9e") for c in cases][::-1])
        for y, c in enumerate(cases[::-1]):
            ax.annotate(f"{c.status}  {c.seconds:.1f} s", (c.seconds, y), xytext=(3, 0), textcoords="offset points",
                        va="center", fontsize=7.5, color=STATUS_COLOR.get(c.status, "#616161"))
        ax.set_xlabel("seconds")
        ax.set_title(f"kvfuzz {what}: {len(cases)} case(s)", loc="left")
        ax.tick_params(axis="y", labelsize=7.5)
    return fig


__all__ = ["breakdown_figure", "coverage_figure", "divergence_figure", "gate_figure", "grid_figure",
           "progress_figure", "require", "save", "schedule_figure", "svg_text"]
