"""Untrusted input: the loaders must answer arbitrary JSON with a BadInput (exit 2), never an
unexpected exception."""

import json

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvfuzz.traces import BadInput, load_any
from kvfuzz.traces.io import parse_finding, parse_trace

json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-2**40, 2**40) | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda children: st.lists(children, max_size=5) | st.dictionaries(st.text(max_size=12), children, max_size=5),
    max_leaves=40,
)

KEYS = ["schema_version", "engine", "events", "kind", "request_id", "at", "step", "offset_ms", "after_tokens",
        "prompt", "length", "prefix_group", "prefix_len", "seed", "token_ids", "adapter", "max_tokens", "stream",
        "trace", "action", "reproduction", "lora", "adapters", "enabled", "max_model_len", "block_size"]

# Valid-looking traces: the right keys with arbitrary values.
trace_like = st.fixed_dictionaries(
    {"events": st.lists(st.dictionaries(st.sampled_from(KEYS), json_values, max_size=8), max_size=6)},
    optional={"schema_version": json_values, "engine": st.dictionaries(st.sampled_from(KEYS), json_values, max_size=6),
              "kind": st.sampled_from(["finding", "trace", "x"]), "trace": json_values,
              "reproduction": json_values, "server_flags": json_values},
)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=json_values | trace_like)
def test_parsers_raise_only_bad_input(data):
    for parse in (parse_trace, parse_finding):
        try:
            parse(data, "fuzz.json")
        except BadInput as e:
            assert str(e).startswith("fuzz.json")
            assert "\n" not in str(e)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(data=json_values | trace_like)
def test_load_any_raises_only_bad_input(tmp_path, data):
    p = tmp_path / "in.json"
    p.write_text(json.dumps(data))
    try:
        load_any(p)
    except BadInput as e:
        assert str(e).startswith(str(p))


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(raw=st.binary(max_size=200))
def test_arbitrary_bytes(tmp_path, raw):
    p = tmp_path / "raw.json"
    p.write_bytes(raw)
    try:
        load_any(p)
    except BadInput:
        pass


foreign_event = st.fixed_dictionaries(
    {"action": st.sampled_from(["send", "cancel", "explode"]) | json_values},
    optional={k: json_values | st.integers(-5, 20000) for k in
              ("request_id", "offset_ms", "prompt_len", "prefix_len", "max_tokens", "stream", "adapter")},
)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(events=st.lists(foreign_event, max_size=8), extra=json_values)
def test_foreign_findings_raise_only_bad_input(tmp_path, events, extra):
    p = tmp_path / "foreign.json"
    p.write_text(json.dumps({"trace": {"events": events}, "reproduction": extra, "server_flags": extra}))
    try:
        load_any(p)
    except BadInput as e:
        assert str(e).startswith(str(p)) and "\n" not in str(e)
