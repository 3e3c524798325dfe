"""``kvfuzz bench``: the detection benchmark.

For every toggle that can change outputs on this device, fuzz with the toggle's single-toggle
arm (clean + fault, or clean - fix) for each seed until the oracle reports a divergence that
attribution pins on that toggle, and record traces- and seconds-to-first-detection. Then fuzz
the clean arm (no fault, every applicable fix on) for a fixed budget over the same seeds and
count corruption-class findings: those are false positives, or real vLLM bugs to report.

The campaign loop, generator and oracle are the ones ``kvfuzz run`` uses; only the arm
differs. One engine serves the whole benchmark (its start is excluded from every figure);
references are memoised per (toggle, seed) so no run profits from another's references.
"""

from __future__ import annotations

import datetime as _dt
import json
import os
import platform
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Annotated, Any, Optional

import typer
from rich.table import Table
from rich.text import Text

from kvfuzz.cli import app, console
from traces import Finding, atomic_write_text
from traces.errors import BadInput

DETECTING = ("corruption", "engine-crash", "error")
TARGET_TRACES = 20
TARGET_SECONDS = 120.0


@dataclass
class SeedResult:
    seed: int
    detected: bool
    traces: int  # traces run (including the detecting one)
    seconds: float  # campaign seconds until detection (or the budget used)
    finding: str | None = None
    victims: list[str] = field(default_factory=list)
    cls: str | None = None


@dataclass
class ToggleResult:
    name: str
    kind: str
    arm: str
    toggles: list[str]
    profile: str = "base"  # engine profile: "base" or "lora"
    seeds: list[SeedResult] = field(default_factory=list)

    def found(self) -> list[SeedResult]:
        return [s for s in self.seeds if s.detected]

    def stat(self, attr: str, fn: Any) -> float | None:
        # A miss counts as "at least the budget used" (inf for the median's sake).
        vals = [getattr(s, attr) if s.detected else float("inf") for s in self.seeds]
        if not vals:
            return None
        v = fn(vals)
        return None if v == float("inf") else v

    def summary(self) -> dict:
        med_t, max_t = self.stat("traces", statistics.median), self.stat("traces", max)
        med_s, max_s = self.stat("seconds", statistics.median), self.stat("seconds", max)
        return {"found": f"{len(self.found())}/{len(self.seeds)}", "median_traces": med_t, "max_traces": max_t,
                "median_seconds": med_s, "max_seconds": max_s,
                "target_met": (med_t is not None and med_t <= TARGET_TRACES and med_s is not None
                               and med_s <= TARGET_SECONDS)}


class _Detected(Exception):
    pass


def _machine() -> dict:
    info: dict[str, Any] = {"platform": platform.platform(), "python": sys.version.split()[0],
                            "cpus": os.cpu_count()}
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                info["cpu"] = line.split(":", 1)[1].strip()
                break
        mem = Path("/proc/meminfo").read_text().splitlines()[0].split()
        info["mem_gib"] = round(int(mem[1]) / 2**20, 1)
    except OSError:
        pass
    from harness.environment import torch_version, vllm_version

    info["vllm"] = vllm_version()
    info["torch"] = torch_version()
    return info


def _detects(f: Finding | None, toggle: str) -> bool:
    return f is not None and any(d.explained_by == toggle and d.class_ in DETECTING for d in f.divergences)


