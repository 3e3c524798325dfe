"""``kvfuzz gate PATH...``: the CI regression gate (docs/gate.md).

Replays every finding and trace under PATH (default: the bundled corpus, traces/regressions/)
on the build under test and fails if any comes back. ``--self-test`` checks the detector
instead: the clean arm passes and each fault arm a trace names still fails.

Exit codes: 0 passed, 1 a case failed (or a fault arm went blind), 2 bad input, 3
infrastructure failure.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Optional

import typer
from rich.table import Table
from rich.text import Text

from kvfuzz.driver import arms as arm_specs
from kvfuzz.cli import options
from kvfuzz.cli.app import app, console
from kvfuzz.traces import GateCase, atomic_write_text
from kvfuzz.traces.errors import BadInput

if TYPE_CHECKING:
    from kvfuzz.driver.settings import SessionSettings

STYLE = {"pass": "green", "detected": "green", "skipped": "dim", "FAIL": "bold red", "BLIND": "bold red",
         "error": "bold red"}


@app.command("gate")
def gate(
    paths: Annotated[Optional[list[Path]], typer.Argument(
        help="Finding/trace files or directories (default: the bundled corpus traces/regressions/).")] = None,
    runs: Annotated[Optional[int], typer.Option(min=1, help="Runs per case (default: 1 in-process, where "
                                                             "replays are step-exact; 3 over HTTP).")] = None,
    junit: Annotated[Optional[Path], typer.Option(help="Write JUnit XML here (one test case per file and arm).")] = None,
    summary: Annotated[Optional[Path], typer.Option(help="Write the markdown summary here (default: OUT/gate-summary.md; "
                                                         "also appended to $GITHUB_STEP_SUMMARY when set).")] = None,
    strict: Annotated[bool, typer.Option(help="numeric-near-tie fails the gate too.")] = False,
    self_test: Annotated[bool, typer.Option("--self-test", help="Check the detector: clean arm passes, every "
                                                               "fault arm a trace names still fails.")] = False,
    engine: options.EngineOpt = "inprocess",
    base_url: options.BaseUrlOpt = None,
    api_key: options.ApiKeyOpt = None,
    model: options.ServedModelOpt = None,
    device: options.DeviceOpt = "cpu",
    server_arg: options.ServerArgOpt = None,
    dtype: options.DtypeOpt = None,
    near_tie: options.NearTieOpt = None,
    bound: options.BoundOpt = None,
    calibration: options.CalibrationOpt = None,
    override: Annotated[Optional[list[str]], typer.Option(
        "--override", metavar="KEY=VALUE", help="Set an engine setting of every trace (repeatable), e.g. "
        "model=Qwen/Qwen2.5-0.5B-Instruct, dtype=bfloat16, extra_args.attention_backend=FLASHINFER.")] = None,
    out: Annotated[Path, typer.Option(help="Output directory (summary, results JSON, findings of failing cases, "
                                           "engine logs).")] = Path("kvfuzz-gate"),
    with_: options.WithOpt = None,
    without: options.WithoutOpt = None,
    arms: options.ArmsOpt = None,
    ray_address: options.RayOpt = None,
    workers: Annotated[Optional[int], typer.Option(min=1, help="With --ray: how many workers (one engine each; "
                                                               "default 2).")] = None,
    vllm: options.VllmOpt = None,
) -> None:
    """Replay a corpus of findings/traces as a CI regression gate."""
    options.use_release(vllm, device=device, base_url=base_url)
    from kvfuzz.gate.gate import (
        GateRunner,
        bundled_corpus,
        collect,
        default_runs,
        gate_plan,
        in_dtype,
        load,
        self_test_plan,
    )
    from kvfuzz.driver.arms import replay_engine_args
    from kvfuzz.harness.dtypes import check_dtype
    from kvfuzz.driver.session import build_session

    settings = options.session_settings(engine, device, base_url=base_url, api_key=api_key, served_model=model,
                                        near_tie=near_tie, bound=bound, calibration=calibration,
                                        server_arg=server_arg)
    kind = settings.kind
    if workers is not None and ray_address is None:
        raise BadInput("only with --ray", field="--workers")
    if ray_address is not None and kind == "url":
        raise BadInput("a --base-url server is one engine: nothing to shard", field="--ray")
    dtype_r = check_dtype(dtype, device) if dtype is not None else None
    if self_test and (with_ or without or arms):
        raise BadInput("--self-test chooses its own arms (clean, and each trace's expect.fails_in)", field="--arms")
    if self_test and kind == "url":
        raise BadInput("--self-test needs toggles, which a --base-url server cannot apply", field="--self-test")
    # Every file is read before any engine starts: bad input fails fast, with exit 2.
    entries = [load(p, override) for p in collect(list(paths) if paths else [bundled_corpus()])]
    if dtype_r is not None:  # every trace in this dtype (auto: the device's), same KV capacity in tokens
        for e in entries:
            e.trace = in_dtype(e.trace, dtype_r)
    if self_test:
        planned = self_test_plan(entries, device)
        what = "self-test"
    else:
        arm_map = (arm_specs.build_arms(with_=with_, without=without, arms=arms, device=device)
                   if (with_ or without or arms) else {arm_specs.VANILLA: []})
        if kind == "url" and any(arm_map.values()):
            raise BadInput("a --base-url server cannot apply toggles: drop --with/--without/--arms", field="--arms")
        planned = gate_plan(entries, arm_map)
        what = "gate"
    k = runs or default_runs(kind)
    settings = settings.model_copy(update={"runs": k})
    out.mkdir(parents=True, exist_ok=True)

    if ray_address is not None:
        _gate_on_ray(ray_address, planned, what=what, files=len(entries), settings=settings, strict=strict, out=out,
                     junit=junit, summary=summary, workers=workers or 2)
        return
    session = build_session(settings, out)
    runner = GateRunner(session, runs=k, strict=strict, engine_args=replay_engine_args(kind, device),
                        findings_dir=out / "findings")
    cases = []
    print(f"kvfuzz {what}: {len(entries)} file(s), {len(planned)} case(s), {k} run(s) each", flush=True)
    try:
        for n, p in enumerate(planned, start=1):
            case, _ = runner.run(p)
            cases.append(case)
            console.print(Text.assemble((f"[{n}/{len(planned)}] ", "dim"), (f"{case.status:9}", STYLE[case.status]),
                                        f" {case.name}  arm {case.arm}  ({case.seconds:.1f}s)"), highlight=False)
    finally:
        session.close()
        _write_reports(cases, out=out, junit=junit, summary=summary, what=what, complete=len(cases) == len(planned))
    _conclude(cases, what, out=out, junit=junit, summary=summary)


def _conclude(cases, what: str, *, out: Path, junit: Path | None, summary: Path | None) -> None:
    show = console
    show.print(_table(cases, what))
    bad = [c for c in cases if not c.ok]
    blind = [c for c in bad if c.expect_fail]
    if blind:
        show.print(Text(f"{len(blind)} fault arm(s) no longer fail: the detector went BLIND for them.", style="bold red"))
    show.print(f"{what}: {'FAILED' if bad else 'passed'} — {len(cases) - len(bad)}/{len(cases)} case(s) as expected "
               f"(summary: {summary or out / 'gate-summary.md'}" + (f", JUnit: {junit}" if junit else "") + ")",
               markup=False, highlight=False)
    raise typer.Exit(1 if bad else 0)


def _gate_on_ray(address: str, planned, *, what: str, files: int, settings: SessionSettings, strict: bool, out: Path,
                 junit: Path | None, summary: Path | None, workers: int) -> None:
    """The gate's cases spread over Ray workers (docs/scale.md); the same reports, in plan order."""
    from kvfuzz.scale.cluster import RayExecutor, WorkerSpec, connect, local_cpus, worker_env
    from kvfuzz.driver.arms import replay_engine_args
    from kvfuzz.traces import save
    from kvfuzz.traces.io import finding_path

    from kvfuzz.driver.settings import CampaignSettings

    k, kind, device = settings.runs, settings.kind, settings.device
    spec = WorkerSpec(CampaignSettings(session=settings), log_dir=str((out / "workers").resolve()), threads=1)
    owns = connect(None if address == "local" else address, num_cpus=local_cpus(workers, 1), env=worker_env(1))
    import ray

    print(f"kvfuzz {what}: {len(planned)} case(s) from {files} file(s), {k} run(s) each, on {workers} Ray "
          f"worker(s)", flush=True)
    cases: list = [None] * len(planned)
    done = [0]

    def shown(n: int, got) -> None:
        case, finding = got
        cases[n] = case
        done[0] += 1
        if finding is not None and case.diverged and not case.expect_fail:
            finding.provenance.gate = GateCase(source=case.source, arm=case.arm)
            save(finding, finding_path(out / "findings", finding))
        console.print(Text.assemble((f"[{done[0]}/{len(planned)}] ", "dim"), (f"{case.status:9}", STYLE[case.status]),
                                    f" {case.name}  arm {case.arm}  ({case.seconds:.1f}s)"), highlight=False)

    try:
        ex = RayExecutor(spec, workers)
        try:
            ex.start_lazy()
            ex.map("gate", planned, k, strict, replay_engine_args(kind, device), on_result=shown)
        finally:
            ex.shutdown()
    finally:
        if owns:
            ray.shutdown()
        ran = [c for c in cases if c is not None]
        _write_reports(ran, out=out, junit=junit, summary=summary, what=what, complete=len(ran) == len(planned))
    _conclude(ran, what, out=out, junit=junit, summary=summary)


