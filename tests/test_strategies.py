"""The Hypothesis strategies (public API): valid traces, both clocks, structural shrinking, and
the documented example property test on the real engine."""

from pathlib import Path

import pytest
from hypothesis import HealthCheck, Phase, find, given, settings

from kvfuzz.fuzzer import default_engine
from kvfuzz.fuzzer.mutate import OPERATORS, clocks_consistent
from kvfuzz.fuzzer.strategies import adapter_events, lifecycle_traces, mutants, prompts, traces
from kvfuzz.traces import GenPrompt, parse_trace
from kvfuzz.traces.trace import parse_embedded_source

LORA = default_engine(lora=True)
FAST = settings(max_examples=60, database=None, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@FAST
@given(traces(LORA))
def test_traces_are_valid_with_both_clocks(t):
    assert parse_trace(t.model_dump(mode="json")) == t
    assert clocks_consistent(t)
    assert all(s.prompt.length + s.max_tokens <= LORA.max_model_len for s in t.sends)
    assert t.lineage.generator == "hypothesis"


@FAST
@given(traces(default_engine(), adapters=[], cancel=False, max_requests=3))
def test_options_restrict_the_shape(t):
    assert 1 <= len(t.sends) <= 3 and not t.cancels and not any(s.adapter for s in t.sends)


@FAST
@given(prompts(block_size=32, max_len=500))
def test_prompts_share_only_within_their_length(p):
    assert isinstance(p, GenPrompt) and p.prefix_len <= p.length <= 500


def test_shrinking_is_structural():
    # Anything with a cancel and a prompt of >= 100 tokens shrinks to one request, one cancel,
    # a 100-token prompt, one token, no prefix sharing and no adapter.
    t = find(traces(LORA), lambda t: bool(t.cancels) and any(s.prompt.length >= 100 for s in t.sends),
             settings=settings(max_examples=500, database=None, derandomize=True))
    (s,) = t.sends
    assert len(t.events) == 2 and s.prompt.length == 100 and s.max_tokens == 1
    assert s.adapter is None and s.prompt.prefix_group is None


@settings(max_examples=30, database=None, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(mutants(traces(LORA, max_requests=3)))
def test_mutants_record_their_operators(m):
    if m.lineage.operators:  # an operator that did not apply leaves the parent unchanged
        assert m.lineage.parent and all(o in OPERATORS for o in m.lineage.operators)
    assert clocks_consistent(m) and parse_trace(m.model_dump(mode="json")) == m


def _docs_example() -> str:
    doc = (Path(__file__).resolve().parents[1] / "docs" / "fuzzer.md").read_text()
    block = doc.split("### Example: your own property test", 1)[1].split("```python", 1)[1].split("```", 1)[0]
    return block


# The example from docs/fuzzer.md, exactly as printed there: a user's property test against the
# real engine, with the kvfuzz_session fixture (here the suite's shared session).
@pytest.mark.engine
def test_the_docs_property_test_runs(session, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    code = _docs_example()
    # Fewer examples than the doc's 25: the point is that the code runs, and finds nothing.
    assert "max_examples=25" in code
    ns: dict = {}
    exec(compile(code.replace("max_examples=25", "max_examples=3"), "docs/fuzzer.md", "exec"), ns)
    ns["test_batching_does_not_change_greedy_outputs"](kvfuzz_session=session)
    assert not (tmp_path / "finding.json").exists()


@FAST
@given(lifecycle_traces())
def test_lifecycle_traces_are_valid_and_round_trip(t):
    from kvfuzz.fuzzer.lifecycle import overwrites_in_flight

    assert parse_trace(t.model_dump(mode="json")) == t
    assert clocks_consistent(t) and t.lifecycle and t.sends
    assert 1 <= t.engine.lora.max_loras <= 3 and not overwrites_in_flight(t)
    assert t.lineage.generator == "hypothesis"


@FAST
@given(adapter_events(names=["x", "y"], max_step=10))
def test_adapter_events_are_events(e):
    assert e.kind in ("load-adapter", "unload-adapter", "reload-adapter") and e.name in ("x", "y")
    assert 0 <= e.at.step <= 10 and e.at.offset_ms == e.at.step * 10.0
    if e.kind != "unload-adapter":
        assert parse_embedded_source(e.source) is not None


@settings(max_examples=30, database=None, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(mutants(lifecycle_traces(max_requests=4), lifecycle=True))
def test_lifecycle_mutants_stay_valid(m):
    if m.lineage.operators:
        assert all(o in OPERATORS for o in m.lineage.operators)
    assert clocks_consistent(m) and parse_trace(m.model_dump(mode="json")) == m


def test_lifecycle_traces_shrink_to_one_send_and_one_event():
    t = find(lifecycle_traces(), lambda t: any(e.kind == "reload-adapter" for e in t.events),
             settings=settings(max_examples=500, database=None, derandomize=True,
                               phases=[Phase.generate, Phase.shrink]))  # no explain phase: 25 s of it
    assert len(t.sends) == 1 and len(t.lifecycle) == 1 and t.engine.lora.max_loras == 1


def test_the_public_module_exposes_the_lifecycle_strategies():
    import kvfuzz.strategies as pub

    assert {"adapter_events", "adapter_sources", "lifecycle_traces"} <= set(pub.__all__)
