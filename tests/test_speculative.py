"""Speculative decoding in the trace format and the engine arguments (pure)."""

import json

import pytest

from kvfuzz.fuzzer.generate import default_engine
from kvfuzz.harness.base import reference_config
from kvfuzz.harness.vllm_args import engine_args, server_command
from kvfuzz.traces import At, GenPrompt, Sampling, SendEvent, Speculative, Trace, parse_trace
from kvfuzz.traces.errors import BadInput


def spec_engine(**kw):
    return default_engine().model_copy(update={"speculative": Speculative(**kw)})


def test_a_trace_without_speculative_decoding_writes_nothing_and_keeps_its_id():
    plain = Trace(engine=default_engine(), events=[])
    assert "speculative" not in plain.model_dump(mode="json")["engine"]
    on = Trace(engine=spec_engine(num_speculative_tokens=4), events=[])
    assert on.model_dump(mode="json")["engine"]["speculative"] == {
        "method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3, "prompt_lookup_min": 1}
    assert on.trace_id() != plain.trace_id()
    assert reference_config(on.engine) == plain.engine and reference_config(plain.engine) is plain.engine


def test_engine_arguments_and_the_server_flag_carry_it():
    cfg = spec_engine(num_speculative_tokens=2, prompt_lookup_max=4, prompt_lookup_min=2)
    assert engine_args(cfg, "/m")["speculative_config"] == {
        "method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 4, "prompt_lookup_min": 2}
    cmd = server_command(cfg, model_path="/m", adapter_paths={}, port=1)
    assert json.loads(cmd[cmd.index("--speculative-config") + 1])["num_speculative_tokens"] == 2
    assert "speculative_config" not in engine_args(default_engine(), "/m")


@pytest.mark.parametrize("edit, field, needle", [
    (lambda d: d["engine"].update(speculative={"prompt_lookup_min": 3, "prompt_lookup_max": 2}),
     "engine.speculative", "prompt_lookup_min 3 exceeds prompt_lookup_max 2"),
    (lambda d: d["engine"].update(speculative={"method": "eagle"}), "engine.speculative.method", "ngram"),
    (lambda d: d.update(schema_version=3), "engine.speculative", "needs schema_version 4"),
    (lambda d: d["events"][0].update(sampling={"logit_bias": {"5": 1.0}}), "events[0].sampling.logit_bias",
     "vLLM refuses logit_bias with speculative decoding"),
])
def test_bad_speculative_settings_are_one_line_naming_the_field(edit, field, needle):
    t = Trace(engine=spec_engine(), events=[SendEvent(request_id="a", at=At(step=0), max_tokens=4,
                                                      sampling=Sampling(min_tokens=1),
                                                      prompt=GenPrompt(length=8, seed=1))])
    data = t.model_dump(mode="json")
    edit(data)
    with pytest.raises(BadInput) as e:
        parse_trace(data)
    assert e.value.field == field or field in str(e.value), (e.value.field, str(e.value))
    assert needle in str(e.value) and "\n" not in str(e.value)
