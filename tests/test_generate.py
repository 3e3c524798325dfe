from fuzzer import default_engine, generate, trace_seed
from traces import CancelEvent, parse_trace


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
