"""``kvfuzz export FILE -o repro.py``: a finding as a self-contained Python script that runs on
vLLM without kvfuzz (kvfuzz.present.export; docs/export.md).

Exit codes: 0 written, 2 bad input (one line naming the file and field), among them a finding
that needs one of kvfuzz's toggles (not a vLLM bug as shipped)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated, Optional

import typer

from kvfuzz.cli.app import app, console, err_console


@app.command("export")
def export_cmd(
    file: Annotated[Path, typer.Argument(help="Finding file (JSON); a kvfuzz trace or a foreign finding works too.")],
    out: Annotated[Optional[Path], typer.Option("--out", "-o", help="Where to write the script (default: FILE "
                                                                     "with .repro.py, or .repro_server.py).")] = None,
    server: Annotated[bool, typer.Option("--server", help="Drive vLLM's OpenAI-compatible server by wall-clock "
                                                          "offsets (best-effort) instead of the in-process engine "
                                                          "step by step.")] = False,
    request: Annotated[Optional[list[str]], typer.Option("--request", help="Judge this request (repeatable; "
                                                                           "default: the finding's victims, every "
                                                                           "request of a trace).")] = None,
) -> None:
    """Write a standalone Python script that reproduces a finding on vLLM without kvfuzz: it
    builds the engine, applies the schedule, runs each judged request alone on a fresh engine and
    prints REPRODUCED (exit 1) or NOT REPRODUCED (exit 0), or INCONCLUSIVE (exit 4) when another
    failure than the finding's ends the run (a crash where it recorded changed outputs)."""
    from kvfuzz.present.export import export

    suffix = ".repro_server.py" if server else ".repro.py"
    out = out or file.with_name(file.name.removesuffix(".json") + suffix)
    src = export(file, out, server=server, requests=request)
    for note in src.notes:
        err_console.print(f"note: {note}", markup=False, highlight=False, soft_wrap=True)
    what = f"arm {src.arm!r}, " if src.arm else ""
    console.print(f"wrote {out} ({len(src.trace.sends)} requests, {what}judged: {', '.join(src.victims)}); "
                  f"run it with: python {out}", markup=False, highlight=False, soft_wrap=True)
    sys.stdout.flush()
