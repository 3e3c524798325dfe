"""Seeded random generation of traces (the first cut; mutation operators live in mutate.py).

The mix aims at the mechanisms in the vLLM reports: prompt lengths on and next to block
boundaries, shared prefixes (prefix-cache hits and sharing), bursts of concurrent sends,
cancels at different points of a request's life (and client retries after them), base-model
and adapter requests mixed, and now and then a long request that pushes the KV cache towards
preemption. On top of that, some traces carry one of the reported shapes whole
(fuzzer/shapes.py): a long prefill interrupted and retried, or KV-cache pressure that forces a
preemption. Without them random traces reached those states in a few traces per hundred.

``random-v2`` draws the v1 trace first and only then the additions, so a seed's v1 events are
a prefix of its v2 events.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

from kvfuzz.traces import At, CancelEvent, EngineConfig, GenPrompt, Lineage, LoraSettings, SendEvent, Trace
from kvfuzz.traces.trace import EMBEDDED_HYBRID, EMBEDDED_MODEL

from . import hybrid, shapes

GENERATOR = "random-v2"

EMBEDDED_ADAPTERS = {"a": "embedded:a", "b": "embedded:b", "c": "embedded:c"}


def default_engine(*, lora: bool = False, kv_cache_bytes: int = 24 * 2**20, **overrides: object) -> EngineConfig:
    """The campaign default on the embedded model. 24 MiB of KV (about 24k tokens of this
    model) is enough for one 16k-token request but not for a burst of long ones, so some
    traces reach preemption."""
    cfg = EngineConfig(
        model=EMBEDDED_MODEL,
        kv_cache_bytes=kv_cache_bytes,
        lora=LoraSettings(enabled=True, adapters=dict(EMBEDDED_ADAPTERS), max_loras=2) if lora else LoraSettings(),
    )
    return cfg.model_copy(update=overrides) if overrides else cfg


@dataclass
class GenOptions:
    min_requests: int = 2
    max_requests: int = 10
    max_tokens: tuple[int, int] = (4, 32)
    # Probability that a request is long (1.5k-6k tokens), otherwise 8-700 tokens.
    p_long: float = 0.1
    p_prefix: float = 0.6
    p_cancel: float = 0.25
    p_block_boundary: float = 0.35
    # Steps between consecutive sends are drawn from this list (0 = same step: a burst).
    gaps: tuple[int, ...] = (0, 0, 0, 1, 1, 2, 3, 5, 8, 13)
    adapters: list[str] = field(default_factory=list)
    # A cancelled request is resent (same prompt, id ``<id>_retry``) shortly after its cancel.
    p_retry: float = 0.4
    # The trace also carries an interrupted long prefill and its retry (shapes.interrupted_prefill).
    p_interrupted_prefill: float = 0.2
    # The trace also carries KV-cache pressure that forces a preemption (shapes.pressure).
    p_pressure: float = 0.2
    # Hybrid-model engines only (fuzzer/hybrid.py): a prefix longer than the window evicted and
    # requested again (external KV), and the #44409 recipe (cross_group_return).
    p_hybrid_return: float = 0.3
    p_cross_group: float = 0.25


def _length(rng: random.Random, bs: int, opts: GenOptions) -> int:
    if rng.random() < opts.p_block_boundary:
        k = rng.randint(1, 20)
        return max(1, k * bs + rng.choice((-1, 0, 0, 1)))
    if rng.random() < opts.p_long:
        return rng.randint(1500, 6000)
    return rng.randint(8, 700)


def generate(seed: int, engine: EngineConfig | None = None, opts: GenOptions | None = None) -> Trace:
    """A random trace, fully determined by ``seed`` (and the engine config / options)."""
    rng = random.Random(seed)
    engine = engine or default_engine()
    opts = opts or GenOptions(adapters=sorted(engine.lora.adapters) if engine.lora.enabled else [])
    bs = engine.block_size
    n = rng.randint(opts.min_requests, opts.max_requests)
    groups = [f"g{seed}-{i}" for i in range(rng.randint(1, 3))]
    events: list[SendEvent | CancelEvent] = []
    step = 0
    budget = engine.max_model_len
    for i in range(n):
        step += rng.choice(opts.gaps)
        max_tokens = rng.randint(*opts.max_tokens)
        length = min(_length(rng, bs, opts), budget - max_tokens)
        if rng.random() < opts.p_prefix:
            group = rng.choice(groups)
            # Prefix lengths on block boundaries share whole blocks; off-by-one ones share a
            # partial block, which is where sharing bugs live.
            prefix_len = min(length, rng.choice([bs, 2 * bs, 4 * bs, 8 * bs, 16 * bs, 2 * bs + 1, 4 * bs - 1,
                                                  rng.randint(1, max(1, length))]))
            prompt = GenPrompt(length=length, prefix_group=group, prefix_len=prefix_len, seed=rng.randrange(1 << 30))
        else:
            prompt = GenPrompt(length=length, seed=rng.randrange(1 << 30))
        adapter = None
        if opts.adapters and rng.random() < 0.6:
            adapter = rng.choice(opts.adapters)
        rid = f"r{i}"
        events.append(SendEvent(request_id=rid, at=At(step=step, offset_ms=step * engine.ms_per_step),
                                prompt=prompt, adapter=adapter, max_tokens=max_tokens,
                                stream=rng.random() < 0.8))
        if rng.random() < opts.p_cancel:
            if rng.random() < 0.5:
                at = At(after_tokens=rng.choice([0, 1, 1, 2, max(1, max_tokens // 2)]))
            else:
                s = step + rng.randint(0, 6)
                at = At(step=s, offset_ms=s * engine.ms_per_step)
            events.append(CancelEvent(request_id=rid, at=at))
    events = _additions(rng, engine, opts, events, step)
    return Trace(engine=engine, events=events, lineage=Lineage(generator=GENERATOR, seed=seed),
                 name=f"random-{seed}")


def _additions(rng: random.Random, engine: EngineConfig, opts: GenOptions, events: list, last: int) -> list:
    """Retries after cancels and the reported shapes, drawn after the v1 events."""
    mps = engine.ms_per_step
    sends = {e.request_id: e for e in events if isinstance(e, SendEvent)}
    for c in [e for e in events if isinstance(e, CancelEvent)]:
        if rng.random() >= opts.p_retry:
            continue
        s = sends[c.request_id]
        if c.at.after_tokens is not None:  # relative: about when its prefill plus k tokens end
            when = s.at.step_or(mps) + shapes.prefill_steps(s.prompt.length, engine) + c.at.after_tokens
        else:
            when = c.at.step_or(mps)
        retry = s.model_copy(update={"request_id": shapes.fresh_id(events, f"{s.request_id}_retry"),
                                     "at": shapes.at_step(when + rng.choice((0, 1, 2, 4)), engine)})
        events.append(retry)
    if rng.random() < opts.p_interrupted_prefill:
        adapter = rng.choice(opts.adapters) if opts.adapters and rng.random() < 0.5 else None
        events = shapes.interrupted_prefill(engine, rng, events, rng.randint(0, last + 2), adapter=adapter)
    if rng.random() < opts.p_pressure:
        events = shapes.pressure(engine, rng, events, rng.randint(max(0, last - 4), last + 4)) or events
    if engine.model == EMBEDDED_HYBRID:
        events = hybrid.additions(rng, engine, opts.p_hybrid_return, opts.p_cross_group, events, last)
    return shapes.in_time_order(events, engine)
