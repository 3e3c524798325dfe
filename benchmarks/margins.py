"""Benchmark: top-1/top-2 logprob margins on clean runs, and how large batch-order numeric
differences are — the evidence behind the oracle's ``near_tie`` default (docs/oracle.md).

The oracle calls a divergence a ``numeric-near-tie`` when the reference's top-1/top-2 margin
at the first divergent token is below ``near_tie``, else ``corruption``. Two numbers decide a
good threshold:

1. the *noise*: how much one request's logprobs move when the same request runs in another
   context (alone, in a big batch, staggered sends, chunked prefill, prefix-cache hits,
   base and LoRA requests mixed). Noise of size d can flip a greedy token only where the
   margin is below about 2 d (the margin is a difference of two logits); the threshold must
   be well above that;
2. the *clean margin distribution*: the share of generated positions whose margin is below
   a threshold is roughly the chance that a real corruption is misfiled as a near tie.

Everything runs on the real engine (in-process, the embedded model by default):

    python benchmarks/margins.py [--requests 48] [--max-tokens 32] [--lora] [--json OUT]
    python benchmarks/margins.py --device cuda --dtype bfloat16 --model /path/to/model   # GPU

Every context is replayed with the fix toggle for the known CPU LoRA bug (docs/findings.md
#1) active, so that bug does not count as noise.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

THRESHOLDS = (0.0, 1e-6, 1e-5, 1e-4, 1e-3, 1e-2, 0.0625, 0.125, 0.25, 0.5)


@dataclass
class Context:
    name: str
    requests: int = 0
    compared_positions: int = 0
    diverged: int = 0
    # margin of the reference at each first divergence
    divergence_margins: list[float] = field(default_factory=list)
    abs_dlogprob: list[float] = field(default_factory=list)
    abs_dmargin: list[float] = field(default_factory=list)
    bit_identical: int = 0
    prefix_hit_requests: int = 0
    # requests whose prefill was split over several steps
    chunked_requests: int = 0


def margins_of(rec) -> list[float]:
    return [p[0][1] - p[1][1] for p in rec.logprobs if len(p) >= 2]


def compare(ctx: Context, ref, got) -> None:
    ctx.requests += 1
    n = min(len(ref.token_ids), len(got.token_ids))
    identical = ref.token_ids[:n] == got.token_ids[:n] and ref.logprobs[:n] == got.logprobs[:n]
    ctx.bit_identical += identical
    for i in range(n):
        if ref.token_ids[i] != got.token_ids[i]:
            ctx.diverged += 1
            ctx.divergence_margins.append(ref.logprobs[i][0][1] - ref.logprobs[i][1][1])
            return
        ctx.compared_positions += 1
        (_rt, rl), (rt2, rl2) = ref.logprobs[i][0], ref.logprobs[i][1]
        (_gt, gl), (gt2, gl2) = got.logprobs[i][0], got.logprobs[i][1]
        ctx.abs_dlogprob.append(abs(rl - gl))
        if rt2 == gt2:
            ctx.abs_dmargin.append(abs((rl - rl2) - (gl - gl2)))


def quantiles(xs: list[float]) -> dict[str, float]:
    if not xs:
        return {}
    s = sorted(xs)

    def q(p: float) -> float:
        return s[min(len(s) - 1, max(0, math.ceil(p * len(s)) - 1))]

    return {"min": s[0], "p0.1": q(0.001), "p1": q(0.01), "p5": q(0.05), "p50": q(0.5), "max": s[-1]}


def build_sends(n: int, max_tokens: int, block: int, adapters: list[str], seed: int):
    from kvfuzz.traces import At, GenPrompt, SendEvent

    rng = random.Random(seed)
    sends = []
    for i in range(n):
        kind = i % 4
        if kind == 0:  # on / next to a block boundary
            length = rng.randint(1, 30) * block + rng.choice((-1, 0, 1))
        elif kind == 1:  # long enough to be prefilled in several chunks when chunking is small
            length = rng.randint(600, 1500)
        else:
            length = rng.randint(8, 500)
        group = None
        prefix = 0
        if rng.random() < 0.5:  # shared prefixes: later requests hit the prefix cache
            group = f"m{rng.randint(0, 2)}"
            prefix = min(length, rng.choice((block, 2 * block, 4 * block, 4 * block + 3)))
        adapter = rng.choice(adapters + [None, None]) if adapters else None
        sends.append(SendEvent(request_id=f"q{i}", at=At(step=0), max_tokens=max_tokens, adapter=adapter,
                               prompt=GenPrompt(length=max(1, length), prefix_group=group, prefix_len=prefix,
                                                seed=rng.randrange(1 << 30))))
    return sends


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=48)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--model", default=None, help="model directory (default: the embedded model)")
    ap.add_argument("--lora", action="store_true", help="mix in requests on the embedded LoRA adapters")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--chunk", type=int, default=128, help="max_num_batched_tokens of the chunked arm")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()

    from kvfuzz.fuzzer import default_engine
    from kvfuzz.harness.inprocess import InProcessEngine
    from kvfuzz.harness.toggles.builtin import LORA_CPU_MASK
    from kvfuzz.traces import At, Trace

    t_start = time.perf_counter()
    base = default_engine(lora=args.lora, kv_cache_bytes=64 * 2**20).model_copy(update={"dtype": args.dtype})
    if args.model:
        base = base.model_copy(update={"model": args.model})
    toggles = [LORA_CPU_MASK] if args.lora and args.device == "cpu" else []
    adapters = sorted(base.lora.adapters) if args.lora else []
    sends = build_sends(args.requests, args.max_tokens, base.block_size, adapters, args.seed)

    contexts: dict[str, Context] = {}
    all_margins: list[float] = []

    def at(send, step):
        return send.model_copy(update={"at": At(step=step)})

    eng = InProcessEngine(base, device=args.device).start()
    try:
        # References: each request alone on a clean cache (what the oracle compares against).
        refs = {s.request_id: eng.run_alone(s) for s in sends}
        for r in refs.values():
            all_margins.extend(margins_of(r))
        # The same alone-run twice: the harness itself must be bit-exact.
        again = Context("alone, repeated")
        for s in sends[:8]:
            compare(again, refs[s.request_id], eng.run_alone(s))
        contexts[again.name] = again

        arms = {
            "batch of all at step 0": [at(s, 0) for s in sends],
            "staggered sends (1 per step)": [at(s, i) for i, s in enumerate(sends)],
            "bursts of 4 every 7 steps": [at(s, 7 * (i // 4)) for i, s in enumerate(sends)],
            "reversed order, staggered": [at(s, i) for i, s in enumerate(reversed(sends))],
        }
        for name, evs in arms.items():
            ctx = Context(name)
            h = eng.replay(Trace(engine=base, events=evs), toggles=toggles)
            for s in sends:
                rec = h.requests[s.request_id]
                compare(ctx, refs[s.request_id], rec)
                ctx.prefix_hit_requests += bool(rec.num_cached_tokens)
            ctx.chunked_requests = len({r for st in h.steps for r in st.partial_prefills})
            contexts[name] = ctx
    finally:
        eng.close()

    # Chunked prefill: a small token budget per step splits long prompts over several steps.
    chunked = base.model_copy(update={"max_num_batched_tokens": args.chunk})
    eng = InProcessEngine(chunked, device=args.device).start()
    try:
        for name, evs in {
            f"chunked prefill ({args.chunk}-token steps), alone": None,
            f"chunked prefill ({args.chunk}-token steps), staggered batch": [at(s, i) for i, s in enumerate(sends)],
        }.items():
            ctx = Context(name)
            if evs is None:
                for s in sends:
                    compare(ctx, refs[s.request_id], eng.run_alone(s))
                ctx.chunked_requests = sum(s.prompt.length > args.chunk for s in sends)
            else:
                h = eng.replay(Trace(engine=chunked, events=evs), toggles=toggles)
                for s in sends:
                    rec = h.requests[s.request_id]
                    compare(ctx, refs[s.request_id], rec)
                    ctx.prefix_hit_requests += bool(rec.num_cached_tokens)
                ctx.chunked_requests = len({r for st in h.steps for r in st.partial_prefills})
            contexts[name] = ctx
    finally:
        eng.close()

    seconds = time.perf_counter() - t_start
    noise = [d for c in contexts.values() for d in c.abs_dmargin]
    dlp = [d for c in contexts.values() for d in c.abs_dlogprob]
    result = {
        "date": time.strftime("%Y-%m-%d"),
        "command": " ".join(["python", "benchmarks/margins.py", *sys.argv[1:]]),
        "device": args.device, "dtype": args.dtype, "model": base.model, "lora": args.lora,
        "requests": len(sends), "max_tokens": args.max_tokens, "seconds": round(seconds, 1),
        "clean_positions": len(all_margins),
        "clean_margin_quantiles": quantiles(all_margins),
        "clean_share_below": {str(t): sum(m < t for m in all_margins) / max(1, len(all_margins))
                              for t in THRESHOLDS},
        "exact_ties": sum(m == 0.0 for m in all_margins),
        "noise_abs_dmargin": quantiles(noise),
        "noise_abs_dlogprob": quantiles(dlp),
        "contexts": {
            c.name: {"requests": c.requests, "bit_identical": c.bit_identical, "diverged": c.diverged,
                     "divergence_margins": c.divergence_margins, "positions": c.compared_positions,
                     "max_abs_dlogprob": max(c.abs_dlogprob, default=0.0),
                     "max_abs_dmargin": max(c.abs_dmargin, default=0.0),
                     "prefix_hit_requests": c.prefix_hit_requests, "chunked_prefills": c.chunked_requests}
            for c in contexts.values()
        },
    }
    print_report(result)
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")


def print_report(r: dict) -> None:
    print(f"# margins — {r['date']}, {r['device']} {r['dtype']}, model {r['model']}, lora={r['lora']}")
    print(f"command: {r['command']}  ({r['seconds']} s)")
    print(f"\nclean margins over {r['clean_positions']} generated positions of {r['requests']} requests "
          f"alone (exact ties: {r['exact_ties']})")
    print("| quantile | margin (nats) |\n| --- | --- |")
    for k, v in r["clean_margin_quantiles"].items():
        print(f"| {k} | {v:.3g} |")
    print("\n| threshold | share of clean positions below |\n| --- | --- |")
    for k, v in r["clean_share_below"].items():
        print(f"| {float(k):g} | {v:.4%} |")
    print("\n| context | requests | bit-identical to alone | diverged | max abs dlogprob | max abs dmargin "
          "| requests with prefix hits | chunked prefills |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for name, c in r["contexts"].items():
        div = f"{c['diverged']}" + (f" (margins {', '.join(f'{m:.3g}' for m in c['divergence_margins'])})"
                                     if c["divergence_margins"] else "")
        print(f"| {name} | {c['requests']} | {c['bit_identical']} | {div} | {c['max_abs_dlogprob']:.3g} "
              f"| {c['max_abs_dmargin']:.3g} | {c['prefix_hit_requests']} | {c['chunked_prefills']} |")
    n = r["noise_abs_dmargin"]
    if n:
        print(f"\nnoise |d margin| over all contexts: p50 {n['p50']:.3g}, max {n['max']:.3g}")
    med = statistics.median([c["max_abs_dmargin"] for c in r["contexts"].values()] or [0])
    print(f"median over contexts of the max |d margin|: {med:.3g}")


if __name__ == "__main__":
    main()