def _campaign(session: Any, arm: str, toggles: list[str], seed: int, *, budget: float, max_traces: int | None,
              runs: int, out: Path, engine: Any, stop_on: str | None,
              on_finding: Any = None) -> tuple[Any, float, Any]:
    """One campaign of ``arm``; stops at the first finding explained by ``stop_on``."""
    from fuzzer import CampaignOptions, run_campaign
    from harness.runner import ReferenceStore

    session.references = ReferenceStore()
    opts = CampaignOptions(seed=seed, budget_s=budget, max_traces=max_traces, runs=runs, out=out, engine=engine)
    hit: dict[str, Any] = {}
    t0 = time.monotonic()

    def outcome(o: Any, state: Any) -> None:
        if on_finding is not None and o.finding is not None:
            on_finding(o.finding)
        if stop_on is not None and _detects(o.finding, stop_on):
            hit.update(outcome=o, seconds=time.monotonic() - t0, traces=state.traces,
                       file=state.finding_files[-1] if state.finding_files else None)
            raise _Detected

    state = None
    try:
        state = run_campaign(opts, lambda t: session.check(t, runs=runs, arms={arm: toggles}, attribute=True).finding,
                             outcome)
    except _Detected:
        pass
    return state, time.monotonic() - t0, hit


def _profiles(chosen: list[str], lora: str) -> dict[str, list[str]]:
    """Engine profile ("lora" / "base") -> toggles benchmarked on it. ``auto``: the LoRA
    engine only for toggles that need LoRA (LoRA requests fragment the prefix cache into
    per-adapter namespaces and make every step slower, which would only hide the others)."""
    from harness import toggles as reg

    out: dict[str, list[str]] = {}
    for name in chosen:
        use = lora == "on" or (lora == "auto" and "lora" in reg.get(name).needs)
        out.setdefault("lora" if use else "base", []).append(name)
    if not out:
        out["lora" if lora == "on" else "base"] = []
    return out


def bench_engine(profile: str, kv_cache_mb: int, max_model_len: int) -> Any:
    from fuzzer import default_engine

    return default_engine(lora=profile == "lora", kv_cache_bytes=kv_cache_mb * 2**20, max_model_len=max_model_len)


