"""``kvfuzz bench``: the detection benchmark's command line and tables (logic: kvfuzz/bench/bench.py)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.table import Table
from rich.text import Text

from kvfuzz.cli import options
from kvfuzz.cli.app import app, console
from kvfuzz.traces import atomic_write_text
from kvfuzz.traces.errors import BadInput


def _fmt(v: float | None, unit: str = "") -> str:
    return "—" if v is None else (f"{v:.0f}{unit}" if isinstance(v, float) else f"{v}{unit}")


def render(report: dict) -> Table:
    table = Table(title="kvfuzz detection benchmark", show_header=True, header_style="bold")
    table.add_column("toggle", overflow="fold")
    for col in ("kind", "engine", "dtype", "found", "traces median / max", "seconds median / max",
                "near-tie share (before)", "target"):
        table.add_column(col, overflow="fold")
    for r in report["toggles"]:
        ok = Text("met", style="green") if r["target_met"] else Text("MISSED", style="bold red")
        table.add_row(r["name"], r["kind"], r["profile"], r.get("dtype", "float32"), r["found"],
                      f"{_fmt(r['median_traces'])} / {_fmt(r['max_traces'])}",
                      f"{_fmt(r['median_seconds'])} / {_fmt(r['max_seconds'])}", _share(r), ok)
    for s in report["skipped"]:
        table.add_row(s["name"], "", "", "", "skipped", s["reason"], "", "", "")
    c = report["control"]
    if c:
        ok = Text("met", style="green") if c["corruption"] == 0 else Text("FALSE POSITIVES", style="bold red")
        table.add_row("clean control", "", "all", "all", f"{c['traces']} traces", f"corruption: {c['corruption']}",
                      f"{c['seconds']:.0f} s", "", ok)
    return table


def _share(r: dict) -> str:
    """Of the divergences the toggle explains, the share filed numeric-near-tie: by the
    evidence rule, and (in brackets) by the former fixed-threshold rule on the same divergences."""
    n = r.get("divergences", 0)
    if not n:
        return "—"
    return f"{r['near_ties']}/{n} ({r['near_ties_before']}/{n})"


def markdown(report: dict) -> str:
    lines = ["| toggle | kind | arm (engine) | dtype | found | traces to detection (median / max) "
             "| seconds (median / max) | filed near-tie: evidence rule (rule before #17) | target |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in report["toggles"]:
        lines.append(f"| `{r['name']}` | {r['kind']} | `{r['arm']}` ({r['profile']}) | {r.get('dtype', 'float32')} | "
                     f"{r['found']} | {_fmt(r['median_traces'])} / {_fmt(r['max_traces'])} | "
                     f"{_fmt(r['median_seconds'])} / {_fmt(r['max_seconds'])} | {_share(r)} | "
                     f"{'met' if r['target_met'] else '**missed**'} |")
    for s in report["skipped"]:
        lines.append(f"| `{s['name']}` | | | | skipped | {s['reason']} | | | |")
    c = report["control"]
    if c:
        lines.append(f"| clean control | | `clean` (all engines) | all | {c['traces']} traces, {c['seconds']:.0f} s | "
                     f"corruption findings: **{c['corruption']}** (all classes: {c['divergences_by_class'] or 'none'}) | | | "
                     f"{'met' if c['corruption'] == 0 else '**missed**'} |")
    return "\n".join(lines) + "\n"


def _ints(text: str, flag: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise BadInput(f"expected comma-separated integers, got {text!r}", field=flag) from None


@app.command("bench")
def bench_cmd(
    seeds: Annotated[str, typer.Option(help="Comma-separated campaign seeds.")] = "0,1,2",
    budget: Annotated[float, typer.Option(help="Seconds per (toggle, seed) before giving up.")] = 240.0,
    max_traces: Annotated[Optional[int], typer.Option("--max-traces", help="Traces per (toggle, seed) cap.")] = 100,
    control_budget: Annotated[float, typer.Option(help="Seconds of the clean control (split over seeds).")] = 600.0,
    toggles: Annotated[Optional[str], typer.Option(help="Comma-separated toggles (default: all that change "
                                                        "outputs on this device).")] = None,
    runs: Annotated[int, typer.Option(min=1, help="Confirmation runs (K), as in kvfuzz run.")] = 3,
    runs_fixed: Annotated[bool, typer.Option("--runs-fixed", help="Every trace K times (the campaign before "
                                                                  "adaptive runs).")] = False,
    lora: Annotated[str, typer.Option(help="auto: LoRA engine only for toggles that need LoRA; on; off.")] = "auto",
    kv_cache_mb: Annotated[Optional[int], typer.Option(min=1, help="KV cache size in MiB (small: preemption "
                                                                    "happens; default 8, embedded:tiny-hybrid 2).")] = None,
    max_model_len: Annotated[Optional[int], typer.Option(min=16, help="Must fit in the KV cache (1 KiB/token for the "
                                                                         "embedded model, one block reserved; default "
                                                                         "8000, embedded:tiny-hybrid 1024).")] = None,
    model: Annotated[Optional[str], typer.Option(help="embedded:tiny-hybrid: benchmark on the hybrid model with the "
                                                      "kvfuzz-store connector (docs/hybrid.md).")] = None,
    device: options.DeviceOpt = "cpu",
    dtype: Annotated[Optional[str], typer.Option("--dtype", metavar="DTYPES", help="Comma-separated dtypes, "
                                                 "benchmarked side by side (auto: the device's; default auto).")] = None,
    out: Annotated[Path, typer.Option(help="Directory for campaign state, findings and the JSON report.")] =
    Path("kvfuzz-bench"),
    json_path: Annotated[Optional[Path], typer.Option("--json", help="Report file (default OUT/bench.json).")] = None,
    md: Annotated[bool, typer.Option("--markdown", help="Also print the table as Markdown.")] = False,
    prompt_reuse: Annotated[Optional[float], typer.Option(min=0.0, max=1.0, help="Prompt reuse probability, as in "
                                                          "kvfuzz run (default: kvfuzz run's).")] = None,
) -> None:
    """Detection benchmark: traces and seconds until each fault (or missing fix) is found, and
    the clean control's false positives."""
    from kvfuzz.bench.bench import run_bench
    from kvfuzz.fuzzer.reuse import DEFAULT_PROMPT_REUSE
    from kvfuzz.harness import toggles as reg
    from kvfuzz.harness.dtypes import check_dtype
    from kvfuzz.driver.settings import check_device

    seed_list = _ints(seeds, "--seeds")
    if len(seed_list) < 1:
        raise BadInput("give at least one seed", field="--seeds")
    if budget <= 0 or control_budget < 0:
        raise BadInput("budgets must be positive", field="--budget")
    check_device(device)
    dtypes = [check_dtype(d.strip(), device) for d in (dtype or "auto").split(",") if d.strip()]
    if not dtypes:
        raise BadInput("give at least one dtype", field="--dtype")
    if lora not in ("auto", "on", "off"):
        raise BadInput(f"expected auto, on or off, got {lora!r}", field="--lora")
    from kvfuzz.traces import EMBEDDED_HYBRID, EMBEDDED_MODEL

    if model is not None and model not in (EMBEDDED_MODEL, EMBEDDED_HYBRID):
        raise BadInput(f"unknown model {model!r} (embedded:tiny-qwen2 or {EMBEDDED_HYBRID})", field="--model")
    if model == EMBEDDED_HYBRID and lora == "on":
        raise BadInput(f"{EMBEDDED_HYBRID} has no LoRA adapters", field="--lora")
    names = None
    if toggles:
        names = [x.strip() for x in toggles.split(",") if x.strip()]
        for n in names:
            reg.get(n)  # BadInput for unknown names
    out.mkdir(parents=True, exist_ok=True)
    report = run_bench(toggles=names, seeds=seed_list, budget=budget, max_traces=max_traces,
                       control_budget=control_budget, runs=runs, out=out, device=device, lora=lora,
                       kv_cache_mb=kv_cache_mb if kv_cache_mb or model == EMBEDDED_HYBRID else 8,
                       max_model_len=max_model_len if max_model_len or model == EMBEDDED_HYBRID else 8000,
                       model=None if model == EMBEDDED_MODEL else model, dtypes=dtypes, runs_fixed=runs_fixed,
                       progress=lambda m: console.print(f"[dim]{m}[/dim]"),
                       prompt_reuse=DEFAULT_PROMPT_REUSE if prompt_reuse is None else prompt_reuse)
    path = json_path or out / "bench.json"
    atomic_write_text(path, json.dumps(report, indent=2) + "\n")
    console.print(render(report))
    console.print(f"fuzzed runs: {report['fuzzed_share']:.0%} of the benchmark's wall time; the fuzzed engine "
                  f"busy {report['busy_share']:.0%}")
    console.print(f"machine: {report['machine'].get('cpu', '?')} x{report['machine'].get('cpus')}, "
                  f"load average before/after {report['load_avg_before']} / {report['load_avg_after']}")
    console.print(f"report written to {path.resolve()}")
    if md:
        console.print(markdown(report), markup=False, highlight=False, soft_wrap=True)
