from kvfuzz.fuzzer import default_engine, generate, trace_seed
from kvfuzz.traces import CancelEvent, parse_trace


def test_same_seed_same_trace():
    assert generate(7) == generate(7)
    assert generate(7) != generate(8)


def test_generated_traces_are_valid_and_varied():
    eng = default_engine(lora=True)
    traces = [generate(s, eng) for s in range(60)]
    for t in traces:
        assert parse_trace(t.model_dump(mode="json")) == t
    sends = [e for t in traces for e in t.sends]
    bs = eng.block_size
    assert any(e.prompt.length % bs == 0 for e in sends)
    assert any(e.prompt.length % bs in (1, bs - 1) for e in sends)
    assert any(e.adapter is None for e in sends) and any(e.adapter for e in sends)
    assert any(e.prompt.prefix_len for e in sends)
    assert any(isinstance(e, CancelEvent) and e.at.after_tokens is not None for t in traces for e in t.events)
    assert any(e.prompt.length > 1500 for e in sends)
    # bursts: several sends at the same step
    assert any(len({e.at.step for e in t.sends}) < len(t.sends) for t in traces)


def test_trace_seed_is_a_pure_function():
    assert trace_seed(1, 5) == trace_seed(1, 5) != trace_seed(1, 6)


def test_v2_keeps_each_seeds_v1_events_and_adds_after_them():
    from kvfuzz.fuzzer.generate import GenOptions

    eng = default_engine(lora=True)
    adapters = sorted(eng.lora.adapters)
    for seed in range(40):
        plain = dict(adapters=adapters, request_state=0.0, p_priority=0.0, p_embeds=0.0, p_spec=0.0, p_reset=0.0)  # the schedule alone
        v1 = generate(seed, eng, GenOptions(**plain, p_retry=0, p_interrupted_prefill=0, p_pressure=0))
        v2 = generate(seed, eng, GenOptions(**plain))
        ids = {e.request_id for e in v1.sends}
        assert [e for e in v2.events if e.request_id in ids] == v1.events, seed


