"""``kvfuzz replay FILE...``: replay kvfuzz findings, kvfuzz traces and foreign findings (the
format of the fuzzer behind vLLM #39146/#38606/#39589) and say, per request, whether the
divergence reproduces — side by side with what the file expected.

Exit codes: 0 no divergence reproduced, 1 a divergence reproduced, 2 bad input, 3
infrastructure failure (engine/server would not start or died, the URL does not answer).
"""

from __future__ import annotations

import datetime as _dt
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, Optional

import typer
from rich.table import Table
from rich.text import Text

from kvfuzz.driver import arms as arm_specs
from kvfuzz.oracle.buckets import crash_state
from kvfuzz.cli import options, tables
from kvfuzz.cli.app import app, console
from kvfuzz.present.style import CLASS_STYLE
from kvfuzz.traces import Divergence, Finding, ReplayOf, Trace, atomic_write_text, load_any, save
from kvfuzz.traces.finding import DIVERGENT_CLASSES
from kvfuzz.traces.foreign import ForeignFinding
from kvfuzz.traces.io import finding_path


@dataclass
class Item:
    """One input file, normalised: the trace to replay, its arms, what it expected."""

    path: Path
    kind: str  # "finding", "trace", "foreign"
    trace: Trace
    arms: dict[str, list[str]] | None
    # (arm, request id) pairs the file reports as diverged; None: the file expects nothing.
    expected: set[tuple[str, str]] | None
    notes: list[str] = field(default_factory=list)
    # What a finding's crash raised (oracle/buckets.py ``crash_state``); None: no crash.
    crash: str | None = None


def load_item(path: Path) -> Item:
    obj = load_any(path)
    if isinstance(obj, Finding):
        expected = {(d.arm, d.request_id) for d in obj.divergences}
        crash = crash_state(obj.crash.detail) if obj.crash is not None and obj.crash.detail else None
        return Item(path, "finding", obj.trace, dict(obj.arms) or None, expected, crash=crash)
    if isinstance(obj, ForeignFinding):
        return Item(path, "foreign", obj.trace, None, {("default", r) for r in obj.expected_diverged},
                    notes=list(obj.notes))
    assert isinstance(obj, Trace)
    return Item(path, "trace", obj, None, None)


def url_arms(item: Item) -> dict[str, list[str]] | None:
    """Toggles cannot reach a server kvfuzz does not manage: keep the arms without toggles."""
    arms = item.arms or {"default": list(item.trace.engine.toggles)}
    kept = {a: t for a, t in arms.items() if not t}
    dropped = sorted(set(arms) - set(kept))
    if dropped:
        item.notes.append(f"arms with toggles not replayed (a --base-url server cannot apply toggles): "
                          f"{', '.join(dropped)}")
    if not kept:
        item.notes.append("replayed once without toggles instead")
        return {"default": []}
    return kept


def verdict_table(item: Item, verdicts: list[Divergence]) -> Table:
    show_expected = item.expected is not None
    t = Table(title=f"{item.path.name}", show_header=True, header_style="bold", title_justify="left")
    t.add_column("arm")
    t.add_column("request")
    if show_expected:
        t.add_column("expected (file)")
    t.add_column("verdict")
    t.add_column("runs diverged", justify="right")
    t.add_column("first diff", justify="right")
    t.add_column("detail", overflow="fold")
    for v in verdicts:
        row: list[Any] = [v.arm, v.request_id]
        if show_expected:
            assert item.expected is not None
            exp = (v.arm, v.request_id) in item.expected or (
                item.kind == "foreign" and ("default", v.request_id) in item.expected)
            got = v.class_ in DIVERGENT_CLASSES
            row.append(Text("diverged" if exp else "clean",
                            style=("bold" if exp == got else "bold yellow")))
        row += [Text(v.class_, style=CLASS_STYLE.get(v.class_, "")), f"{v.runs_diverged}/{v.runs}",
                "" if v.first_divergence is None else str(v.first_divergence), (v.detail or "")[:160]]
        t.add_row(*row)
    return t


def agreement(item: Item, verdicts: list[Divergence]) -> str | None:
    if item.expected is None:
        return None
    got = {(v.arm, v.request_id) for v in verdicts if v.class_ in DIVERGENT_CLASSES}
    exp = item.expected
    if item.kind == "foreign":  # one arm; compare request ids only
        got_ids, exp_ids = {r for _, r in got}, {r for _, r in exp}
    else:
        got_ids, exp_ids = {f"{a}:{r}" for a, r in got}, {f"{a}:{r}" for a, r in exp}
    both = sorted(got_ids & exp_ids)
    missing = sorted(exp_ids - got_ids)
    extra = sorted(got_ids - exp_ids)
    parts = [f"expected {len(exp_ids)} diverged, reproduced {len(both)}"]
    if missing:
        parts.append(f"not reproduced: {', '.join(missing)}")
    if extra:
        parts.append(f"diverged but not expected: {', '.join(extra)}")
    return "; ".join(parts)


