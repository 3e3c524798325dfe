import json
import math

import pytest

from kvfuzz.traces import (
    At,
    BadInput,
    CancelEvent,
    Divergence,
    EngineConfig,
    Environment,
    Finding,
    GenPrompt,
    History,
    LoraSettings,
    RequestRecord,
    SendEvent,
    TokenPrompt,
    Trace,
    load_any,
    load_finding,
    load_trace,
    parse_trace,
    save,
)


def _trace() -> Trace:
    eng = EngineConfig(lora=LoraSettings(enabled=True, adapters={"a": "embedded:a"}))
    return Trace(engine=eng, events=[
        SendEvent(request_id="r0", at=At(step=0, offset_ms=0.0), prompt=GenPrompt(length=70, prefix_group="g", prefix_len=64, seed=3)),
        SendEvent(request_id="r1", at=At(offset_ms=8.5), prompt=TokenPrompt(token_ids=[17, 18, 19]), adapter="a",
                  max_tokens=5, stream=False),
        CancelEvent(request_id="r0", at=At(after_tokens=2)),
    ])


def test_trace_round_trips_exactly(tmp_path):
    t = _trace()
    p = tmp_path / "t.json"
    save(t, p)
    t2 = load_trace(p)
    assert t2 == t
    assert t2.model_dump_json() == t.model_dump_json()
    assert t2.trace_id() == t.trace_id()


def test_finding_round_trips_exactly_including_infinite_logprobs(tmp_path):
    t = _trace()
    rec = RequestRecord(request_id="r0", token_ids=[5, 6], logprobs=[[(5, -0.1), (7, -math.inf)], [(6, -1e-9), (8, -3.25)]],
                        finish_reason="length")
    h = History(trace_id=t.trace_id(), engine="inprocess", requests={"r0": rec})
    f = Finding(trace=t, environment=Environment(kvfuzz_version="x"), references={"r0": rec}, runs=[h],
                divergences=[Divergence(request_id="r0", class_="corruption", first_divergence=1, runs_diverged=2, runs=3,
                                        margin=0.5)])
    p = tmp_path / "f.json"
    save(f, p)
    raw = json.loads(p.read_text())
    assert raw["divergences"][0]["class"] == "corruption"  # JSON name is "class"
    f2 = load_finding(p)
    assert f2 == f
    assert f2.model_dump_json(by_alias=True) == f.model_dump_json(by_alias=True)
    assert isinstance(load_any(p), Finding)


@pytest.mark.parametrize("mutate,field,needle", [
    (lambda d: d.update(schema_version=6), "schema_version", "unsupported schema_version 6"),
    (lambda d: d["events"].append({"kind": "explode", "request_id": "x", "at": {"step": 1}}), "events.3", "explode"),
    (lambda d: d["events"].append({"kind": "cancel", "request_id": "nobody", "at": {"step": 1}}), "events.3.request_id" , "cancel of unknown request 'nobody'"),
    (lambda d: d["events"][0]["at"].update(step=-1), "events.0.send.at.step", "greater than or equal to 0"),
    (lambda d: d["events"][1]["at"].update(offset_ms=-5), "events.1.send.at.offset_ms", "greater than or equal to 0"),
    (lambda d: d["events"][0]["prompt"].update(length=20000), "events.0.prompt", "exceed engine.max_model_len"),
    (lambda d: d["events"][1].update(adapter="zz"), "events.1.adapter", "unknown adapter 'zz'"),
    (lambda d: d["engine"].update(blocksize=16), "engine.blocksize", "Extra inputs are not permitted"),
    (lambda d: d["events"].append(dict(d["events"][0])), "events.3.request_id", "sent twice"),
])
def test_bad_traces_name_the_field(mutate, field, needle):
    d = json.loads(_trace().model_dump_json())
    mutate(d)
    with pytest.raises(BadInput) as ei:
        parse_trace(d, "bad.json")
    msg = str(ei.value)
    assert msg.startswith("bad.json: ")
    assert needle in msg
    assert "\n" not in msg
    assert ei.value.code == 2
    if field != "schema_version":
        assert field.split(".")[0] in msg


def test_malformed_json_is_one_line(tmp_path):
    p = tmp_path / "broken.json"
    p.write_text('{"events": [')
    with pytest.raises(BadInput) as ei:
        load_any(p)
    assert "broken.json: malformed JSON" in str(ei.value)
    with pytest.raises(BadInput, match="no such file"):
        load_any(tmp_path / "missing.json")


def test_at_needs_a_clock_and_sends_cannot_be_relative():
    with pytest.raises(ValueError):
        At()
    with pytest.raises(ValueError):
        SendEvent(request_id="x", at=At(after_tokens=1), prompt=GenPrompt(length=4))


def test_clock_conversion():
    assert At(offset_ms=25).step_or(10.0) == 2
    assert At(step=3).offset_or(8.0) == 24.0
