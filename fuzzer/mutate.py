"""Named, composable mutation operators.

Each operator takes a trace and a ``random.Random`` and returns a new, valid trace (or None
when it does not apply, e.g. adapter thrash on an engine without LoRA). Every operator aims at
one mechanism from the vLLM reports; docs/fuzzer.md lists them. ``mutate`` stacks one or more
operators and records the lineage (parent trace id, operators applied).

Both clocks: operators reason in engine steps (``At.step_or``) and write every absolute time
as ``At(step=s, offset_ms=s * ms_per_step)``, so a mutant replays on the in-process engine
(steps) and on a server (offsets) alike. A parent given in offsets only is read through the
same conversion, so server traces mutate too.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass

from pydantic import ValidationError

from kvfuzz.traces import (
    EMBEDDED_MODEL,
    At,
    CancelEvent,
    EngineConfig,
    GenPrompt,
    Lineage,
    SendEvent,
    TokenPrompt,
    Trace,
)
from kvfuzz.traces.trace import (
    Event,
    LoadAdapterEvent,
    Prompt,
    ReloadAdapterEvent,
    ResetPrefixCacheEvent,
    UnloadAdapterEvent,
)

from . import configs, lifecycle, shapes
from .lifecycle import overwrites_in_flight
from .requests import with_knobs_of, without_knobs
from .shapes import at_step, embedded_bytes_per_token, fresh_id, kv_capacity_tokens  # noqa: F401  (kv_capacity_tokens: public)

OperatorFn = Callable[[Trace, random.Random], Trace | None]


@dataclass(frozen=True)
class Operator:
    name: str
    fn: OperatorFn
    # The mechanism the operator aims at (also the docs/fuzzer.md text).
    mechanism: str
    # Relative weight when operators are drawn at random.
    weight: float = 1.0
    # Changes the engine configuration (a campaign with a fixed engine skips these: an engine
    # restart costs seconds and invalidates the reference memo).
    changes_engine: bool = False
    # An adapter-lifecycle operator: drawn only by lifecycle campaigns (``kvfuzz run
    # --lifecycle``) or when named, so other campaigns keep their mutant sequence.
    lifecycle: bool = False
    # A prefix-cache reset operator: drawn only for a trace that already carries a reset (or when
    # named), so the mutants of every other trace are drawn as before.
    resets: bool = False


OPERATORS: dict[str, Operator] = {}


def operator(name: str, mechanism: str, *, weight: float = 1.0, changes_engine: bool = False,
             lifecycle: bool = False, resets: bool = False) -> Callable[[OperatorFn], OperatorFn]:
    def deco(fn: OperatorFn) -> OperatorFn:
        OPERATORS[name] = Operator(name, fn, mechanism, weight, changes_engine, lifecycle, resets)
        return fn

    return deco


# -- helpers ----------------------------------------------------------------------------------


def step_of(ev: Event, trace: Trace) -> int | None:
    """The event's engine step, None for a cancel relative to its request's life."""
    if isinstance(ev, CancelEvent) and ev.at.after_tokens is not None and ev.at.step is None:
        return None
    return ev.at.step_or(trace.engine.ms_per_step)


def clocks_consistent(trace: Trace) -> bool:
    """Every absolute time gives both clocks and they agree (step = offset / ms_per_step)."""
    mps = trace.engine.ms_per_step
    for ev in trace.events:
        at = ev.at
        if at.step is None and at.offset_ms is None:
            continue
        if at.step is None or at.offset_ms is None:
            return False
        if not (at.step * mps - 1e-6 <= at.offset_ms < (at.step + 1) * mps - 1e-9):
            return False
    return True


def _send_step(trace: Trace, rid: str) -> int:
    return trace.send(rid).at.step_or(trace.engine.ms_per_step)


def _last_step(trace: Trace) -> int:
    steps = [s for e in trace.events if (s := step_of(e, trace)) is not None]
    return max(steps, default=0)


def _room(engine: EngineConfig, max_tokens: int) -> int:
    """Longest prompt that fits next to ``max_tokens`` new tokens."""
    return engine.max_model_len - max_tokens


def moved(at: At, dsteps: int, engine: EngineConfig) -> At:
    """``at`` moved by ``dsteps`` steps in both clocks (a sub-step offset is kept)."""
    step = at.step_or(engine.ms_per_step) + dsteps
    if step < 0:
        return at_step(0, engine).model_copy(update={"after_tokens": at.after_tokens})
    return At(step=step, offset_ms=at.offset_or(engine.ms_per_step) + dsteps * engine.ms_per_step,
              after_tokens=at.after_tokens)


def both_clocks(at: At, engine: EngineConfig) -> At:
    """Fill in whichever clock an absolute time lacks (a server trace gives offsets only)."""
    if at.step is None and at.offset_ms is None:
        return at
    return at.model_copy(update={"step": at.step_or(engine.ms_per_step), "offset_ms": at.offset_or(engine.ms_per_step)})


def _rebuild(trace: Trace, events: list[Event], *, engine: EngineConfig | None = None, sort: bool = True
             ) -> Trace | None:
    """A validated copy with new events, both clocks filled in, in time order
    (``shapes.in_time_order``)."""
    eng = engine or trace.engine
    events = [(e.fitted() if isinstance(e, SendEvent) else e).model_copy(update={"at": both_clocks(e.at, eng)})
              for e in events]
    if sort:
        events = shapes.in_time_order(events, eng)
    data = trace.model_dump(mode="python", exclude={"events", "engine"})
    try:
        return Trace(engine=eng, events=events, **data)
    except ValidationError:
        return None


def _pick_send(trace: Trace, rng: random.Random, pred: Callable[[SendEvent], bool] | None = None
               ) -> SendEvent | None:
    sends = [s for s in trace.sends if pred is None or pred(s)]
    return rng.choice(sends) if sends else None


def _block_len(rng: random.Random, bs: int, lo_blocks: int = 1, hi_blocks: int = 20) -> int:
    """A length on a block boundary or one token either side of it."""
    return max(1, rng.randint(lo_blocks, hi_blocks) * bs + rng.choice((-1, 0, 1)))


def _with_prompt_len(prompt: GenPrompt | TokenPrompt, length: int) -> GenPrompt | TokenPrompt:
    if isinstance(prompt, TokenPrompt):
        ids = list(prompt.token_ids)
        while len(ids) < length:
            ids = ids + ids
        return TokenPrompt(token_ids=ids[:length])
    return prompt.model_copy(update={"length": length, "prefix_len": min(prompt.prefix_len, length)})


# -- operators --------------------------------------------------------------------------------


@operator("split", "Prefix-cache reuse of a request's own head: the first k tokens (k on or next to a "
                   "block boundary) go first as their own request, the full request follows after Δ steps "
                   "and resumes from the head's cached blocks — a hit on a block that may still be being "
                   "written, just freed, or only partly full (chunked prefill restarting from a cache hit).")
def op_split(trace: Trace, rng: random.Random) -> Trace | None:
    s = _pick_send(trace, rng, lambda s: s.prompt.length >= 2)
    if s is None:
        return None
    bs = trace.engine.block_size
    L = s.prompt.length
    cands = [k for k in (bs - 1, bs, bs + 1, 2 * bs, 4 * bs - 1, 4 * bs, 4 * bs + 1, L // 2) if 0 < k < L]
    k = rng.choice(cands) if cands else L - 1
    head: Prompt
    full: Prompt
    if isinstance(s.prompt, TokenPrompt):
        head = TokenPrompt(token_ids=s.prompt.token_ids[:k])
        full = s.prompt
    elif s.prompt.prefix_group and s.prompt.prefix_len >= k:
        head = GenPrompt(length=k, prefix_group=s.prompt.prefix_group, prefix_len=k, seed=s.prompt.seed)
        full = s.prompt
    else:
        # Give the request its own prefix group so the head's tokens are the full one's first k.
        group = s.prompt.prefix_group or f"split-{s.request_id}-{s.prompt.seed}"
        full = s.prompt.model_copy(update={"prefix_group": group, "prefix_len": max(k, s.prompt.prefix_len)})
        head = GenPrompt(length=k, prefix_group=group, prefix_len=k, seed=s.prompt.seed)
    t0 = _send_step(trace, s.request_id)
    delta = rng.choice((0, 1, 2, 4, 8))
    hid = fresh_id(trace, f"{s.request_id}_head")
    head_ev = SendEvent(request_id=hid, at=at_step(t0, trace.engine), prompt=head, adapter=s.adapter,
                        max_tokens=rng.choice((1, 2, s.max_tokens)), stream=s.stream)
    events: list[Event] = []
    for e in trace.events:
        if isinstance(e, SendEvent) and e.request_id == s.request_id:
            events.append(head_ev)
            events.append(e.model_copy(update={"prompt": full, "at": at_step(t0 + delta, trace.engine)}))
        else:
            events.append(e)
    return _rebuild(trace, events)


@operator("burst", "Many identical prompts at once: same-step prefix reuse (a hit on blocks whose KV is "
                   "not written yet, vLLM PR #38715), block refcounts shared by N requests, large batch "
                   "compositions and the free-queue order when they all finish together.", weight=1.5)
def op_burst(trace: Trace, rng: random.Random) -> Trace | None:
    s = _pick_send(trace, rng)
    if s is None:
        return None
    n = rng.randint(2, min(8, max(2, trace.engine.max_num_seqs)))
    spacing = rng.choice((0, 0, 1, 2))
    t0 = _send_step(trace, s.request_id)
    events: list[Event] = list(trace.events)
    for j in range(1, n + 1):
        cid = fresh_id(events, f"{s.request_id}_b{j}")
        events.append(s.model_copy(update={"request_id": cid, "at": at_step(t0 + j * spacing, trace.engine)}))
    return _rebuild(trace, events)


@operator("cancel_retry", "A client timeout: the request is cancelled and resent (a new request id, "
                          "`<id>_retry`) Δ steps later with the same prompt, so the retry allocates right "
                          "after the cancel freed its blocks — the cancel-path block reuse of the vLLM reports "
                          "(stale block tables, blocks freed while still referenced). Mid-generation, or (2 "
                          "in 5) mid-prefill: the prompt is made longer than one step's token budget and "
                          "cancelled after its first chunk or inside its prefill, and the retry (or a request "
                          "sharing all but its tail) hits blocks the cancelled request registered but may "
                          "never have written (vllm#37076).", weight=1.5)
def op_cancel_retry(trace: Trace, rng: random.Random) -> Trace | None:
    s = _pick_send(trace, rng, lambda s: s.max_tokens >= 2)
    if s is None:
        return None
    eng = trace.engine
    if rng.random() < 0.4 and isinstance(s.prompt, GenPrompt):
        return _interrupted_prefill(trace, s, rng)
    t0 = _send_step(trace, s.request_id)
    # Cancel a few decode steps after the prefill.
    t_cancel = t0 + shapes.prefill_steps(s.prompt.length, eng) + rng.randint(0, max(1, s.max_tokens // 2))
    delta = rng.choice((0, 0, 1, 2, 4))
    events: list[Event] = [e for e in trace.events if not (isinstance(e, CancelEvent) and e.request_id == s.request_id)]
    rid = fresh_id(events, f"{s.request_id}_retry")
    events.append(CancelEvent(request_id=s.request_id, at=at_step(t_cancel, eng)))
    events.append(s.model_copy(update={"request_id": rid, "at": at_step(t_cancel + delta, eng)}))
    return _rebuild(trace, events)


def _interrupted_prefill(trace: Trace, s: SendEvent, rng: random.Random) -> Trace | None:
    eng = trace.engine
    budget = eng.max_num_batched_tokens
    room = _room(eng, s.max_tokens) - eng.block_size
    if room <= budget:
        return None
    assert isinstance(s.prompt, GenPrompt)
    length = s.prompt.length if s.prompt.length > budget else min(room, budget + rng.randint(1, budget))
    length = min(length, room)
    group = s.prompt.prefix_group or f"ip-{s.request_id}-{s.prompt.seed}"
    prompt = s.prompt.model_copy(update={"length": length, "prefix_group": group, "prefix_len": length})
    events: list[Event] = [e.model_copy(update={"prompt": prompt}) if e is s else e for e in trace.events
                           if not (isinstance(e, CancelEvent) and e.request_id == s.request_id)]
    events = shapes.interrupted_prefill(eng, rng, events, _send_step(trace, s.request_id), prompt=prompt,
                                        adapter=s.adapter, max_tokens=s.max_tokens, request_id=s.request_id)
    return _rebuild(trace, events)


@operator("adapter_thrash", "Adapters alternating every Δ steps over one shared prefix with base-model "
                            "requests interleaved: the LoRA block-hash namespace (a request on adapter B "
                            "must not hit adapter A's blocks, vllm#38606), adapter slot swaps when more "
                            "adapters are used than max_loras, and base tokens batched with LoRA tokens "
                            "(the CPU no-LoRA index bug, vLLM PR #48421).", weight=1.2)
def op_adapter_thrash(trace: Trace, rng: random.Random) -> Trace | None:
    eng = trace.engine
    adapters = sorted(eng.lora.adapters) if eng.lora.enabled else []
    if len(adapters) < 2:
        return None
    bs = eng.block_size
    prefix_len = rng.choice((bs * 18 + rng.choice((-1, 0, 1)), 600, bs * 4, bs * 8 + 1))
    tail = rng.randint(1, 64)
    group = f"thrash-{rng.randrange(1 << 20)}"
    n = rng.randint(4, 10)
    delta = rng.choice((0, 1, 1, 2, 3))
    start = rng.randint(0, _last_step(trace))
    use = adapters if rng.random() < 0.5 else rng.sample(adapters, 2)
    p_base = rng.choice((0.0, 0.25, 0.34))
    events: list[Event] = list(trace.events)
    k = 0
    for j in range(n):
        adapter = None if rng.random() < p_base else use[k % len(use)]
        if adapter is not None:
            k += 1
        rid = fresh_id(events, f"t{j}")
        events.append(SendEvent(request_id=rid, at=at_step(start + j * delta, eng), adapter=adapter,
                                max_tokens=rng.randint(2, 16),
                                prompt=GenPrompt(length=prefix_len + tail, prefix_group=group, prefix_len=prefix_len,
                                                 seed=rng.randrange(1 << 30))))
    return _rebuild(trace, events)


@operator("block_boundary", "Shared prefixes and prompt ends exactly on, one before or one after a block "
                            "boundary (prefix_len ≡ 0, ±1 mod block_size): full-block hashing, the partial "
                            "last block, and off-by-one errors in block counts and block-table tails.",
          weight=1.2)
def op_block_boundary(trace: Trace, rng: random.Random) -> Trace | None:
    s = _pick_send(trace, rng, lambda s: isinstance(s.prompt, GenPrompt))
    if s is None:
        return None
    bs = trace.engine.block_size
    room = _room(trace.engine, s.max_tokens)
    prefix = min(_block_len(rng, bs, 1, 16), room - 1)
    length = min(room, max(prefix + 1, prefix + rng.choice((0, 1, bs - 1, bs, bs + 1, 2 * bs))))
    if prefix < 1:
        return None
    assert isinstance(s.prompt, GenPrompt)
    group = s.prompt.prefix_group or f"bb-{s.request_id}-{s.prompt.seed}"
    prompt = s.prompt.model_copy(update={"length": length, "prefix_group": group, "prefix_len": prefix})
    events: list[Event] = [e.model_copy(update={"prompt": prompt}) if e is s else e for e in trace.events]
    sharers = [e for e in events if isinstance(e, SendEvent) and e.request_id != s.request_id
               and isinstance(e.prompt, GenPrompt) and e.prompt.prefix_group == group]
    if not sharers:
        # A prefix nobody shares tests nothing: add a sibling over the same prefix after Δ.
        t = _send_step(trace, s.request_id) + rng.choice((0, 1, 4, 16))
        sib_len = min(room, prefix + rng.choice((0, 1, bs - 1, bs, bs + 1)))
        events.append(SendEvent(request_id=fresh_id(events, f"{s.request_id}_sib"), at=at_step(t, trace.engine),
                                adapter=s.adapter, max_tokens=s.max_tokens,
                                prompt=GenPrompt(length=max(prefix, sib_len), prefix_group=group, prefix_len=prefix,
                                                 seed=s.prompt.seed + 1)))
    else:
        # Re-align the sharers' prefix length too (it cannot exceed their own length).
        for i, e in enumerate(events):
            if e in sharers:
                L = max(e.prompt.length, min(prefix, _room(trace.engine, e.max_tokens)))
                events[i] = e.model_copy(update={"prompt": e.prompt.model_copy(
                    update={"length": L, "prefix_len": min(prefix, L)})})
    return _rebuild(trace, events)


@operator("long_pressure", "KV-cache pressure: holder requests fill most of the cache and keep decoding, "
                           "then a request near max_model_len arrives late. vLLM 0.32 admits a request only "
                           "when its whole prompt fits (scheduler_reserve_full_isl), so the operator sizes the "
                           "prompts to leave a few blocks free; the decode growth of everyone running then "
                           "overflows the cache and the scheduler preempts and later resumes (recomputes) a "
                           "request — preemption resuming on reallocated blocks.", weight=0.8)
def op_long_pressure(trace: Trace, rng: random.Random) -> Trace | None:
    last = _last_step(trace)
    events = shapes.pressure(trace.engine, rng, list(trace.events), rng.randint(max(0, last - 4), last + 4))
    return None if events is None else _rebuild(trace, events)


def min_kv_bytes(engine: EngineConfig) -> int:
    """The smallest KV cache vLLM accepts: one request of max_model_len tokens must fit (the
    embedded model's bytes per token, shapes.embedded_bytes_per_token)."""
    blocks = -(-engine.max_model_len // engine.block_size) + 1
    return blocks * engine.block_size * embedded_bytes_per_token(engine)


@operator("small_kv", "The same trace on a KV cache barely larger than one max-length request: "
                      "preemption and eviction under ordinary load (changes the engine, so the campaign "
                      "uses it only when engine changes are allowed).", weight=0.5, changes_engine=True)
def op_small_kv(trace: Trace, rng: random.Random) -> Trace | None:
    if trace.engine.model != EMBEDDED_MODEL:
        return None  # bytes per token is known only for the embedded model
    floor = min_kv_bytes(trace.engine)
    size = floor + rng.choice((0, 1, 2, 4)) * 2**20
    if trace.engine.kv_cache_bytes is not None and size >= trace.engine.kv_cache_bytes:
        return None
    return _rebuild(trace, list(trace.events), engine=trace.engine.model_copy(update={"kv_cache_bytes": size}),
                    sort=False)


@operator("engine_knob", "One scheduler or KV-cache knob of the engine moved, or moved back (prefix caching or "
                         "chunked prefill off, block size, max sequences, token budget, long-prefill cap: "
                         "fuzzer/configs.py): the same schedule down another path. The regions are few, so the "
                         "campaign's engine pool keeps an engine for each (an engine change: drawn only "
                         "when engine changes are allowed).", weight=0.6, changes_engine=True)
def op_engine_knob(trace: Trace, rng: random.Random) -> Trace | None:
    if trace.engine.model != EMBEDDED_MODEL or trace.engine.kv_connector is not None:
        return None
    engine = configs.mutate_knob(trace.engine, rng)
    if engine is None:
        return None
    if engine.long_prefill_token_threshold is not None and trace.schema_version < 5:
        trace = trace.model_copy(update={"schema_version": 5})
    return _rebuild(trace, list(trace.events), engine=engine, sort=False)


@operator("cancel_timing", "A cancel placed relative to the request's life: 0 tokens (mid-prefill; the "
                           "prompt is made longer than one step's token budget so the prefill is chunked), "
                           "after the first token, or after N tokens — each frees blocks in a different "
                           "state (partly written, just-cached, decoding).", weight=1.2)
def op_cancel_timing(trace: Trace, rng: random.Random) -> Trace | None:
    s = _pick_send(trace, rng)
    if s is None:
        return None
    eng = trace.engine
    k = rng.choice((0, 0, 1, 1, 2, max(1, s.max_tokens // 2), max(1, s.max_tokens - 1)))
    prompt = s.prompt
    if k == 0 and prompt.length <= eng.max_num_batched_tokens and rng.random() < 0.6:
        want = min(_room(eng, s.max_tokens), eng.max_num_batched_tokens + rng.randint(1, eng.max_num_batched_tokens))
        if want > prompt.length:
            prompt = _with_prompt_len(prompt, want)
    events: list[Event] = []
    for e in trace.events:
        if isinstance(e, CancelEvent) and e.request_id == s.request_id:
            continue
        events.append(e.model_copy(update={"prompt": prompt}) if e is s else e)
    events.append(CancelEvent(request_id=s.request_id, at=At(after_tokens=k)))
    return _rebuild(trace, events)


@operator("shift", "Moves one event, or every event from a point on, by ±Δ steps: changes which requests "
                   "share a step, a batch, or a prefill chunk — the interleavings behind same-step races.",
          weight=1.5)
def op_shift(trace: Trace, rng: random.Random) -> Trace | None:
    eng = trace.engine
    timed = [(i, s) for i, e in enumerate(trace.events) if (s := step_of(e, trace)) is not None]
    if not timed:
        return None
    i0, s0 = rng.choice(timed)
    delta = rng.choice((-8, -3, -2, -1, 1, 2, 3, 8, 32))
    if s0 + delta < 0:
        delta = -delta  # a move clamped at step 0 would change nothing
    suffix = rng.random() < 0.4
    events: list[Event] = []
    for i, e in enumerate(trace.events):
        s = step_of(e, trace)
        move = s is not None and (i == i0 or (suffix and s >= s0))
        events.append(e.model_copy(update={"at": moved(e.at, delta, eng)}) if move else e)
    return _rebuild(trace, events)


@operator("max_tokens", "Changes how long a request decodes (1 token, a few, or many): when it frees its "
                        "blocks relative to the others, and how many blocks decode appends.")
def op_max_tokens(trace: Trace, rng: random.Random) -> Trace | None:
    s = _pick_send(trace, rng)
    if s is None:
        return None
    n = rng.choice((1, 2, 3, 8, 31, 32, 33, 64, max(1, s.max_tokens * 2), max(1, s.max_tokens // 2)))
    n = min(n, trace.engine.max_model_len - s.prompt.length)
    if n < 1 or n == s.max_tokens:
        return None
    return _rebuild(trace, [e.model_copy(update={"max_tokens": n}) if e is s else e for e in trace.events])


@operator("drop", "Removes one event (a send takes its cancels with it): the structural step of "
                  "minimization, and traces where a cancel no longer lands.", weight=0.7)
def op_drop(trace: Trace, rng: random.Random) -> Trace | None:
    if len(trace.events) <= 1:
        return None
    victim = rng.choice(trace.events)
    if isinstance(victim, SendEvent):
        if len(trace.sends) <= 1:
            return None
        events = [e for e in trace.events if not (isinstance(e, (SendEvent, CancelEvent))
                                                   and e.request_id == victim.request_id)]
    else:
        events = [e for e in trace.events if e is not victim]
    return _rebuild(trace, events)


# -- prefix-cache resets (drawn only for a trace that carries one, or when named) --------------


def _v5(trace: Trace) -> Trace:
    """The trace at schema 5 (reset-prefix-cache events need it); validated on rebuild."""
    return trace if trace.schema_version >= 5 else trace.model_copy(update={"schema_version": 5})


@operator("reset_cache", "Empties the prefix cache while a request runs, before a later request sharing its "
                         "prompt prefix (shapes.prefix_cache_reset), or moves such a reset to another pair, flips "
                         "its reset_running_requests, or removes it: with it every running request is preempted "
                         "and recomputed, and the later request's prefix-cache hit lands on blocks recomputed after "
                         "the reset; without it vLLM declines while blocks are held.", resets=True)
def op_reset_cache(trace: Trace, rng: random.Random) -> Trace | None:
    eng = trace.engine
    resets = trace.resets
    r = rng.random()
    if resets and r < 0.6:
        e = rng.choice(resets)
        if r < 0.25:
            return _rebuild(trace, [x.model_copy(update={"reset_running_requests": not e.reset_running_requests})
                                    if x is e else x for x in trace.events], sort=False)
        rest = [x for x in trace.events if x is not e]
        if r < 0.4:
            return _rebuild(trace, rest, sort=False)
        out = shapes.prefix_cache_reset(eng, rng, rest, running=e.reset_running_requests)  # moved
    else:
        out = shapes.prefix_cache_reset(eng, rng, list(trace.events), running=rng.random() < 0.5)
    return None if out is None else _rebuild(_v5(trace), out)


# -- adapter lifecycle (lifecycle campaigns: drawn only with lifecycle=True or when named) ------


def _v2(trace: Trace) -> Trace:
    """The trace at schema 2 (lifecycle events and cache_salt need it); validated on rebuild."""
    return trace if trace.schema_version >= 2 else trace.model_copy(update={"schema_version": 2})


def _rebuild_lc(trace: Trace, events: list, **kw: object) -> Trace | None:
    """``_rebuild`` for the lifecycle operators: also None when a load would overwrite the files
    of a request still in flight (``lifecycle.overwrites_in_flight``)."""
    out = _rebuild(trace, events, **kw)  # type: ignore[arg-type]
    return None if out is None or lifecycle.overwrites_in_flight(out) else out


def _embedded_lora(trace: Trace) -> bool:
    """LoRA on the embedded model: the only one whose adapters the embedded weight variants fit."""
    return trace.engine.lora.enabled and trace.engine.model == EMBEDDED_MODEL


@operator("rebind", "Rebinds an adapter name between two of its requests that share a prompt prefix: a "
                    "reload from a new path, a reload in place (same_path: the files overwritten, reloaded "
                    "from the same directory) or an unload followed by a load with new weights — after the "
                    "first request has probably finished (sometimes racing it). The second request must not "
                    "be served KV cached under the previous weights (vllm#42125, #30931); if no later request "
                    "shares the prefix, a repeat of the first one's prompt follows the rebinding.",
          weight=1.5, lifecycle=True)
def op_rebind(trace: Trace, rng: random.Random) -> Trace | None:
    if not _embedded_lora(trace):
        return None
    trace = _v2(trace)
    eng = trace.engine
    order = trace.planned_order()
    rank = {i: k for k, i in enumerate(order)}
    ev = trace.events
    sends = {i: e for i, e in enumerate(ev) if isinstance(e, SendEvent)}
    firsts = [i for i in order if i in sends and sends[i].adapter is not None]
    if not firsts:
        return None
    pairs = [(i, j) for i in firsts for j in order
             if rank[j] > rank[i] and j in sends and lifecycle.shares_prefix(sends[i], sends[j])]
    i1, i2 = rng.choice(pairs) if pairs and rng.random() < 0.8 else (rng.choice(firsts), None)
    s1 = sends[i1]
    assert s1.adapter is not None
    name = s1.adapter
    t1 = step_of(s1, trace) or 0
    before = [e for e in trace.sends if e.adapter == name and rank[ev.index(e)] <= rank[i1]]
    free = max(t1, lifecycle.name_free_at(before, eng, name))
    t2 = step_of(ev[i2], trace) if i2 is not None else None
    race = rng.random() < 0.15
    if t2 is None:
        t = rng.randint(t1, free) if race else free + rng.choice((0, 0, 1, 2))
    elif race or free > t2:
        t = rng.randint(t1, t2)
    else:
        t = rng.randint(free, t2)
    assert t is not None
    cur = lifecycle.bound_at(trace, t).get(name)
    if cur is None:
        return None
    kind = rng.choices(("in-place", "new-path", "unload+load"), weights=(0.4, 0.35, 0.25))[0]
    if kind == "unload+load" and t < free:
        kind = "new-path"  # a load must not overwrite files a request of the old binding may re-read
    source = lifecycle.other_source(cur, rng) if rng.random() < 0.85 else cur
    if kind == "unload+load":
        life = [UnloadAdapterEvent(name=name, at=at_step(t, eng)),
                LoadAdapterEvent(name=name, source=source, at=at_step(t, eng))]
    else:
        life = [ReloadAdapterEvent(name=name, source=source, same_path=kind == "in-place", at=at_step(t, eng))]
    salt = s1.cache_salt if rng.random() < 0.85 else None
    if i2 is None:
        follower = SendEvent(request_id=fresh_id(trace, f"{s1.request_id}_rb"), prompt=s1.prompt, adapter=name,
                             at=at_step(t + rng.choice((0, 0, 1, 2)), eng), max_tokens=s1.max_tokens,
                             stream=s1.stream, cache_salt=salt)
        events = [*ev, *life, follower]
    else:
        s2 = sends[i2].model_copy(update={"adapter": name, "cache_salt": salt})
        events = [*ev[:i2], *life, s2, *ev[i2 + 1:]]
    return _rebuild_lc(trace, events)


@operator("lifecycle_shift", "Moves one adapter load / unload / reload earlier or later (by ±1..16 steps, or "
                             "to just after its name's requests have probably finished): which requests it "
                             "races, which are admitted under the old or the new weights, and which adapters "
                             "hold the slots and the CPU cache when it lands.", lifecycle=True)
def op_lifecycle_shift(trace: Trace, rng: random.Random) -> Trace | None:
    eng = trace.engine
    life = [(i, e) for i, e in enumerate(trace.events) if lifecycle.is_lifecycle(e)]
    if not life:
        return None
    i, e = rng.choice(life)
    s0 = step_of(e, trace) or 0
    deltas = [d for d in rng.sample((-16, -8, -4, -2, -1, 1, 2, 4, 8, 16), 10) if s0 + d >= 0]
    if rng.random() < 0.3:
        sends = [s for s in trace.sends if s.adapter == e.name and (step_of(s, trace) or 0) <= s0]
        free = lifecycle.name_free_at(sends, eng, e.name)
        if free >= 0 and free != s0:
            deltas.insert(0, free - s0)
    for d in deltas[:4]:
        events = list(trace.events)
        events[i] = e.model_copy(update={"at": moved(e.at, d, eng)})
        out = _rebuild_lc(trace, events)
        if out is not None:
            return out
    return None


@operator("flip_same_path", "Turns a reload from a new path into an in-place one (the files at the name's "
                            "path overwritten, reloaded from that same path: vLLM's prefix-cache key (name, "
                            "path) stays the same, vllm#42125) or back.", weight=0.6, lifecycle=True)
def op_flip_same_path(trace: Trace, rng: random.Random) -> Trace | None:
    idx = [i for i, e in enumerate(trace.events) if isinstance(e, ReloadAdapterEvent)]
    if not idx:
        return None
    i = rng.choice(idx)
    e = trace.events[i]
    assert isinstance(e, ReloadAdapterEvent)
    events = list(trace.events)
    events[i] = e.model_copy(update={"same_path": not e.same_path})
    return _rebuild_lc(trace, events)


@operator("swap_variant", "Binds a load, a reload or an initial adapter to other weights: another variant "
                          "of the same embedded adapter (embedded:a -> embedded:a@v3) or another adapter's "
                          "weights — so a rebinding changes what the name computes, or two names share weights.",
          weight=0.8, lifecycle=True)
def op_swap_variant(trace: Trace, rng: random.Random) -> Trace | None:
    if not _embedded_lora(trace):
        return None
    eng = trace.engine
    targets: list[int | str] = [i for i, e in enumerate(trace.events)
                                if isinstance(e, (LoadAdapterEvent, ReloadAdapterEvent))]
    targets += sorted(eng.lora.adapters)
    if not targets:
        return None
    t = rng.choice(targets)
    if isinstance(t, str):
        adapters = {**eng.lora.adapters, t: lifecycle.other_source(eng.lora.adapters[t], rng)}
        engine = eng.model_copy(update={"lora": eng.lora.model_copy(update={"adapters": adapters})})
        return _rebuild_lc(trace, list(trace.events), engine=engine, sort=False)
    e = trace.events[t]
    assert isinstance(e, (LoadAdapterEvent, ReloadAdapterEvent))
    events = list(trace.events)
    events[t] = e.model_copy(update={"source": lifecycle.other_source(e.source, rng)})
    return _rebuild_lc(trace, events)


@operator("cache_salt", "Adds, changes or removes a request's cache_salt (tenants), or repeats a request's "
                        "prompt under another tenant: requests of different salts must never share "
                        "prefix-cache blocks, and a salt must not change a lone request's output.",
          weight=0.8, lifecycle=True)
def op_cache_salt(trace: Trace, rng: random.Random) -> Trace | None:
    s = _pick_send(trace, rng)
    if s is None:
        return None
    trace = _v2(trace)
    others = [t for t in (None, *lifecycle.TENANTS) if t != s.cache_salt]
    if rng.random() < 0.35:
        t = (step_of(s, trace) or 0) + rng.choice((0, 1, 2, 8))
        clone = s.model_copy(update={"request_id": fresh_id(trace, f"{s.request_id}_salt"),
                                     "cache_salt": rng.choice(others), "at": at_step(t, trace.engine)})
        out = _rebuild_lc(trace, [*trace.events, clone])
        if out is not None:
            return out  # else its adapter is no longer bound then: change the salt instead
    events = [e.model_copy(update={"cache_salt": rng.choice(others)}) if e is s else e for e in trace.events]
    return _rebuild_lc(trace, events)


@operator("retarget", "Moves a request to another adapter name bound at its admission, or to the base "
                      "model: which names share a batch and the slots (max_loras), base-model tokens batched "
                      "beside LoRA ones (the CPU no-LoRA index bug, vLLM PR #48421), and which requests a "
                      "rebinding concerns.", weight=0.8, lifecycle=True)
def op_retarget(trace: Trace, rng: random.Random) -> Trace | None:
    if not trace.engine.lora.enabled:
        return None

    def targets(s: SendEvent) -> list[str | None]:
        step = step_of(s, trace) or 0
        # Bound at the send's step both before and after that step's lifecycle events.
        names = set(lifecycle.bound_at(trace, step)) & set(lifecycle.bound_at(trace, step, inclusive=False))
        return [n for n in sorted(names) if n != s.adapter]

    s = _pick_send(trace, rng, lambda s: s.adapter is not None or bool(targets(s)))
    if s is None:
        return None
    choices = targets(s)
    target = None if s.adapter is not None and (not choices or rng.random() < 0.25) else rng.choice(choices)
    return _rebuild_lc(trace, [e.model_copy(update={"adapter": target}) if e is s else e for e in trace.events])


# -- composition ------------------------------------------------------------------------------


def apply(trace: Trace, names: list[str], rng: random.Random) -> Trace | None:
    """Apply the named operators in order (None if one does not apply); no lineage update."""
    t: Trace | None = trace
    for name in names:
        if t is None:
            return None
        t = OPERATORS[name].fn(t, rng)
    return t


def choose_operators(rng: random.Random, *, allow_engine_changes: bool = False,
                     allowed: list[str] | None = None, lifecycle: bool = False, resets: bool = False) -> list[str]:
    """1–3 operators drawn by weight (stacked mutations, like AFL's havoc stage). Lifecycle
    operators only with ``lifecycle``, prefix-cache reset operators only with ``resets`` (the
    parent carries a reset), either when named in ``allowed``."""
    ops = [o for o in OPERATORS.values()
           if (allowed is None or o.name in allowed) and (allow_engine_changes or not o.changes_engine)
           and (lifecycle or allowed is not None or not o.lifecycle)
           and (resets or allowed is not None or not o.resets)]
    if not ops:
        raise ValueError("no mutation operator is allowed")
    n = rng.choice((1, 1, 1, 2, 2, 3))
    return [rng.choices(ops, weights=[o.weight for o in ops])[0].name for _ in range(n)]


MAX_EVENTS = 64


def mutate(trace: Trace, rng: random.Random, *, allow_engine_changes: bool = False,
           allowed: list[str] | None = None, tries: int = 8, lifecycle: bool = False) -> Trace:
    """A mutant of ``trace`` with its lineage: ``parent`` is the parent's trace id and
    ``operators`` the operators applied to it. Falls back to ``shift`` if nothing applies.
    ``lifecycle``: the adapter-lifecycle operators are drawn too; the prefix-cache reset
    operators are when ``trace`` carries a reset."""
    for _ in range(tries):
        names = choose_operators(rng, allow_engine_changes=allow_engine_changes, allowed=allowed,
                                 lifecycle=lifecycle, resets=bool(trace.resets))
        child = apply(trace, names, rng)
        if (child is not None and len(child.events) <= MAX_EVENTS and child.trace_id() != trace.trace_id()
                and not overwrites_in_flight(child)):  # e.g. `shift` moved a load (fuzzer/lifecycle.py)
            return with_lineage(child, trace, names)
    child = apply(trace, ["shift"], rng) or trace
    return with_lineage(child, trace, ["shift"])


def graft(base: Trace, donor: Trace, rng: random.Random, *, max_sends: int = 8) -> Trace:
    """``base`` with a window of ``donor`` grafted in (AFL++'s splice, at the schedule level).

    The window is up to ``max_sends`` of the donor's sends that are consecutive in time, with
    their cancels; its request ids get an ``x.`` prefix (unique in the result) and it is moved
    to start at a random step within ``base``'s span. Prefix groups keep their names, so a
    grafted request may share a prefix with the base's. The bounded window keeps the traces of
    a graft-of-a-graft lineage from growing without end. The lineage is the donor's plus
    ``graft``; ``generator``/``seed`` name the base (see ``mutate_into``). The engine settings
    drawn per trace (``requests.with_knobs_of``) follow the donor's sends: priorities take the
    result to priority scheduling, embeddings to an engine that takes them."""
    eng = with_knobs_of(base.engine, donor.engine)
    sends = sorted(donor.sends, key=lambda s: s.at.step_or(donor.engine.ms_per_step))
    w = min(len(sends), rng.randint(2, max(2, max_sends)))
    start = rng.randint(0, len(sends) - w)
    window_sends = sends[start:start + w]
    window: list[SendEvent | CancelEvent | ResetPrefixCacheEvent]
    while window_sends:
        chosen = {s.request_id for s in window_sends}
        window = [e for e in donor.events if isinstance(e, (SendEvent, CancelEvent)) and e.request_id in chosen]
        if len(base.events) + len(window) <= MAX_EVENTS:
            break
        window_sends = window_sends[:-1]
    else:
        window = []
    if window_sends and window:
        # The donor's prefix-cache resets within the window's span come along (no draw: the
        # grafts of donors without one are what they were).
        mps = donor.engine.ms_per_step
        span = [s.at.step_or(mps) for s in window_sends]
        resets = [e for e in donor.resets if min(span) <= e.at.step_or(mps) <= max(span)]
        if resets and len(base.events) + len(window) + len(resets) <= MAX_EVENTS:
            window += resets
            base = _v5(base)
    first = min((s for e in window if (s := step_of(e, donor)) is not None), default=0)
    shift = rng.randint(0, _last_step(base) + 2) - first
    events: list[Event] = list(base.events)
    renamed: dict[str, str] = {}
    for e in window:
        at = e.at if step_of(e, donor) is None else moved(e.at, shift, eng)
        if isinstance(e, ResetPrefixCacheEvent):
            events.append(e.model_copy(update={"at": at}))
            continue
        if e.request_id not in renamed:
            renamed[e.request_id] = fresh_id(events, f"x.{e.request_id}")
        events.append(e.model_copy(update={"request_id": renamed[e.request_id], "at": at}))
    child = _rebuild(base, events, engine=eng)
    if child is None and eng.speculative is not None:
        # A send with a logit bias on either side: no speculative decoding (vLLM refuses the pair).
        child = _rebuild(base, events, engine=eng.model_copy(update={"speculative": None}))
    child = child or base
    lin = Lineage(parent=donor.lineage.parent, operators=[*donor.lineage.operators, "graft"],
                  generator=base.lineage.generator, seed=base.lineage.seed)
    return child.model_copy(update={"lineage": lin, "name": f"graft-{child.trace_id()}"})


def mutate_into(base: Trace, parent: Trace, rng: random.Random, *, allow_engine_changes: bool = False,
                allowed: list[str] | None = None, lifecycle: bool = False) -> Trace:
    """A mutant of ``parent`` (a corpus entry) grafted into ``base`` (a fresh trace): the
    feedback campaign's default mutant. Why not the plain mutant: a fresh ``random-v2`` trace
    already carries the reported shapes, and a mutant that *replaces* it with a corpus entry
    was the worse draw for three of four faults measured; grafting the corpus entry's mutated
    part *into* the fresh trace keeps the generator's diversity and adds the structure the
    campaign learned. Lineage: ``parent`` is the corpus entry,
    ``operators`` the operators applied to it and then ``graft``, ``generator``/``seed`` the
    fresh trace it was grafted into."""
    donor = mutate(parent, rng, allow_engine_changes=allow_engine_changes, allowed=allowed, lifecycle=lifecycle)
    if without_knobs(donor.engine) != without_knobs(base.engine):
        return donor  # an engine-changing operator: the donor's engine cannot host the base
    return graft(base, donor, rng)


def with_lineage(child: Trace, parent: Trace, names: list[str]) -> Trace:
    lin = Lineage(parent=parent.trace_id(), operators=names, generator=parent.lineage.generator,
                  seed=parent.lineage.seed)
    return child.model_copy(update={"lineage": lin, "name": f"mutant-{child.trace_id()}"})
