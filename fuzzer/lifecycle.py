"""Building blocks for adapter-lifecycle churn, shared by the lifecycle generator
(fuzzer/generate.py), its mutation operators (fuzzer/mutate.py) and the Hypothesis strategies.

The surfaces aimed at (upstream reports): KV cached under an adapter name's previous weights
served after a reload of that name (vllm#42125: same-path and new-path reloads; vllm#30931:
unload + load of a name with new weights), a base-model request batched with LoRA requests
getting an adapter applied (the CPU bug of vLLM PR #48421), and slot / CPU-LRU churn when more
names are live than ``max_loras`` / ``max_cpu_loras``. Stale prefix reuse shows only when a
request sharing a prefix with an earlier request of the same name (same tenant) arrives after
the rebinding, so the builders pair each rebinding with such a follower.

The oracle's contract (docs/oracle.md): a request whose own adapter is reloaded while it runs is
``unconstrained`` (any output legal), so most reloads and unloads of a name are placed after
the name's requests have had time to finish (``finish_estimate``), and a few race them.
"""

from __future__ import annotations

import random
from typing import TypeGuard

from kvfuzz.traces import EngineConfig, GenPrompt, SendEvent, Trace
from kvfuzz.traces.trace import (
    ADAPTER_EVENT_TYPES,
    AdapterEvent,
    LoadAdapterEvent,
    ReloadAdapterEvent,
    UnloadAdapterEvent,
    parse_embedded_source,
)

from .shapes import prefill_steps

# Adapter names a lifecycle trace uses (the first n), and the weights they are bound to: the
# embedded adapters and their deterministic weight variants (embedded:a@v2 ...).
NAMES = ("a", "b", "c", "d", "e")
EMBEDDED_BASES = ("a", "b", "c")
VERSIONS = (1, 2, 3)
SOURCES = tuple(f"embedded:{n}" if v == 1 else f"embedded:{n}@v{v}" for n in EMBEDDED_BASES for v in VERSIONS)
# cache_salt values: a couple of tenants.
TENANTS = ("tenant-1", "tenant-2")


def source_of(name: str, version: int) -> str:
    return f"embedded:{name}" if version == 1 else f"embedded:{name}@v{version}"


def other_source(source: str, rng: random.Random, *, p_other_adapter: float = 0.25) -> str:
    """Other weights for a name bound to ``source``: mostly another variant of the same
    embedded adapter (new weights, same shape), sometimes another adapter's weights."""
    parsed = parse_embedded_source(source)
    if parsed is None:  # a directory: any embedded weights differ from it
        return rng.choice(SOURCES)
    base, version = parsed
    if rng.random() < p_other_adapter:
        return source_of(rng.choice([b for b in EMBEDDED_BASES if b != base]), rng.choice(VERSIONS))
    return source_of(base, rng.choice([v for v in VERSIONS if v != version]))


def draw_slots(rng: random.Random, menu: tuple[tuple[int, int | None], ...] | None = None) -> tuple[int, int | None]:
    """(max_loras, max_cpu_loras): slots per batch 1-3, and vLLM's CPU-side LRU of loaded
    adapters either at its default (None: = max_loras) or one or two larger."""
    if menu:
        return rng.choice(menu)
    ml = rng.randint(1, 3)
    return ml, rng.choice((None, None, ml + 1, ml + 2))


def finish_estimate(send: SendEvent, engine: EngineConfig, *, slack: int = 3) -> int:
    """About the step by which ``send`` has finished when nothing holds it back: its prefill
    steps, one step per generated token, and some slack for batching and slot waits."""
    return send.at.step_or(engine.ms_per_step) + prefill_steps(send.prompt.length, engine) + send.max_tokens + slack


def bound_at(trace: Trace, step: int, *, inclusive: bool = True) -> dict[str, str]:
    """Adapter name -> source bound at engine step ``step`` of the plan (after the lifecycle
    events planned at that step when ``inclusive``, before them otherwise)."""
    mps = trace.engine.ms_per_step
    bound = dict(trace.engine.lora.adapters)
    for i in trace.planned_order():
        ev = trace.events[i]
        s = ev.at.step_or(mps)
        if s > step or (s == step and not inclusive):
            break
        if isinstance(ev, (LoadAdapterEvent, ReloadAdapterEvent)):
            bound[ev.name] = ev.source
        elif isinstance(ev, UnloadAdapterEvent):
            bound.pop(ev.name, None)
    return bound