def test_retries_and_reported_shapes_are_generated():
    """Retries follow cancels with the same prompt; some traces carry a chunked prompt cancelled
    mid-prefill and then retried or shared, some carry enough KV pressure to preempt."""
    from kvfuzz.fuzzer.shapes import kv_capacity_tokens

    eng = default_engine()
    budget, cap = eng.max_num_batched_tokens, kv_capacity_tokens(eng)
    interrupted = pressured = retried = 0
    for seed in range(100):
        t = generate(seed, eng)
        for r in t.sends:
            if "_retry" not in r.request_id:
                continue
            orig = t.send(r.request_id.rsplit("_retry", 1)[0])
            assert any(c.request_id == orig.request_id for c in t.cancels)
            assert r.at.step >= orig.at.step and r.adapter == orig.adapter
            retried += 1
            if orig.prompt.length > budget and any(
                    c.request_id == orig.request_id and (c.at.after_tokens == 0 or c.at.step is not None
                                                         and c.at.step < orig.at.step + orig.prompt.length // budget + 1)
                    for c in t.cancels):
                assert r.prompt.prefix_group == orig.prompt.prefix_group
                interrupted += 1
        if sum(s.prompt.length + s.max_tokens for s in t.sends if s.request_id.startswith(("hold", "long"))) > cap:
            pressured += 1
    assert retried >= 20 and 10 <= interrupted <= 40 and 10 <= pressured <= 40, (retried, interrupted, pressured)


def test_default_generation_and_mutation_are_pinned():
    """Neither the lifecycle mode nor per-request state changes the schedule a seed draws: without
    per-request state, the trace ids of fresh traces and their mutants (with and without LoRA)
    are those of random-v2, as before either existed."""
    import hashlib
    import random

    from kvfuzz.fuzzer import GenOptions, mutate

    ids = []
    for lora in (False, True):
        eng = default_engine(lora=lora)
        plain = GenOptions(adapters=sorted(eng.lora.adapters) if lora else [], request_state=0.0, p_priority=0.0, p_embeds=0.0, p_spec=0.0, p_reset=0.0)
        for s in range(25):
            t = generate(s, eng, plain)
            ids += [t.trace_id(), mutate(t, random.Random(s)).trace_id()]
    assert hashlib.sha256(" ".join(ids).encode()).hexdigest()[:16] == "557157654ec7efae"


LC_SEEDS = range(400)


def _lifecycle(seed, **kw):
    from kvfuzz.fuzzer.generate import GenOptions

    return generate(seed, default_engine(lora=True), GenOptions(lifecycle=True, **kw))


def test_lifecycle_traces_are_valid_small_and_varied():
    from kvfuzz.fuzzer import lifecycle
    from kvfuzz.traces.trace import LoadAdapterEvent, ReloadAdapterEvent, UnloadAdapterEvent

    seen = set()
    for seed in LC_SEEDS:
        t = _lifecycle(seed)
        assert parse_trace(t.model_dump(mode="json")) == t  # the validator accepts it, JSON round trip
        assert t == _lifecycle(seed) and t.lineage.generator == "lifecycle-v1"
        lora = t.engine.lora
        assert lora.enabled and 1 <= lora.max_loras <= 3
        assert lora.max_cpu_loras is None or lora.max_loras < lora.max_cpu_loras <= lora.max_loras + 2
        names = set(lora.adapters) | {e.name for e in t.lifecycle}
        assert 1 <= len(lora.adapters) and names <= set(lifecycle.NAMES)
        assert t.lifecycle and 1 <= len(t.sends) <= 20
        assert sum(s.prompt.length + s.max_tokens for s in t.sends) <= 8000  # seconds, not minutes
        assert not lifecycle.overwrites_in_flight(t)
        sources = list(lora.adapters.values()) + [e.source for e in t.lifecycle if hasattr(e, "source")]
        assert all(src in lifecycle.SOURCES for src in sources)
        for e in t.lifecycle:
            if isinstance(e, ReloadAdapterEvent):
                seen.add(("reload", e.same_path))
            elif isinstance(e, UnloadAdapterEvent):
                seen.add("unload")
            elif isinstance(e, LoadAdapterEvent):
                seen.add("load")
                if e.name not in lora.adapters and all(x.name != e.name for x in t.lifecycle[:t.lifecycle.index(e)]):
                    seen.add("first load")
        if len(set(lora.adapters.values())) < len(lora.adapters):
            seen.add("two names, same weights")
        if any(src.split("@")[0] != f"embedded:{n}" for n, src in lora.adapters.items()):
            seen.add("a name on another adapter's weights")
        if len({s.cache_salt for s in t.sends} - {None}) == 2:
            seen.add("two tenants")
        if any(a.prompt == b.prompt and a.cache_salt != b.cache_salt for a in t.sends for b in t.sends):
            seen.add("one prompt, two tenants")
        if any(s.adapter is None for s in t.sends) and any(s.adapter for s in t.sends):
            seen.add("base and lora")
        seen.add(("slots", lora.max_loras, lora.max_cpu_loras is None))
    assert {("reload", True), ("reload", False), "unload", "load", "first load", "two names, same weights",
            "a name on another adapter's weights", "two tenants", "one prompt, two tenants", "base and lora"} <= seen
    assert {("slots", m, d) for m in (1, 2, 3) for d in (True, False)} <= seen


def test_lifecycle_rebindings_are_followed_by_a_prefix_sharer_and_mostly_wait():
    """After most rebindings (reload, or unload then load) of a name comes a request of that
    name sharing a prefix with one it served under the previous weights, in the same tenant; most
    rebindings wait until the name's requests have probably finished, some race them."""
    from kvfuzz.fuzzer import lifecycle
    from kvfuzz.traces.trace import LoadAdapterEvent, ReloadAdapterEvent

    revealed = rebinds = raced = 0
    for seed in LC_SEEDS:
        t = _lifecycle(seed)
        order = [t.events[i] for i in t.planned_order()]
        for k, e in enumerate(order):
            if not isinstance(e, (LoadAdapterEvent, ReloadAdapterEvent)):
                continue
            before = [s for s in order[:k] if s.kind == "send" and s.adapter == e.name]
            rebind = isinstance(e, ReloadAdapterEvent) or (isinstance(e, LoadAdapterEvent) and before)
            if not rebind or not before:
                continue
            rebinds += 1
            if isinstance(e, ReloadAdapterEvent) and e.at.step < lifecycle.name_free_at(before, t.engine, e.name) - 2:
                raced += 1
            after = [s for s in order[k + 1:] if s.kind == "send" and s.adapter == e.name][:1]
            if after and any(a.cache_salt == after[0].cache_salt and (a.prompt == after[0].prompt or (
                    a.prompt.prefix_group and a.prompt.prefix_group == after[0].prompt.prefix_group))
                    for a in before):
                revealed += 1
    assert rebinds > 200
    assert revealed / rebinds > 0.6, (revealed, rebinds)
    assert 0.02 < raced / rebinds < 0.35, (raced, rebinds)  # about 5 %: p_race, where the name was still busy


def test_lifecycle_options_and_the_campaign_cap():
    t = _lifecycle(5, lifecycle_slots=((2, 3),), max_requests=3, lifecycle_events=(2, 2))
    assert (t.engine.lora.max_loras, t.engine.lora.max_cpu_loras) == (2, 3)
    assert len([s for s in t.sends if s.request_id in {f"r{i}" for i in range(3)}]) <= 3
    assert len(t.lifecycle) >= 2
    import pytest

    from kvfuzz.fuzzer.hybrid import hybrid_engine

    with pytest.raises(ValueError, match="embedded adapters"):
        from kvfuzz.fuzzer.generate import GenOptions

        generate(1, hybrid_engine(), GenOptions(lifecycle=True))
