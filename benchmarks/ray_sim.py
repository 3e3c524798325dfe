"""Where does the `kvfuzz run --ray` driver saturate? The real driver (fuzzer/distributed.py:
generation, mutation, feedback, in-order commits, campaign.json and pending files written per
trace) and the real Ray executor loop (kvfuzz/scale/cluster.py ``RayExecutor.wait``: ray.wait, drain,
ray.get, re-submit), driving N *simulated* workers whose trace takes S seconds (asyncio.sleep,
+-20 % jitter so results finish out of order) and returns coverage buckets of the size a real
trace gives (~40 of a few thousand).

    python benchmarks/ray_sim.py --workers 256 --hosts 16 --sleep 12 --seconds 120

256 worker *processes* do not fit next to other jobs on a 2-core box (about 50 MiB and 0.6 % of
a core each while idle), so N virtual workers live in ``--hosts`` async actors (N/hosts
concurrent calls each). The driver cannot tell: it holds one handle per virtual worker, submits
one task per worker and waits on one ref per task, exactly as with one actor per engine.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import resource
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--workers", type=int, default=256)
    ap.add_argument("--hosts", type=int, default=16, help="async actors that host the simulated workers")
    ap.add_argument("--sleep", type=float, required=True, help="simulated seconds per trace")
    ap.add_argument("--seconds", type=float, default=120.0, help="campaign budget")
    ap.add_argument("--window", type=int, default=None, help="default 4 x workers, as kvfuzz run")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()

    import ray

    from kvfuzz.scale.cluster import RayExecutor, WorkerSpec, connect
    from kvfuzz.fuzzer import CampaignOptions, GenOptions, default_engine
    from kvfuzz.fuzzer.distributed import Driver, Result, default_window

    connect(None, num_cpus=2, env={"RAY_USAGE_STATS_ENABLED": "0"})
    sleep_s = args.sleep

    @ray.remote(num_cpus=0)
    class SimHost:
        async def ready(self):
            return {"pid": os.getpid(), "host": "sim"}

        async def stop(self):  # the executor's shutdown asks idle workers to close their engines
            return None

        async def run(self, task):
            rng = random.Random(task.trace.trace_id())
            await asyncio.sleep(sleep_s * rng.uniform(0.8, 1.2))
            return Result(task.index, "sim", buckets=sorted({f"b{rng.randrange(3000)}" for _ in range(40)}),
                          seconds=sleep_s)

    class SimExecutor(RayExecutor):
        def start_sim(self, hosts: int) -> None:
            per = -(-self.n // hosts)
            handles = [SimHost.options(max_concurrency=per).remote() for _ in range(hosts)]
            ray.get([h.ready.remote() for h in handles])
            for k in range(self.n):
                self.actors[f"v{k}"] = handles[k % hosts]
                self.ready_workers.add(f"v{k}")

    ex = SimExecutor(WorkerSpec(), args.workers)
    t0 = time.monotonic()
    ex.start_sim(args.hosts)
    start_s = time.monotonic() - t0
    out = Path(tempfile.mkdtemp(prefix="kvfuzz-ray-sim-"))
    opts = CampaignOptions(seed=0, budget_s=args.seconds, max_traces=None, runs=1, out=out,
                           engine=default_engine(lora=True), gen=GenOptions(min_requests=2, max_requests=3,
                                                                            adapters=["a", "b", "c"]))
    ru0 = resource.getrusage(resource.RUSAGE_SELF)
    drv = Driver(opts, ex, window=args.window or default_window(args.workers))
    t1 = time.monotonic()
    state = drv.run()
    wall = time.monotonic() - t1
    ru1 = resource.getrusage(resource.RUSAGE_SELF)
    cpu = (ru1.ru_utime - ru0.ru_utime) + (ru1.ru_stime - ru0.ru_stime)
    ex.shutdown(grace_s=0)
    ray.shutdown()
    ideal = args.workers / sleep_s
    rate = state.traces / wall
    row = {"workers": args.workers, "hosts": args.hosts, "sleep_s": sleep_s, "seconds": round(wall, 1),
           "traces": state.traces, "rate_per_s": round(rate, 2), "ideal_per_s": round(ideal, 2),
           "efficiency": round(rate / ideal, 3), "driver_cpu_share": round(cpu / wall, 3),
           "driver_cpu_ms_per_trace": round(1000 * cpu / max(1, state.traces), 2),
           "commit_cpu_ms_per_trace": round(1000 * drv.commit_cpu_s / max(1, state.traces), 2),
           "campaign_json_kib": round((out / "campaign.json").stat().st_size / 1024, 1),
           "corpus_entries": len(state.corpus), "coverage_buckets": len(state.coverage),
           "actor_start_s": round(start_s, 1), "load_avg": os.getloadavg()[0]}
    print(json.dumps(row))
    if args.json:
        with open(args.json, "a") as f:
            f.write(json.dumps(row) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
