"""Seeded random generation of traces (the first cut; mutation operators live in mutate.py).

The mix aims at the mechanisms in the vLLM reports: prompt lengths on and next to block
boundaries, shared prefixes (prefix-cache hits and sharing), bursts of concurrent sends,
cancels at different points of a request's life (and client retries after them), base-model
and adapter requests mixed, and now and then a long request that pushes the KV cache towards
preemption. On top of that, some traces carry one of the reported shapes whole
(fuzzer/shapes.py): a long prefill interrupted and retried, or KV-cache pressure that forces a
preemption. Without them random traces reached those states in a few traces per hundred.

``random-v2`` draws the v1 trace first and only then the additions, so a seed's v1 events are
a prefix of its v2 events. ``random-v3`` is v2's schedule with per-request state on a share of
its sends (fuzzer/requests.py, its own random stream): the same sends at the same steps;
``random-v4`` draws bad words among that state too; ``random-v5`` also runs a share of its
traces with ngram speculative decoding (its own random stream: the other traces are v4's);
``random-v6`` moves one engine knob on a share of its traces (fuzzer/configs.py; `kvfuzz run`'s
default) and empties the prefix cache once in a share of them, half of those resetting the
running requests too (``shapes.prefix_cache_reset``); each on its own stream, so a trace that
draws neither is v5's. ``random-v7`` draws speculative decoding first, on a larger share (35 %) from
three settings (``requests.SPECULATIVE``), and a trace that drafts moves no other engine
dimension.

``GenOptions(lifecycle=True)`` selects the lifecycle generator (``lifecycle-v1``,
``generate_lifecycle``): adapter names loaded, unloaded and reloaded between sends (docs/fuzzer.md,
"Adapter lifecycle"). It has its own random stream, so the default generator is unchanged.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

from kvfuzz.traces import At, CancelEvent, EngineConfig, GenPrompt, Lineage, LoraSettings, SendEvent, Trace
from kvfuzz.traces.trace import (
    EMBEDDED_HYBRID,
    EMBEDDED_MODEL,
    LoadAdapterEvent,
    Prompt,
    ReloadAdapterEvent,
    UnloadAdapterEvent,
)

from . import configs, hybrid, lifecycle, requests, shapes
from .reuse import reuse_prompts

GENERATOR = "random-v7"

EMBEDDED_ADAPTERS = {"a": "embedded:a", "b": "embedded:b", "c": "embedded:c"}


def default_engine(*, lora: bool = False, kv_cache_bytes: int = 24 * 2**20, **overrides: object) -> EngineConfig:
    """The campaign default on the embedded model. 24 MiB of KV (about 24k tokens of this
    model) is enough for one 16k-token request but not for a burst of long ones, so some
    traces reach preemption.

    ``kv_cache_bytes`` is the size in float32: a 16-bit ``dtype`` override gets the same tokens
    in half the bytes (EngineConfig.with_dtype), so KV pressure is the same in every dtype.
    Taken literally, 24 MiB held 48k bfloat16 tokens, and bfloat16 campaigns preempted in 1
    trace of 57 against 1 in 9 in float32: preemption went untested."""
    dtype = overrides.pop("dtype", None)
    cfg = EngineConfig(
        model=EMBEDDED_MODEL,
        kv_cache_bytes=kv_cache_bytes,
        lora=LoraSettings(enabled=True, adapters=dict(EMBEDDED_ADAPTERS), max_loras=2) if lora else LoraSettings(),
    )
    cfg = cfg.model_copy(update=overrides) if overrides else cfg
    return cfg.with_dtype(str(dtype)) if dtype is not None else cfg


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
    # Adapter lifecycle churn instead of the default generator (``generate_lifecycle``).
    lifecycle: bool = False
    lifecycle_sends: tuple[int, int] = (4, 10)
    lifecycle_events: tuple[int, int] = (1, 4)
    # (max_loras, max_cpu_loras) pairs to draw from; None: max_loras 1-3, max_cpu_loras None or +1/+2.
    lifecycle_slots: tuple[tuple[int, int | None], ...] | None = None
    # A reload / unload placed while its name's requests probably still run (else after them).
    p_race: float = 0.15
    p_salt: float = 0.3
    p_base: float = 0.25
    # Prompt reuse: each request of a fresh trace takes, with this probability, a prompt of the
    # campaign's pool (``fuzzer/reuse.py``; seeded by ``pool_seed``), as real traffic repeats
    # system prompts and documents. 0: no reuse (every prompt drawn fresh).
    prompt_reuse: float = 0.0
    pool_seed: int = 0
    pool_size: int = 32
    # Per-request state (fuzzer/requests.py): the share of sends that carry some, and the
    # probability that the engine schedules by priority (every send then has one). The share
    # is chosen in docs/benchmarks.md ("Per-request state"). 0 and 0: random-v2's traces.
    request_state: float = 0.4
    p_priority: float = 0.25
    # The probability that a trace's engine takes prompt embeddings and some of its sends give
    # their prompts as embeddings (in-process engines only: `kvfuzz run` turns it off elsewhere).
    p_embeds: float = 0.15
    # The probability that a trace's engine runs ngram speculative decoding (in-process only,
    # as above); most of its sends then restrict their output so drafts are accepted. Drawn
    # first: such a trace moves no other engine dimension.
    p_spec: float = 0.35
    # The probability that a trace empties the prefix cache once while a request runs, before a
    # request sharing its prefix; half of them with reset_running_requests (every running request
    # preempted and recomputed). shapes.prefix_cache_reset.
    p_reset: float = 0.1
    # The probability that a trace's engine has one scheduler or KV-cache knob moved
    # (fuzzer/configs.py; the embedded default model only). `kvfuzz run` draws 0.4 in-process.
    p_config: float = 0.0


def _length(rng: random.Random, bs: int, opts: GenOptions) -> int:
    if rng.random() < opts.p_block_boundary:
        k = rng.randint(1, 20)
        return max(1, k * bs + rng.choice((-1, 0, 0, 1)))
    if rng.random() < opts.p_long:
        return rng.randint(1500, 6000)
    return rng.randint(8, 700)


def generate(seed: int, engine: EngineConfig | None = None, opts: GenOptions | None = None) -> Trace:
    """A random trace, fully determined by ``seed`` (and the engine config / options)."""
    if opts is not None and opts.lifecycle:
        return generate_lifecycle(seed, engine, opts)
    rng = random.Random(seed)
    engine = engine or default_engine()
    opts = opts or GenOptions(adapters=sorted(engine.lora.adapters) if engine.lora.enabled else [])
    moved = spec = requests.draws_speculative(seed, engine, opts.p_spec)
    if not spec and engine.model == EMBEDDED_MODEL and engine.kv_connector is None:
        drawn = configs.draw(seed, engine, opts.p_config)
        moved, engine = drawn != engine, drawn
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
    if opts.prompt_reuse > 0:
        # Its own RNG: the trace drawn above is the same whatever the reuse probability.
        events = reuse_prompts(events, seed, engine, opts)
    events = _additions(rng, engine, opts, events, step)
    # One engine dimension moved a trace: a knob, or priority scheduling, embeddings or drafts.
    # It keeps a campaign's engines few enough for its pool, and a finding's engine one step
    # from the campaign's.
    dressed, engine = requests.dress(events, seed, engine, share=opts.request_state,
                                     p_priority=0.0 if moved else opts.p_priority,
                                     p_embeds=0.0 if moved else opts.p_embeds, p_spec=1.0 if spec else 0.0)
    dressed = _reset(dressed, seed, engine, opts.p_reset)
    plain = (opts.request_state <= 0 and opts.p_priority <= 0 and opts.p_embeds <= 0 and opts.p_spec <= 0
             and opts.p_reset <= 0 and opts.p_config <= 0)
    name = "random-v2" if plain else GENERATOR
    return Trace(engine=engine, events=dressed, name=f"random-{seed}",
                 lineage=Lineage(generator=name, seed=seed))


def _reset(events: list, seed: int, engine: EngineConfig, p: float) -> list:
    """With probability ``p``, ``events`` with one prefix-cache reset (``shapes.prefix_cache_reset``;
    half of them with ``reset_running_requests``). Its own random stream, drawn last: a trace
    without a reset is the one drawn before."""
    rng = random.Random(f"kvfuzz/reset-prefix-cache/{seed}")
    if p <= 0 or rng.random() >= p:
        return events
    return shapes.prefix_cache_reset(engine, rng, events, running=rng.random() < 0.5) or events


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


# -- adapter lifecycle churn -------------------------------------------------------------------

LIFECYCLE_GENERATOR = "lifecycle-v1"
_LC_GAPS = (0, 0, 1, 1, 2, 3, 5)


def generate_lifecycle(seed: int, engine: EngineConfig | None = None, opts: GenOptions | None = None) -> Trace:
    """A small trace of sends interleaved with adapter load / unload / reload events, fully
    determined by ``seed`` (docs/fuzzer.md, "Adapter lifecycle").

    The engine's LoRA section is drawn: ``max_loras`` 1-3, ``max_cpu_loras`` None or a little
    larger, 2-5 adapter names (some bound in ``engine.lora.adapters``, the others loaded by
    events) on the embedded adapters and their weight variants — two names on the same weights
    now and then. Each rebinding (a reload, same-path or not, or an unload followed by a load of
    the same name) is followed by a request of that name sharing a prefix with one served under
    its previous weights, in the same tenant: what shows stale prefix-cache KV (vllm#42125,
    #30931). Rebindings mostly wait until the name's requests have probably finished
    (``lifecycle.simulate_finish``) and race them with probability ``p_race``. Some sends carry a
    ``cache_salt`` (two tenants), and some repeat an earlier prompt under another tenant."""
    opts = opts or GenOptions(lifecycle=True)
    base = engine or default_engine(lora=True)
    if base.model != EMBEDDED_MODEL or base.kv_connector is not None:
        raise ValueError(f"lifecycle traces use the embedded adapters: the engine must be {EMBEDDED_MODEL} "
                         f"without a KV connector")
    return _Lifecycle(random.Random(f"kvfuzz/lifecycle/{seed}"), base, opts, seed).build()


class _Lifecycle:
    """The generator's state while it walks forward in time: what is bound, what was sent."""

    def __init__(self, rng: random.Random, base: EngineConfig, opts: GenOptions, seed: int) -> None:
        self.rng, self.opts, self.seed = rng, opts, seed
        ml, mcl = lifecycle.draw_slots(rng, opts.lifecycle_slots)
        self.names = list(lifecycle.NAMES[: rng.randint(2, len(lifecycle.NAMES))])
        sources: dict[str, str] = {}
        for i, name in enumerate(self.names):
            r = rng.random()
            if i and r < 0.2:
                sources[name] = sources[self.names[i - 1]]  # two names, the same weights
            elif name in lifecycle.EMBEDDED_BASES and r < 0.7:
                sources[name] = f"embedded:{name}"
            else:
                sources[name] = rng.choice(lifecycle.SOURCES)
        initial = sorted(rng.sample(self.names, rng.randint(1, len(self.names))))
        self.later = {n: sources[n] for n in self.names if n not in initial}  # loaded by events
        self.engine = base.model_copy(update={"lora": LoraSettings(
            enabled=True, adapters={n: sources[n] for n in initial}, max_loras=ml, max_cpu_loras=mcl,
            max_lora_rank=base.lora.max_lora_rank)})
        self.bound = {n: sources[n] for n in initial}
        self.groups = [f"lc{seed}-{i}" for i in range(rng.randint(1, 3))]
        self.events: list = []
        self.sends: list[SendEvent] = []
        self.step = 0

    # -- sends -----------------------------------------------------------------------------------
    def _prompt(self, max_tokens: int) -> GenPrompt:
        rng, bs = self.rng, self.engine.block_size
        room = max(1, self.engine.max_model_len - max_tokens)
        if rng.random() < 0.5:
            length = bs * rng.randint(1, 12) + rng.choice((-1, 0, 0, 1))
        else:
            length = rng.randint(8, 400)
        length = max(1, min(length, room))
        if rng.random() < 0.75:
            prefix = min(length, rng.choice((bs, 2 * bs, 4 * bs, 4 * bs - 1, 4 * bs + 1, 8 * bs, length)))
            return GenPrompt(length=length, prefix_group=rng.choice(self.groups), prefix_len=prefix,
                             seed=rng.randrange(1 << 30))
        return GenPrompt(length=length, seed=rng.randrange(1 << 30))

    def _send(self, adapter: str | None, prompt: Prompt | None = None, salt: str | None = None,
              *, cancel: bool = True) -> SendEvent:
        rng = self.rng
        max_tokens = rng.randint(2, 12)
        if prompt is None:
            prompt = self._prompt(max_tokens)
        max_tokens = max(1, min(max_tokens, self.engine.max_model_len - prompt.length))
        ev = SendEvent(request_id=f"r{len(self.sends)}", at=shapes.at_step(self.step, self.engine), prompt=prompt,
                       adapter=adapter, max_tokens=max_tokens, stream=rng.random() < 0.8, cache_salt=salt)
        self.events.append(ev)
        self.sends.append(ev)
        if cancel and rng.random() < 0.08:
            self.events.append(CancelEvent(request_id=ev.request_id, at=At(after_tokens=rng.choice((0, 1, 2)))))
        return ev

    def _salt(self) -> str | None:
        return self.rng.choice(lifecycle.TENANTS) if self.rng.random() < self.opts.p_salt else None

    def plain_send(self) -> None:
        rng = self.rng
        live = sorted(self.bound)
        adapter = None if not live or rng.random() < self.opts.p_base else rng.choice(live)
        if self.sends and rng.random() < 0.2:
            # The same prompt under another tenant (or none): salts must keep them apart.
            src = rng.choice(self.sends)
            salt = rng.choice([t for t in (None, *lifecycle.TENANTS) if t != src.cache_salt])
            self._send(adapter, src.prompt, salt)
        else:
            self._send(adapter, salt=self._salt())

    def reveal(self, name: str) -> None:
        """After ``name`` was rebound: a request of ``name`` sharing a prefix with one served
        under its previous weights (same tenant, mostly), so cached KV of the old weights would
        be hit; sometimes a base-model request beside it."""
        rng, bs = self.rng, self.engine.block_size
        earlier = [s for s in self.sends if isinstance(s.prompt, GenPrompt) and s.prompt.prefix_group
                   and s.prompt.prefix_len >= bs]
        own = [s for s in earlier if s.adapter == name]
        self.step += rng.choice((0, 0, 1, 2, 3))
        repeat = [s for s in self.sends if s.adapter == name and s.prompt.length >= bs]
        if not own and repeat and rng.random() < 0.7:
            e = rng.choice(repeat)  # the same prompt again: all its full blocks are cached
            self._send(name, e.prompt, e.cache_salt, cancel=False)
        elif own or earlier:
            e = rng.choice(own or earlier)
            assert isinstance(e.prompt, GenPrompt)
            max_len = self.engine.max_model_len - 2
            length = max(e.prompt.prefix_len, min(max_len, e.prompt.prefix_len + rng.randint(1, 2 * bs)))
            prompt = GenPrompt(length=length, prefix_group=e.prompt.prefix_group,
                               prefix_len=min(e.prompt.prefix_len, max_len), seed=rng.randrange(1 << 30))
            salt = e.cache_salt if rng.random() < 0.85 else self._salt()
            self._send(name, prompt, salt, cancel=False)
        else:
            self._send(name, salt=self._salt(), cancel=False)
        if rng.random() < 0.3:
            self._send(None, salt=self._salt())

    # -- lifecycle events ------------------------------------------------------------------------
    def _free_at(self, name: str) -> int:
        """A step for a lifecycle event of ``name``: after its requests have probably finished,
        or (``p_race``) while the last of them may still run."""
        rng = self.rng
        free = lifecycle.name_free_at(self.sends, self.engine, name)
        if free <= self.step:
            return self.step
        if rng.random() < self.opts.p_race:
            last = max(s.at.step or 0 for s in self.sends if s.adapter == name)
            return rng.randint(max(self.step, last), free)
        return free + rng.choice((0, 0, 1, 3))

    def _at(self, step: int):
        self.step = max(self.step, step)
        return shapes.at_step(self.step, self.engine)

    def _load(self, name: str, source: str) -> None:
        # Never while requests of the name's previous binding may still run: a name reloaded in
        # place elsewhere in the trace is served from one working directory, which this load
        # overwrites, and a request in flight would re-read it (docs/oracle.md: in flight
        # across an unload, a request keeps its weights).
        self.events.append(LoadAdapterEvent(name=name, source=source,
                                            at=self._at(lifecycle.name_free_at(self.sends, self.engine, name))))
        self.bound[name] = source

    def action(self) -> None:
        rng = self.rng
        unbound = [n for n in self.names if n not in self.bound]
        kinds = (["reload"] * 5 + ["unload"] * 3 if self.bound else []) + (["load"] * 5 if unbound else [])
        kind = rng.choice(kinds)
        if kind == "load":
            name = rng.choice(unbound)
            if name in self.later and rng.random() < 0.75:
                source = self.later.pop(name)
            elif self.bound and rng.random() < 0.3:
                source = self.bound[rng.choice(sorted(self.bound))]  # the same weights as another name
            else:
                source = rng.choice(lifecycle.SOURCES)
            had = any(s.adapter == name for s in self.sends)
            self._load(name, source)
            if had:
                self.reveal(name)
            elif rng.random() < 0.7:
                self._send(name, salt=self._salt())
            return
        name = rng.choice(sorted(self.bound))
        old = self.bound[name]
        at = self._at(self._free_at(name))
        if kind == "reload":
            source = lifecycle.other_source(old, rng) if rng.random() < 0.85 else old
            self.events.append(ReloadAdapterEvent(name=name, source=source, same_path=rng.random() < 0.5, at=at))
            self.bound[name] = source
        else:
            self.events.append(UnloadAdapterEvent(name=name, at=at))
            del self.bound[name]
            if rng.random() >= 0.6:
                return
            self.step += rng.choice((0, 1, 2))
            self._load(name, lifecycle.other_source(old, rng) if rng.random() < 0.8 else old)
        if rng.random() < 0.85:
            self.reveal(name)

    def build(self) -> Trace:
        rng, opts = self.rng, self.opts
        hi = min(opts.lifecycle_sends[1], opts.max_requests)
        n_sends = rng.randint(min(opts.lifecycle_sends[0], hi), hi)
        n_life = rng.randint(*opts.lifecycle_events)
        # Lifecycle events go between sends (position k: before send k), or after the last one.
        at = sorted(rng.choices(range(1, n_sends + 1), k=n_life))
        for i in range(n_sends):
            while at and at[0] == i:
                at.pop(0)
                self.action()
            if i:
                self.step += rng.choice(_LC_GAPS)
            self.plain_send()
        for _ in at:
            self.action()
        return Trace(engine=self.engine, events=shapes.in_time_order(self.events, self.engine),
                     lineage=Lineage(generator=LIFECYCLE_GENERATOR, seed=self.seed), name=f"lifecycle-{self.seed}")