def _table(cases, what: str) -> Table:
    t = Table(title=f"kvfuzz {what}", show_header=True, header_style="bold", title_justify="left")
    for col in ("result", "file", "arm", "verdict"):
        t.add_column(col, overflow="fold")
    for c in cases:
        t.add_row(Text(c.status, style=STYLE[c.status]), c.name, c.arm, c.verdict_text())
    return t


def _write_reports(cases, *, out: Path, junit: Path | None, summary: Path | None, what: str, complete: bool) -> None:
    from kvfuzz.present.gate import junit_xml, markdown_summary

    # Written even when the run stops early (infrastructure failure): CI shows what did run.
    header = "" if complete else "**Incomplete**: the gate stopped early (see the log for the error)."
    md = markdown_summary(cases, title=f"kvfuzz {what}", header=header)
    atomic_write_text(summary or out / "gate-summary.md", md)
    step_summary = os.environ.get("GITHUB_STEP_SUMMARY")
    if step_summary:
        with open(step_summary, "a", encoding="utf-8") as f:
            f.write(md)
    if junit is not None:
        atomic_write_text(junit, junit_xml(cases, suite=f"kvfuzz-{what}"))
    results = [{"source": c.source, "name": c.name, "arm": c.arm, "toggles": c.toggles, "status": c.status,
                "ok": c.ok, "expect_fail": c.expect_fail, "verdict": c.verdict_text(), "seconds": round(c.seconds, 3),
                "replay": c.replay_command,
                "verdicts": [v.model_dump(mode="json", by_alias=True) for v in c.verdicts]} for c in cases]
    atomic_write_text(out / "gate.json", json.dumps({"what": what, "complete": complete, "cases": results},
                                                    indent=2) + "\n")
    from kvfuzz.present import gate_page

    gate_page(out)  # OUT/gate.html from gate.json, with the saved findings' reports (never raises)
