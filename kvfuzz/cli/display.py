"""Rich terminal display for campaigns: a live panel while running, a table at the end."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from rich.console import Console, Group
from rich.live import Live
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

from kvfuzz.present.style import CLASS_STYLE


class CampaignDisplay:
    def __init__(self, console: Console, *, budget_s: float | None, max_traces: int | None,
                 out: Path | None = None):
        self.console = console
        # OUT/campaign.html follows the campaign: rewritten after every committed trace (the
        # drivers call update right after campaign.json is written). The fuzzer room knows
        # nothing of pictures; presentation hangs off the same hook as the live panel.
        self.out = out
        self.budget_s = budget_s
        self.max_traces = max_traces
        self.start = time.monotonic()
        self._status = "starting"
        self._state: Any = None
        self._last: Any = None
        self._live: Live | None = None

    def __enter__(self) -> "CampaignDisplay":
        # A live panel only on a terminal; CI logs get one line per finding instead.
        if self.console.is_terminal:
            self._live = Live(self._render(), console=self.console, refresh_per_second=4, transient=True)
            self._live.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._live is not None:
            self._live.__exit__(*exc)  # type: ignore[arg-type]
            self._live = None

    def status(self, text: str) -> None:
        self._status = text
        if self._live is not None:
            self._live.update(self._render())
        else:
            self.console.print(f"[dim]{text}[/dim]")

    def update(self, outcome: Any, state: Any) -> None:
        self._state = state
        self._last = outcome
        if self.out is not None:
            from kvfuzz.present import campaign_page

            campaign_page(self.out, state)  # never raises
        if outcome.finding is not None and self._live is None:
            f = outcome.finding
            where = f" -> bucket {f.bucket}" if f.bucket else ""
            self.console.print(f"finding {f.id}: {f.worst_class()} ({f.signature()}) in trace {outcome.index}{where}")
        if self._live is not None:
            self._live.update(self._render())

    def _render(self) -> Panel:
        elapsed = time.monotonic() - self.start
        s = self._state
        grid = Table.grid(padding=(0, 2))
        grid.add_column(style="bold")
        grid.add_column()
        grid.add_row("status", self._status)
        limit = []
        if self.budget_s:
            limit.append(f"{elapsed:.0f}/{self.budget_s:.0f} s")
        if self.max_traces:
            limit.append(f"{s.traces if s else 0}/{self.max_traces} traces")
        grid.add_row("progress", ", ".join(limit) or f"{elapsed:.0f} s")
        if s is not None:
            rate = s.traces / elapsed if elapsed > 0 else 0.0
            grid.add_row("traces", f"{s.traces}  ({rate:.2f}/s)")
            grid.add_row("mode", getattr(s, "mode", "random"))
            grid.add_row("corpus", f"{len(getattr(s, 'corpus', []))} entries")
            grid.add_row("coverage", f"{len(getattr(s, 'coverage', {}))} buckets")
            found = Text()
            for cls, n in sorted(s.by_class.items()):
                found.append(f"{cls}: {n}  ", style=CLASS_STYLE.get(cls, ""))
            grid.add_row("findings", found if s.by_class else Text("none", style="green"))
            if s.bug_buckets:
                from kvfuzz.present.buckets import rows, sections

                bugs, ties = sections(rows(s.bug_buckets))
                for r in bugs[:4]:
                    grid.add_row(f"bucket {r.id}", Text(f"{r.count} x {r.cls}, {r.explanation}; needs: {r.needs}",
                                                        style=CLASS_STYLE.get(r.cls, "")))
                if len(bugs) > 4:
                    grid.add_row("", f"... {len(bugs) - 4} more bug bucket(s)")
                if ties:
                    grid.add_row("near-tie buckets", f"{len(ties)} ({sum(r.count for r in ties)} findings)")
        if self._last is not None:
            t = self._last.trace
            last = self._last
            how = getattr(last, "source", "")
            if how == "mutant":
                how = "mutant (" + "+".join(t.lineage.operators) + ")"
            novel = getattr(last, "novel", [])
            grid.add_row("last trace", f"#{last.index} {how}: {len(t.sends)} requests, "
                                       f"{len(t.cancels)} cancels, {last.seconds:.1f} s"
                                       + (f", {len(novel)} new buckets" if novel else ""))
        return Panel(Group(grid), title="kvfuzz run", border_style="cyan")

    def summary(self, state: Any, out: Path) -> None:
        table = Table(title="kvfuzz campaign", show_header=True, header_style="bold")
        table.add_column("metric")
        table.add_column("value", justify="right")
        table.add_row("seed", str(state.seed))
        table.add_row("traces run", str(state.traces))
        table.add_row("seconds", f"{state.seconds:.1f}")
        rate = state.traces / state.seconds if state.seconds else 0.0
        table.add_row("traces / s", f"{rate:.2f}")
        table.add_row("mode", str(getattr(state, "mode", "random")))
        table.add_row("corpus entries", str(len(getattr(state, "corpus", []))))
        table.add_row("coverage buckets", str(len(getattr(state, "coverage", {}))))
        fields = dict(getattr(state, "request_fields", {}))
        if fields:
            table.add_row("requests with per-request state", f"{fields.pop('any', 0)} of {state.requests}")
            for name, n in sorted(fields.items(), key=lambda kv: -kv[1]):
                table.add_row(f"  {name}", str(n))
        spec = dict(getattr(state, "speculative", {}))
        if spec:
            table.add_row("traces with speculative decoding", f"{spec.get('traces', 0)} ({spec.get('accepted', 0)} "
                                                               f"accepted drafts)")
        regions = dict(getattr(state, "configs", {}))
        if len(regions) > 1:
            from kvfuzz.fuzzer.configs import counts_text

            table.add_row("traces per engine configuration", counts_text(regions))
        refused = dict(getattr(state, "refused", {}))
        if refused:
            table.add_row("traces skipped: engine configuration refused",
                          "; ".join(f"{n} x {why}" for why, n in sorted(refused.items())))
        table.add_row("findings", str(state.findings))
        for cls, n in sorted(state.by_class.items()):
            table.add_row(f"  {cls}", Text(str(n), style=CLASS_STYLE.get(cls, "")))
        from kvfuzz.present.buckets import broken_line, rich_tables, rows, sections, summary_line

        brows = rows(state.bug_buckets)
        bugs, ties = sections(brows)
        table.add_row("bug buckets", str(len(bugs)))
        if ties:
            table.add_row("near-tie buckets", str(len(ties)))
        if state.untriaged:  # campaigns written by an older kvfuzz only
            table.add_row("  findings without a bucket (older campaign)", str(len(state.untriaged)))
        self.console.print(table)
        for t in rich_tables(brows):
            self.console.print(t)
        if state.findings:
            self.console.print(summary_line(brows, state.findings), markup=False, highlight=False, soft_wrap=True)
        broken = broken_line(getattr(state, "coverage", {}) or {})
        if broken:
            self.console.print(broken, markup=False, highlight=False, soft_wrap=True)
        where = out / "findings"
        self.console.print(f"findings written to: {where.resolve()}" + ("" if state.findings else " (none)"))
        self.console.print(f"campaign state: {(out / 'campaign.json').resolve()}")
        from kvfuzz.present import campaign_page

        campaign_page(out, state, final=True)  # the last word: charts and bucket reports drawn now
        if (out / "campaign.html").exists():
            self.console.print(f"campaign page: {(out / 'campaign.html').resolve()}")
        if getattr(state, "corpus_dir", None):
            self.console.print(f"corpus: {Path(state.corpus_dir).resolve()}")


