"""Send-time accuracy of the HTTP replay client on loopback, and managed-server start time.

Starts a managed vLLM server serving the embedded default (CPU), then replays traces of 20
and 100 requests whose sends are spread over a few seconds (with bursts: several sends at the
same instant) and measures |actual - planned| send offset per request, where "actual" is
when the request body was fully written to the socket. Timed cancels are measured the same
way. Target: p99 <= 2 ms.

    python benchmarks/send_accuracy.py [--repeats 3] [--out kvfuzz-bench] [--json results.json]

The client sends from a SCHED_FIFO loop when the OS allows it (harness/priority.py; the JSON
says which: ``client_priority``); ``KVFUZZ_REALTIME=0 python benchmarks/send_accuracy.py``
measures the normal-priority control.

Re-runnable; numbers measured while other jobs share the CPU are distorted (say so). The
event-loop lag (how late a 1 ms timer fires during the replays) is printed as a witness: a lag
tail of tens of milliseconds means this process was not getting the CPU, and the send figures
measure the machine, not the client.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import time
from pathlib import Path

from kvfuzz.harness.http import replay as http_replay
from kvfuzz.harness.server import ServerEngine, ServerOptions
from kvfuzz.traces import At, CancelEvent, EngineConfig, GenPrompt, SendEvent, Trace


def percentile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    if not xs:
        return float("nan")
    k = (len(xs) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def bench_trace(n: int, seed: int, span_ms: float, cfg: EngineConfig) -> Trace:
    """``n`` sends over ``span_ms``; ~1/3 of them in bursts sharing an instant; ~1/5 cancelled
    at a fixed offset 20-200 ms after their send."""
    rng = random.Random(seed)
    events: list[SendEvent | CancelEvent] = []
    t = 0.0
    i = 0
    while i < n:
        burst = rng.choice([1, 1, 1, 2, 3, 4])
        for _ in range(min(burst, n - i)):
            rid = f"r{i}"
            events.append(SendEvent(request_id=rid, at=At(offset_ms=round(t, 3)), max_tokens=rng.randint(4, 16),
                                    prompt=GenPrompt(length=rng.randint(16, 200), seed=rng.randrange(1 << 30)),
                                    stream=rng.random() < 0.8))
            if rng.random() < 0.2:
                events.append(CancelEvent(request_id=rid, at=At(offset_ms=round(t + rng.uniform(20, 200), 3))))
            i += 1
        t += rng.uniform(0, 2 * span_ms / n * burst)
    return Trace(engine=cfg, events=events, name=f"bench-{n}-{seed}")


LAGS: list[float] = []


async def _bare_loop_lag(seconds: float) -> list[float]:
    """Lateness of a 1 ms timer in an otherwise idle event loop: what the machine alone costs."""
    lags = []
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        t = time.perf_counter()
        await asyncio.sleep(0.001)
        lags.append((time.perf_counter() - t - 0.001) * 1000.0)
    return lags


def _monitor_loop_lag() -> None:
    """Wrap the replayer so a 1 ms ticker records event-loop lateness during each replay."""
    orig = http_replay.Replayer.run

    async def run(self):  # type: ignore[no-untyped-def]
        stop = False

        async def tick() -> None:
            while not stop:
                t = time.perf_counter()
                await asyncio.sleep(0.001)
                LAGS.append((time.perf_counter() - t - 0.001) * 1000.0)

        ticker = asyncio.create_task(tick())
        try:
            return await orig(self)
        finally:
            stop = True
            await ticker

    http_replay.Replayer.run = run  # type: ignore[method-assign]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=3, help="replays of each trace size")
    ap.add_argument("--out", type=Path, default=Path("kvfuzz-bench"), help="server log directory")
    ap.add_argument("--json", type=Path, default=None, help="also write the figures here")
    ap.add_argument("--baseline-seconds", type=float, default=5.0,
                    help="measure a bare event loop's timer lag this long first (machine baseline)")
    ap.add_argument("--client-nice", type=int, default=None,
                    help="renice this (client) process after the server started, e.g. -10 (root): on a "
                         "shared machine this separates the client's accuracy from CPU starvation")
    args = ap.parse_args()

    _monitor_loop_lag()
    base = asyncio.run(_bare_loop_lag(args.baseline_seconds)) if args.baseline_seconds > 0 else []
    cfg = EngineConfig(kv_cache_bytes=64 * 2**20)
    eng = ServerEngine(cfg, options=ServerOptions(log_dir=args.out))
    t0 = time.perf_counter()
    eng.start()
    wall_start = time.perf_counter() - t0
    results: dict[str, object] = {
        "server_start_to_health_s": round(eng.start_seconds[0], 2),
        "server_start_incl_warmup_s": round(wall_start, 2),
        "load_average_at_start": [round(x, 2) for x in os.getloadavg()],
    }
    if base:
        results["bare_loop_lag_ms"] = {"p50": round(statistics.median(base), 3),
                                       "p99": round(percentile(base, 0.99), 3), "max": round(max(base), 3)}
    if args.client_nice is not None:
        os.setpriority(os.PRIO_PROCESS, 0, args.client_nice)  # this process only, not the server
        results["client_nice"] = args.client_nice
    try:
        for n, span in ((20, 1000.0), (100, 4000.0)):
            send_err: list[float] = []
            cancel_err: list[float] = []
            walls = []
            prios: set[str] = set()
            LAGS.clear()
            for rep in range(args.repeats):
                trace = bench_trace(n, seed=1000 * n + rep, span_ms=span, cfg=cfg)
                h = eng.replay(trace, run_index=rep)
                walls.append(h.wall_seconds)
                prios.add(h.client_priority or "?")
                for e in h.events:
                    if e.actual_offset_ms is None or e.planned_offset_ms is None:
                        continue
                    err = abs(e.actual_offset_ms - e.planned_offset_ms)
                    (send_err if e.kind == "send" else cancel_err).append(err)
                bad = [r.request_id for r in h.requests.values() if r.error]
                if bad:
                    raise SystemExit(f"requests failed: {bad}")
            results[f"{n}_requests"] = {
                "sends": len(send_err),
                "send_p50_ms": round(statistics.median(send_err), 3),
                "send_p99_ms": round(percentile(send_err, 0.99), 3),
                "send_max_ms": round(max(send_err), 3),
                "cancels": len(cancel_err),
                "cancel_p50_ms": round(statistics.median(cancel_err), 3) if cancel_err else None,
                "cancel_p99_ms": round(percentile(cancel_err, 0.99), 3) if cancel_err else None,
                "run_wall_s_median": round(statistics.median(walls), 2),
                "client_priority": ",".join(sorted(prios)),
                "loop_lag_p50_ms": round(statistics.median(LAGS), 3),
                "loop_lag_p99_ms": round(percentile(LAGS, 0.99), 3),
                "loop_lag_max_ms": round(max(LAGS), 3),
            }
    finally:
        eng.close()
    results["load_average_after"] = [round(x, 2) for x in os.getloadavg()]
    text = json.dumps(results, indent=2)
    print(text)
    if args.json:
        args.json.write_text(text + "\n")


if __name__ == "__main__":
    main()
