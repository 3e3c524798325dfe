"""Benchmark: what a second engine beside the first costs it (the ceiling of ``--reference-engines``).

One engine replays a fixed trace for ``--seconds``; then two engines, in two processes with one
torch thread each, replay it at once. If the machine gave each engine a core of its own, each
would keep its lone rate; what it loses is the memory system and cores the two share. The
reference engine can speed a campaign up at most by (fuzzed + reference time) / fuzzed time, each
measured beside the other.

    python benchmarks/side_by_side.py [--seconds 30] [--requests 4] [--max-tokens 32]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import time


def _worker(barrier: object, seconds: float, requests: int, max_tokens: int, out: object) -> None:
    from kvfuzz.fuzzer import default_engine
    from kvfuzz.harness.inprocess import InProcessEngine
    from kvfuzz.traces import At, GenPrompt, SendEvent, Trace

    cfg = default_engine(kv_cache_bytes=64 * 2**20)
    sends = [SendEvent(request_id=f"r{i}", at=At(step=i), max_tokens=max_tokens,
                       prompt=GenPrompt(length=96 + 61 * i, seed=i)) for i in range(requests)]
    trace = Trace(engine=cfg, events=sends)
    eng = InProcessEngine(cfg)
    eng.start()
    eng.replay(trace)  # warm-up
    barrier.wait()  # type: ignore[attr-defined]
    t0, n = time.perf_counter(), 0
    while time.perf_counter() - t0 < seconds:
        eng.replay(trace)
        n += 1
    out.put(n / (time.perf_counter() - t0))  # type: ignore[attr-defined]
    eng.close()


def rates(engines: int, seconds: float, requests: int, max_tokens: int) -> list[float]:
    ctx = mp.get_context("spawn")
    barrier, out = ctx.Barrier(engines), ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(barrier, seconds, requests, max_tokens, out)) for _ in range(engines)]
    for p in procs:
        p.start()
    got = [out.get() for _ in procs]
    for p in procs:
        p.join()
    return got


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seconds", type=float, default=30.0)
    ap.add_argument("--requests", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=32)
    args = ap.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")  # one torch thread per engine, as campaigns run
    alone = rates(1, args.seconds, args.requests, args.max_tokens)[0]
    pair = rates(2, args.seconds, args.requests, args.max_tokens)
    print(json.dumps({
        "cpus": os.cpu_count(), "seconds": args.seconds, "requests": args.requests, "max_tokens": args.max_tokens,
        "replays_per_s_alone": round(alone, 3), "replays_per_s_each_beside_another": [round(r, 3) for r in pair],
        "slowdown_beside_another": round(alone / min(pair), 3),
    }, indent=2))


if __name__ == "__main__":
    main()
