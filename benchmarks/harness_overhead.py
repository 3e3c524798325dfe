"""Benchmark: engine start time and in-process harness overhead against LLM.generate.

Same requests, same engine configuration: a batch of N requests sent at step 0 replayed by
kvfuzz's step-by-step harness (clean slate, per-step stats, logprobs), versus vLLM's own
``LLM.generate`` of the same prompts with the same sampling parameters. Target: <= 1.15x.

    python benchmarks/harness_overhead.py [--requests 32] [--max-tokens 64] [--repeats 5]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()

    from kvfuzz.fuzzer import default_engine
    from kvfuzz.harness.embedded import resolve_model
    from kvfuzz.harness.inprocess import InProcessEngine
    from kvfuzz.harness.vllm_args import engine_args
    from kvfuzz.traces import At, GenPrompt, SendEvent, Trace, expand

    cfg = default_engine(kv_cache_bytes=64 * 2**20)
    sends = [SendEvent(request_id=f"r{i}", at=At(step=0), max_tokens=args.max_tokens,
                       prompt=GenPrompt(length=64 + 37 * i, seed=i)) for i in range(args.requests)]
    trace = Trace(engine=cfg, events=sends)

    eng = InProcessEngine(cfg)
    t0 = time.perf_counter()
    eng.start()
    start_s = time.perf_counter() - t0
    eng.replay(trace)  # warm-up
    harness = []
    for _ in range(args.repeats):
        t0 = time.perf_counter()
        h = eng.replay(trace)
        harness.append(time.perf_counter() - t0)
    tokens_h = {r: v.token_ids for r, v in h.requests.items()}
    # The post-condition monitor's own share (harness/postconditions.py): the same replays
    # with its checks switched off.
    from kvfuzz.harness.postconditions import Monitor

    checks = Monitor._guarded
    Monitor._guarded = lambda self, fn: None  # type: ignore[method-assign]
    unmonitored = []
    for _ in range(args.repeats):
        t0 = time.perf_counter()
        eng.replay(trace)
        unmonitored.append(time.perf_counter() - t0)
    Monitor._guarded = checks  # type: ignore[method-assign]
    model_path = resolve_model(cfg).model_path
    eng.close()

    from vllm import LLM, SamplingParams

    t0 = time.perf_counter()
    llm = LLM(**engine_args(cfg, model_path))
    llm_start_s = time.perf_counter() - t0
    sp = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, logprobs=2, ignore_eos=True)
    prompts = [{"prompt_token_ids": expand(s.prompt)} for s in sends]
    llm.generate(prompts, sp, use_tqdm=False)  # warm-up
    generate = []
    for _ in range(args.repeats):
        llm.reset_prefix_cache()  # the harness starts each replay with an empty prefix cache too
        t0 = time.perf_counter()
        outs = llm.generate(prompts, sp, use_tqdm=False)
        generate.append(time.perf_counter() - t0)
    same = all(list(o.outputs[0].token_ids) == tokens_h[f"r{i}"] for i, o in enumerate(outs))
    result = {
        "requests": args.requests, "max_tokens": args.max_tokens, "repeats": args.repeats,
        "engine_start_s": round(start_s, 2), "llm_start_s": round(llm_start_s, 2),
        "harness_replay_s_median": round(statistics.median(harness), 3),
        "harness_replay_unmonitored_s_median": round(statistics.median(unmonitored), 3),
        "monitor_ratio": round(statistics.median(harness) / statistics.median(unmonitored), 3),
        "llm_generate_s_median": round(statistics.median(generate), 3),
        "overhead_ratio": round(statistics.median(harness) / statistics.median(generate), 3),
        "same_tokens": same,
    }
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
