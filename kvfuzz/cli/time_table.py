"""The closing summary's block on where a campaign's time went (traces/timing.py)."""

from __future__ import annotations

from rich.console import Console
from rich.table import Table

from kvfuzz.traces.timing import PHASES, TimeBreakdown

LABELS = {
    "engine_start": "engine start",
    "fuzzed_runs": "fuzzed runs",
    "confirmation_runs": "confirmation runs",
    "references_computed": "references computed",
    "references_from_store": "references from the store",
    "references_verified": "references verified",
    "references_waited": "waiting for the reference engine",
    "scores": "teacher-forced scorings",
    "triage": "triage (and oracle)",
    "generation_feedback_files": "generation, feedback, files",
}


def time_table(time: TimeBreakdown) -> Table:
    table = Table(title="where the time went", header_style="bold")
    table.add_column("phase")
    table.add_column("seconds", justify="right")
    table.add_column("share", justify="right")
    wall = time.wall_s or 1.0
    for p in PHASES:
        s = getattr(time, f"{p}_s")
        table.add_row(LABELS[p], f"{s:.1f}", f"{s / wall:.0%}")
    table.add_row("other (calibration, start-up)", f"{time.other_s:.1f}", f"{time.other_s / wall:.0%}")
    table.add_row("wall", f"{time.wall_s:.1f}", "100%")
    table.add_row("the fuzzed engine busy", "", f"{time.busy_share:.0%}")
    n = time.references_computed + time.references_from_store
    table.add_row("references: computed / from store", f"{time.references_computed} / {time.references_from_store}",
                  f"hit rate {time.hit_rate:.0%}" if n else "")
    if time.references_ahead:
        table.add_row("  of which by the reference engine", f"{time.references_ahead}",
                      f"waited {time.references_waited_s:.1f} s")
    if time.references_shared or time.references_verified:
        table.add_row("  of which shared / verified", f"{time.references_shared} / {time.references_verified}", "")
    return table


def print_time(console: Console, time: TimeBreakdown) -> None:
    if time.wall_s > 0:
        console.print(time_table(time))
