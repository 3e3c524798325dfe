"""Building blocks for the request shapes of the vLLM reports, shared by the generator
(fuzzer/generate.py) and the mutation operators (fuzzer/mutate.py).

Random traces reach the easy states; the reported bugs needed specific shapes, which plain
random generation hits only a few times in a hundred traces (measured with the first, plain
random generator):

- ``interrupted_prefill``: a long prompt (chunked: longer than one step's token budget) is
  cancelled while its prefill is under way, then retried — or followed by a request sharing
  almost all of its prompt. The follower's prefix-cache hit lands on blocks the cancelled
  request registered, some of whose KV may never have been written (vllm#37076; the
  cancel/retry path of vllm#39146).
- ``pressure``: holder requests fill most of the KV cache and keep decoding, then a long
  request arrives late; their decode growth overflows the cache, so the scheduler preempts
  and later resumes (recomputes) a request on blocks that were handed out in between (the
  late 8192-token request of vllm#39146).
- ``prefix_cache_reset``: the prefix cache emptied while a request runs, before a request
  that shares its prefix; with ``reset_running_requests`` every running request is preempted
  and recomputed, and the later request's hit lands on blocks recomputed after the reset.

Every function returns new events; absolute times are written in both clocks (steps and
offsets), so traces replay on the in-process engine and on a server alike.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

from kvfuzz.traces import EMBEDDED_MODEL, At, CancelEvent, EngineConfig, GenPrompt, SendEvent, TokenPrompt, Trace
from kvfuzz.traces.trace import Event, ResetPrefixCacheEvent


def at_step(step: int, engine: EngineConfig) -> At:
    """An absolute time in both clocks."""
    step = max(0, int(step))
    return At(step=step, offset_ms=step * engine.ms_per_step)


def fresh_id(trace: Trace | Sequence[Event], base: str) -> str:
    """``base``, or ``base2``, ``base3``... if a request of that id exists."""
    events = trace.events if isinstance(trace, Trace) else trace
    used = {e.request_id for e in events if isinstance(e, (SendEvent, CancelEvent))}  # lifecycle events have none
    if base not in used:
        return base
    n = 2
    while f"{base}{n}" in used:
        n += 1
    return f"{base}{n}"


def in_time_order(events: list[Event], engine: EngineConfig) -> list[Event]:
    """Events sorted by step, stably, so list order (a cancel before a retry in the same step,
    a cancel right after its send) is kept among equals; a cancel relative to its request's
    life (no time of its own) sorts at its send's step."""
    mps = engine.ms_per_step
    send_step = {e.request_id: e.at.step_or(mps) for e in events if isinstance(e, SendEvent)}

    def step(e: Event) -> int:
        # Only a cancel can lack an absolute time (At and the events' validators).
        if isinstance(e, CancelEvent) and e.at.step is None and e.at.offset_ms is None:
            return send_step.get(e.request_id, 0)
        return e.at.step_or(mps)

    return sorted(events, key=step)


