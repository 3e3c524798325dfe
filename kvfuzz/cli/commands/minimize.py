"""``kvfuzz minimize FILE -o OUT``: shrink a finding to the smallest trace with the same
signature, run its control arms, and write it linked to the original (kvfuzz.triage)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Annotated, Optional

import typer

from kvfuzz.cli import options
from kvfuzz.cli.app import app, console
from kvfuzz.traces import load_finding, save
from kvfuzz.traces.errors import BadInput


@app.command("minimize")
def minimize_cmd(
    file: Annotated[Path, typer.Argument(help="Finding file (JSON) to minimize.")],
    out: Annotated[Optional[Path], typer.Option("--out", "-o", help="Where to write the minimized finding "
                                                                     "(default: FILE with .min.json).")] = None,
    victim: Annotated[Optional[str], typer.Option(help="Request whose divergence to keep (default: the most "
                                                       "reproducible victim of the worst class).")] = None,
    repeats: Annotated[Optional[int], typer.Option("--repeats", "-k", min=1, help="Replays per candidate "
                                                   "(default 1 in-process, 4 for wall-clock engines).")] = None,
    min_hits: Annotated[Optional[int], typer.Option("--min-hits", "-m", min=1, help="Keep a candidate when it "
                                                    "reproduces in at least this many of the k replays.")] = None,
    strategy: Annotated[str, typer.Option(help="probdd or ddmin.")] = "probdd",
    max_replays: Annotated[int, typer.Option(min=1, help="Stop shrinking after this many replays.")] = 400,
    max_seconds: Annotated[Optional[float], typer.Option(help="Stop shrinking after this many seconds.")] = None,
    shrink_engine: Annotated[bool, typer.Option("--shrink-engine/--no-shrink-engine",
                                                help="Also try fewer LoRA slots / LoRA off (restarts the engine).")] = True,
    controls: Annotated[bool, typer.Option("--controls/--no-controls", help="Run the control arms on the result.")] = True,
    engine: options.EngineOpt = "inprocess",
    device: options.DeviceOpt = "cpu",
    dtype: options.DtypeOpt = None,
    near_tie: options.NearTieOpt = None,
    bound: options.BoundOpt = None,
    calibration: options.CalibrationOpt = None,
    vllm: options.VllmOpt = None,
) -> None:
    """Shrink a finding to the fewest requests, tokens and steps that keep its signature.

    Exit codes: 0 written, 1 not reproduced here (nothing written), 2 bad input, 3 engine failure."""
    options.use_release(vllm, device=device)
    from kvfuzz.gate.gate import in_dtype
    from kvfuzz.harness.dtypes import check_dtype
    from kvfuzz.oracle.controls import escalate
    from kvfuzz.driver.session import build_session
    from kvfuzz.triage.finish import acceptance_for, add_controls, minimize
    from kvfuzz.triage.minimize import NotReproduced

    if strategy not in ("probdd", "ddmin"):
        raise BadInput(f"unknown strategy {strategy!r} (probdd or ddmin)", field="--strategy")
    settings = options.session_settings(engine, device, near_tie=near_tie, bound=bound, calibration=calibration)
    acceptance = acceptance_for(settings.step_exact, repeats, min_hits)
    finding = load_finding(file)
    if not finding.divergences:
        raise BadInput("the finding has no divergence to minimize", source=str(file), field="divergences")
    if victim is not None and victim not in {d.request_id for d in finding.divergences}:
        raise BadInput(f"request {victim!r} did not diverge in this finding", source=str(file), field="--victim")
    if dtype is not None:  # minimize in this dtype (auto: the device's), whatever the file says
        finding.trace = in_dtype(finding.trace, check_dtype(dtype, device))
    out = out or file.with_name(file.name.removesuffix(".json") + ".min.json")
    t0 = time.monotonic()
    session = build_session(settings, out.parent, log_name=out.with_suffix(".engine.log").name)
    try:
        session.engine_for(finding.trace.engine)
        console.print(f"minimizing {file} ({len(finding.trace.sends)} requests, signature {finding.signature()})")
        try:
            small = minimize(session, finding, victim=victim, acceptance=acceptance,
                             strategy="ddmin" if strategy == "ddmin" else "probdd", max_replays=max_replays,
                             max_seconds=max_seconds, engine=shrink_engine, original_path=str(file))
        except NotReproduced as e:
            console.print(f"[red]not minimized[/red]: {e}; nothing written")
            raise typer.Exit(1) from None
        if controls:
            small = escalate(add_controls(session, small))
    finally:
        session.close()
    save(small, out)
    m = small.minimization
    assert m is not None
    console.print(f"{m.original_requests} -> {m.requests} requests, {m.original_events} -> {m.events} events, "
                  f"{m.replays} replays (+{m.reference_runs} reference runs), {time.monotonic() - t0:.0f} s; "
                  f"signature {m.signature} {'verified' if m.verified else '[red]NOT verified[/red]'}")
    for line in m.passes:
        console.print(f"  {line}", markup=False)
    if m.stopped:
        console.print(f"  stopped early: {m.stopped}")
    console.print(f"wrote {out}  (kvfuzz report {out})")
