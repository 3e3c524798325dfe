"""Hypothesis strategies for kvfuzz traces: a public API for writing property tests against vLLM.

    from hypothesis import given, settings
    from kvfuzz.fuzzer.strategies import traces

    @given(traces(max_requests=4))
    @settings(max_examples=20, deadline=None)
    def test_batching_does_not_change_outputs(session, trace):
        assert session.check(trace).finding is None

A trace is drawn as a list of request specs (gap to the previous send, prompt length, shared
prefix, adapter, max_tokens, optional cancel). Hypothesis shrinks that structure directly, so
a failing example shrinks to fewer requests, fewer cancels, shorter prompts, fewer tokens,
no prefix sharing and no adapter before anything else — the minimal trace a maintainer wants.
Every absolute time carries both clocks (step and offset_ms), so examples replay on the
in-process engine and on a server.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

from hypothesis import strategies as st

from kvfuzz.traces import At, CancelEvent, EngineConfig, GenPrompt, Lineage, LoraSettings, Sampling, SendEvent, Trace
from kvfuzz.traces.trace import LoadAdapterEvent, ReloadAdapterEvent, UnloadAdapterEvent

from . import lifecycle, requests
from .generate import default_engine
from .mutate import OPERATORS, apply, at_step, with_lineage


def prompt_lengths(*, block_size: int = 32, max_len: int = 1024) -> st.SearchStrategy[int]:
    """Any length, or one on / one next to a block boundary (where sharing bugs live).
    Shrinks towards 1."""
    blocks = max(1, max_len // block_size)
    aligned = st.builds(lambda k, d: min(max_len, max(1, k * block_size + d)),
                        st.integers(1, blocks), st.sampled_from((0, -1, 1)))
    return st.one_of(st.integers(1, max_len), aligned)


@st.composite
def prompts(draw: st.DrawFn, *, block_size: int = 32, max_len: int = 1024,
            groups: Sequence[str] = ("p0", "p1")) -> GenPrompt:
    """A generated prompt, sometimes sharing a prefix with others in the same group."""
    length = draw(prompt_lengths(block_size=block_size, max_len=max_len))
    seed = draw(st.integers(0, 2**16))
    share = draw(st.none() | st.tuples(st.sampled_from(list(groups)),
                                       prompt_lengths(block_size=block_size, max_len=max_len)))
    if share is None or not groups:
        return GenPrompt(length=length, seed=seed)
    group, prefix_len = share
    return GenPrompt(length=length, prefix_group=group, prefix_len=min(prefix_len, length), seed=seed)


@st.composite
def cancels(draw: st.DrawFn, *, max_tokens: int, max_delay: int = 8) -> At:
    """When to cancel: after N tokens (0 = mid-prefill) or at an absolute step offset."""
    rel = draw(st.booleans())
    if rel:
        return At(after_tokens=draw(st.integers(0, max(0, max_tokens - 1))))
    return At(step=draw(st.integers(0, max_delay)))  # relative to the send; made absolute below


def _engine(engine: EngineConfig | None) -> EngineConfig:
    return engine if engine is not None else default_engine()


@st.composite
def samplings(draw: st.DrawFn, *, max_tokens: int = 16, vocab: int = requests.EMBEDDED_VOCAB) -> Sampling:
    """A send's per-request state (allowed tokens, bias, EOS and stop rules, ``min_tokens``,
    penalties, ``n``, prompt logprobs) over token ids below ``vocab``. Shrinks towards a plain
    greedy request."""
    tokens = st.integers(0, vocab - 1)
    fields: dict[str, object] = {}
    if draw(st.booleans()):
        fields["allowed_token_ids"] = draw(st.lists(tokens, min_size=1, max_size=16, unique=True))
    if draw(st.booleans()):
        fields["logit_bias"] = draw(st.dictionaries(tokens, st.floats(-10, 10, allow_nan=False), min_size=1,
                                                    max_size=4))
    if draw(st.booleans()):
        fields["ignore_eos"] = False
        fields["min_tokens"] = draw(st.integers(0, max_tokens))
    if draw(st.booleans()):
        fields["stop_token_ids"] = draw(st.lists(tokens, min_size=1, max_size=3, unique=True))
    if draw(st.booleans()):
        fields["stop"] = [f"<t{t}>" for t in draw(st.lists(tokens, min_size=1, max_size=2, unique=True))]
    if draw(st.booleans()):
        fields["presence_penalty"] = draw(st.floats(-2, 2, allow_nan=False))
        fields["frequency_penalty"] = draw(st.floats(-2, 2, allow_nan=False))
        fields["repetition_penalty"] = draw(st.floats(0.5, 2, allow_nan=False))
    fields["n"] = draw(st.integers(1, 4))
    if draw(st.booleans()):
        fields["prompt_logprobs"] = draw(st.integers(0, 2))
    return Sampling(**fields)  # type: ignore[arg-type]


@st.composite
def traces(draw: st.DrawFn, engine: EngineConfig | None = None, *, min_requests: int = 1, max_requests: int = 6,
           max_prompt_len: int = 1024, max_tokens: tuple[int, int] = (1, 16), max_gap: int = 8,
           adapters: Sequence[str] | None = None, cancel: bool = True,
           prefix_groups: Sequence[str] = ("p0", "p1"), request_state: bool = True) -> Trace:
    """Valid traces for ``engine`` (default: the embedded model). ``adapters`` defaults to the
    engine's LoRA adapters (none if LoRA is off); pass ``[]`` for base-model requests only.
    ``request_state``: sends may carry per-request state (``samplings``) and the engine may
    schedule by priority (every send then has one); shrinks towards neither."""
    eng = _engine(engine)
    if request_state and draw(st.booleans()):
        eng = eng.model_copy(update={"scheduling_policy": "priority"})
    if adapters is None:
        adapters = sorted(eng.lora.adapters) if eng.lora.enabled else []
    lo_tok, hi_tok = max_tokens
    max_len = max(1, min(max_prompt_len, eng.max_model_len - hi_tok))
    spec = st.tuples(
        st.integers(0, max_gap),
        prompts(block_size=eng.block_size, max_len=max_len, groups=prefix_groups),
        st.none() | st.sampled_from(list(adapters)) if adapters else st.none(),
        st.integers(lo_tok, hi_tok),
        st.none() | cancels(max_tokens=hi_tok) if cancel else st.none(),
        st.just(Sampling()) | samplings(max_tokens=lo_tok) if request_state else st.just(Sampling()),
        st.integers(-2, 2) if eng.scheduling_policy == "priority" else st.just(0),
    )
    specs = draw(st.lists(spec, min_size=min_requests, max_size=max_requests))
    events: list[SendEvent | CancelEvent] = []
    step = 0
    for i, (gap, prompt, adapter, n, when, sampling, priority) in enumerate(specs):
        step += gap
        rid = f"r{i}"
        events.append(SendEvent(request_id=rid, at=at_step(step, eng), prompt=prompt, adapter=adapter, max_tokens=n,
                                sampling=sampling, priority=priority))
        if when is not None:
            at = when if when.after_tokens is not None else at_step(step + (when.step or 0), eng)
            events.append(CancelEvent(request_id=rid, at=at))
    events.sort(key=lambda e: e.at.step if e.at.step is not None else _send_step(events, e))
    return Trace(engine=eng, events=events, name="hypothesis", lineage=Lineage(generator="hypothesis"))


def _send_step(events: list[SendEvent | CancelEvent], e: SendEvent | CancelEvent) -> int:
    # A relative cancel sorts with its send (the sort is stable: it stays after it).
    for x in events:
        if isinstance(x, SendEvent) and x.request_id == e.request_id:
            return x.at.step or 0
    return 0


AdapterEvent = LoadAdapterEvent | UnloadAdapterEvent | ReloadAdapterEvent
LIFECYCLE_KINDS = ("load-adapter", "unload-adapter", "reload-adapter")


def adapter_sources() -> st.SearchStrategy[str]:
    """Weights an adapter name can be bound to: the embedded adapters and their variants
    (``embedded:a``, ``embedded:a@v2``, ...). Shrinks towards ``embedded:a``."""
    return st.sampled_from(lifecycle.SOURCES)


def _event(kind: str, name: str, source: str, same_path: bool, at: At) -> AdapterEvent:
    if kind == "load-adapter":
        return LoadAdapterEvent(name=name, source=source, at=at)
    if kind == "unload-adapter":
        return UnloadAdapterEvent(name=name, at=at)
    return ReloadAdapterEvent(name=name, source=source, same_path=same_path, at=at)


@st.composite
def adapter_events(draw: st.DrawFn, *, names: Sequence[str] = lifecycle.NAMES, max_step: int = 64,
                   engine: EngineConfig | None = None) -> AdapterEvent:
    """One adapter lifecycle event (load / unload / reload, both clocks). Valid on its own;
    whether a trace's plan accepts it depends on what is bound then — ``lifecycle_traces``
    draws whole valid schedules."""
    eng = _engine(engine)
    return _event(draw(st.sampled_from(LIFECYCLE_KINDS)), draw(st.sampled_from(list(names))),
                  draw(adapter_sources()), draw(st.booleans()), at_step(draw(st.integers(0, max_step)), eng))


@st.composite
def lifecycle_traces(draw: st.DrawFn, engine: EngineConfig | None = None, *, min_requests: int = 1,
                     max_requests: int = 6, min_events: int = 1, max_events: int = 4,
                     names: Sequence[str] = lifecycle.NAMES[:3], max_prompt_len: int = 512,
                     max_tokens: tuple[int, int] = (1, 8), max_gap: int = 8, cache_salt: bool = True,
                     prefix_groups: Sequence[str] = ("p0", "p1")) -> Trace:
    """Valid traces with adapter lifecycle churn on ``engine`` (default: the embedded model with
    LoRA): ``max_loras`` 1-3, ``max_cpu_loras`` None or up to 2 more, each name bound at the
    start or not, sends and load / unload / reload events interleaved, ``cache_salt`` on some
    sends. The schedule is drawn as specs and repaired while it is walked in time, so every
    draw is valid: a send to an unbound name goes to the base model, a load of a bound name
    becomes a reload, an unload or reload of an unbound name a load. Shrinks towards fewer
    requests and events, ``max_loras`` 1, names bound to ``embedded:a``, no salt."""
    eng = _engine(engine if engine is not None else default_engine(lora=True))
    names = list(names)
    ml = draw(st.integers(1, 3))
    extra = draw(st.none() | st.integers(0, 2))
    initial = {n: src for n in names if (src := draw(st.one_of(adapter_sources(), st.none()))) is not None}
    eng = eng.model_copy(update={"lora": LoraSettings(enabled=True, adapters=initial, max_loras=ml,
                                                      max_cpu_loras=None if extra is None else ml + extra,
                                                      max_lora_rank=eng.lora.max_lora_rank)})
    lo_tok, hi_tok = max_tokens
    max_len = max(1, min(max_prompt_len, eng.max_model_len - hi_tok))
    send_spec = st.tuples(
        st.integers(0, max_gap),
        prompts(block_size=eng.block_size, max_len=max_len, groups=prefix_groups),
        st.none() | st.sampled_from(names),
        st.integers(lo_tok, hi_tok),
        st.none() | st.sampled_from(lifecycle.TENANTS) if cache_salt else st.none(),
    )
    event_spec = st.tuples(
        st.integers(0, max_requests),  # goes before send k (after the last one if k >= their number)
        st.integers(0, max_gap),
        st.sampled_from(LIFECYCLE_KINDS),
        st.sampled_from(names),
        adapter_sources(),
        st.booleans(),
    )
    sends = draw(st.lists(send_spec, min_size=min_requests, max_size=max_requests))
    life = sorted(draw(st.lists(event_spec, min_size=min_events, max_size=max_events)), key=lambda x: x[0])
    bound = dict(initial)
    events: list = []
    step = 0

    def apply_event(gap: int, kind: str, name: str, source: str, same_path: bool) -> None:
        nonlocal step
        step += gap
        if kind == "load-adapter" and name in bound:
            kind = "reload-adapter"
        elif kind != "load-adapter" and name not in bound:
            kind = "load-adapter"
        events.append(_event(kind, name, source, same_path, at_step(step, eng)))
        if kind == "unload-adapter":
            del bound[name]
        else:
            bound[name] = source

    for i, (gap, prompt, adapter, n, salt) in enumerate(sends):
        while life and life[0][0] <= i:
            apply_event(*life.pop(0)[1:])
        step += gap
        events.append(SendEvent(request_id=f"r{i}", at=at_step(step, eng), prompt=prompt, max_tokens=n,
                                adapter=adapter if adapter in bound else None, cache_salt=salt))
    for spec in life:
        apply_event(*spec[1:])
    trace = Trace(engine=eng, events=events, name="hypothesis-lifecycle", lineage=Lineage(generator="hypothesis"))
    if lifecycle.overwrites_in_flight(trace):
        # A load over the working directory of a request still in flight (a harness artefact,
        # not a schedule: fuzzer/lifecycle.py): those names' reloads become new-path ones.
        events = [e.model_copy(update={"same_path": False}) if isinstance(e, ReloadAdapterEvent) else e
                  for e in events]
        trace = Trace(engine=eng, events=events, name="hypothesis-lifecycle", lineage=Lineage(generator="hypothesis"))
    return trace


@st.composite
def mutants(draw: st.DrawFn, base: Trace | st.SearchStrategy[Trace], *,
            operators: Sequence[str] | None = None, max_ops: int = 3, lifecycle: bool = False) -> Trace:
    """A trace after 1..max_ops named mutation operators (fuzzer/mutate.py). Shrinks towards
    fewer operators and the earlier operators of ``operators`` (default: those that keep the
    engine; with ``lifecycle``, the adapter-lifecycle operators too; for a trace with a prefix-cache
    reset, the reset operator too, as ``mutate`` draws them)."""
    trace = draw(base) if isinstance(base, st.SearchStrategy) else base
    names = list(operators) if operators is not None else [
        o.name for o in OPERATORS.values() if not o.changes_engine and (lifecycle or not o.lifecycle)
        and (bool(trace.resets) or not o.resets)]
    ops = draw(st.lists(st.sampled_from(names), min_size=1, max_size=max_ops))
    seed = draw(st.integers(0, 2**32 - 1))
    child = apply(trace, ops, random.Random(seed))
    return with_lineage(child, trace, ops) if child is not None else trace


__all__ = ["adapter_events", "adapter_sources", "cancels", "lifecycle_traces", "mutants", "prompt_lengths", "prompts",
           "traces"]
