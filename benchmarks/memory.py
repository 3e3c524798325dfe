"""Memory of a long campaign: resident set size after 1, 100, 200, ... traces.

    python benchmarks/memory.py --traces 1000 --out memory.json

A real campaign (``fuzzer.run_campaign``, feedback mode, corpus and findings on disk) on the
in-process vLLM CPU engine with the embedded default model, with small traces (1-3 requests of
at most 256 tokens, 2-6 new tokens each, one run per trace) so 1000 traces take
minutes, not hours. Memory is read from /proc/self/status: VmRSS (now) and VmHWM (peak since
the process started, engine start included). "Flat" means RSS after 1000 traces is within a
few percent of RSS after 100: every structure that grows per trace is bounded (reference memo
LRU, campaign coverage log) or proportional to what is kept on disk (findings, corpus).

Re-runnable: the lead can re-measure on an idle machine with the same command.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def proc_status() -> dict[str, float]:
    """VmRSS and VmHWM of this process, in MiB."""
    out: dict[str, float] = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, rest = line.partition(":")
            if key in ("VmRSS", "VmHWM"):
                out[key] = round(int(rest.split()[0]) / 1024.0, 1)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--traces", type=int, default=1000)
    ap.add_argument("--every", type=int, default=100, help="Sample memory every N traces.")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--runs", type=int, default=1)
    ap.add_argument("--max-model-len", type=int, default=256)
    ap.add_argument("--mode", choices=("feedback", "random"), default="feedback")
    ap.add_argument("--work", type=Path, default=None, help="Campaign directory (default: a temporary one).")
    ap.add_argument("--out", type=Path, default=None, help="Write the figures as JSON here.")
    ap.add_argument("--onednn-cache", type=int, default=None,
                    help="Set ONEDNN_PRIMITIVE_CACHE_CAPACITY (oneDNN keeps one kernel per matmul shape, "
                         "1024 by default: that cache is what grows over the first few hundred traces).")
    args = ap.parse_args()
    if args.onednn_cache is not None:  # before torch loads (the engine starts below)
        os.environ["ONEDNN_PRIMITIVE_CACHE_CAPACITY"] = str(args.onednn_cache)

    from kvfuzz.fuzzer import CampaignOptions, default_engine, run_campaign
    from kvfuzz.fuzzer.generate import GenOptions
    from kvfuzz.driver.settings import SessionSettings
    from kvfuzz.driver.session import build_session

    work = args.work or Path(tempfile.mkdtemp(prefix="kvfuzz-memory-"))
    # max_model_len caps generated prompt lengths (generate() fits each request in it): short
    # prompts keep a trace well under a second on 2 CPU cores.
    engine = default_engine(max_model_len=args.max_model_len)
    gen = GenOptions(min_requests=1, max_requests=3, max_tokens=(2, 6), p_long=0.0, p_cancel=0.2)
    session = build_session(SessionSettings(runs=args.runs), work)
    samples: list[dict] = []
    t0 = time.monotonic()
    try:
        session.engine_for(engine)
        t0 = time.monotonic()
        samples.append({"traces": 0, "seconds": 0.0, **proc_status()})
        print(f"engine started: {samples[-1]}", flush=True)

        def on(outcome, state) -> None:
            n = state.traces
            if n == 1 or n % args.every == 0:
                row = {"traces": n, "seconds": round(time.monotonic() - t0, 1), **proc_status(),
                       "references": len(session.references), "corpus": len(state.corpus),
                       "findings": state.findings, "coverage_log": len(state.coverage_log)}
                samples.append(row)
                print(json.dumps(row), flush=True)

        opts = CampaignOptions(seed=args.seed, budget_s=None, max_traces=args.traces, runs=args.runs, out=work,
                               engine=engine, gen=gen, mode=args.mode, arms={"vanilla": []})
        state = run_campaign(opts, lambda t: session.check(t, runs=args.runs, arms={"vanilla": []}), on)
    finally:
        session.close()
    by_n = {s["traces"]: s for s in samples}
    first, last = by_n.get(100), by_n.get(args.traces)
    report = {
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "machine": f"{platform.machine()} {os.cpu_count()} cores, {platform.platform()}",
        "load_at_end": os.getloadavg(),
        "command": " ".join([os.path.basename(sys.executable), *sys.argv]),
        "traces": state.traces, "seconds": state.seconds, "findings": state.findings,
        "samples": samples,
        "onednn_cache": os.environ.get("ONEDNN_PRIMITIVE_CACHE_CAPACITY"),
        "rss_growth_100_to_end_mib": round(last["VmRSS"] - first["VmRSS"], 1) if first and last else None,
    }
    print(json.dumps({k: v for k, v in report.items() if k != "samples"}, indent=2), flush=True)
    if args.out:
        args.out.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
