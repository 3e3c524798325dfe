"""The detection benchmark behind ``kvfuzz bench`` (its CLI and tables: kvfuzz/cli/commands/bench.py).

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
import os
import platform
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from kvfuzz.driver.session import Session
from kvfuzz.driver.settings import SessionSettings, check_device
from kvfuzz.driver.session import build_session
from kvfuzz.traces import Divergence, EngineConfig, Finding

DETECTING = ("corruption", "engine-crash", "error")
TARGET_TRACES = 20
TARGET_SECONDS = 120.0


@dataclass
class SeedResult:
    seed: int
    detected: bool
    traces: int  # traces run (including the detecting one)
    seconds: float  # campaign seconds until detection (or the budget used)
    finding: str | None = None  # relative to the bench output directory
    victims: list[str] = field(default_factory=list)
    cls: str | None = None


@dataclass
class ToggleResult:
    name: str
    kind: str
    arm: str
    toggles: list[str]
    profile: str = "base"  # engine profile: "base" or "lora"
    dtype: str = "float32"
    seeds: list[SeedResult] = field(default_factory=list)
    # Divergences the toggle explains, over every finding of its campaigns: how many, and how
    # many were filed numeric-near-tie by the evidence rule and by the former fixed-threshold rule.
    divergences: int = 0
    near_ties: int = 0
    near_ties_before: int = 0

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
    from kvfuzz.harness.environment import torch_version, vllm_version

    info["vllm"] = vllm_version()
    info["torch"] = torch_version()
    return info


# The former fixed-threshold rule, for the comparison figure: a flip was a near tie when the
# reference's margin was below one per-dtype threshold and the drift before it was not above it.
PREVIOUS_NEAR_TIE = {"float32": 1e-3, "bfloat16": 0.5, "float16": 0.0625}


def near_tie_before(d: Divergence, dtype: str) -> bool:
    if d.class_ not in ("corruption", "numeric-near-tie") or d.margin is None:
        return False
    th = PREVIOUS_NEAR_TIE.get(dtype, 0.5)
    return d.margin < th and not (d.drift is not None and d.drift > th)


def _detects(f: Finding | None, toggle: str) -> bool:
    return f is not None and any(d.explained_by == toggle and d.class_ in DETECTING for d in f.divergences)


def _campaign(session: Session, arm: str, toggles: list[str], seed: int, *, budget: float, max_traces: int | None,
              runs: int, out: Path, engine: EngineConfig, stop_on: str | None, runs_fixed: bool = False,
              on_finding: Any = None, prompt_reuse: float = 0.0) -> tuple[Any, float, Any]:
    """One campaign of ``arm`` as ``kvfuzz run`` runs it (adaptive runs, attribution and
    buckets; no minimization, controls or ablation: they come after detection); stops at the
    first finding explained by ``stop_on``."""
    from kvfuzz.fuzzer import CampaignOptions, run_campaign
    from kvfuzz.harness.runner import ReferenceStore, ScoreStore
    from kvfuzz.driver.recovery import Recovering
    from kvfuzz.driver.settings import CampaignSettings, TriageSettings
    from kvfuzz.triage.campaign import build_triage

    # A fresh memo per (toggle, seed): no campaign profits from another's references.
    session.references, session.scores = ReferenceStore(ledger=session.ledger), ScoreStore(ledger=session.ledger)
    gen = None
    if prompt_reuse > 0:
        from kvfuzz.fuzzer import GenOptions

        gen = GenOptions(adapters=sorted(engine.lora.adapters) if engine.lora.enabled else [],
                         prompt_reuse=prompt_reuse, pool_seed=seed)
    opts = CampaignOptions(seed=seed, budget_s=budget, max_traces=max_traces, runs=runs, out=out, engine=engine,
                           gen=gen)
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
        # As `kvfuzz run` triages, without minimization, controls or ablation (after detection).
        settings = CampaignSettings(session=session.settings.model_copy(update={"runs": runs}), arms={arm: toggles},
                                    triage=TriageSettings(runs_fixed=runs_fixed, minimize=False, controls=False,
                                                          ablate=False))
        triage = build_triage(settings, session, Recovering(session), out)
        state = run_campaign(opts, triage, outcome, ledger=session.ledger)
    except _Detected:
        pass
    return state, time.monotonic() - t0, hit


def _profiles(chosen: list[str], lora: str) -> dict[str, list[str]]:
    """Engine profile ("lora" / "base") -> toggles benchmarked on it. ``auto``: the LoRA
    engine only for toggles that need LoRA (LoRA requests fragment the prefix cache into
    per-adapter namespaces and make every step slower, which would only hide the others)."""
    from kvfuzz.harness import toggles as reg

    out: dict[str, list[str]] = {}
    for name in chosen:
        use = lora == "on" or (lora == "auto" and "lora" in reg.get(name).needs)
        out.setdefault("lora" if use else "base", []).append(name)
    if not out:
        out["lora" if lora == "on" else "base"] = []
    return out


def bench_engine(profile: str, kv_cache_mb: int | None, max_model_len: int | None, dtype: str = "float32",
                 model: str | None = None) -> EngineConfig:
    from kvfuzz.fuzzer import default_engine
    from kvfuzz.traces import EMBEDDED_HYBRID

    if model == EMBEDDED_HYBRID:
        # The hybrid model with the kvfuzz-store connector (fuzzer/hybrid.py): blocks pinned,
        # so the count (and the queue positions the #44409 fault needs) is the same in every dtype.
        from kvfuzz.fuzzer.hybrid import BLOCK_BYTES, DEFAULT_BLOCKS, hybrid_engine

        blocks = kv_cache_mb * 2**20 // BLOCK_BYTES["float32"] if kv_cache_mb else DEFAULT_BLOCKS
        return hybrid_engine(blocks=blocks, dtype=dtype, **({"max_model_len": max_model_len} if max_model_len else {}))
    # The same number of KV tokens in every dtype (default_engine: the size is float32's), so a
    # fault that needs KV pressure meets the same pressure.
    return default_engine(lora=profile == "lora", kv_cache_bytes=(kv_cache_mb or 8) * 2**20,
                          max_model_len=max_model_len or 8000, dtype=dtype)


def run_bench(*, toggles: list[str] | None, seeds: list[int], budget: float, max_traces: int | None,
              control_budget: float, runs: int, out: Path, device: str, lora: str = "auto",
              kv_cache_mb: int | None = 8, max_model_len: int | None = 8000, dtypes: list[str] | None = None,
              runs_fixed: bool = False, progress: Any = print, session: Session | None = None,
              model: str | None = None, prompt_reuse: float = 0.0) -> dict:
    from kvfuzz.driver.calibrate import prepare_bounds
    from kvfuzz.harness import toggles as reg
    from kvfuzz.oracle.attribution import single_arm

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
    if session is None:
        session = build_session(SessionSettings(device=check_device(device), runs=runs), out)
    from kvfuzz.traces.timing import Ledger

    session.ledger = Ledger()  # where this benchmark's time goes (traces/timing.py)
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

    dtypes = dtypes or ["float32"]
    calibrations: dict[str, dict] = {}
    try:
        for dtype in dtypes:
            for profile, names in profiles.items():
                label = f"{profile}/{dtype}"
                engine = engines[label] = bench_engine(profile, kv_cache_mb, max_model_len, dtype, model)
                t_start = time.monotonic()
                session.engine_for(engine)
                starts[label] = round(time.monotonic() - t_start, 1)
                # The default campaign calibrates its noise bounds first (not counted in any figure).
                t_cal = time.monotonic()
                bounds = prepare_bounds(session, engine, calibrate_if_missing=True, progress=progress)
                calibrations[label] = {**bounds.to_json(), "seconds": round(time.monotonic() - t_cal, 1)}
                for name in names:
                    arm, arm_toggles = single_arm(name, clean)
                    tr = ToggleResult(name=name, kind=reg.get(name).kind, arm=arm, toggles=arm_toggles,
                                      profile=profile, dtype=dtype)

                    def count(f: Finding, tr: ToggleResult = tr) -> None:
                        for d in f.divergences:
                            if d.explained_by == tr.name and d.class_ in ("corruption", "numeric-near-tie"):
                                tr.divergences += 1
                                tr.near_ties += d.class_ == "numeric-near-tie"
                                tr.near_ties_before += near_tie_before(d, tr.dtype)

                    for seed in seeds:
                        state, secs, hit = _campaign(session, arm, arm_toggles, seed, budget=budget,
                                                     max_traces=max_traces, runs=runs,
                                                     out=out / dtype / name / f"seed{seed}", engine=engine,
                                                     stop_on=name, runs_fixed=runs_fixed, on_finding=count,
                                                     prompt_reuse=prompt_reuse)
                        if hit:
                            f = hit["outcome"].finding
                            victims = sorted({d.request_id for d in f.divergences if d.explained_by == name})
                            # Relative to the bench's --out, so `kvfuzz report OUT/<finding>` works.
                            rel = f"{dtype}/{name}/seed{seed}/{hit['file']}" if hit["file"] else None
                            sr = SeedResult(seed, True, hit["traces"], round(hit["seconds"], 1), rel,
                                            victims, f.worst_class())
                        else:
                            sr = SeedResult(seed, False, state.traces if state else 0, round(secs, 1))
                        tr.seeds.append(sr)
                        progress(f"{name} ({dtype}) seed {seed}: " + (
                            f"found after {sr.traces} traces, {sr.seconds:.0f} s" if sr.detected else
                            f"not found in {sr.traces} traces, {sr.seconds:.0f} s"))
                    results.append(tr)
                # Clean control on this engine: the same seeds (so the same traces the faults ran
                # on), every applicable fix on, no fault; its share of the control budget.
                share = control_budget / len(profiles) / len(dtypes) / max(1, len(seeds))
                for seed in seeds if share > 0 else []:
                    state, secs, _ = _campaign(session, "clean", clean, seed, budget=share, max_traces=None,
                                               runs=runs, out=out / dtype / "control" / profile / f"seed{seed}",
                                               engine=engine, stop_on=None, runs_fixed=runs_fixed, on_finding=note,
                                               prompt_reuse=prompt_reuse)
                    control_traces += state.traces if state else 0
                    control_seconds += secs
                    progress(f"control ({label}) seed {seed}: {state.traces if state else 0} traces, {secs:.0f} s, "
                             f"divergences so far: {by_class or 'none'}")
    finally:
        if own:
            session.close()
    time_spent = session.ledger.breakdown()
    return {
        "date": _dt.datetime.now(_dt.timezone.utc).replace(microsecond=0).isoformat(),
        # Where the benchmark's wall time went; fuzzed_share: the share in fuzzed runs;
        # busy_share: the share the fuzzed engine ran anything (traces/timing.py).
        "time": time_spent.model_dump(),
        "fuzzed_share": round(time_spent.share("fuzzed_runs"), 3),
        "busy_share": round(time_spent.busy_share, 3),
        "machine": _machine(),
        "load_avg_before": [round(x, 2) for x in load_before],
        "load_avg_after": [round(x, 2) for x in os.getloadavg()],
        "command": "kvfuzz " + " ".join(sys.argv[1:]),
        "config": {"device": device, "seeds": seeds, "budget_s": budget, "max_traces": max_traces, "runs": runs,
                   "runs_fixed": runs_fixed, "prompt_reuse": prompt_reuse,
                   "control_budget_s": control_budget, "lora": lora, "kv_cache_mb": kv_cache_mb, "model": model,
                   "max_model_len": max_model_len, "dtypes": dtypes,
                   "engines": {p: e.model_dump(mode="json") for p, e in engines.items()},
                   "engine_start_s": starts, "calibration": calibrations},
        "clean_arm": clean,
        "targets": {"median_traces": TARGET_TRACES, "median_seconds": TARGET_SECONDS, "control_corruption": 0},
        "toggles": [{**asdict(r), **r.summary()} for r in results],
        "skipped": skipped,
        "control": {"arm": "clean", "toggles": clean, "traces": control_traces,
                    "seconds": round(control_seconds, 1), "divergences_by_class": by_class,
                    "corruption": by_class.get("corruption", 0), "unexplained": unexplained}
        if control_budget > 0 else {},
    }