def run_bench(*, toggles: list[str] | None, seeds: list[int], budget: float, max_traces: int | None,
              control_budget: float, runs: int, out: Path, device: str, lora: str = "auto", kv_cache_mb: int = 8,
              max_model_len: int = 8000, progress: Any = print, session: Any = None) -> dict:
    from harness import toggles as reg
    from kvfuzz.session import Session
    from oracle.attribution import single_arm

    clean = reg.clean_set(device)
    changing = reg.output_changing(device)
    chosen = toggles if toggles is not None else changing
    skipped = []
    for name in chosen:
        if name not in changing:
            t = reg.get(name)
            problem = reg.self_check(t)
            skipped.append({"name": name, "reason": problem or f"cannot change outputs on {device} "
                                                            f"(changes them on: {', '.join(t.backends)})"})
    chosen = [t for t in chosen if t in changing]
    profiles = _profiles(chosen, lora)
    load_before = os.getloadavg()
    own = session is None
    if own:
        session = Session(device=device, runs=runs, attribute=True, log_file=out / "engine.log")
    results: list[ToggleResult] = []
    engines: dict[str, Any] = {}
    starts: dict[str, float] = {}
    by_class: dict[str, int] = {}
    unexplained: list[str] = []
    control_traces = 0
    control_seconds = 0.0

    def note(f: Finding) -> None:
        for d in f.divergences:
            by_class[d.class_] = by_class.get(d.class_, 0) + 1
            if d.explained_by is None:
                unexplained.append(f"{f.id}:{d.arm}:{d.request_id}:{d.class_}")

    try:
        for profile, names in profiles.items():
            engine = engines[profile] = bench_engine(profile, kv_cache_mb, max_model_len)
            t_start = time.monotonic()
            session.engine_for(engine)
            starts[profile] = round(time.monotonic() - t_start, 1)
            for name in names:
                arm, arm_toggles = single_arm(name, clean)
                tr = ToggleResult(name=name, kind=reg.get(name).kind, arm=arm, toggles=arm_toggles, profile=profile)
                for seed in seeds:
                    state, secs, hit = _campaign(session, arm, arm_toggles, seed, budget=budget,
                                                 max_traces=max_traces, runs=runs, out=out / name / f"seed{seed}",
                                                 engine=engine, stop_on=name)
                    if hit:
                        f = hit["outcome"].finding
                        victims = sorted({d.request_id for d in f.divergences if d.explained_by == name})
                        sr = SeedResult(seed, True, hit["traces"], round(hit["seconds"], 1), hit["file"], victims,
                                        f.worst_class())
                    else:
                        sr = SeedResult(seed, False, state.traces if state else 0, round(secs, 1))
                    tr.seeds.append(sr)
                    progress(f"{name} seed {seed}: " + (f"found after {sr.traces} traces, {sr.seconds:.0f} s"
                                                        if sr.detected else
                                                        f"not found in {sr.traces} traces, {sr.seconds:.0f} s"))
                results.append(tr)
            # Clean control on this engine: the same seeds (so the same traces the faults ran
            # on), every applicable fix on, no fault; its share of the control budget.
            share = control_budget / len(profiles) / max(1, len(seeds))
            for seed in seeds if share > 0 else []:
                state, secs, _ = _campaign(session, "clean", clean, seed, budget=share, max_traces=None, runs=runs,
                                           out=out / "control" / profile / f"seed{seed}", engine=engine,
                                           stop_on=None, on_finding=note)
                control_traces += state.traces if state else 0
                control_seconds += secs
                progress(f"control ({profile}) seed {seed}: {state.traces if state else 0} traces, {secs:.0f} s, "
                         f"divergences so far: {by_class or 'none'}")
    finally:
        if own:
            session.close()
    return {
        "date": _dt.datetime.now(_dt.timezone.utc).replace(microsecond=0).isoformat(),
        "machine": _machine(),
        "load_avg_before": [round(x, 2) for x in load_before],
        "load_avg_after": [round(x, 2) for x in os.getloadavg()],
        "command": "kvfuzz " + " ".join(sys.argv[1:]),
        "config": {"device": device, "seeds": seeds, "budget_s": budget, "max_traces": max_traces, "runs": runs,
                   "control_budget_s": control_budget, "lora": lora, "kv_cache_mb": kv_cache_mb,
                   "max_model_len": max_model_len,
                   "engines": {p: e.model_dump(mode="json") for p, e in engines.items()},
                   "engine_start_s": starts},
        "clean_arm": clean,
        "targets": {"median_traces": TARGET_TRACES, "median_seconds": TARGET_SECONDS, "control_corruption": 0},
        "toggles": [{**asdict(r), **r.summary()} for r in results],
        "skipped": skipped,
        "control": {"arm": "clean", "toggles": clean, "traces": control_traces,
                    "seconds": round(control_seconds, 1), "divergences_by_class": by_class,
                    "corruption": by_class.get("corruption", 0), "unexplained": unexplained}
        if control_budget > 0 else {},
    }


def _fmt(v: float | None, unit: str = "") -> str:
    return "—" if v is None else (f"{v:.0f}{unit}" if isinstance(v, float) else f"{v}{unit}")


def render(report: dict) -> Table:
    table = Table(title="kvfuzz detection benchmark", show_header=True, header_style="bold")
    table.add_column("toggle", no_wrap=True)
    for col in ("kind", "engine", "found", "traces median / max", "seconds median / max", "target"):
        table.add_column(col)
    for r in report["toggles"]:
        ok = Text("met", style="green") if r["target_met"] else Text("MISSED", style="bold red")
        table.add_row(r["name"], r["kind"], r["profile"], r["found"],
                      f"{_fmt(r['median_traces'])} / {_fmt(r['max_traces'])}",
                      f"{_fmt(r['median_seconds'])} / {_fmt(r['max_seconds'])}", ok)
    for s in report["skipped"]:
        table.add_row(s["name"], "", "", "skipped", s["reason"], "", "")
    c = report["control"]
    if c:
        ok = Text("met", style="green") if c["corruption"] == 0 else Text("FALSE POSITIVES", style="bold red")
        table.add_row("clean control", "", "all", f"{c['traces']} traces", f"corruption: {c['corruption']}",
                      f"{c['seconds']:.0f} s", ok)
    return table