@app.command()
def replay(
    files: Annotated[list[Path], typer.Argument(help="kvfuzz findings, kvfuzz traces, or foreign finding files.")],
    runs: Annotated[int, typer.Option(min=1, help="Runs of each trace (K).")] = 3,
    engine: options.EngineOpt = "inprocess",
    base_url: options.BaseUrlOpt = None,
    api_key: options.ApiKeyOpt = None,
    model: options.ServedModelOpt = None,
    out: Annotated[Path, typer.Option(help="Output directory (replay summaries, new findings, server logs).")] = Path("kvfuzz-out"),
    device: options.DeviceOpt = "cpu",
    server_arg: options.ServerArgOpt = None,
    dtype: options.DtypeOpt = None,
    near_tie: options.NearTieOpt = None,
    bound: options.BoundOpt = None,
    calibration: options.CalibrationOpt = None,
    with_: options.WithOpt = None,
    without: options.WithoutOpt = None,
    arms: options.ArmsOpt = None,
    attribute: options.AttributeOpt = False,
    vllm: options.VllmOpt = None,
) -> None:
    """Replay finding/trace files and report, per request, whether a divergence reproduces.

    Each file replays in its own arms (a finding's, else its trace's toggles) unless --arms /
    --with / --without say otherwise; --attribute explains divergences by toggles as `kvfuzz run` does."""
    options.use_release(vllm, device=device, base_url=base_url)
    from kvfuzz.gate.gate import in_dtype
    from kvfuzz.harness.dtypes import check_dtype
    from kvfuzz.driver.session import build_session

    settings = options.session_settings(engine, device, runs=runs, base_url=base_url, api_key=api_key,
                                        served_model=model, near_tie=near_tie, bound=bound, calibration=calibration,
                                        server_arg=server_arg)
    kind = settings.kind
    arm_map = arm_specs.build_arms(with_=with_, without=without, arms=arms, device=device) \
        if (with_ or without or arms) else None
    # Every file is read before any engine starts: bad input fails fast, with exit 2.
    items = [load_item(p) for p in files]
    if kind != "url":  # a local engine reads the directories the files name
        from kvfuzz.traces.paths import check_exists

        for item in items:
            check_exists(item.trace.engine, source=str(item.path),
                         prefix="trace.engine" if item.kind == "finding" else "engine")
    if arm_map is not None:
        for item in items:
            item.arms = dict(arm_map)
    if dtype is not None:  # replay in this dtype (auto: the device's), whatever the file says
        for item in items:
            item.trace = in_dtype(item.trace, check_dtype(dtype, device))
    out.mkdir(parents=True, exist_ok=True)
    session = build_session(settings, out)
    # A server kvfuzz does not manage cannot switch toggles, so it cannot attribute.
    explain = attribute and kind != "url"
    show = console
    from kvfuzz.harness.http.wire import redact_url
    from kvfuzz.triage.attribution import check_attributed

    where = redact_url(base_url) if base_url is not None else {"inprocess": "in-process engine", "server": "managed vLLM server"}[kind]
    reproduced_any = False
    written: list[tuple[str, Finding]] = []
    try:
        for n, item in enumerate(items, start=1):
            item_arms = url_arms(item) if kind == "url" else item.arms
            print(f"replaying {item.path} ({n}/{len(items)}): {len(item.trace.sends)} requests, "
                  f"{runs} run(s) per arm, on the {where}", flush=True)
            checked = (check_attributed(session, item.trace, runs=runs, arms=item_arms) if explain
                       else session.check(item.trace, runs=runs, arms=item_arms))
            verdicts = checked.verdicts
            reproduced = any(v.class_ in DIVERGENT_CLASSES for v in verdicts)
            reproduced_any |= reproduced
            show.print(verdict_table(item, verdicts))
            agree = agreement(item, verdicts)
            env = checked.recording.environment
            notes = list(item.notes)
            ref_note = session.engine.reference_note if session.engine is not None else None
            if ref_note and kind != "inprocess":
                notes.append(ref_note)
            for line in ([agree] if agree else []) + notes:
                show.print(f"  note: {line}", markup=False, highlight=False)
            finding_file = None
            if checked.finding is not None:
                f = checked.finding
                f.provenance.replay_of = ReplayOf(source=str(item.path), kind=item.kind)
                if item.kind == "foreign":
                    f.notes["foreign"] = {"notes": item.notes}
                finding_file = finding_path(out / "findings", f)
                save(f, finding_file)
                written.append((str(finding_file), f))
            summary = {
                "source": str(item.path), "kind": item.kind, "engine": kind, "runs": runs,
                "reproduced": reproduced, "agreement": agree, "notes": notes,
                "expected": sorted(f"{a}:{r}" for a, r in item.expected) if item.expected is not None else None,
                "verdicts": [v.model_dump(mode="json", by_alias=True) for v in verdicts],
                "environment": env.model_dump(mode="json"),
                "finding": str(finding_file) if finding_file else None,
                "created": _dt.datetime.now(_dt.timezone.utc).replace(microsecond=0).isoformat(),
            }
            summary_path = out / "replays" / f"{item.path.stem}.replay.json"
            atomic_write_text(summary_path, json.dumps(summary, indent=2) + "\n")
            status = "REPRODUCED" if reproduced else "not reproduced"
            show.print(f"{item.path}: {status} (summary: {summary_path}"
                       + (f", finding: {finding_file}" if finding_file else "") + ")", markup=False,
                       highlight=False)
    finally:
        session.close()
    tables.print_attribution(show, written)
    sys.stdout.flush()
    raise typer.Exit(1 if reproduced_any else 0)
