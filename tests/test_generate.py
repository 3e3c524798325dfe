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
        v1 = generate(seed, eng, GenOptions(adapters=adapters, p_retry=0, p_interrupted_prefill=0, p_pressure=0))
        v2 = generate(seed, eng)
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