def markdown(report: dict) -> str:
    lines = ["| toggle | kind | arm (engine) | found | traces to detection (median / max) | seconds (median / max) "
             "| target |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for r in report["toggles"]:
        lines.append(f"| `{r['name']}` | {r['kind']} | `{r['arm']}` ({r['profile']}) | {r['found']} | "
                     f"{_fmt(r['median_traces'])} / {_fmt(r['max_traces'])} | "
                     f"{_fmt(r['median_seconds'])} / {_fmt(r['max_seconds'])} | "
                     f"{'met' if r['target_met'] else '**missed**'} |")
    for s in report["skipped"]:
        lines.append(f"| `{s['name']}` | | | skipped | {s['reason']} | | |")
    c = report["control"]
    if c:
        lines.append(f"| clean control | | `clean` (all engines) | {c['traces']} traces, {c['seconds']:.0f} s | "
                     f"corruption findings: **{c['corruption']}** (all classes: {c['divergences_by_class'] or 'none'}) | | "
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
    runs: Annotated[int, typer.Option(min=1, help="Runs of each trace (K), as in kvfuzz run.")] = 3,
    lora: Annotated[str, typer.Option(help="auto: LoRA engine only for toggles that need LoRA; on; off.")] = "auto",
    kv_cache_mb: Annotated[int, typer.Option(min=1, help="KV cache size in MiB (small: preemption happens).")] = 8,
    max_model_len: Annotated[int, typer.Option(min=16, help="Must fit in the KV cache (1 KiB/token for the "
                                                               "embedded model, one block reserved).")] = 8000,
    device: Annotated[str, typer.Option(help="cpu or cuda.")] = "cpu",
    out: Annotated[Path, typer.Option(help="Directory for campaign state, findings and the JSON report.")] =
    Path("kvfuzz-bench"),
    json_path: Annotated[Optional[Path], typer.Option("--json", help="Report file (default OUT/bench.json).")] = None,
    md: Annotated[bool, typer.Option("--markdown", help="Also print the table as Markdown.")] = False,
) -> None:
    """Detection benchmark: traces and seconds until each fault (or missing fix) is found, and
    the clean control's false positives."""
    from harness import toggles as reg

    seed_list = _ints(seeds, "--seeds")
    if len(seed_list) < 1:
        raise BadInput("give at least one seed", field="--seeds")
    if budget <= 0 or control_budget < 0:
        raise BadInput("budgets must be positive", field="--budget")
    if device not in ("cpu", "cuda"):
        raise BadInput(f"unknown device {device!r} (cpu or cuda)", field="--device")
    if lora not in ("auto", "on", "off"):
        raise BadInput(f"expected auto, on or off, got {lora!r}", field="--lora")
    names = None
    if toggles:
        names = [x.strip() for x in toggles.split(",") if x.strip()]
        for n in names:
            reg.get(n)  # BadInput for unknown names
    out.mkdir(parents=True, exist_ok=True)
    report = run_bench(toggles=names, seeds=seed_list, budget=budget, max_traces=max_traces,
                       control_budget=control_budget, runs=runs, out=out, device=device, lora=lora,
                       kv_cache_mb=kv_cache_mb, max_model_len=max_model_len,
                       progress=lambda m: console.print(f"[dim]{m}[/dim]"))
    path = json_path or out / "bench.json"
    atomic_write_text(path, json.dumps(report, indent=2) + "\n")
    console.print(render(report))
    console.print(f"machine: {report['machine'].get('cpu', '?')} x{report['machine'].get('cpus')}, "
                  f"load average before/after {report['load_avg_before']} / {report['load_avg_after']}")
    console.print(f"report written to {path.resolve()}")
    if md:
        console.print(markdown(report), markup=False, highlight=False, soft_wrap=True)
