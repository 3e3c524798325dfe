"""Tables several commands print (attribution of divergences to toggles)."""

from __future__ import annotations

from rich.console import Console
from rich.table import Table
from rich.text import Text

from kvfuzz.traces import Divergence, Finding


def attribution_table(findings: list[tuple[str, Finding]], *, title: str = "divergences") -> Table | None:
    """Every divergence of the given findings, unexplained ones first (candidate vLLM bugs)."""
    from kvfuzz.oracle.attribution import loudest_first

    rows: list[tuple[str, Divergence]] = []
    for where, f in findings:
        rows.extend((where, d) for d in f.divergences)
    if not rows:
        return None
    order = {id(d): i for i, d in enumerate(loudest_first([d for _, d in rows]))}
    rows.sort(key=lambda r: order[id(r[1])])
    table = Table(title=title, show_header=True, header_style="bold")
    for col in ("explained by", "class", "request", "arm", "runs", "finding"):
        table.add_column(col, overflow="fold")  # toggle names and paths are read whole
    for where, d in rows:
        if d.explained_by is None:
            why = Text("UNEXPLAINED — candidate vLLM bug", style="bold white on red")
        else:
            why = Text(d.explained_by, style="green")
        table.add_row(why, d.class_, d.request_id, d.arm, f"{d.runs_diverged}/{d.runs}", where)
    return table


def print_attribution(console: Console, findings: list[tuple[str, Finding]]) -> int:
    """Print the attribution table; return how many divergences are unexplained."""
    from kvfuzz.oracle.attribution import unexplained

    n = sum(len(unexplained(f.divergences)) for _, f in findings)
    if n:
        console.print(Text(f"{n} UNEXPLAINED divergence(s): no toggle explains them — candidate new vLLM bug(s). "
                           "Minimize and report them (docs/findings.md).", style="bold red"))
    table = attribution_table(findings)
    if table is not None:
        console.print(table)
    return n
