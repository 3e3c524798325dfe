"""``kvfuzz explain FINDING``: causal ablation — which engine mechanisms the finding needs
(triage/explain.py). The explanation is written into the finding (in place, atomically, or
to ``-o``)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.table import Table

from kvfuzz.cli import options
from kvfuzz.cli.app import app, console
from kvfuzz.traces import load_finding, save
from kvfuzz.traces.errors import BadInput

OUTCOME_STYLE = {"disappears": "bold green", "persists": "yellow", "n/a": "dim", "failed": "red", "skipped": "dim",
                 "moved": "magenta", "flaky": "magenta"}


@app.command("explain")
def explain_cmd(
    file: Annotated[Path, typer.Argument(help="Finding file (JSON), ideally minimized.")],
    out: Annotated[Optional[Path], typer.Option("--out", "-o", help="Write the explained finding here (default: "
                                                                     "FILE itself).")] = None,
    victim: Annotated[Optional[str], typer.Option(help="Request whose divergence to explain (default: the one "
                                                       "minimization keeps).")] = None,
    mechanism: Annotated[Optional[list[str]], typer.Option("--mechanism", help="Only these mechanisms "
                                                           "(repeatable; default: all).")] = None,
    engine: options.EngineOpt = "inprocess",
    device: options.DeviceOpt = "cpu",
    calibration: options.CalibrationOpt = None,
    vllm: options.VllmOpt = None,
) -> None:
    """Replay a finding with one engine mechanism taken away at a time and say which removals
    make its divergence disappear: prefix caching, chunked prefill, KV pressure, concurrency,
    cancels, LoRA adapters, adapter swaps, 16-bit numerics."""
    options.use_release(vllm, device=device)
    from kvfuzz.driver.session import build_session
    from kvfuzz.triage.explain import ABLATIONS, explain

    settings = options.session_settings(engine, device, runs=1, calibration=calibration)
    for m in mechanism or []:
        if m not in ABLATIONS:
            raise BadInput(f"unknown mechanism {m!r} (known: {', '.join(ABLATIONS)})", field="--mechanism")
    finding = load_finding(file)
    if not finding.divergences:
        raise BadInput("the finding has no divergence to explain", source=str(file), field="divergences")
    if victim is not None and victim not in {d.request_id for d in finding.divergences}:
        raise BadInput(f"request {victim!r} did not diverge in this finding", source=str(file), field="--victim")
    target = out or file
    session = build_session(settings, target.parent, log_name=target.with_suffix(".engine.log").name)
    try:
        ex = explain(session, finding, victim=victim, mechanisms=mechanism)
    finally:
        session.close()
    finding.explanation = ex
    save(finding, target)
    table = Table(title=f"{file.name}: {ex.cls} in {ex.victim} (arm {ex.arm})", header_style="bold",
                  title_justify="left")
    for col in ("mechanism", "taken away", "outcome", "victim"):
        table.add_column(col, overflow="fold")
    for a in ex.ablations:
        table.add_row(a.mechanism, a.change, f"[{OUTCOME_STYLE[a.outcome]}]{a.outcome}[/]",
                      " — ".join(filter(None, [a.victim_class, a.detail])))  # a drift that persists says why
    console.print(table)
    console.print(ex.summary(), markup=False, highlight=False)
    console.print(f"{ex.replays} replays, {ex.seconds:g} s; wrote {target}", markup=False)
