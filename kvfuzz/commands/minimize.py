"""``kvfuzz minimize FILE -o OUT``: shrink a finding to the smallest trace with the same
signature, run its control arms, and write it linked to the original. Also the
post-processing ``kvfuzz run`` applies to each new finding (``finish_finding``)."""

from __future__ import annotations

import functools
import time
from pathlib import Path
from typing import Annotated, Any, Optional

import typer

from kvfuzz.cli import app, console
from traces import Finding, load_finding, save
from traces.errors import BadInput


def add_controls(session: Any, finding: Finding, *, device: str) -> Finding:
    """Run the control arms of ``finding`` (serialized; batch-invariant where supported)."""
    from kvfuzz.isolated import check_isolated
    from oracle.controls import reproducing_arms, run_controls

    isolated = functools.partial(check_isolated, engine_kind=session.engine_kind, device=device)
    finding.controls = run_controls(session, finding, device=device, isolated=isolated)
    # Stated in the file: every arm (the finding's own and the controls) that reproduced it.
    finding.notes["reproduced_in"] = reproducing_arms(finding)
    return finding


def minimize(session: Any, finding: Finding, *, victim: str | None = None, repeats: int | None = None,
             min_hits: int | None = None, strategy: str = "probdd", max_replays: int | None = 400,
             max_seconds: float | None = None, engine: bool = True, original_path: str | None = None) -> Finding:
    from oracle.minimize import Acceptance, Budget, Options, default_acceptance, minimize_finding

    acc = default_acceptance(session.engine_kind)
    if repeats is not None or min_hits is not None:
        k = repeats if repeats is not None else acc.repeats
        m = min_hits if min_hits is not None else min(acc.min_hits, k)
        try:
            acc = Acceptance(k, m)
        except ValueError as e:
            raise BadInput(str(e), field="--min-hits") from None
    opts = Options(acceptance=acc, budget=Budget(max_replays=max_replays, max_seconds=max_seconds),
                   strategy=strategy,  # type: ignore[arg-type]
                   clock="step" if session.engine_kind == "inprocess" else "offset", engine=engine)
    return minimize_finding(session, finding, victim=victim, options=opts, original_path=original_path)


def finish_finding(session: Any, finding: Finding, *, out: Path, device: str, do_minimize: bool = True,
                   controls: bool = True, max_seconds: float | None = 120.0) -> Finding:
    """What ``kvfuzz run`` does with a new finding: control arms, then (unless disabled) the
    minimized finding with its own controls. The original is written to ``out/originals/``
    and linked both ways; the returned finding is the one the campaign records."""
    from oracle.minimize import NotReproduced

    if controls:
        add_controls(session, finding, device=device)
    if not do_minimize:
        return finding
    rel = Path("originals") / f"{finding.worst_class()}-{finding.id}.json"
    try:
        small = minimize(session, finding, max_seconds=max_seconds, original_path=str(rel))
    except NotReproduced as e:
        finding.notes["minimize"] = f"not minimized: {e}"
        return finding
    if controls:
        add_controls(session, small, device=device)
    finding.notes["minimized_to"] = small.id
    save(finding, out / rel)
    return small


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
    engine: Annotated[str, typer.Option(help="Engine to replay on (inprocess).")] = "inprocess",
    device: Annotated[str, typer.Option(help="cpu or cuda.")] = "cpu",
) -> None:
    """Shrink a finding to the fewest requests, tokens and steps that keep its signature.

    Exit codes: 0 written, 1 not reproduced here (nothing written), 2 bad input, 3 engine failure."""
    from kvfuzz.session import Session
    from oracle.minimize import NotReproduced

    if strategy not in ("probdd", "ddmin"):
        raise BadInput(f"unknown strategy {strategy!r} (probdd or ddmin)", field="--strategy")
    if device not in ("cpu", "cuda"):
        raise BadInput(f"unknown device {device!r} (cpu or cuda)", field="--device")
    finding = load_finding(file)
    if not finding.divergences:
        raise BadInput("the finding has no divergence to minimize", source=str(file), field="divergences")
    if victim is not None and victim not in {d.request_id for d in finding.divergences}:
        raise BadInput(f"request {victim!r} did not diverge in this finding", source=str(file), field="--victim")
    out = out or file.with_name(file.name.removesuffix(".json") + ".min.json")
    t0 = time.monotonic()
    session = Session(engine_kind=engine, device=device, log_file=out.with_suffix(".engine.log"))
    try:
        try:
            session.engine_for(finding.trace.engine)
        except ValueError as e:
            raise BadInput(str(e), field="--engine") from None
        console.print(f"minimizing {file} ({len(finding.trace.sends)} requests, signature {finding.signature()})")
        try:
            small = minimize(session, finding, victim=victim, repeats=repeats, min_hits=min_hits, strategy=strategy,
                             max_replays=max_replays, max_seconds=max_seconds, engine=shrink_engine,
                             original_path=str(file))
        except NotReproduced as e:
            console.print(f"[red]not minimized[/red]: {e}; nothing written")
            raise typer.Exit(1) from None
        if controls:
            add_controls(session, small, device=device)
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
