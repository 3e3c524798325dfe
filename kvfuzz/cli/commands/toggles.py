"""``kvfuzz toggles``: the fault / fix toggles and their status on the installed vLLM."""

from __future__ import annotations

import json
import sys
from typing import Annotated

import typer
from rich.table import Table
from rich.text import Text

from kvfuzz.cli.app import app, console
from kvfuzz.traces.errors import BadInput


def toggle_rows(device: str) -> list[dict]:
    """One dict per toggle: its registry entry plus the self-check result here."""
    from kvfuzz.harness import toggles

    clean = set(toggles.clean_set(device))
    rows = []
    for t, problem in sorted(toggles.status(), key=lambda x: (x[0].kind, x[0].name)):
        rows.append({
            "name": t.name,
            "kind": t.kind,
            "models": t.models,
            "process": t.process,
            "target": t.target,
            "backends": list(t.backends),
            "versions": t.versions,
            "needs": list(t.needs),
            "description": t.description,
            "status": "ok" if problem is None else "refuses",
            "problem": problem,
            "changes_outputs_here": problem is None and t.changes_outputs_on(device),
            "in_clean_arm": t.name in clean,
        })
    return rows


@app.command("toggles")
def toggles_cmd(
    device: Annotated[str, typer.Option(help="Device whose output-changing toggles to mark (cpu or cuda).")] = "cpu",
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON instead of a table.")] = False,
    verbose: Annotated[bool, typer.Option("--verbose", "-v", help="Also show targets and descriptions.")] = False,
) -> None:
    """List fault and fix toggles with their self-check status on the installed vLLM."""
    if device not in ("cpu", "cuda"):
        raise BadInput(f"unknown device {device!r} (cpu or cuda)", field="--device")
    from kvfuzz.harness.environment import vllm_version

    rows = toggle_rows(device)
    if as_json:
        sys.stdout.write(json.dumps({"vllm": vllm_version(), "device": device, "toggles": rows}, indent=2) + "\n")
        return
    table = Table(title=f"kvfuzz toggles on {vllm_version() or 'no vLLM'} ({device})", show_header=True,
                  header_style="bold", show_lines=verbose)
    table.add_column("toggle", overflow="fold")
    for col in ("kind", "models", "process", "changes outputs on", "on " + device, "status"):
        table.add_column(col)
    if verbose:
        table.add_column("target / description")
    for r in rows:
        here = ("clean arm" if r["in_clean_arm"] else "yes") if r["changes_outputs_here"] else "no (patch only)"
        status = Text("ok", style="green") if r["status"] == "ok" else Text(f"REFUSES: {r['problem']}", style="red")
        short = r["models"].split(" (")[0]  # the full text is in --json / --verbose / docs
        cells = [r["name"], r["kind"], short, r["process"], ", ".join(r["backends"]), here, status]
        if verbose:
            cells.append(f"{r['models']}\n{r['target']}\n{r['description']}")
        table.add_row(*cells)
    console.print(table)
    console.print("Use them with `kvfuzz run --with TOGGLE / --without TOGGLE / --arms ...`; docs/toggles.md.")