def prefill_steps(length: int, engine: EngineConfig) -> int:
    """Engine steps a prompt's prefill takes when it runs alone (chunked prefill)."""
    return max(1, -(-length // engine.max_num_batched_tokens))


# KV bytes per token of the embedded model: 2 layers x (K, V) x 1 KV head x 64 dims x the
# KV dtype's size (the model dtype's: 4 bytes in float32, 2 in 16-bit).
EMBEDDED_KV_VALUES_PER_TOKEN = 2 * 2 * 64


def embedded_bytes_per_token(engine: EngineConfig) -> int:
    return EMBEDDED_KV_VALUES_PER_TOKEN * (4 if engine.dtype in ("float32", "auto") else 2)


def kv_capacity_tokens(engine: EngineConfig) -> int:
    """About how many tokens the KV cache holds (exact for the embedded model: 1 KiB/token in
    float32, half that in 16-bit; other models: assume 1.5 x max_model_len)."""
    if engine.model == EMBEDDED_MODEL and engine.kv_cache_bytes:
        return engine.kv_cache_bytes // embedded_bytes_per_token(engine)
    return int(engine.max_model_len * 1.5)


def interrupted_prefill(engine: EngineConfig, rng: random.Random, events: list[Event], step: int, *,
                        prompt: GenPrompt | None = None, adapter: str | None = None,
                        max_tokens: int | None = None, request_id: str | None = None) -> list[Event]:
    """A chunked prompt cancelled mid-prefill, then retried (same prompt) or followed by a
    request sharing all but its last few tokens. Appends to a copy of ``events``; with
    ``request_id`` the existing send of that id is the one interrupted (its prompt must
    already be chunked), otherwise a new one is added at ``step``."""
    bs, budget = engine.block_size, engine.max_num_batched_tokens
    out = list(events)
    mt = max_tokens if max_tokens is not None else rng.choice((4, 8, 16))
    room = engine.max_model_len - mt - bs  # leave the follower a little room to differ
    if room <= budget:
        return out  # the engine cannot hold a chunked prompt: no shape to build
    if request_id is None:
        length = rng.randint(budget + 1, min(room, 3 * budget))
        if rng.random() < 0.5:
            length = min(room, -(-length // bs) * bs + rng.choice((-1, 0, 1)))
        group = f"ip-{rng.randrange(1 << 30)}"
        prompt = GenPrompt(length=length, prefix_group=group, prefix_len=length, seed=rng.randrange(1 << 30))
        request_id = fresh_id(out, "pre")
        out.append(SendEvent(request_id=request_id, at=at_step(step, engine), prompt=prompt, adapter=adapter,
                             max_tokens=mt, stream=True))
    else:
        assert prompt is not None
    chunks = prefill_steps(prompt.length, engine)
    # Mid-prefill: right after the first chunk (relative: 0 tokens) or at a step inside it.
    if rng.random() < 0.5:
        out.append(CancelEvent(request_id=request_id, at=At(after_tokens=0)))
        cancel_step = step + 1
    else:
        cancel_step = step + rng.randint(1, max(1, chunks - 1))
        out.append(CancelEvent(request_id=request_id, at=at_step(cancel_step, engine)))
    gap = rng.choice((0, 0, 1, 2, 4))
    fid = fresh_id(out, f"{request_id}_retry")
    if rng.random() < 0.7 or prompt.prefix_group is None:
        follower = prompt  # a client retry: the same prompt
    else:
        # A sharer: all of the prefix (on, or one off, a block boundary) and its own tail.
        share = max(1, min(prompt.prefix_len, (prompt.length // bs) * bs + rng.choice((-1, 0, 1))))
        follower = GenPrompt(length=min(engine.max_model_len - mt, share + rng.randint(1, 2 * bs)),
                             prefix_group=prompt.prefix_group, prefix_len=share, seed=prompt.seed + 1)
    out.append(SendEvent(request_id=fid, at=at_step(cancel_step + gap, engine), prompt=follower, adapter=adapter,
                         max_tokens=mt, stream=rng.random() < 0.8))
    return out


def pressure(engine: EngineConfig, rng: random.Random, events: list[Event], step: int) -> list[Event] | None:
    """Holders that fill most of the KV cache and keep decoding, then a late long request.

    vLLM 0.32 admits a request only when its whole prompt fits (scheduler_reserve_full_isl),
    so the prompts leave a few blocks free; the decode growth of everyone running then
    overflows the cache and the scheduler preempts the newest request and resumes it later.
    None when the cache is too small for the shape."""
    bs = engine.block_size
    blocks = kv_capacity_tokens(engine) // bs - 1  # one block is vLLM's null block
    max_tokens = rng.choice((16, 32, 64))
    room = engine.max_model_len - max_tokens
    long_blocks = min(room // bs, int(blocks * rng.choice((0.5, 0.6, 0.66))))
    n_hold = rng.randint(1, 3)
    hold_tokens = rng.choice((64, 96, 128))  # each holder grows by 2-4 blocks while decoding
    slack = rng.randint(1, n_hold + 1)      # blocks left free after the long prompt is admitted
    hold_blocks = blocks - long_blocks - slack
    if long_blocks < 1 or hold_blocks < n_hold:
        return None
    out = list(events)
    for j in range(n_hold):
        nb = hold_blocks // n_hold + (1 if j < hold_blocks % n_hold else 0)
        out.append(SendEvent(request_id=fresh_id(out, f"hold{j}"), at=at_step(step, engine),
                             max_tokens=hold_tokens,
                             prompt=GenPrompt(length=min(engine.max_model_len - hold_tokens, nb * bs - rng.choice((0, 1))),
                                              seed=rng.randrange(1 << 30))))
    # Late: once the holders' prefill is done (about one step per token budget) and they decode.
    late = step + prefill_steps(hold_blocks * bs, engine) + rng.randint(1, 4)
    out.append(SendEvent(request_id=fresh_id(out, "long"), at=at_step(late, engine), max_tokens=max_tokens,
                         prompt=GenPrompt(length=long_blocks * bs - rng.choice((0, 1)), seed=rng.randrange(1 << 30))))
    return out


def shared_prefix_tokens(a: SendEvent, b: SendEvent) -> int:
    """Prompt tokens two sends share at their start, where a prefix-cache hit could serve them:
    0 when adapters or tenants (``cache_salt``) differ, which vLLM keys its blocks by."""
    if a.adapter != b.adapter or a.cache_salt != b.cache_salt:
        return 0
    pa, pb = a.prompt, b.prompt
    if pa == pb:
        return pa.length
    if isinstance(pa, GenPrompt) and isinstance(pb, GenPrompt):
        return min(pa.prefix_len, pb.prefix_len) if pa.prefix_group and pa.prefix_group == pb.prefix_group else 0
    if isinstance(pa, TokenPrompt) and isinstance(pb, TokenPrompt):
        n = 0
        for x, y in zip(pa.token_ids, pb.token_ids):
            if x != y:
                break
            n += 1
        return n
    return 0


def prefix_cache_reset(engine: EngineConfig, rng: random.Random, events: list[Event], *,
                       running: bool) -> list[Event] | None:
    """``events`` with a prefix-cache reset (``reset_running_requests`` = ``running``) while a
    request runs, before a later request that shares at least one block of its prompt: after
    the reset that one can hit only blocks computed after it — the first request's recomputed
    ones (preempted by a reset of running requests), a burst sibling's, or none (a plain reset
    is declined while blocks are held, and empties the cache once they are not). Without such a
    pair, after any send while it probably runs. None without sends."""
    mps = engine.ms_per_step
    sends = sorted((e for e in events if isinstance(e, SendEvent)), key=lambda s: s.at.step_or(mps))
    if not sends:
        return None
    pairs = [(a, b) for k, a in enumerate(sends) for b in sends[k + 1:]
             if min(shared_prefix_tokens(a, b), b.prompt.length - 1) >= engine.block_size]  # a full block
    a, b = rng.choice(pairs) if pairs else (rng.choice(sends), None)
    t0 = a.at.step_or(mps)
    life = prefill_steps(a.prompt.length, engine) + a.max_tokens  # its steps alone
    hi = t0 + max(1, life)
    if b is not None and b.at.step_or(mps) > t0:
        hi = min(hi, b.at.step_or(mps))  # before the later request
    t = rng.randint(t0 + 1, max(t0 + 1, hi))
    reset = ResetPrefixCacheEvent(at=at_step(t, engine), reset_running_requests=running)
    out = list(events)
    # In time order; at the later request's own step, just before it.
    pos = next((k for k, e in enumerate(out) if e is b and t == b.at.step_or(mps)), None)
    if pos is None:
        pos = next((k for k, e in enumerate(out) if _planned_step(e, out, mps) > t), len(out))
    out.insert(pos, reset)
    return in_time_order(out, engine)


def _planned_step(e: Event, events: list[Event], mps: float) -> int:
    if isinstance(e, CancelEvent) and e.at.step is None and e.at.offset_ms is None:
        return next((s.at.step_or(mps) for s in events if isinstance(s, SendEvent) and s.request_id == e.request_id), 0)
    return e.at.step_or(mps)