def is_lifecycle(ev: object) -> TypeGuard[AdapterEvent]:
    return isinstance(ev, ADAPTER_EVENT_TYPES)


def shares_prefix(a: SendEvent, b: SendEvent) -> bool:
    """Whether two sends' prompts start with the same tokens: equal prompts, or one prefix
    group with a shared prefix of at least one token."""
    if a.prompt == b.prompt:
        return True
    pa, pb = a.prompt, b.prompt
    return (isinstance(pa, GenPrompt) and isinstance(pb, GenPrompt) and pa.prefix_group is not None
            and pa.prefix_group == pb.prefix_group and min(pa.prefix_len, pb.prefix_len) > 0)


def simulate_finish(sends: list[SendEvent], engine: EngineConfig, *, max_loras: int | None = None) -> dict[str, int]:
    """Request id -> the step it finishes in a crude model of vLLM's scheduler: first come,
    first served, one step per prefill chunk and per generated token, and at most ``max_loras``
    distinct adapters per step (a request whose adapter would exceed it waits; base-model
    requests never do). Cancels are ignored (a cancelled request ends no later). Used to place
    a lifecycle event after its name's requests have probably finished — an estimate: the real
    schedule also waits for KV and token budget."""
    mps = engine.ms_per_step
    slots = max_loras if max_loras is not None else engine.lora.max_loras
    order = sorted(sends, key=lambda s: s.at.step_or(mps))
    left = {s.request_id: prefill_steps(s.prompt.length, engine) + s.max_tokens for s in order}
    finish: dict[str, int] = {}
    if not order:
        return finish
    step = order[0].at.step_or(mps)
    limit = step + sum(left.values()) + max(s.at.step_or(mps) for s in order) + 10
    while len(finish) < len(order) and step <= limit:
        arrived = [s for s in order if s.at.step_or(mps) <= step and s.request_id not in finish]
        if not arrived:
            step = min(s.at.step_or(mps) for s in order if s.request_id not in finish)
            continue
        active: set[str] = set()
        for s in arrived:
            if s.adapter is not None and s.adapter not in active:
                if len(active) >= slots:
                    continue
                active.add(s.adapter)
            left[s.request_id] -= 1
            if left[s.request_id] <= 0:
                finish[s.request_id] = step
        step += 1
    return finish


def name_free_at(sends: list[SendEvent], engine: EngineConfig, name: str, *, slack: int = 2) -> int:
    """The step from which adapter ``name``'s requests among ``sends`` have probably all
    finished (``simulate_finish`` plus ``slack``); -1 if the name has none."""
    finish = simulate_finish(sends, engine)
    ends = [finish.get(s.request_id, finish_estimate(s, engine)) for s in sends if s.adapter == name]
    return max(ends) + slack if ends else -1


def overwrites_in_flight(trace: Trace) -> bool:
    """Whether a load of a name that the trace also reloads in place (``same_path``) may land
    while a request of the name's earlier binding still runs. Such a name is served from one
    working directory (harness/adapters.py) that the load overwrites, and a request in flight
    across an unload re-reads its adapter from there: the oracle's contract (it keeps the
    weights it was admitted with, docs/oracle.md) would not hold for a reason of the harness's
    making, so the builders avoid it (by the estimate of ``name_free_at``)."""
    in_place = {e.name for e in trace.lifecycle if isinstance(e, ReloadAdapterEvent) and e.same_path}
    if not in_place:
        return False
    sent: list[SendEvent] = []
    for i in trace.planned_order():
        e = trace.events[i]
        if isinstance(e, SendEvent):
            sent.append(e)
        elif isinstance(e, LoadAdapterEvent) and e.name in in_place:
            if e.at.step_or(trace.engine.ms_per_step) < name_free_at(sent, trace.engine, e.name):
                return True
    return False
