"""Benchmark: engine starts in a process with a large heap, as in a test process or a campaign's
engine pool.

vLLM freezes the process heap at each engine start and unfreezes it at each shutdown, and runs
several full collections per start; with the engine pool evicting one engine per start, each of
them walks every object of the process. This starts ``--starts`` engine configurations in a pool
of ``--pool`` engines, after filling the heap with ``--objects`` small objects, and reports the
seconds the starts took and how much of it was garbage collection.

    python benchmarks/pool_starts.py [--objects 4000000] [--starts 8] [--pool 3]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import time


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--objects", type=int, default=4_000_000, help="small objects kept alive (half dicts, half lists)")
    ap.add_argument("--starts", type=int, default=8)
    ap.add_argument("--pool", type=int, default=3, help="engines the pool keeps: each start past it closes one")
    a = ap.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")

    from kvfuzz.driver.session import Session
    from kvfuzz.driver.settings import SessionSettings
    from kvfuzz.fuzzer import default_engine
    from kvfuzz.harness import inprocess

    inprocess.share_engines(a.pool)
    session = Session(SessionSettings(kind="inprocess", runs=1))
    session.engine_for(default_engine(lora=True))  # vLLM imported, the first start paid
    heap = [dict(a=i, b=[i]) for i in range(a.objects // 2)]

    collect, spent = gc.collect, [0, 0.0]

    def timed(*args: object, **kw: object) -> int:
        t = time.perf_counter()
        try:
            return collect(*args, **kw)  # type: ignore[arg-type]
        finally:
            spent[0] += 1
            spent[1] += time.perf_counter() - t

    gc.collect = timed  # type: ignore[assignment]
    t0 = time.perf_counter()
    for i in range(a.starts):
        session.engine_for(default_engine(lora=True, kv_cache_bytes=(26 + 2 * i) * 2**20))
    seconds = time.perf_counter() - t0
    gc.collect = collect
    print(json.dumps({"starts": a.starts, "pool": a.pool, "objects": a.objects, "heap_kept": len(heap),
                      "seconds": round(seconds, 2), "per_start_s": round(seconds / a.starts, 3),
                      "gc_calls": spent[0], "gc_seconds": round(spent[1], 2)}))
    inprocess.unshare_engines()


if __name__ == "__main__":
    main()
